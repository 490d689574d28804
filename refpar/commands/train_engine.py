"""`refpar train --mesh dp=D,cp=C,tp=T,pp=P [--sp] [--zero 1|2|3 | --fsdp] [--schedule KIND]
[--microbatches M]`: the N-D engine (refpar/engine.py) as a job, for meshes that mix pp with tp,
cp or ZeRO/FSDP, ZeRO/FSDP with tp or cp, or sp with cp.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --steps 3 --check

Prints who holds what, a line per step (with --check the single-device loss next to it), and a
closing report: differences, bytes per rank by axis and op next to the closed forms
(refpar.analysis.engine), peak memory per rank by category next to the closed forms, the bubble
measured and simulated, and the last step's time split into compute, communication and idle.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from refpar.analysis.engine import (
    cp_tokens,
    expected_comm_rows,
    expected_memory_rows,
    rank_coords,
    rank_param_numels,
)
from refpar.config import ConfigError
from refpar.engine import EngineOptions, full_params, run_engine, validate
from refpar.holdings import stage_layers
from refpar.memory import CATEGORIES
from refpar.parallel.intra_layer_runner import loss_scaling_line
from refpar.parallel.pipeline.schedules import simulate
from refpar.sharding import shard_range

P2P = ("isend", "irecv")  # their time is spent waiting for the other side: idle, not transfer


def wants_engine(sizes: dict[str, int], args) -> bool:
    """What no single-strategy runner composes: pp together with tp or cp, or pp with ZeRO or FSDP
    sharding over dp; ZeRO or FSDP with tp or cp; sp with cp."""
    if sizes["pp"] > 1:
        return (sizes["tp"] > 1 or sizes["cp"] > 1 or args.sp or args.cp_algo is not None
                or args.zero > 0 or args.fsdp)
    sharded = args.zero > 0 or args.fsdp
    return (sharded and (sizes["tp"] > 1 or sizes["cp"] > 1)) or (args.sp and sizes["cp"] > 1)


def engine_options(sizes: dict[str, int], args) -> EngineOptions:
    kind = args.schedule or "1f1b"
    v = args.chunks if args.chunks is not None else (2 if kind == "interleaved-1f1b" else 1)
    if args.fsdp and args.zero:
        raise ConfigError(f"--fsdp and --zero {args.zero} are two ways to shard; give one of them")
    if args.prefetch or not args.reshard_after_forward:
        raise ConfigError("--prefetch and --no-reshard-after-forward are the dp-only FSDP's options; "
                          "the engine's FSDP gathers each unit for each piece: drop them")
    zero = 3 if args.fsdp else args.zero
    return EngineOptions(kind, args.microbatches, v, args.sp, zero, args.cp_algo, fsdp=args.fsdp)


def time_split(slots, events, window) -> dict[str, float]:
    """One rank's step in seconds: compute = its actions minus the collectives inside them,
    communication = every blocking collective, idle = the rest (waiting for pipeline messages,
    the optimizer update, bookkeeping)."""
    spans = [(e.t_start, e.t_end) for e in events if e.op not in P2P]
    inside = sum(max(0.0, min(b, s.end) - max(a, s.start)) for a, b in spans for s in slots)
    compute = sum(s.end - s.start for s in slots) - inside
    comm = sum(b - a for a, b in spans)
    wall = window[1] - window[0]
    return {"compute": compute, "communication": comm, "idle": max(0.0, wall - compute - comm),
            "wall": wall}


def holdings(model, train, sizes, opts) -> list[str]:
    """One line per rank: coordinates, stages and blocks, heads, vocabulary rows, parameters."""
    p, t, v = sizes["pp"], sizes["tp"], opts.chunks
    S, out = p * v, []
    for rank in range(int(np.prod(list(sizes.values())))):
        co = rank_coords(sizes, rank)
        parts = []
        for s in (c * p + co["pp"] for c in range(v)):
            blocks = stage_layers(model.n_layer, S, s)
            ends = (("embedding + " if s == 0 else "") + f"blocks {blocks[0]}-{blocks[-1]}"
                    + (" + head" if s == S - 1 else ""))
            parts.append(f"stage {s} ({ends})")
        h0, h1 = shard_range(model.n_head, t, co["tp"])
        v0, v1 = shard_range(model.vocab_size, t, co["tp"])
        b0, b1 = shard_range(train.batch_size, sizes["dp"], co["dp"])
        n = sum(rank_param_numels(model, sizes, co, v).values())
        cp = f" cp={co['cp']}" if sizes["cp"] > 1 else ""
        tokens = (f", {cp_tokens(train.seq_len, sizes['cp'], opts.cp_algo)[co['cp']]} tokens"
                  if cp else "")
        out.append(f"  rank {rank} pp={co['pp']} dp={co['dp']}{cp} tp={co['tp']}: {', '.join(parts)}; "
                   f"heads {h0}-{h1 - 1}, vocab rows {v0}-{v1 - 1}, samples {b0}-{b1 - 1}{tokens}; "
                   f"{n:,} parameters")
    return out


def run_cli(model, train, sizes: dict[str, int], args) -> int:
    from refpar.comm.communicator import world
    from refpar.comm.trace import Tracer
    from refpar.mesh import DeviceMesh
    from refpar.report import run_summary, summary_line
    from refpar.trainer import corpus_for, train_single_device

    opts = engine_options(sizes, args)
    validate(model, train, sizes, opts)  # on every rank, before any communication
    comm, plain = world(Tracer()), world()  # plain: the report's own traffic, left out of the trace
    mesh = DeviceMesh(comm, sizes)
    speak = comm.rank == 0

    def say(text=""):
        if speak:
            print(text, flush=True)

    ref = train_single_device(model, train) if args.check and speak else None
    axes = [a for a in ("pp", "dp", "cp", "tp") if sizes[a] > 1]
    say(f"mesh {' x '.join(f'{a}={sizes[a]}' for a in axes)} on {comm.size} ranks: schedule {opts.schedule}"
        f" (v={opts.chunks}), {opts.microbatches} microbatches per pipeline, "
        + ("FSDP" if opts.fsdp else f"zero {opts.zero}")
        + (", sequence parallel" if opts.sp else "")
        + (f", {opts.cp_algo or 'ring'} attention over cp" if sizes["cp"] > 1 else ""))
    say(f"GPT-2 {args.model}: {model.n_layer} layers, {model.n_embd} channels, {model.n_head} heads, "
        f"{model.dtype}, dropout {model.dropout}; batch {train.batch_size} x {train.seq_len}")
    for line in holdings(model, train, sizes, opts):
        say(line)
    say(f"{'step':>5} {'loss':>18}" + (f" {'single device':>18} {'rel diff':>8}" if ref else "")
        + f" {'tokens/s':>9}  rank 0 sent this step")
    sent_before: dict[str, int] = {}

    def progress(step, loss, seconds, totals):
        by_axis: dict[str, int] = {}
        for (axis, _), (s, _) in totals.items():
            by_axis[axis] = by_axis.get(axis, 0) + s
        moved = ", ".join(f"{a} {by_axis[a] - sent_before.get(a, 0):,} B" for a in sorted(by_axis))
        sent_before.update(by_axis)
        tail = f" {ref.losses[step]:>18.12f} {abs(loss - ref.losses[step]) / abs(ref.losses[step]):>8.1e}" \
            if ref else ""
        tokens_s = train.batch_size * train.seq_len / seconds
        say(f"{step + 1:>5} {loss:>18.12f}{tail} {tokens_s:>9,.0f}  {moved}")

    run = run_engine(model, train, mesh, opts, on_step=progress, save=args.save,
                     save_every=args.save_every, resume=args.resume)
    last = train.steps - 1
    split = time_split(run.executor.slots, [e for e in comm.tracer.events if e.step == last],
                       run.windows[-1])
    mine = {"totals": run.totals, "peak": {c: run.ledger.peak[c] for c in CATEGORIES},
            "full": full_params(run, model, mesh) if args.check else {}, "split": split}
    if args.trace:
        from refpar.parallel.pipeline.runner import write_chrome_trace

        write_chrome_trace(args.trace, plain, run, last)
        events = plain.gather_object([e.to_dict() for e in comm.tracer.events])
        if speak:
            path = Path(args.trace).with_suffix(".jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(e) + "\n" for part in events for e in part)
    every = plain.gather_object(mine)
    if not speak:
        return 0
    comm_rows = [{"rank": r, "axis": a, "op": o, "bytes_sent": int(s), "bytes_recv": int(rv)}
                 for r, e in enumerate(every) for (a, o), (s, rv) in sorted(e["totals"].items()) if s or rv]
    memory_rows = [{"rank": r, "category": c, "bytes": int(e["peak"][c])}
                   for r, e in enumerate(every) for c in CATEGORIES]
    skipped = len(run.loss_scaling["skipped_steps"]) if run.loss_scaling else 0
    expected_comm = expected_comm_rows(model, replace(train, steps=len(run.losses)), sizes, opts, skipped)
    expected_memory = expected_memory_rows(model, train, sizes, opts)
    checked = {}
    if ref is not None:
        ref_losses = ref.losses[run.first_step:]  # a resumed run has only the steps after its checkpoint
        checked = {"reference_losses": ref_losses,
                   "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                            zip(run.losses, ref_losses, strict=True)),
                   "max_param_rel_diff": max(float(np.max(np.abs(p - ref.params[n])) / np.max(
                       np.abs(ref.params[n]))) for e in every for n, p in e["full"].items())}
        say(f"largest relative difference from one device: loss {checked['max_loss_rel_diff']:.1e}, "
            f"parameters {checked['max_param_rel_diff']:.1e} after {train.steps} steps")
    if run.loss_scaling:
        say(loss_scaling_line(run.loss_scaling))
    report(say, comm_rows, expected_comm, memory_rows, expected_memory, train)
    bubble = {"measured": run.measured.bubble_fraction, "simulated": run.simulated.bubble_fraction,
              "simulated_unit_costs": simulate(run.executor.schedule).bubble_fraction}
    say(f"bubble of the last step: measured {bubble['measured']:.1%}, simulated with the measured "
        f"action times {bubble['simulated']:.1%}, with unit costs {bubble['simulated_unit_costs']:.1%}")
    say("last step per rank, ms: compute | communication (collectives) | idle (pipeline waits, "
        "optimizer, bookkeeping)")
    for r, e in enumerate(every):
        s = e["split"]
        say(f"  rank {r}: {s['compute'] * 1e3:8.2f} | {s['communication'] * 1e3:8.2f} | "
            f"{s['idle'] * 1e3:8.2f}  of {s['wall'] * 1e3:.2f}")
    if args.trace:
        say(f"trace: {args.trace} (open in https://ui.perfetto.dev), "
            f"{Path(args.trace).with_suffix('.jsonl')} (JSON lines)")
    if args.json:
        times = run.step_times[1:] or run.step_times
        say(summary_line(run_summary(
            model, train, run.losses, mesh=sizes, world_size=comm.size, zero=opts.zero,
            schedule=opts.schedule, microbatches=opts.microbatches, comm_bytes=comm_rows,
            expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
            expected_memory_peak_bytes=expected_memory, bubble_fraction=bubble,
            step_time_s=float(np.mean(times)), loss_floor=corpus_for(model, train).entropy_rate(),
            loss_scaling=run.loss_scaling, **checked)))
    return 0


def _ranks(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0-3" or "ranks 0,2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def _grouped(lines_of: dict[int, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """Ranks with the same lines printed once (a mesh's replicas move and hold the same bytes)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, lines in sorted(lines_of.items()):
        groups.setdefault(lines, []).append(rank)
    return [(_ranks(ranks), lines) for lines, ranks in groups.items()]


def report(say, comm_rows, expected_comm, memory_rows, expected_memory, train) -> None:
    closed = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in expected_comm}
    measured = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in comm_rows}
    lines: dict[int, tuple[str, ...]] = {}
    for key in sorted(set(closed) | set(measured)):
        m, c = measured.get(key, (0, 0)), closed.get(key, (0, 0))
        lines[key[0]] = (*lines.get(key[0], ()), f"{key[1]:<3} {key[2]:<14} {m[0]:>11,} ({m[1]:,}) | "
                         f"{c[0]:,} ({c[1]:,}){'' if m == c else '  MISMATCH'}")
    say(f"bytes sent (received) per rank over {train.steps} steps, measured | closed form:")
    for who, rows in _grouped(lines):
        say(f"  {who}:")
        for row in rows:
            say(f"    {row}")
    want = {(r["rank"], r["category"]): r["bytes"] for r in expected_memory}
    say("peak memory per rank in bytes, measured | closed form:")
    mem = {rank: (", ".join(f"{r['category']} {r['bytes']:,} | {want[rank, r['category']]:,}"
                            + ("" if r["bytes"] == want[rank, r["category"]] else " MISMATCH")
                            for r in memory_rows if r["rank"] == rank),)
           for rank in sorted({r["rank"] for r in memory_rows})}
    for who, (row,) in _grouped(mem):
        say(f"  {who}: {row}")
