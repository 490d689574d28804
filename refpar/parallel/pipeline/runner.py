"""`refpar train --mesh pp=P[,dp=D] --schedule KIND --microbatches M [--chunks V] [--check]`.

    mpiexec -n 4 python -m refpar train --mesh pp=4 --schedule zb-h1 --microbatches 8 --steps 3 --check

Pipeline training: each pipeline rank holds its stages' parameters and optimizer state and runs
its list of the schedule every step (refpar/parallel/pipeline/executor.py). With dp > 1 each
data-parallel replica is a whole pipeline over its shard of the global batch, and the gradients
are summed over dp before the update. Reports the losses (next to the single-device run's with
--check), the bytes each rank sent, peak memory per rank, and the bubble of the last step: as
measured from the executed trace, and as simulated from the same per-action durations.

Mixed precision: 16-bit stages (stage.py), 16-bit activation messages, gradients summed over dp in
their dtype, AdamW on fp32 master weights (`refpar.model.optim`, ledger "master"); fp16 scales the
loss, and the pipeline ranks, which hold different stages' gradients, agree on an overflow with
one all-reduce (max) of a float32 flag over pp (`found_inf.pp`) before all skip the step or none.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from refpar import backend, checkpoint
from refpar.config import ConfigError, ModelConfig, TrainConfig
from refpar.memory import CATEGORIES, MemoryLedger
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import DropoutContext, init_params, param_shapes
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.parallel.intra_layer_runner import loss_scaling_line, resumed_position, saved_position
from refpar.parallel.pipeline.executor import Microbatch, PipelineExecutor, held_bytes
from refpar.parallel.pipeline.schedules import (
    BUILDERS,
    Timeline,
    build,
    critical_path_gap,
    simulate,
    stored,
)
from refpar.parallel.pipeline.stage import Stage, stage_layers
from refpar.precision import MASTER_DTYPE, loss_scaler, overflow_anywhere
from refpar.report import loss_scaling_summary
from refpar.sharding import shard_range

if TYPE_CHECKING:
    from refpar.comm.trace import Tracer


def add_arguments(parser) -> None:
    """The pipeline flags of `refpar train` (--microbatches, --check and --trace are train's own)."""
    add = parser.add_argument
    add("--schedule", default=None, help=f"pipeline schedule: {', '.join(BUILDERS)} (default 1f1b)")
    add("--chunks", type=int, default=None,
        help="model chunks per pipeline rank for interleaved-1f1b (default 2)")
    add("--n-layer", type=int, default=None,
        help="blocks of the model, replacing the preset's (each pipeline stage needs at least one)")


def wants_pipeline(sizes: dict[str, int], args) -> bool:
    """A mesh with pp, or a pipeline flag (so that it can say what is missing)."""
    return sizes["pp"] > 1 or args.schedule is not None or args.chunks is not None


@dataclass
class PipelineRun:
    """One rank's view of a finished run."""

    losses: list[float]
    step_time_s: float
    params: dict  # this rank's parameters after the last step
    executor: PipelineExecutor
    ledger: MemoryLedger
    tracer: Tracer | None
    measured: Timeline  # the last step's executed actions, every pipeline rank
    simulated: Timeline  # the schedule simulated with those actions' measured durations
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    loss_scaling: dict | None = None  # fp16: report.loss_scaling_summary (scales, skipped steps)


def microbatches(tokens, targets, first_id: int, m: int) -> list[Microbatch]:
    """Rows split into m microbatches by `shard_range`; each keeps its rows' global sample ids."""
    if tokens.shape[0] < m:
        raise ConfigError(f"{tokens.shape[0]} sequences per pipeline cannot fill {m} microbatches; use "
                          f"--microbatches {tokens.shape[0]} or fewer, or a larger --batch-size")
    out = []
    for i in range(m):
        a, b = shard_range(tokens.shape[0], m, i)
        # copies: a microbatch owns its rows, so the embedding cache that keeps its tokens holds
        # (b, T), not a view of the whole batch, in the ledger
        out.append(Microbatch(tokens[a:b].copy(), targets[a:b].copy(),
                              tuple(range(first_id + a, first_id + b))))
    return out


def checkpoint_arrays(params: dict, state: dict, mesh, saving: bool) -> list:
    """(checkpoint.Piece, array) for each tensor this rank holds, all whole (a stage holds whole
    parameters). Saving, only each pipeline's dp rank 0 writes, and the tied wte, held by the first
    and the last stage, only pp rank 0 (stage 0 is always there): each element is written once."""
    if saving and mesh.coords["dp"]:
        return []
    held = [("params", params)] + [(f"adamw.{k}", state[k]) for k in ("m", "v") if k in state]
    held += [("master", state["master"])] if "master" in state else []  # 16-bit models
    return [(checkpoint.whole(f"{prefix}/{n}", a.shape), a) for prefix, arrays in held
            for n, a in arrays.items()
            if not (saving and n == "wte.weight" and mesh.coords["pp"] != 0)]


def run_pipeline(model: ModelConfig, train: TrainConfig, mesh, kind: str, m: int, v: int = 1, *,
                 save: str | None = None, save_every: int | None = None, resume: str | None = None
                 ) -> PipelineRun:
    """Trains `train.steps` steps on `mesh` (pp, and optionally dp) with schedule `kind`, or from
    the checkpoint `resume` (any mesh's) up to `train.steps`; with `save`, checkpoints every
    `save_every` steps and after the last (refpar/checkpoint.py)."""
    train.check_model(model)
    pp, dp = mesh.pp, mesh.dp
    ledger = MemoryLedger()
    executor = PipelineExecutor(build(kind, pp.size, m, v), model, pp, ledger)
    full = init_params(model, train.seed)  # drawn whole, then this rank keeps its stages' part
    params = backend.current().from_host({n: full[n] for n in executor.param_names()})
    for n, p in params.items():
        ledger.alloc(f"param:{n}", p, "params")
    state = optimizer_init(params, train)
    _hold_state(ledger, state, params)
    scaler = loss_scaler(model, train)  # fp16 only
    if train.fp32_grads:
        executor.grad_dtype = MASTER_DTYPE
    start_step = 0
    if resume is not None:
        manifest = checkpoint.open_training(resume, model, train)
        pairs = checkpoint_arrays(params, state, mesh, saving=False)
        for (_, array), loaded in zip(pairs, checkpoint.load(resume, [p for p, _ in pairs], manifest),
                                      strict=True):
            array[...] = loaded
        start_step, state["t"] = resumed_position(manifest, scaler)
    corpus = MarkovCorpus(model.vocab_size, train.seed)
    first, stop = shard_range(train.batch_size, dp.size, dp.rank)
    normalizer = train.batch_size * train.seq_len  # global tokens: the losses add up to the mean
    losses, times, scales, skipped_steps = [], [], [], []
    for step in range(start_step, train.steps):
        start = time.perf_counter()
        with pp.tracer.context(step=step) if pp.tracer else nullcontext():
            tokens, targets = corpus.batch(step, range(first, stop), train.seq_len)  # (b, T) each
            scale = 1.0 if scaler is None else scaler.scale
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                loss, grads = executor.step(params, microbatches(tokens, targets, first, m), step=step,
                                            seed=train.seed, normalizer=normalizer, dloss=scale)
            if dp.size > 1:
                grads = {n: dp.all_reduce(g, tag=f"{n}:grad") for n, g in grads.items()}
            skip = False
            if scaler is not None:  # dp replicas hold the same sums; pp ranks different stages
                skip = overflow_anywhere(grads, [pp])
                scaler.update(skip)
                scales.append(scale)
                skipped_steps += [step] * skip
            params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale, skip=skip)
            losses.append(float(mesh.world.all_reduce(np.array([loss]), tag="loss")[0]))
        times.append(time.perf_counter() - start)
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            checkpoint.save_training(save, step + 1, checkpoint_arrays(params, state, mesh, saving=True),
                                     model, train, mesh.sizes, kind, mesh.world,
                                     **saved_position(state, scaler))
    measured = executor.measured_timeline()
    simulated = executor.simulated_timeline(measured)
    return PipelineRun(losses, sum(times[1:] or times) / len(times[1:] or times), params, executor,
                       ledger, pp.tracer, measured, simulated, start_step,
                       loss_scaling_summary(scales, skipped_steps))


def _hold_state(ledger: MemoryLedger, state: dict, params: dict) -> None:
    """Registers AdamW's moments and the fp32 master weights of this rank's parameters (the step
    replaces the arrays, not their sizes)."""
    for n in params:
        for key, category in (("m", "optimizer"), ("v", "optimizer"), ("master", "master")):
            if key in state:
                ledger.alloc(f"opt:{key}:{n}", state[key][n], category)


def reference_diffs(model: ModelConfig, train: TrainConfig, run: PipelineRun, plain) -> dict:
    """The single-device run (on every rank: it is small) and the largest relative differences:
    per step's loss, and each parameter's max |difference| over its max |value|, over all ranks."""
    from refpar.trainer import train_single_device

    ref = train_single_device(model, train)
    ref_losses = ref.losses[run.first_step:]  # a resumed run has only the steps after its checkpoint
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref_losses, strict=True))
    mine = max(float(np.max(np.abs(backend.to_host(p) - ref.params[n])) / np.max(np.abs(ref.params[n])))
               for n, p in run.params.items())
    param_diff = float(plain.all_reduce(np.array([mine]), op="max")[0])
    return {"reference_losses": ref_losses, "max_loss_rel_diff": loss_diff,
            "max_param_rel_diff": param_diff}


def validate(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], kind: str, m: int,
             v: int) -> None:
    """Every microbatch's sequences, the stages' blocks and the schedule, or a ConfigError; the
    schedule last, since building it takes time and memory in proportion to p x m x v."""
    if train.batch_size // sizes["dp"] < m:
        raise ConfigError(f"--batch-size {train.batch_size} over dp={sizes['dp']} leaves fewer "
                          f"sequences per pipeline than --microbatches {m}; use "
                          f"--batch-size {sizes['dp'] * m} or more")
    stage_layers(model.n_layer, sizes["pp"] * v, 0)
    build(kind, sizes["pp"], m, v)


def run_cli(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], args) -> int:
    if sizes["pp"] == 1:
        raise ConfigError("--schedule and --chunks need a pipeline; add pp=2 or more to --mesh")
    kind = args.schedule or "1f1b"
    other = [f"{a}={s}" for a, s in sizes.items() if a not in ("pp", "dp") and s > 1]
    if other:
        raise ConfigError(f"pipeline training combines with dp, tp and cp (the engine) only so far; "
                          f"drop {', '.join(other)}")
    v = args.chunks if args.chunks is not None else (2 if kind == "interleaved-1f1b" else 1)
    validate(model, train, sizes, kind, args.microbatches, v)  # on every rank, before the first message
    from refpar.comm.communicator import abort_on_error, world  # starts MPI
    from refpar.comm.trace import Tracer
    from refpar.mesh import DeviceMesh
    from refpar.report import run_summary, summary_line

    with abort_on_error():
        comm, plain = world(Tracer()), world()  # plain: the report's own traffic, left out of the trace
        run = run_pipeline(model, train, DeviceMesh(comm, sizes), kind, args.microbatches, v,
                           save=args.save, save_every=args.save_every, resume=args.resume)
        checked = reference_diffs(model, train, run, plain) if args.check else {}
        comm_rows, memory_rows = gather_rows(plain, run)
        if args.trace:
            write_chrome_trace(args.trace, plain, run, train.steps - 1)
        if comm.rank != 0:
            return 0
        expected_comm = expected_comm_rows(model, replace(train, steps=len(run.losses)), sizes,
                                           args.microbatches, v)
        expected_memory = expected_memory_rows(model, train, sizes, kind, args.microbatches, v)
        report(kind, sizes, model, train, run, checked, comm_rows, expected_comm,
               memory_rows, expected_memory, v)
        if args.json:
            bubble = {"measured": run.measured.bubble_fraction,
                      "simulated": run.simulated.bubble_fraction,
                      "simulated_unit_costs": simulate(run.executor.schedule).bubble_fraction}
            summary = run_summary(
                model, train, run.losses, mesh=sizes, world_size=comm.size, zero=0,
                schedule=kind, microbatches=args.microbatches, comm_bytes=comm_rows,
                expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
                expected_memory_peak_bytes=expected_memory, bubble_fraction=bubble,
                step_time_s=run.step_time_s, loss_scaling=run.loss_scaling,
                loss_floor=MarkovCorpus(model.vocab_size, train.seed).entropy_rate(), **checked)
            print(summary_line(summary), flush=True)
    return 0


def expected_comm_rows(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], m: int,
                       v: int) -> list[dict]:
    """Every rank's bytes over the run, from closed forms (rows as in `gather_rows`).

    Stage s lives on rank s mod p, so every one of the S - 1 stage boundaries crosses ranks: pp
    rank r sends one activation per microbatch for each of its stages but the last one overall and
    one input gradient for each but the first, 2v - [r = 0] - [r = p-1] copies of its pipeline's
    batch (b, T, C), and receives as many. Then per step: wte's gradient all-reduced between the
    first and the last rank (Megatron's embedding group), each gradient all-reduced over dp, and
    the loss (one float64) over the world; all-reduce bytes are the ring's (refpar.comm.cost).
    Gradients move in their dtype; fp16 adds the overflow flag (one float32) over pp."""
    from refpar.analysis.intra_layer import grad_itemsize
    from refpar.comm.cost import all_reduce_bytes
    from refpar.parallel.pipeline.stage import Stage

    p, d, n = sizes["pp"], sizes["dp"], sizes["pp"] * sizes["dp"]
    item, gitem = np.dtype(model.dtype).itemsize, grad_itemsize(model, train)
    shapes = {name: int(np.prod(shape)) for name, shape in param_shapes(model).items()}
    rows = []
    for rank in range(n):
        r, dr = divmod(rank, d)  # the mesh lays pp slowest, then dp
        first, stop = shard_range(train.batch_size, d, dr)
        b = stop - first  # this pipeline's sequences
        crossings = 2 * v - (r == 0) - (r == p - 1)
        p2p = int(crossings * b * train.seq_len * model.n_embd * item * train.steps)
        totals = {("pp", "isend"): (p2p, 0), ("pp", "irecv"): (0, p2p)}
        if r in (0, p - 1):
            ar = all_reduce_bytes(shapes["wte.weight"], 2, int(r == p - 1), gitem)
            totals["pp", "all_reduce"] = (ar.sent * train.steps, ar.recv * train.steps)
        if model.dtype == "float16":
            ar = all_reduce_bytes(1, p, r, 4)
            old = totals.get(("pp", "all_reduce"), (0, 0))
            totals["pp", "all_reduce"] = (old[0] + ar.sent * train.steps, old[1] + ar.recv * train.steps)
        if d > 1:
            names = {nm for c in range(v) for nm in Stage(model, p * v, c * p + r).param_names()}
            per = [all_reduce_bytes(shapes[nm], d, dr, gitem) for nm in names]
            totals["dp", "all_reduce"] = (sum(x.sent for x in per) * train.steps,
                                          sum(x.recv for x in per) * train.steps)
        loss = all_reduce_bytes(1, n, rank, 8)
        totals["world", "all_reduce"] = (loss.sent * train.steps, loss.recv * train.steps)
        rows += [{"rank": rank, "axis": a, "op": o, "bytes_sent": int(sb), "bytes_recv": int(rb)}
                 for (a, o), (sb, rb) in totals.items()]
    return rows


def microbatch_bytes(stage: Stage, b: int, model: ModelConfig, train: TrainConfig, params: dict
                     ) -> tuple[int, int]:
    """Bytes `stage` keeps for one microbatch of b sequences after its F, and after its B (what
    W needs), measured by running the stage once on zeros: they depend on shapes only."""
    T, C = train.seq_len, model.n_embd
    tokens = np.zeros((b, T), dtype=np.int64)  # (b, T)
    x = tokens if stage.first else np.zeros((b, T, C), dtype=model.dtype)  # (b, T) or (b, T, C)
    drop = DropoutContext(train.seed, 0, tuple(range(b)), model.dropout, True)
    out, cache = stage.forward(params, x, tokens, drop, b * T)
    after_f = held_bytes(cache, params)
    _, saved = stage.backward_input(None if stage.last else np.ones_like(out), cache)
    return after_f, held_bytes(saved, params)


def expected_memory_rows(model: ModelConfig, train: TrainConfig, sizes: dict[str, int], kind: str,
                         m: int, v: int) -> list[dict]:
    """Every rank's peak bytes by category: its stages' parameters, as many gradients, fp32 master
    weights (16-bit models), AdamW's two moments (analysis.intra_layer.state_bytes); and activations,
    the schedule's in-flight replay (`schedules.stored`) with the bytes one microbatch keeps after F
    and after B (`microbatch_bytes`)."""
    from refpar.analysis.intra_layer import state_bytes

    p, d = sizes["pp"], sizes["dp"]
    schedule = build(kind, p, m, v)
    stages = [Stage(model, p * v, s) for s in range(p * v)]
    params = init_params(model, train.seed)
    rows_of = {}  # dp rank -> the rows of each of its microbatches
    for dr in range(d):
        first, stop = shard_range(train.batch_size, d, dr)
        rows_of[dr] = [b - a for a, b in (shard_range(stop - first, m, i) for i in range(m))]
    kept = {(st.stage, b): microbatch_bytes(st, b, model, train, params)  # after F, after B
            for st in stages for b in {b for rows in rows_of.values() for b in rows}}
    replays = {dr: _replay(schedule, kept, rows) for dr, rows in rows_of.items()}
    out = []
    for rank in range(p * d):
        r, dr = divmod(rank, d)  # the mesh lays pp slowest, then dp
        names = {n for st in stages if st.stage % p == r for n in st.param_names()}
        peaks = state_bytes(sum(params[n].size for n in names), model, train) | {
            "activations": max(replays[dr][r], default=0), "comm": 0}
        out += [{"rank": rank, "category": c, "bytes": int(peaks[c])} for c in CATEGORIES]
    return out


def _replay(schedule, kept, rows_of) -> dict[int, list[int]]:
    return stored(schedule, lambda a: kept[a.stage, rows_of[a.microbatch]][0],
                  lambda a: kept[a.stage, rows_of[a.microbatch]][1])


def write_chrome_trace(path, plain, run: PipelineRun, step: int) -> None:
    """Rank 0 writes one Chrome trace of step `step`: per rank, its messages (track 0) and its
    actions as compute slices named like "1F0" (track 1), on the one clock of the machine."""
    from refpar.comm.trace import CommEvent, chrome_trace

    mine = {"events": [e.to_dict() for e in run.tracer.events if e.step == step],
            "slots": [{"action": str(s.action), "tick": s.tick, "start": s.start, "end": s.end}
                      for s in run.executor.slots]}
    payload = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
    pieces = plain.all_gather(payload)
    lengths = plain.all_gather(np.array([payload.size]))
    if plain.rank != 0:
        return
    events, slots = [], []
    for rank, (a, b) in enumerate(zip(np.cumsum(lengths) - lengths, np.cumsum(lengths), strict=True)):
        part = json.loads(pieces[a:b].tobytes())
        events += [CommEvent(**{**e, "group": tuple(e["group"]), "shape": tuple(e["shape"])})
                   for e in part["events"]]
        slots += [{**sl, "rank": rank} for sl in part["slots"]]
    t0 = min([e.t_start for e in events] + [sl["start"] for sl in slots])
    trace = chrome_trace(events, t0)
    for rank in sorted({sl["rank"] for sl in slots}):
        trace["traceEvents"] += [
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
            for tid, name in ((0, "messages"), (1, "compute"))]
    trace["traceEvents"] += [
        {"name": sl["action"], "cat": "compute", "ph": "X", "pid": sl["rank"], "tid": 1,
         "ts": (sl["start"] - t0) * 1e6, "dur": (sl["end"] - sl["start"]) * 1e6,
         "args": {"tick": sl["tick"], "step": step}} for sl in slots]
    with open(path, "w") as f:
        json.dump(trace, f)


def gather_rows(plain, run: PipelineRun) -> tuple[list[dict], list[dict]]:
    """Every rank's (comm rows by axis and op, peak memory rows), gathered onto every rank."""
    keys = [("pp", "isend"), ("pp", "irecv"), ("pp", "all_reduce"), ("dp", "all_reduce"),
            ("world", "all_reduce")]
    totals = run.tracer.totals() if run.tracer is not None else {}
    mine = [v for k in keys for v in totals.get(k, (0, 0))] + [run.ledger.peak[c] for c in CATEGORIES]
    every = plain.all_gather(np.array([mine], dtype=np.int64))
    comm, memory = [], []
    for r, row in enumerate(every.tolist()):
        for i, (axis, op) in enumerate(keys):
            if row[2 * i] or row[2 * i + 1]:
                comm.append({"rank": r, "axis": axis, "op": op, "bytes_sent": row[2 * i],
                             "bytes_recv": row[2 * i + 1]})
        for j, c in enumerate(CATEGORIES):
            memory.append({"rank": r, "category": c, "bytes": row[2 * len(keys) + j]})
    return comm, memory


def report(kind, sizes, model, train, run: PipelineRun, checked, comm_rows, expected_comm, memory_rows,
           expected_memory, v) -> None:
    def say(text=""):
        print(text, flush=True)

    p, m = sizes["pp"], run.executor.layout.n_microbatches
    say(f"pipeline {kind} over pp={p}" + (f" x dp={sizes['dp']}" if sizes["dp"] > 1 else "")
        + f", v={v}: GPT-2 {model.n_layer} layers, {model.dtype}, batch {train.batch_size} x "
        f"{train.seq_len} in {m} microbatches per pipeline")
    ref = checked.get("reference_losses")
    say(f"{'step':>5} {'loss':>20}" + ("" if ref is None else f" {'single device':>20} {'rel diff':>10}"))
    for s, loss in enumerate(run.losses):
        tail = "" if ref is None else f" {ref[s]:>20.15f} {abs(loss - ref[s]) / abs(ref[s]):>10.1e}"
        say(f"{run.first_step + s + 1:>5} {loss:>20.15f}{tail}")
    if checked:
        say(f"max relative parameter difference after {train.steps} steps: "
            f"{checked['max_param_rel_diff']:.1e}")
    if run.loss_scaling:
        say(loss_scaling_line(run.loss_scaling))
    measured, simulated = run.measured, run.simulated
    say(f"bubble of the last step: measured {measured.bubble_fraction:.1%} of rank-time, simulated "
        f"with the measured action times {simulated.bubble_fraction:.1%}, with unit costs "
        f"{simulate(run.executor.schedule).bubble_fraction:.1%}")
    say(f"  measured makespan {measured.makespan * 1e3:.2f} ms, simulated {simulated.makespan * 1e3:.2f}"
        f" ms; time on the executed critical path outside actions (messages, bookkeeping): "
        f"{critical_path_gap(measured, run.executor.schedule) * 1e3:.2f} ms")
    closed = {(r["rank"], r["axis"], r["op"]): r for r in expected_comm}
    say("bytes sent (received) per rank over all steps, measured | closed form:")
    for r in comm_rows:
        e = closed.get((r["rank"], r["axis"], r["op"]), {"bytes_sent": 0, "bytes_recv": 0})
        say(f"  rank {r['rank']} {r['axis']:<5} {r['op']:<10} {r['bytes_sent']:>10,} ({r['bytes_recv']:,})"
            f" | {e['bytes_sent']:,} ({e['bytes_recv']:,})")
    expected = {(r["rank"], r["category"]): r["bytes"] for r in expected_memory}
    say("peak memory per rank in bytes, measured | expected (activations: the schedule's in-flight "
        "microbatches x the bytes each keeps):")
    for rank in range(max(r["rank"] for r in memory_rows) + 1):
        cells = [f"{r['category']} {r['bytes']:,} | {expected[rank, r['category']]:,}"
                 for r in memory_rows if r["rank"] == rank and r["category"] != "comm"]
        say(f"  rank {rank}: " + ", ".join(cells))
