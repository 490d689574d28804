"""`refpar train --mesh tp=N [--sp]` and `--mesh cp=N [--cp-algo ring|ulysses]`, with dp around them.

    mpiexec -n 4 python -m refpar train --mesh dp=2,tp=2 --sp --steps 5 --check

Trains with refpar/parallel/intra_layer.py, then (with --check) runs the single-device reference on
rank 0 and reports per step the loss next to the reference's, the largest relative parameter
difference, the bytes each rank sent by axis and op next to the closed form
(refpar.analysis.intra_layer), and each rank's peak memory by category next to the closed form
(refpar.analysis.activations for the activations).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import numpy as np

from refpar import checkpoint
from refpar.analysis.activations import activation_peak_bytes
from refpar.analysis.intra_layer import expected_comm_rows, local_param_numel, state_bytes
from refpar.memory import CATEGORIES

# Every (axis, op) this runner can trace, in report order.
AXIS_OPS = (("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter"), ("cp", "isend"),
            ("cp", "irecv"), ("cp", "all_to_all"), ("cp", "all_reduce"), ("dp", "all_reduce"))


def add_arguments(parser) -> None:
    """The tp/cp flags of `refpar train` (--check and --trace are train's own)."""
    add = parser.add_argument
    add("--sp", action="store_true", help="TP: Megatron sequence parallelism over the tp axis")
    add("--cp-algo", default=None, choices=("ring", "ulysses"),
        help="how cp ranks share attention: ring (zig-zag ring attention, default) or ulysses")


def wants_intra_layer(sizes: dict[str, int], args) -> bool:
    """A mesh with tp or cp, or a flag only this runner takes (so that it can say what is wrong)."""
    return sizes.get("tp", 1) > 1 or sizes.get("cp", 1) > 1 or args.sp or args.cp_algo is not None


def rank_coords(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """The mesh coordinates of a world rank (DeviceMesh's layout: tp fastest-varying)."""
    from refpar.config import MESH_AXES

    position = np.unravel_index(rank, tuple(sizes[a] for a in MESH_AXES))
    return {a: int(c) for a, c in zip(MESH_AXES, position, strict=True)}


def expected_memory(model, train, sizes, rank, sp, cp_algo) -> dict[str, int]:
    """Peak bytes by category on `rank`: its parameter shards, their gradients, fp32 master weights
    and AdamW's two moments, and the activations kept at the end of the forward pass."""
    coords = rank_coords(sizes, rank)
    states = state_bytes(local_param_numel(model, sizes["tp"], coords["tp"]), model, train)
    peaks = states | {"activations": activation_peak_bytes(model, train, sizes, coords, sp, cp_algo),
                      "comm": 0}
    return {c: peaks[c] for c in CATEGORIES}


def checkpoint_arrays(trainer, saving: bool) -> list:
    """(checkpoint.Piece, view) for each array this rank holds: parameters, fp32 master weights (16-bit
    models) and AdamW moments, each a box of the global tensor (`tp_param_slices`: a shard's columns
    of c_attn are three runs, of q, k and v, so three boxes). Loading writes through the views.
    Saving, only the ranks at dp = cp = 0 write, and a tensor every tp rank holds whole only tp rank
    0: each element is written once."""
    from refpar.holdings import tp_param_slices

    coords, sizes = trainer.mesh.coords, trainer.mesh.sizes
    if saving and (coords["dp"] or coords["cp"]):
        return []
    slices = tp_param_slices(trainer.model, sizes["tp"], coords["tp"])
    held = [("params", trainer.params)] + [(f"adamw.{k}", trainer.state[k]) for k in ("m", "v")
                                            if k in trainer.state]
    held += [("master", trainer.state["master"])] if "master" in trainer.state else []
    out = []
    for prefix, arrays in held:
        for name, w in arrays.items():
            if name in slices or not saving or coords["tp"] == 0:
                axis, index = slices.get(name, (None, None))
                # copy=False: the pieces must view w itself, so that loading writes into it
                out += checkpoint.shard_pieces(f"{prefix}/{name}", np.reshape(w, -1, copy=False),
                                               w.shape, 0, axis, index)
    return out


def saved_position(state: dict, scaler) -> dict:
    """What `checkpoint.save_training` keeps beside the arrays so that a resumed run goes on bit for
    bit: AdamW's step count (behind the step when fp16 skipped steps) and the loss scaler's state."""
    return {"optimizer_t": state["t"], "loss_scaler": None if scaler is None else scaler.state_dict()}


def resumed_position(manifest: dict, scaler) -> tuple[int, int]:
    """(steps done, AdamW's t) of a checkpoint's manifest; restores the fp16 loss scaler's state."""
    step = int(manifest["step"])
    if scaler is not None and manifest.get("loss_scaler") is not None:
        scaler.load_state_dict(manifest["loss_scaler"])
    return step, int(manifest.get("optimizer_t", step))


def run_cli(model, train, sizes: dict[str, int], args) -> int:
    from refpar.comm.communicator import world
    from refpar.comm.trace import Tracer, write_trace
    from refpar.memory import MemoryLedger
    from refpar.mesh import DeviceMesh
    from refpar.parallel.context_parallel import causal_work, contiguous_positions, zigzag_positions
    from refpar.parallel.intra_layer import IntraLayerTrainer, validate
    from refpar.report import loss_scaling_summary, run_summary, summary_line
    from refpar.trainer import corpus_for, train_single_device

    sp, cp_algo = args.sp, args.cp_algo
    validate(model, train, sizes, sp, cp_algo)  # on every rank, before any communication
    tracer = Tracer()
    comm = world(tracer)
    mesh = DeviceMesh(comm, sizes)
    ledger = MemoryLedger()
    trainer = IntraLayerTrainer(model, train, mesh, ledger, sp, cp_algo)
    first = 0
    if args.resume is not None:
        manifest = checkpoint.open_training(args.resume, model, train)
        pairs = checkpoint_arrays(trainer, saving=False)
        for (_, view), loaded in zip(pairs, checkpoint.load(args.resume, [p for p, _ in pairs], manifest),
                                     strict=True):
            view[...] = loaded
        first, trainer.state["t"] = resumed_position(manifest, trainer.scaler)
    corpus = corpus_for(model, train)
    losses, times = [], []
    for step in range(first, train.steps):
        start = time.perf_counter()
        with tracer.context(step=step):
            losses.append(trainer.step(step, corpus))
        times.append(time.perf_counter() - start)
        if args.save is not None and checkpoint.should_save(step + 1, train.steps, args.save_every):
            checkpoint.save_training(args.save, step + 1, checkpoint_arrays(trainer, saving=True), model,
                                     train, sizes, "sp" if sp else "tp", comm,
                                     **saved_position(trainer.state, trainer.scaler))
    totals = tracer.totals()  # before the reporting below adds its own messages
    block = Counter(f"{e.op}{' (re-gather)' if e.tag.endswith(':regather') else ''}" for e in tracer.events
                    if e.axis == "tp" and e.step == 0 and e.tag.startswith("h.0."))
    last = [e for e in tracer.events if e.step == train.steps - 1]
    full = trainer.full_params() if args.check else None
    if args.trace:  # every rank's messages of the last step, one track per rank
        every_event = comm.gather_object(last)
        if comm.rank == 0:
            write_trace(args.trace, [e for events in every_event for e in events])
    mine = [v for key in AXIS_OPS for v in totals.get(key, (0, 0))] + [ledger.peak[c] for c in CATEGORIES]
    every = comm.gather_object(mine)
    if comm.rank != 0:
        return 0
    comm_rows, memory_rows, expected_comm, expected_mem = [], [], [], []
    for r, row in enumerate(every):
        for i, (axis, op) in enumerate(AXIS_OPS):
            if row[2 * i] or row[2 * i + 1]:
                comm_rows.append({"rank": r, "axis": axis, "op": op, "bytes_sent": row[2 * i],
                                  "bytes_recv": row[2 * i + 1]})
        peaks = row[2 * len(AXIS_OPS):]
        memory_rows += [{"rank": r, "category": c, "bytes": b}
                        for c, b in zip(CATEGORIES, peaks, strict=True)]
        rows = expected_comm_rows(model, replace(train, steps=len(losses)), sizes, rank_coords(sizes, r),
                                  r, sp, cp_algo)
        expected_comm += sorted(rows, key=lambda row: AXIS_OPS.index((row["axis"], row["op"])))
        expected_mem += [{"rank": r, "category": c, "bytes": b}
                         for c, b in expected_memory(model, train, sizes, r, sp, cp_algo).items()]
    checked = {}
    if args.check:
        ref = train_single_device(model, train)
        ref_losses = ref.losses[first:]  # a resumed run has only the steps after its checkpoint
        checked = {"reference_losses": ref_losses,
                   "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses,
                                                                                  strict=True)),
                   "max_param_rel_diff": max(float(np.max(np.abs(full[n] - p)) / np.max(np.abs(p)))
                                             for n, p in ref.params.items())}
    step_time = float(np.mean(times[1:] or times))
    scaling = loss_scaling_summary(trainer.scales, trainer.skipped_steps)
    report(model, train, sizes, sp, cp_algo, losses, checked, comm_rows, expected_comm, memory_rows,
           expected_mem, first)
    if scaling:
        print(loss_scaling_line(scaling), flush=True)
    if block:
        print("tp collectives of block 0 in one step, from rank 0's trace: "
              + ", ".join(f"{n} {op}" for op, n in block.items()), flush=True)
    if sizes["cp"] > 1 and (cp_algo or "ring") == "ring":
        c, T = sizes["cp"], train.seq_len
        zigzag = [causal_work(zigzag_positions(T, c, r)) for r in range(c)]
        contiguous = [causal_work(contiguous_positions(T, c, r)) for r in range(c)]
        print(f"ring attention's causal (query, key) pairs per cp rank: {zigzag} with zig-zag chunks "
              f"(contiguous chunks would give {contiguous})", flush=True)
    if args.json:
        print(summary_line(run_summary(
            model, train, losses, mesh=sizes, world_size=comm.size, zero=0, comm_bytes=comm_rows,
            expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
            expected_memory_peak_bytes=expected_mem, step_time_s=step_time,
            loss_floor=corpus.entropy_rate(), loss_scaling=scaling, **checked)), flush=True)
    return 0


def loss_scaling_line(scaling: dict) -> str:
    """fp16's loss scale: where it ended and which steps (1-based) every rank skipped."""
    skipped = [s + 1 for s in scaling["skipped_steps"]]
    return (f"fp16 loss scale {scaling['scales'][0]:g} -> {scaling['final_scale']:g}; steps skipped on "
            f"every rank (gradients overflowed): {', '.join(map(str, skipped)) or 'none'}")


def report(model, train, sizes, sp, cp_algo, losses, checked, comm_rows, expected_comm, memory_rows,
           expected_mem, first: int = 0) -> None:
    """The learner's table: losses by step, bytes by rank, axis and op, peak memory by rank."""
    def say(text=""):
        print(text, flush=True)

    parts = [f"{a}={sizes[a]}" for a in ("dp", "tp", "cp") if sizes[a] > 1]
    how = " with sequence parallelism" if sp else ""
    if sizes["cp"] > 1:
        how += f", {cp_algo or 'ring'} attention"
    say(f"{','.join(parts)}{how}: GPT-2 {model.n_layer} layers, {model.dtype}, "
        f"batch {train.batch_size} x {train.seq_len}, vocabulary {model.vocab_size}")
    ref = checked.get("reference_losses")
    say(f"{'step':>5} {'loss':>20} {'single device':>20} {'rel diff':>10}")
    for s, loss in enumerate(losses):
        tail = "" if ref is None else f" {ref[s]:>20.15f} {abs(loss - ref[s]) / abs(ref[s]):>10.1e}"
        say(f"{first + s + 1:>5} {loss:>20.15f}{tail}")
    if checked:
        say(f"max relative parameter difference after {train.steps} steps: "
            f"{checked['max_param_rel_diff']:.1e}")
    expected = {(r["rank"], r["axis"], r["op"]): r for r in expected_comm}
    say(f"bytes sent (received) per rank over {len(losses)} steps, measured | closed form:")
    for r in comm_rows:
        e = expected.get((r["rank"], r["axis"], r["op"]), {"bytes_sent": 0, "bytes_recv": 0})
        say(f"  rank {r['rank']} {r['axis']} {r['op']:<15} {r['bytes_sent']:>10,} ({r['bytes_recv']:,}) | "
            f"{e['bytes_sent']:,} ({e['bytes_recv']:,})")
    want = {(r["rank"], r["category"]): r["bytes"] for r in expected_mem}
    say("peak memory per rank in bytes, measured | closed form:")
    for rank in sorted({r["rank"] for r in memory_rows}):
        say(f"  rank {rank}: " + ", ".join(
            f"{r['category']} {r['bytes']:,} | {want[(rank, r['category'])]:,}"
            for r in memory_rows if r["rank"] == rank))
