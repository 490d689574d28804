"""`refpar train` on this job's ranks: the world and the mesh, the single device's run (--check),
`parallelize` and `train`, every rank's measurements gathered on rank 0 (refpar/engine/report.py sets
them next to the closed forms; refpar/engine/lines.py prints them), and --trace's files.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --steps 3 --check

The options arrive checked (refpar/commands/train.py calls refpar/engine/validate.py:validate on every
rank before any message); from the first message on, an error on one rank ends every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from refpar.agreement import agreed
from refpar.analysis import closed_forms as closed
from refpar.files import write_atomically
from refpar.holdings import kv_replicas, tp_param_slices
from refpar.trainer import baseline, corpus_for, train_single_device, validation_loss

from . import runlog
from .header import header
from .lines import closing_lines, progress
from .parallelize import parallelize
from .report import summarize, summary_line
from .sharded_state import gather_params, open_resume
from .train import train

STATES = ("params", "grads", "master", "optimizer")  # the model states: the ZeRO paper's categories
P2P = ("isend", "irecv")  # their time is spent waiting for the other side: idle, not transfer


def run_job(model, cfg, sizes: dict, plan, args) -> int:
    """Trains on this job's ranks as `plan` says and reports (module docstring)."""
    from refpar.comm.communicator import abort_on_error, world
    from refpar.comm.trace import Tracer
    from refpar.mesh import DeviceMesh

    comm, plain = world(Tracer()), world()  # plain: the report's own traffic, left out of the trace
    # its sentence comes from every rank alike, before any message
    mesh = DeviceMesh(comm, sizes, kv_replicas(model, sizes["tp"]))
    if args.resume is not None:  # so do a checkpoint's that this run cannot take (every rank reads the
        # files of the step rank 0 chose, refpar/commands/train.py:decide_checkpoints; one that sees
        # them changed by another job refuses for all)
        agreed(plain, lambda: open_resume(args.resume, model, cfg, plan))
    if comm.size == 1:
        return _train_and_report(model, cfg, sizes, plan, args, mesh, plain)
    # From here on ranks communicate: an error one rank meets alone (a full disk, say) must end
    # every rank, not leave the others waiting in a collective. (refpar.cli returns 2 from each rank
    # for a ConfigError, which is right only for the checks every rank makes alike before this.)
    with abort_on_error():
        return _train_and_report(model, cfg, sizes, plan, args, mesh, plain)


def _train_and_report(model, cfg, sizes: dict, plan, args, mesh, plain) -> int:
    comm = mesh.world
    speak = comm.rank == 0

    def say(text=""):
        if speak:
            print(text, flush=True)

    peak = None
    if runlog.wants_peak(args):  # every rank at once: ranks that share cores in the run share them here
        plain.barrier()
        peak = runlog.measure_peak(runlog.gemm_dtype(model.dtype))
    ref = train_single_device(model, cfg, microbatches=plan.microbatches) if args.check and speak else None
    corpus = corpus_for(model, cfg)
    label = cfg.init_from or args.model  # the model's name: its preset, or the folder it came from
    for line in header(model, cfg, sizes, plan, label, corpus) + ([peak.line(comm.size)] if peak else []):
        say(line)
    if args.save is not None and getattr(corpus, "tokenizer", None) is not None and speak:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        corpus.tokenizer.save(args.save)  # beside the steps: refpar export and generate --from read it
    with runlog.RunLog(model, cfg, comm.size, args, peak, speak) as log:  # --log, --tensorboard, the bar
        summary, par, out, every = collect(
            model, cfg, mesh, plan, check=args.check, ref=ref, plain=plain, trace=args.trace,
            on_step=log.on_step(progress(log.say, model, cfg, ref, baseline(corpus), comm.size > 1,
                                         sizes["pp"], args.log_every)),
            save=args.save, save_every=args.save_every, resume=args.resume)
    if not speak:
        return 0
    closing_lines(say, model, cfg, sizes, plan, par, out, every, summary)
    if args.trace:
        say(f"trace: {args.trace} (open in https://ui.perfetto.dev), "
            f"{args.trace}.jsonl (JSON lines)")
    if args.json:
        say(summary_line(summary))
    return 0


def collect(model, cfg, mesh, plan, *, check: bool = False, ref=None, plain=None, trace=None, on_step=None,
            save=None, save_every=None, resume=None):
    """Trains on `mesh` and gathers every rank's measurements next to its closed forms: (the JSON
    summary, the Parallel, the Run, every rank's measurements) on rank 0, (None, ...) elsewhere.
    `check`: compare with the single-device run (`ref`, computed here on rank 0 if not given);
    `plain`: an untraced communicator for the gathers (default the mesh's world); `trace`: write
    the Chrome trace and JSON lines there."""
    comm = mesh.world
    plain = plain or comm
    par = parallelize(model, cfg, mesh, plan)
    corpus = corpus_for(model, cfg)

    def evaluate():  # the validation loss of the parameters every rank holds a part of, on rank 0
        params = gather_params(par, plain)
        return None if params is None else validation_loss(params, model, corpus, cfg)

    out = train(par, on_step, save=save, save_every=save_every, resume=resume, evaluate=evaluate)
    sizes, last = mesh.sizes, cfg.steps - 1
    skipped = {k - out.first_step for k in out.skipped_steps}
    mine = {"totals": out.totals, "peak": dict(par.ledger.peak),
            "state": sum(par.ledger.current[c] for c in STATES), "held": par.states.units.total,
            "expected_comm": closed.rank_comm_rows(model, cfg, sizes, mesh.coords, plan, len(out.losses),
                                                   skipped, _kept(out)),
            "expected_memory": closed.rank_memory_rows(model, cfg, sizes, mesh.coords, plan, _kept(out),
                                                       stepped=len(skipped) < len(out.losses)),
            "full": full_params(par) if check else {},
            "split": time_split(par.executor.slots, [e for e in comm.tracer.events if e.step == last]
                                if comm.tracer else [], out.windows[-1]),
            "moe": [(s.tokens_per_expert, s.dropped, s.kept_counts, s.microbatch_kept_counts,
                     s.microbatch_pair_counts) for s in out.moe_steps],
            "flops": out.flops}
    if trace:
        write_traces(trace, plain, par, comm.tracer.events, last)
    every = plain.gather_object(mine)
    if plain.rank != 0:
        return None, par, out, None
    if check and ref is None:
        ref = train_single_device(model, cfg, microbatches=plan.microbatches)
    return summarize(model, cfg, sizes, plan, par, out, every, ref, corpus), par, out, every


def time_split(slots, events, window) -> dict[str, float]:
    """One rank's step in seconds: compute = its actions minus the collectives inside them,
    communication = every blocking collective, idle = the rest (waiting for pipeline messages,
    the optimizer update, bookkeeping)."""
    spans = [(e.t_start, e.t_end) for e in events if e.op not in P2P]
    inside = sum(max(0.0, min(b, s.end) - max(a, s.start)) for a, b in spans for s in slots)
    compute = sum(s.end - s.start for s in slots) - inside
    comm = sum(b - a for a, b in spans)
    wall = window[1] - window[0]
    return {"compute": compute, "communication": comm, "idle": max(0.0, wall - compute - comm), "wall": wall}


def write_traces(path, plain, par, events, step: int) -> None:
    """Rank 0 writes one Chrome trace of step `step` (per rank its messages on track 0 and, in a
    pipeline, its actions as compute slices named like "1F0" on track 1, on the one clock of the
    machine; with --recompute each rerun forward too, named like "recompute h.3") and every event
    of the run as JSON lines beside it (PATH.jsonl)."""
    from refpar.comm.trace import chrome_trace, event_of

    piped = par.mesh.sizes["pp"] > 1
    reruns = {id(st.recompute): st.recompute for st in par.executor.stages.values() if st.recompute}
    mine = {"events": [e.to_dict() for e in events if e.step == step],
            "slots": [{"action": str(s.action), "tick": s.tick, "start": s.start, "end": s.end}
                      for s in par.executor.slots] if piped else [], "all": [e.to_dict() for e in events]}
    # --recompute: each forward run again inside a backward, a compute slice of its own
    mine["slots"] += [{"action": f"recompute {piece}", "tick": None, "start": a, "end": b}
                      for rc in reruns.values() for piece, a, b in rc.spans]
    every = plain.gather_object(mine)
    if plain.rank != 0:
        return
    parts = [event_of(e) for part in every for e in part["events"]]
    slots = [{**sl, "rank": rank} for rank, part in enumerate(every) for sl in part["slots"]]
    # one device sends nothing and runs no pipeline: its trace is empty, on the clock of no event
    t0 = min([e.t_start for e in parts] + [sl["start"] for sl in slots], default=0.0)
    trace = chrome_trace(parts, t0)
    for rank in sorted({sl["rank"] for sl in slots}):
        trace["traceEvents"] += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                                  "args": {"name": name}} for tid, name in ((0, "messages"), (1, "compute"))]
    trace["traceEvents"] += [
        {"name": sl["action"], "cat": "compute", "ph": "X", "pid": sl["rank"], "tid": 1,
         "ts": (sl["start"] - t0) * 1e6, "dur": (sl["end"] - sl["start"]) * 1e6,
         "args": {"tick": sl["tick"], "step": step}} for sl in slots]
    lines = "".join(json.dumps(e) + "\n" for part in every for e in part["all"])
    write_atomically(path, lambda f: f.write(json.dumps(trace).encode()))  # whole or not at all
    write_atomically(f"{path}.jsonl", lambda f: f.write(lines.encode()))


def full_params(par) -> dict:
    """This rank's parameters whole over tp, as NumPy, on every tp rank (for the comparison with one
    device, not for training): each tp-sliced one all-gathered along its split axis and its global
    indices (holdings.tp_param_slices) put back in order; a replicated kv head must be the same on
    each of its ranks (else it is infinitely far from one device)."""
    local, tp = par.states.full_params(), par.mesh.tp
    if tp.size == 1:
        return local
    every = [tp_param_slices(par.model, tp.size, r) for r in range(tp.size)]
    full = {}
    for name, w in local.items():
        if name not in every[tp.rank]:
            full[name] = w
            continue
        axis = every[tp.rank][name][0]
        pieces = tp.all_gather(np.ascontiguousarray(np.moveaxis(w, axis, 0)), tag=f"{name}:check")
        index = np.concatenate([s[name][1] for s in every])  # Llama's replicated kv heads repeat
        moved = np.empty((len(np.unique(index)), *pieces.shape[1:]), pieces.dtype)
        moved[index] = pieces
        if not np.array_equal(moved[index], pieces):  # replicas that differ match no single device
            moved[...] = np.inf
        full[name] = np.moveaxis(moved, 0, axis)
    return full


def _kept(out) -> list:
    """MoE: per step, per microbatch, layer -> (kept (D, E), pairs (D, ep)) of this rank's blocks."""
    return [s.microbatch_counts for s in out.moe_steps]
