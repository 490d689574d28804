"""Training a MoE GPT-2 with expert parallelism over `--mesh dp=D,ep=P` (layout: expert_parallel.py).

    mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 2 --check

Each step, every rank runs `gpt.loss_and_grads` on its part of the global batch with the MoE blocks
replaced by `ExpertParallelMoE`, then sums gradients over the ranks that share them: dense weights
(routers included) over all dp x ep ranks, an expert's weights over dp, and takes the AdamW step
on what it holds. The loss is normalised by the global token count, so per-rank losses add up to
the single device's, router losses included.

Mixed precision: tokens travel to their experts and back in 16 bits, the router's softmax runs in
fp32 inside refpar.model.moe, gradients are summed in their dtype (float32 with fp32_grads) and
AdamW updates fp32 master weights (ledger category "master"). fp16 scales the loss, the router
losses' gradients included; the ep ranks, which hold different experts' gradients, agree on an
overflow (`found_inf.ep`) and all skip the step.
Routing is a discrete choice: once two runs' parameters differ in the last bit, a token near a tie
or at the capacity edge can go elsewhere, so a 16-bit run agrees with one device in its losses
within a tolerance, not in every dropped assignment.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from refpar import backend
from refpar.config import ConfigError
from refpar.memory import MemoryLedger, nbytes_of
from refpar.model.gpt import init_params, loss_and_grads
from refpar.model.moe import MoELayer, expert_prefix, kept_counts
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.parallel.expert_parallel import ExpertParallelMoE, check_expert_parallel
from refpar.parallel.intra_layer import all_reduce_replicated_grads, overflow_anywhere
from refpar.precision import MASTER_DTYPE, has_overflow, loss_scaler
from refpar.report import loss_scaling_summary
from refpar.sharding import shard_range
from refpar.trainer import corpus_for

UNSUPPORTED_AXES = ("pp", "cp", "tp")


@dataclass
class MoEStep:
    """One step as the whole run saw it: every number is global (the same on every rank)."""

    step: int
    loss: float  # cross-entropy + router losses, the single device's loss
    aux_loss: float  # sum over MoE blocks of the load-balancing losses
    z_loss: float  # sum over MoE blocks of the router z-losses
    tokens_per_expert: dict[int, list[int]]  # layer -> assignments each expert kept
    dropped: dict[int, int]  # layer -> assignments dropped by the capacity
    kept_counts: dict[int, np.ndarray]  # layer -> (D, E) kept per data rank and expert
    time_s: float


@dataclass
class MoERun:
    steps: list[MoEStep] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # this rank's, after the last step
    ledger: MemoryLedger | None = None  # this rank's parameters, gradients, optimizer state
    loss_scaling: dict | None = None  # fp16: report.loss_scaling_summary (scales, skipped steps)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def step_time_s(self) -> float:
        times = [s.time_s for s in self.steps][1:] or [s.time_s for s in self.steps]
        return sum(times) / len(times)


def check_run(model, train, sizes: dict[str, int]) -> None:
    """Every ConfigError of an expert-parallel run, before any communication."""
    for axis in UNSUPPORTED_AXES:
        if sizes.get(axis, 1) > 1:
            raise ConfigError(f"expert parallelism combines with dp only; drop {axis}={sizes[axis]} "
                              "from the mesh")
    ep, n_data = sizes.get("ep", 1), sizes.get("dp", 1) * sizes.get("ep", 1)
    check_expert_parallel(model, ep)
    if model.moe_experts == 0:
        raise ConfigError("this run needs experts; add --moe-experts E")
    if train.batch_size < n_data:
        raise ConfigError(f"batch_size={train.batch_size} is smaller than dp x ep = {n_data}; use "
                          f"--batch-size {n_data} or more so every rank has a sequence")


def local_params(full: dict, model, ep: int, ep_rank: int) -> dict:
    """The dense weights and this rank's experts, sliced from the full initialisation."""
    mine = {expert_prefix(layer, e) + "." for layer in model.moe_blocks
            for e in range(*shard_range(model.moe_experts, ep, ep_rank))}
    return {n: p for n, p in full.items()
            if ".mlp.experts." not in n or any(n.startswith(m) for m in mine)}


def reduce_grads(grads: dict, names: list[str], comm, tag: str) -> None:
    """Sums `grads[names]` over `comm` in place (one coalesced all-reduce, the one the other
    data-parallel strategies use); nothing to do on one rank."""
    if comm.size > 1 and names:
        grads.update(all_reduce_replicated_grads({n: grads[n] for n in names}, comm, tag))


def _record(step, loss, routing, start, totals=None) -> MoEStep:
    """A step's record from the routing of every MoE layer; `totals` the (loss, aux, z) summed over
    ranks, else this process ran the whole batch."""
    if totals is None:
        totals = (loss, sum(float(r["aux_loss"]) for r in routing.values()),
                  sum(float(r["z_loss"]) for r in routing.values()))
    return MoEStep(
        step=step, loss=float(totals[0]), aux_loss=float(totals[1]), z_loss=float(totals[2]),
        tokens_per_expert={i: [int(c) for c in r["tokens_per_expert"]] for i, r in routing.items()},
        dropped={i: int(r["dropped"]) for i, r in routing.items()},
        kept_counts={i: backend.to_host(kept_counts(r["selections"], r["capacity"]))
                     for i, r in routing.items()},
        time_s=time.perf_counter() - start)


def reference_run(model, train, on_step=None) -> MoERun:
    """The single-device run (`refpar.trainer.train_single_device`'s loop) with the routing of
    each step kept: the numbers an expert-parallel run must reproduce."""
    params = init_params(model, train.seed)
    state = optimizer_init(params, train)
    corpus = corpus_for(model, train)
    sample_ids = range(train.batch_size)
    scaler = loss_scaler(model, train)  # fp16 only
    run = MoERun()
    for step in range(train.steps):
        start = time.perf_counter()
        scale = 1.0 if scaler is None else scaler.scale
        layer = MoELayer(loss_scale=scale)
        tokens, targets = corpus.batch(step, sample_ids, train.seq_len)  # (B, T) each
        with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
            loss, grads = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                         sample_ids=sample_ids, moe=layer, dloss=scale,
                                         grad_dtype=_grad_dtype(train))
        skip = scaler is not None and has_overflow(grads)
        params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale, skip=skip)
        if scaler is not None:
            scaler.update(skip)
        run.steps.append(_record(step, loss, layer.last_routing, start))
        if on_step is not None:
            on_step(run.steps[-1])
    run.params = params
    return run


def _grad_dtype(train):
    """float32 when gradients accumulate in fp32 (fp32_grads), else None: the parameters' dtype."""
    return MASTER_DTYPE if train.fp32_grads else None


def train_expert_parallel(model, train, mesh, on_step=None) -> MoERun:
    """Trains `train.steps` steps on `mesh` (axes dp and ep) from `init_params(model, train.seed)`."""
    check_run(model, train, mesh.sizes)
    ep_comm = mesh.ep
    data = mesh.world.split(0, key=mesh.world.rank, axis="data")  # dp x ep, in batch order
    layer = ExpertParallelMoE(data, ep_comm, model)
    # Drawn whole on the host, this rank's experts kept, then moved to the run's backend.
    params = backend.current().from_host(local_params(init_params(model, train.seed), model, ep_comm.size,
                                                      ep_comm.rank))
    state = optimizer_init(params, train)
    # The model states this rank holds; activations and buffers are not counted in MoE runs.
    ledger = MemoryLedger()
    ledger.alloc("params", sum(nbytes_of(p) for p in params.values()), "params")
    for key in ("m", "v"):
        if key in state:
            ledger.alloc(f"optimizer.{key}", sum(nbytes_of(a) for a in state[key].values()), "optimizer")
    if "master" in state:  # fp32 copies of a 16-bit model's parameters
        ledger.alloc("master", sum(nbytes_of(a) for a in state["master"].values()), "master")
    dense = [n for n in params if ".mlp.experts." not in n]
    experts = [n for n in params if ".mlp.experts." in n]
    corpus = corpus_for(model, train)
    sample_ids = list(range(*shard_range(train.batch_size, data.size, data.rank)))
    normalizer = train.batch_size * train.seq_len
    scaler = loss_scaler(model, train)  # fp16 only
    scales, skipped_steps = [], []
    run = MoERun()
    for step in range(train.steps):
        start = time.perf_counter()
        tracer = mesh.world.tracer
        with tracer.context(step=step) if tracer is not None else nullcontext():
            tokens, targets = corpus.batch(step, sample_ids, train.seq_len)  # (B/D, T) each
            scale = layer.loss_scale = 1.0 if scaler is None else scaler.scale
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                loss, grads = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                             sample_ids=sample_ids, normalizer=normalizer, moe=layer,
                                             dloss=scale, grad_dtype=_grad_dtype(train))
            ledger.alloc("grads", sum(nbytes_of(g) for g in grads.values()), "grads")
            reduce_grads(grads, dense, data, "dense:grad")  # over every dp x ep rank
            reduce_grads(grads, experts, mesh.dp, "experts:grad")  # over the copies of each expert
            skip = False
            if scaler is not None:  # dense sums agree everywhere; ep ranks hold different experts
                skip = overflow_anywhere(grads, [ep_comm] if ep_comm.size > 1 else [])
                scaler.update(skip)
                scales.append(scale)
                skipped_steps += [step] * skip
            params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale, skip=skip)
            ledger.free("grads")
            routing = layer.last_routing
            shares = np.array([loss, sum(float(r["aux_loss"]) for r in routing.values()),
                               sum(float(r["z_loss"]) for r in routing.values())])
            totals = data.all_reduce(shares, tag="loss")
        run.steps.append(_record(step, loss, routing, start, totals))
        if on_step is not None:
            on_step(run.steps[-1])
    run.params, run.ledger = params, ledger
    run.loss_scaling = loss_scaling_summary(scales, skipped_steps)
    return run
