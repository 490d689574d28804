"""`refpar train --mesh dp=N [--zero 0|1|2|3] [--fsdp]`: data-parallel training on MPI ranks.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --steps 5 --check

Runs the chosen strategy, then (with --check) the single-device reference on rank 0, and reports
per step the loss next to the reference's, the largest relative parameter difference, the bytes
each rank sent by op next to the closed form (refpar.analysis.comm_volume) and each rank's peak
memory by category next to the closed form (refpar.analysis.memory).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from refpar import backend, checkpoint
from refpar.analysis.comm_volume import step_bytes
from refpar.analysis.memory import (
    Options,
    activation_peak_bytes,
    model_state_bytes,
    peak_bytes,
    precision_options,
    unit_sizes,
)
from refpar.comm.trace import Tracer, chrome_trace
from refpar.config import ConfigError
from refpar.memory import CATEGORIES, MemoryLedger
from refpar.model.gpt import init_params
from refpar.parallel.data_parallel import DataParallel
from refpar.parallel.fsdp import FSDP
from refpar.parallel.units import train_step
from refpar.parallel.zero import Zero
from refpar.precision import precision_of
from refpar.trainer import corpus_for, train_single_device

OPS = ("all_reduce", "reduce_scatter", "all_gather", "isend", "irecv")
STATES = ("params", "grads", "master", "optimizer")  # the model states: the ZeRO paper's categories


@dataclass
class DPRun:
    """One rank's view of a finished run."""

    losses: list[float]
    step_times_s: list[float]  # wall time of each step on this rank
    comm: dict[str, tuple[int, int]]  # op -> (bytes sent, bytes received) over the training steps
    peaks: dict[str, int]  # category -> peak bytes
    model_state: dict[str, int]  # params/grads/master/optimizer held between steps
    params: dict = field(default_factory=dict)  # every parameter, whole, after the last step
    tracer: Tracer | None = None
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    loss_scales: list[float] = field(default_factory=list)  # fp16-mixed: the scale of each step
    skipped_steps: list[int] = field(default_factory=list)  # fp16-mixed: 0-based steps skipped

    @property
    def step_time_s(self) -> float:
        """Mean step time, leaving out the first step (warm-up) when there are others."""
        return float(np.mean(self.step_times_s[1:] or self.step_times_s))


def options(strategy: str, model, train, microbatches: int = 1, bucket_elems: int = 1 << 62,
            prefetch: bool = False, reshard_after_forward: bool = True, overlap: bool = False) -> Options:
    return Options(strategy=strategy, **precision_options(model.dtype, train.fp32_grads),
                   optimizer=train.optimizer, bucket_elems=bucket_elems, microbatches=microbatches,
                   prefetch=prefetch, reshard_after_forward=reshard_after_forward, overlap=overlap)


def check_options(opts: Options, train, dp_size: int) -> None:
    if opts.microbatches < 1:
        raise ConfigError(f"--microbatches {opts.microbatches} must be at least 1")
    if train.batch_size < dp_size * opts.microbatches:
        raise ConfigError(
            f"the global batch of {train.batch_size} cannot give each of dp={dp_size} ranks "
            f"{opts.microbatches} micro-batches of at least one sequence; use --batch-size "
            f"{dp_size * opts.microbatches} or more, or fewer micro-batches")
    if opts.overlap and opts.strategy != "dp":
        raise ConfigError("--overlap applies to plain DP's gradient buckets; drop it or use --zero 0")
    if (opts.prefetch or not opts.reshard_after_forward) and opts.strategy != "fsdp":
        raise ConfigError("--prefetch and --no-reshard-after-forward are FSDP options; add --fsdp or "
                          "drop them")
    if opts.bucket_elems < 1:
        raise ConfigError(f"the bucket must hold at least one element, got {opts.bucket_elems}; "
                          "give --bucket-kb a larger size")


def build(opts: Options, model, train, dp, ledger, params: dict):
    """The strategy object for `opts.strategy`, holding its share of `params`."""
    if opts.strategy == "dp":
        return DataParallel(model, train, dp, ledger, params, opts.bucket_elems, opts.overlap)
    if opts.strategy == "fsdp":
        return FSDP(model, train, dp, ledger, params, opts.prefetch, opts.reshard_after_forward)
    return Zero(model, train, dp, ledger, params, int(opts.strategy[-1]))


def run_data_parallel(opts: Options, model, train, dp, gather_params: bool = False, *,
                      save: str | None = None, save_every: int | None = None,
                      resume: str | None = None) -> DPRun:
    """Trains `train.steps` steps with the strategy on the dp communicator `dp` (its tracer, if any,
    records the communication), or from the checkpoint `resume` (written under any mesh) up to
    `train.steps`; with `save`, checkpoints every `save_every` steps and after the last (dp must be
    the world communicator then). With gather_params every rank ends with all parameters whole."""
    check_options(opts, train, dp.size)
    ledger = MemoryLedger()
    params = backend.current().from_host(init_params(model, train.seed))  # drawn on the host, moved
    strategy = build(opts, model, train, dp, ledger, params)
    first = 0
    if resume is not None:
        manifest = checkpoint.open_training(resume, model, train)
        pairs = checkpoint_arrays(strategy, saving=False)
        for (_, view), loaded in zip(pairs, checkpoint.load(resume, [p for p, _ in pairs], manifest),
                                     strict=True):
            view[...] = loaded
        first = int(manifest["step"])
        strategy.t = int(manifest.get("optimizer_t", first))  # fewer than the steps if fp16 skipped
        if strategy.dtypes.scaler is not None:
            strategy.dtypes.scaler.load_state_dict(manifest["loss_scaler"])
    corpus = corpus_for(model, train)
    losses, times, scales, skipped = [], [], [], []
    scaler = strategy.dtypes.scaler  # fp16-mixed only
    for step in range(first, train.steps):
        start = time.perf_counter()
        if scaler is not None:
            scales.append(scaler.scale)
            before = scaler.skipped
        losses.append(train_step(strategy, corpus, step, opts.microbatches, dp.tracer))
        times.append(time.perf_counter() - start)
        if scaler is not None and scaler.skipped > before:
            skipped.append(step)
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            checkpoint.save_training(save, step + 1, checkpoint_arrays(strategy, saving=True), model,
                                     train, {"dp": dp.size}, opts.strategy, dp, optimizer_t=strategy.t,
                                     loss_scaler=None if scaler is None else scaler.state_dict())
    comm = {}
    if dp.tracer is not None:
        for e in dp.tracer.events:
            sent, recv = comm.get(e.op, (0, 0))
            comm[e.op] = (sent + e.bytes_sent, recv + e.bytes_recv)
    state = {c: ledger.current[c] for c in STATES}
    result = DPRun(losses, times, comm, dict(ledger.peak), state, tracer=dp.tracer, first_step=first,
                   loss_scales=scales, skipped_steps=skipped)
    if gather_params:
        result.params = strategy.full_params()
    return result


def checkpoint_arrays(strategy, saving: bool) -> list:
    """(checkpoint.Piece, view) for each array this rank holds, as flat ranges of the global
    parameters, fp32 master weights (mixed precision) and AdamW moments (each unit is one flat
    buffer cut with `shard_range`, blind to where one parameter ends: refpar/parallel/units.py).
    Loading writes through the views. A buffer every rank holds whole is written by each rank only
    for its own `shard_range`, so the files hold each element once."""
    lay, out = strategy.layout, []
    for u in lay.units:
        own = lay.shard(u, strategy.dp.size, strategy.dp.rank)
        if isinstance(strategy, DataParallel):
            states = ({} if strategy.master is None else {"master": strategy.master}) | {
                f"adamw.{k}": s for k, s in strategy.state.items()}
            held = [("params", 0, strategy.unit_flat(u, strategy.params), True)] + [
                (prefix, 0, strategy.unit_flat(u, s), True) for prefix, s in states.items()]
        else:
            full = strategy.stage < 3  # ZeRO-1/2 keep every parameter; stage 3 and FSDP their shard
            params = strategy.unit_slice(u, strategy.params) if full else strategy.shards[u]
            states = ({} if strategy.master is None else {"master": strategy.master[u]}) | {
                f"adamw.{k}": s for k, s in strategy.state[u].items()}
            held = [("params", 0 if full else own[0], params, full)] + [
                (prefix, own[0], s, False) for prefix, s in states.items()]
        for prefix, start, flat, whole in held:
            if saving and whole:
                flat, start = flat[own[0]:own[1]], own[0]
            out += checkpoint.flat_unit_pieces(prefix, lay, u, start, flat)
    return out


def reference_diffs(model, train, run: DPRun) -> dict:
    """The single-device run and the largest relative differences from it (loss per step; each
    parameter's max |difference| over its max |value|)."""
    ref = train_single_device(model, train)
    ref_losses = ref.losses[run.first_step:]  # a resumed run has only the steps after its checkpoint
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref_losses, strict=True))
    param_diff = max(_rel(run.params[n], p) for n, p in ref.params.items())
    return {"reference_losses": ref_losses, "max_loss_rel_diff": loss_diff,
            "max_param_rel_diff": param_diff}


def _rel(a, ref) -> float:
    """max |a - ref| / max |ref| (the plain max difference for an all-zero reference: a bias no
    step has changed yet, as when fp16 skips every step)."""
    diff = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64))))
    scale = float(np.max(np.abs(np.asarray(ref, np.float64))))
    return diff / scale if scale else diff


def expected_rows(opts: Options, model, train, n: int, skipped: int = 0):
    """(comm rows, memory rows) of every rank from the closed forms (`skipped`: fp16 steps
    skipped on overflow)."""
    comm, memory = [], []
    for r in range(n):
        for op, b in step_bytes(model, n, r, opts, train.steps, skipped=skipped).items():
            comm.append({"rank": r, "axis": "dp", "op": op, "bytes_sent": b.sent, "bytes_recv": b.recv})
        peaks = peak_bytes(model, n, r, opts, stepped=skipped < train.steps)
        peaks["activations"] = activation_peak_bytes(model, n, r, opts.microbatches, train.batch_size,
                                                     train.seq_len)
        for cat in CATEGORIES:
            memory.append({"rank": r, "category": cat, "bytes": peaks[cat]})
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


# ------------------------------------------------------------------------------ command line
def add_arguments(parser) -> None:
    """The data-parallel flags of `refpar train` (--microbatches, --check and --trace are train's
    own)."""
    add = parser.add_argument
    add("--zero", type=int, default=0, choices=(0, 1, 2, 3),
        help="ZeRO stage over the dp axis: 0 plain DP, 1 optimizer, 2 +gradients, 3 +parameters")
    add("--fsdp", action="store_true", help="FSDP over the dp axis (ZeRO-3 by units)")
    add("--prefetch", action="store_true", help="FSDP: gather the next unit one piece early")
    add("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
        help="FSDP: keep each block gathered from its forward to its backward")
    add("--overlap", action="store_true",
        help="DP: all-reduce each bucket as ring rounds interleaved with the rest of the backward")
    add("--bucket-kb", type=float, default=None,
        help="DP: gradient all-reduce bucket size in KiB (default: one bucket)")


# The options only this runner reads, with the values that mean "not asked for".
OWN_OPTIONS = {"--overlap": ("overlap", False), "--bucket-kb": ("bucket_kb", None),
               "--prefetch": ("prefetch", False),
               "--no-reshard-after-forward": ("reshard_after_forward", True)}


def refuse_own_options(args, flags=tuple(OWN_OPTIONS)) -> None:
    """For a run another runner takes: the first of `flags` given is refused, not ignored."""
    for flag in flags:
        name, default = OWN_OPTIONS[flag]
        if getattr(args, name, default) != default:
            raise ConfigError(f"{flag} applies to data parallelism over a --mesh of dp alone (plain DP, "
                              f"ZeRO or FSDP); drop it for this run")


def wants_data_parallel(sizes: dict[str, int], args) -> bool:
    """A dp-only mesh with more than one rank, or ZeRO/FSDP asked for."""
    only_dp = all(size == 1 for axis, size in sizes.items() if axis != "dp")
    return only_dp and (sizes["dp"] > 1 or args.zero > 0 or args.fsdp)


def strategy_name(args) -> str:
    if args.fsdp and args.zero:
        raise ConfigError(f"--fsdp and --zero {args.zero} are two ways to shard; give one of them")
    return "fsdp" if args.fsdp else ("dp" if args.zero == 0 else f"zero{args.zero}")


def run_cli(model, train, sizes: dict[str, int], args) -> int:
    from refpar.comm.communicator import abort_on_error, world
    from refpar.mesh import DeviceMesh
    from refpar.report import loss_scaling_summary, run_summary, summary_line

    fields = precision_options(model.dtype, train.fp32_grads)
    itemsize = fields.get("grad_itemsize") or fields["itemsize"]  # a bucket holds gradients
    if args.bucket_kb is not None and (args.zero or args.fsdp):
        raise ConfigError("--bucket-kb sizes plain DP's all-reduce buckets; drop it or use --zero 0")
    if args.bucket_kb is not None and not 0 < args.bucket_kb < math.inf:  # nan too
        raise ConfigError(f"--bucket-kb {args.bucket_kb:g} must be a positive finite size in KiB; give "
                          "e.g. --bucket-kb 64")
    bucket = 1 << 62 if args.bucket_kb is None else int(args.bucket_kb * 1024 // itemsize)
    opts = options(strategy_name(args), model, train, args.microbatches, bucket, args.prefetch,
                   args.reshard_after_forward, args.overlap)
    check_options(opts, train, sizes["dp"])
    comm = world(Tracer())
    mesh = DeviceMesh(comm, sizes)  # a mesh that does not fit the job: the same ConfigError everywhere
    n = mesh.dp.size
    with abort_on_error():
        run = run_data_parallel(opts, model, train, mesh.dp, gather_params=args.check,
                                save=args.save, save_every=args.save_every, resume=args.resume)
        comm_rows, memory_rows = gather_rows(comm, run)
        events = comm.gather_object(run.tracer.events) if args.trace else None
        states = comm.all_gather(np.array([[run.model_state[c] for c in STATES]]),
                                 tag="report", counts=[1] * n)
        if comm.rank != 0:
            return 0
        if events is not None:
            with open(args.trace, "w") as f:
                json.dump(chrome_trace([e for rank_events in events for e in rank_events]), f)
        checked = reference_diffs(model, train, run) if args.check else {}
        expected_comm, expected_memory = expected_rows(
            opts, model, replace(train, steps=len(run.losses)), n, len(run.skipped_steps))
        report(opts, model, train, n, run, checked, comm_rows, expected_comm, memory_rows,
               expected_memory, states.sum(axis=1).tolist())
        if args.json:
            summary = run_summary(
                model, train, run.losses, mesh=sizes, world_size=comm.size,
                zero=3 if opts.strategy == "fsdp" else int(args.zero), microbatches=opts.microbatches,
                comm_bytes=comm_rows, expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
                expected_memory_peak_bytes=expected_memory, step_time_s=run.step_time_s,
                loss_floor=corpus_for(model, train).entropy_rate(),
                loss_scaling=loss_scaling_summary(run.loss_scales, run.skipped_steps),
                data_parallel={"strategy": opts.strategy, "model_state_bytes": states.sum(axis=1).tolist(),
                               "bucket_elems": min(opts.bucket_elems, sum(unit_sizes(model).values())),
                               "overlap": opts.overlap, "prefetch": opts.prefetch,
                               "reshard_after_forward": opts.reshard_after_forward}, **checked)
            print(summary_line(summary), flush=True)
    return 0


def report(opts, model, train, n, run, checked, comm_rows, expected_comm, memory_rows, expected_memory,
           state_per_rank) -> None:
    """The learner's table: losses by step, bytes by rank and op, peak memory by rank and category,
    and how the model states per rank compare with plain DP's."""
    def say(text=""):
        print(text, flush=True)

    label = {"dp": "DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP"}
    say(f"{label[opts.strategy]} over dp={n}: GPT-2 {model.n_layer} layers, {precision_of(model.dtype)}, "
        f"batch {train.batch_size} x {train.seq_len} in {opts.microbatches} micro-batch(es) per rank")
    ref = checked.get("reference_losses")
    scaled = bool(run.loss_scales)  # fp16-mixed: each step's loss scale, and whether it was skipped
    say(f"{'step':>5} {'loss':>20} {'single device':>20} {'rel diff':>10}"
        + (f" {'loss scale':>11} {'skipped':>8}" if scaled else ""))
    for s, loss in enumerate(run.losses):
        number = run.first_step + s + 1
        scale = (f" {run.loss_scales[s]:>11g} {sum(k <= number - 1 for k in run.skipped_steps):>8}"
                 if scaled else "")
        if ref is None:
            say(f"{number:>5} {loss:>20.15f}" + scale)
        else:
            say(f"{number:>5} {loss:>20.15f} {ref[s]:>20.15f} {abs(loss - ref[s]) / abs(ref[s]):>10.1e}"
                + scale)
    if checked:
        say(f"max relative parameter difference after {train.steps} steps: "
            f"{checked['max_param_rel_diff']:.1e}")
    expected = {(r["rank"], r["op"]): r for r in expected_comm}
    say(f"bytes sent (received) per rank over {len(run.losses)} steps, measured | closed form:")
    for r in comm_rows:
        e = expected.get((r["rank"], r["op"]), {"bytes_sent": 0, "bytes_recv": 0})
        say(f"  rank {r['rank']} {r['op']:<15} {r['bytes_sent']:>10,} ({r['bytes_recv']:,}) | "
            f"{e['bytes_sent']:,} ({e['bytes_recv']:,})")
    expected_mem = {(r["rank"], r["category"]): r["bytes"] for r in expected_memory}
    say("peak memory per rank in bytes, measured | closed form:")
    for rank in range(n):
        cells = []
        for r in memory_rows:
            if r["rank"] == rank:
                e = expected_mem.get((rank, r["category"]))
                cells.append(f"{r['category']} {r['bytes']:,}" + ("" if e is None else f" | {e:,}"))
        say(f"  rank {rank}: " + ", ".join(cells))
    def state(strategy):
        return max(sum(model_state_bytes(model, n, r, replace(opts, strategy=strategy)).values())
                   for r in range(n))

    dp_state, z3_state = state("dp"), state("zero3")
    say(f"model states (params+grads+master+optimizer) per rank: {label[opts.strategy]} measured "
        + ", ".join(f"{b:,}" for b in state_per_rank)
        + f"; closed forms at dp={n}: DP {dp_state:,}, ZeRO-3 {z3_state:,} "
        f"(DP / ZeRO-3 = {dp_state / z3_state:.2f}, falls as 1/N)")
