"""What rank 0 prints during and after a run of `refpar train` (refpar/engine/run.py; the header before
the first step is refpar/engine/header.py's): the step table, and the closing lines: the losses'
progress and difference from one device, the bytes per rank, axis and op and the peak memory per rank
and category next to their closed forms (from refpar/engine/report.py's summary), the model states,
the pipeline's bubble and time split, the routing of a MoE model, the tp collectives of block 0 and
ring attention's balance.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4 --check
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

from refpar.analysis import closed_forms as closed
from refpar.model.optim import clipped_steps
from refpar.parallel.context_parallel import causal_work, contiguous_positions, zigzag_positions
from refpar.precision import is_16bit, precision_of
from refpar.schedules.simulate import critical_path_gap

from .header import LABEL
from .runlog import HEARTBEAT_S, duration


def progress(say, model, cfg, ref, floor: tuple[str, float], moves: bool, pp: int = 1,
             log_every: int | None = None):
    """The step table: about a dozen rows whatever the length of the run, plus the first and last,
    and one whenever a minute has passed without (runlog.HEARTBEAT_S); with `log_every` N the steps
    N, 2N, ..., the first and the last, each with the run's elapsed time, ETA and MFU (`measured`,
    refpar/engine/runlog.py); a row for each step with a validation loss. `floor`: ("floor", the
    Markov chain's entropy rate) or ("unigram", the text's unigram entropy). `moves`: with what rank 0
    sent in the step, by axis. Without a pipeline rank 0 routes every MoE block, and shows the
    assignments dropped in all of them and the first one's experts' loads."""
    whole = model.moe_experts and pp == 1
    every = log_every or max(1, cfg.steps // 12)
    last_row = [time.monotonic()]
    label, floor = floor
    say(f"{'step':>6} {'loss':>9} {label:>9} {'tokens/s':>10}"
        + (f" {'elapsed':>8} {'ETA':>8} {'MFU':>7}" if log_every else "")
        + (f" {'single device':>14} {'rel diff':>8}" if ref else "")
        + (f" {'aux':>7} {'z':>7}" if model.moe_experts else "")
        + (f" {'dropped':>7}  tokens per expert (block {model.moe_blocks[0]})" if whole else "")
        + (f" {'loss scale':>11} {'skipped':>8}" if model.dtype == "float16" else "")
        + (f" {'val loss':>9}" if cfg.eval_every else "")
        + ("  rank 0 sent this step" if moves else ""))
    sent_before: dict[str, int] = {}

    def row(step, loss, seconds, totals, moe_step, scaling=None, measured=None, val_loss=None):
        by_axis: dict[str, int] = {}
        for (axis, _), (s, _) in totals.items():
            by_axis[axis] = by_axis.get(axis, 0) + s
        moved = ", ".join(f"{a} {by_axis[a] - sent_before.get(a, 0):,} B" for a in sorted(by_axis)
                          if by_axis[a] > sent_before.get(a, 0))
        sent_before.update(by_axis)
        due = (not (step + 1) % every or step in (0, cfg.steps - 1) or (scaling and scaling[1])
               or val_loss is not None)
        if not (due or log_every is None and time.monotonic() - last_row[0] >= HEARTBEAT_S):
            return
        last_row[0] = time.monotonic()
        tail = (f" {ref.losses[step]:>14.10f} {abs(loss - ref.losses[step]) / abs(ref.losses[step]):>8.1e}"
                if ref else "")
        if moe_step is not None:
            tail += f" {moe_step.aux_loss:>7.4f} {moe_step.z_loss:>7.4f}"
            if whole:
                loads = moe_step.tokens_per_expert[model.moe_blocks[0]]
                tail += f" {sum(moe_step.dropped.values()):>7}  {loads}"
        if scaling is not None:
            tail += f" {scaling[0]:>11g} {scaling[2]:>8}"
        if cfg.eval_every:
            tail += f" {val_loss:>9.4f}" if val_loss is not None else f" {'':>9}"
        clock = (f" {duration(measured.elapsed_s):>8} {duration(measured.eta_s):>8} {measured.mfu:>7.2%}"
                 if log_every else "")
        say(f"{step + 1:>6} {loss:>9.4f} {floor:>9.4f} {cfg.batch_size * cfg.seq_len / seconds:>10,.0f}"
            f"{clock}{tail}" + (f"  {moved or '-'}" if moves else ""))

    return row


def closing_lines(say, model, cfg, sizes, plan, par, out, every, s) -> None:
    """The closing lines, on rank 0 (module docstring)."""
    tail = out.losses[-10:]
    first, last, floor = out.losses[0], sum(tail) / len(tail), s["loss_floor"]
    if floor is None:  # text: next to the loss of a model that ignores the context
        unigram = s["data"]["unigram_entropy"]
        say(f"loss {first:.4f} at step {out.first_step + 1}, {last:.4f} over the last {len(tail)} steps; "
            f"the text's unigram entropy {unigram:.4f}, "
            + ("below it: the model predicts from the context" if last < unigram else "not yet below it")
            + f"; {out.step_time_s * 1e3:.1f} ms per step")
    else:
        gap = first - floor
        # Of the way from this run's first loss (a resumed run's first step is after its checkpoint); an
        # integer, so that a loss a hair above the first prints 0%, not "-0%", and one that rose says so.
        percent = round(100 * (first - last) / gap) if gap > 0 else None
        say(f"loss {first:.4f} at step {out.first_step + 1}, {last:.4f} over the last {len(tail)} steps"
            + ("" if percent is None else f", {percent}% of the way to the floor" if percent >= 0
               else ", above the first loss")
            + f"; {out.step_time_s * 1e3:.1f} ms per step")
    if s["val_losses"]:
        step, val = s["val_losses"][-1]["step"], s["val_losses"][-1]["loss"]
        before = [v["loss"] for v in s["val_losses"] if v["step"] == 0]
        say(f"validation loss {val:.4f} after {step} steps" + (f", {before[0]:.4f} before the first" if before
                                                                 else "")
            + " (held-out windows, evaluation mode)"
            + ("" if not s["reference_val_losses"] else
               f"; one device's {s['reference_val_losses'][-1]['loss']:.4f}"))
    if s["max_loss_rel_diff"] is not None:
        say(f"largest relative difference from one device: loss {s['max_loss_rel_diff']:.1e}, parameters "
            f"{s['max_param_rel_diff']:.1e} after {cfg.steps} steps")
        if is_16bit(model.dtype):
            say(f"  expected in {precision_of(model.dtype)}: one device runs it too, but the ranks sum in "
                "another order, which flips some 16-bit roundings; AdamW moves a weight by about lr "
                "whatever its gradient's size, so a flip can move it by 2 lr, large next to a tensor "
                "(a bias, from 0) that has moved a few lr (lesson 13)")
    norms = [n for n in s["grad_norms"] or () if n is not None]  # none on the steps fp16 skipped
    if norms:
        clipped = clipped_steps(norms, cfg.clip_grad_norm)
        say(f"global gradient norm before clipping: {norms[0]:.4g} at the first step, {norms[-1]:.4g} at the "
            f"last; clipped to {cfg.clip_grad_norm:g} on {clipped} of {len(norms)} steps"
            + ("" if s["max_grad_norm_rel_diff"] is None else
               f"; largest relative difference from one device {s['max_grad_norm_rel_diff']:.1e}"))
    if out.loss_scaling:
        skipped = [k + 1 for k in out.loss_scaling["skipped_steps"]]
        say(f"fp16 loss scale {out.loss_scaling['scales'][0]:g} -> {out.loss_scaling['final_scale']:g}; "
            f"steps skipped on every rank (gradients overflowed): {', '.join(map(str, skipped)) or 'none'}")
    if len(every) == 1:
        return
    _table(say, s)
    states = s["data_parallel"]["model_state_bytes"]
    replicas = sizes["dp"] * sizes["cp"] * (sizes["ep"] if model.moe_experts else 1) > 1
    line = ("model states (params+grads+master+optimizer) per rank: "
            + (f"{LABEL[plan.strategy]} " if replicas or plan.strategy != "dp" else "") + "measured "
            + ", ".join(f"{b:,}" for b in states))
    if replicas:
        def most(zero):  # the largest over the ranks, from the closed forms
            variant = replace(plan, zero=zero, fsdp=False, prefetch=False, reshard_after_forward=True)
            return max(closed.model_state_bytes(model, cfg, sizes, closed.rank_coords(sizes, r), variant)
                       for r in range(len(every)))

        dp, z3 = most(0), most(3)
        line += (f"; closed forms on this mesh: DP {dp:,}, ZeRO-3 {z3:,} (DP / ZeRO-3 = {dp / z3:.2f}, falls "
                 f"as 1/N)")
    say(line)
    if s["bubble_fraction"] is not None:
        b = s["bubble_fraction"]
        say(f"bubble of the last step: measured {b['measured']:.1%} of rank-time, simulated with the "
            f"measured action times {b['simulated']:.1%}, with unit costs {b['simulated_unit_costs']:.1%}")
        say(f"  measured makespan {out.measured.makespan * 1e3:.2f} ms, simulated "
            f"{out.simulated.makespan * 1e3:.2f} ms; time on the executed critical path outside actions "
            f"(messages, bookkeeping): "
            f"{critical_path_gap(out.measured, par.executor.schedule) * 1e3:.2f} ms")
        say("last step per rank, ms: compute | communication (collectives) | idle (pipeline waits, "
            "optimizer, bookkeeping)")
        for r, e in enumerate(every):
            t = e["split"]
            say(f"  rank {r}: {t['compute'] * 1e3:8.2f} | {t['communication'] * 1e3:8.2f} | "
                f"{t['idle'] * 1e3:8.2f}  of {t['wall'] * 1e3:.2f}")
    if s["moe"] is not None:
        m = s["moe"]
        say("dropped assignments per block over the run: " + ", ".join(
            f"{i}: {sum(st[k] for st in m['dropped'])}" for k, i in enumerate(m["blocks"]))
            + ("" if m["reference_dropped"] is None else "; one device's: " + (
                "the same" if m["reference_dropped"] == m["dropped"] else str(m["reference_dropped"]))))
        sent = [r["bytes_sent"] for r in s["comm_bytes"] if (r["axis"], r["op"]) == ("ep", "all_to_all")]
        # the data ranks of one stage between them run its blocks once (every tp rank of them
        # sends the same rows again)
        measured = sum(sent) / (len(out.losses) * sizes["dp"] * sizes["ep"] * sizes["tp"])
        say(f"ep all-to-all per data rank and step, every MoE block: {measured:,.0f} bytes; uniform "
            f"routing would send {m['uniform_all_to_all_bytes_per_rank_step']:,.0f}")
    tracer = par.mesh.world.tracer
    block = Counter(e.op + (" (re-gather)" if e.tag.endswith(":regather") else "") for e in
                    (tracer.events if tracer else ()) if e.axis == "tp" and e.step == out.first_step
                    and e.tag.startswith("h.0."))  # rank 0 holds stage 0, which holds block 0
    if block:
        say("tp collectives of block 0 in one step, from rank 0's trace: "
            + ", ".join(f"{n} {op}" for op, n in block.items()))
    if sizes["cp"] > 1 and (plan.cp_algo or "ring") == "ring":
        c, T = sizes["cp"], cfg.seq_len
        zigzag = [causal_work(zigzag_positions(T, c, r)) for r in range(c)]
        contiguous = [causal_work(contiguous_positions(T, c, r)) for r in range(c)]
        say(f"ring attention's causal (query, key) pairs per cp rank: {zigzag} with zig-zag chunks "
            f"(contiguous chunks would give {contiguous})")


def _table(say, s) -> None:
    """Bytes per rank, axis and op, and peak memory per rank and category, each next to its closed
    form; ranks that move and hold the same are printed once."""
    closed_rows = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"])
                   for r in s["expected_comm_bytes"]}
    measured = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in s["comm_bytes"]}
    lines: dict[int, tuple[str, ...]] = {}
    for key in sorted(set(closed_rows) | set(measured)):
        m, c = measured.get(key, (0, 0)), closed_rows.get(key, (0, 0))
        lines[key[0]] = (*lines.get(key[0], ()), f"{key[1]:<5} {key[2]:<14} {m[0]:>11,} ({m[1]:,}) | "
                         f"{c[0]:,} ({c[1]:,}){'' if m == c else '  MISMATCH'}")
    say(f"bytes sent (received) per rank over {len(s['losses'])} steps, measured | closed form:")
    for who, rows in _grouped(lines):
        say(f"  {who}:")
        for row in rows:
            say(f"    {row}")
    want = {(r["rank"], r["category"]): r["bytes"] for r in s["expected_memory_peak_bytes"]}
    say("peak memory per rank in bytes, measured | closed form:")
    mem = {rank: (", ".join(_against(r["category"], r["bytes"], want.get((rank, r["category"])))
                            for r in s["memory_peak_bytes"] if r["rank"] == rank),)
           for rank in sorted({r["rank"] for r in s["memory_peak_bytes"]})}
    for who, (row,) in _grouped(mem):
        say(f"  {who}: {row}")


def _against(category: str, measured: int, closed: int | None) -> str:
    """One category's peak next to its closed form; a category without one says so rather than differ."""
    if closed is None:
        return f"{category} {measured:,} | no closed form yet"
    return f"{category} {measured:,} | {closed:,}" + ("" if measured == closed else " MISMATCH")


def _grouped(lines_of: dict[int, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """Ranks with the same lines printed once (a mesh's replicas move and hold the same bytes)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, lines in sorted(lines_of.items()):
        groups.setdefault(lines, []).append(rank)
    out = []
    for lines, ranks in groups.items():
        if len(ranks) == 1:
            who = f"rank {ranks[0]}"
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            who = f"ranks {ranks[0]}-{ranks[-1]}"
        else:
            who = "ranks " + ",".join(map(str, ranks))
        out.append((who, lines))
    return out
