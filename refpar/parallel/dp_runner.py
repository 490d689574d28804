"""`refpar train --mesh dp=N [--zero 0|1|2|3] [--fsdp]`: data-parallel training on MPI ranks.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --steps 5 --check

Runs the chosen strategy, then (with --check) the single-device reference on rank 0, and reports
per step the loss next to the reference's, the largest relative parameter difference, the bytes
each rank sent by op next to the closed form (refpar.analysis.comm_volume) and each rank's peak
memory by category next to the closed form (refpar.analysis.memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from refpar.analysis.comm_volume import step_bytes
from refpar.analysis.memory import Options, peak_bytes
from refpar.comm.trace import Tracer
from refpar.config import ConfigError
from refpar.memory import CATEGORIES, MemoryLedger
from refpar.model.gpt import init_params
from refpar.parallel.data_parallel import DataParallel
from refpar.parallel.fsdp import FSDP
from refpar.parallel.units import train_step
from refpar.parallel.zero import Zero
from refpar.trainer import corpus_for, train_single_device

OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass
class DPRun:
    """One rank's view of a finished run."""

    losses: list[float]
    step_time_s: float
    comm: dict[str, tuple[int, int]]  # op -> (bytes sent, bytes received) over the training steps
    peaks: dict[str, int]  # category -> peak bytes
    model_state: dict[str, int]  # params/grads/optimizer held between steps
    params: dict = field(default_factory=dict)  # every parameter, whole, after the last step
    tracer: Tracer | None = None


def options(strategy: str, model, train, microbatches: int = 1, bucket_elems: int = 1 << 62,
            prefetch: bool = False, reshard_after_forward: bool = True) -> Options:
    return Options(strategy=strategy, itemsize=np.dtype(model.dtype).itemsize, optimizer=train.optimizer,
                   bucket_elems=bucket_elems, microbatches=microbatches, prefetch=prefetch,
                   reshard_after_forward=reshard_after_forward)


def check_options(opts: Options, train, dp_size: int) -> None:
    if opts.microbatches < 1:
        raise ConfigError(f"--microbatches {opts.microbatches} must be at least 1")
    if train.batch_size < dp_size * opts.microbatches:
        raise ConfigError(
            f"the global batch of {train.batch_size} cannot give each of dp={dp_size} ranks "
            f"{opts.microbatches} micro-batches of at least one sequence; use --batch-size "
            f"{dp_size * opts.microbatches} or more, or fewer micro-batches")
    if opts.bucket_elems < 1:
        raise ConfigError(f"the bucket size must be positive, got {opts.bucket_elems} elements")


def build(opts: Options, model, train, dp, ledger, params: dict):
    """The strategy object for `opts.strategy`, holding its share of `params`."""
    if opts.strategy == "dp":
        return DataParallel(model, train, dp, ledger, params, opts.bucket_elems)
    if opts.strategy == "fsdp":
        return FSDP(model, train, dp, ledger, params, opts.prefetch, opts.reshard_after_forward)
    return Zero(model, train, dp, ledger, params, int(opts.strategy[-1]))


def run_data_parallel(opts: Options, model, train, dp, gather_params: bool = False) -> DPRun:
    """Trains `train.steps` steps with the strategy on the dp communicator `dp` (its tracer, if any,
    records the communication). With gather_params every rank ends with all parameters whole."""
    check_options(opts, train, dp.size)
    ledger = MemoryLedger()
    strategy = build(opts, model, train, dp, ledger, init_params(model, train.seed))
    corpus = corpus_for(model, train)
    losses, times = [], []
    for step in range(train.steps):
        start = time.perf_counter()
        losses.append(train_step(strategy, corpus, step, opts.microbatches, dp.tracer))
        times.append(time.perf_counter() - start)
    comm = {}
    if dp.tracer is not None:
        for e in dp.tracer.events:
            sent, recv = comm.get(e.op, (0, 0))
            comm[e.op] = (sent + e.bytes_sent, recv + e.bytes_recv)
    state = {c: ledger.current[c] for c in ("params", "grads", "optimizer")}
    result = DPRun(losses, float(np.mean(times[1:] or times)), comm, dict(ledger.peak), state,
                   tracer=dp.tracer)
    if gather_params:
        result.params = strategy.full_params()
    return result


def reference_diffs(model, train, run: DPRun) -> dict:
    """The single-device run and the largest relative differences from it (loss per step; each
    parameter's max |difference| over its max |value|)."""
    ref = train_single_device(model, train)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    param_diff = max(float(np.max(np.abs(run.params[n] - p)) / np.max(np.abs(p)))
                     for n, p in ref.params.items())
    return {"reference_losses": ref.losses, "max_loss_rel_diff": loss_diff,
            "max_param_rel_diff": param_diff}


def expected_rows(opts: Options, model, train, n: int):
    """(comm rows, memory rows) of every rank from the closed forms."""
    comm, memory = [], []
    for r in range(n):
        for op, b in step_bytes(model, n, r, opts, train.steps).items():
            comm.append({"rank": r, "axis": "dp", "op": op, "bytes_sent": b.sent, "bytes_recv": b.recv})
        for cat, b in peak_bytes(model, n, r, opts).items():
            memory.append({"rank": r, "category": cat, "bytes": b})
    return comm, memory


def gather_rows(world, run: DPRun):
    """Every rank's measured (comm rows, memory rows), on every rank, as one all-gather of numbers."""
    mine = [v for op in OPS for v in run.comm.get(op, (0, 0))] + [run.peaks[c] for c in CATEGORIES]
    every = world.all_gather(np.array([mine], dtype=np.int64), tag="report", counts=[1] * world.size)
    comm, memory = [], []
    for r, row in enumerate(every.tolist()):
        for i, op in enumerate(OPS):
            if op in run.comm:
                comm.append({"rank": r, "axis": "dp", "op": op, "bytes_sent": row[2 * i],
                             "bytes_recv": row[2 * i + 1]})
        for j, c in enumerate(CATEGORIES):
            memory.append({"rank": r, "category": c, "bytes": row[2 * len(OPS) + j]})
    return comm, memory

