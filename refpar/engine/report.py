"""One report for every run of `refpar train`, printed by rank 0 and, with --json, as the one-line
summary (refpar/report.py; DESIGN.md "Command line"): the losses next to the single device's
(--check), the bytes each rank sent by axis and op next to the closed forms (refpar.analysis.engine),
the peak memory per rank by category next to the closed forms, and what the run's strategies add:
the data-parallel model states, the pipeline's bubble, the routing of a MoE model.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --steps 3 --check
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from refpar.analysis import engine as closed
from refpar.analysis.flops import step_flops
from refpar.analysis.moe import expected_all_to_all_bytes, expert_param_bytes_per_rank
from refpar.analysis.presets import from_model_config
from refpar.files import write_atomically
from refpar.holdings import kv_replicas, tp_param_slices
from refpar.memory import CATEGORIES
from refpar.model.moe import capacity
from refpar.parallel.expert_parallel import owned_experts
from refpar.parallel.pipeline.schedules import simulate
from refpar.report import run_summary, summary_line
from refpar.trainer import baseline, corpus_for, loss_floor, train_single_device, validation_loss

from . import runlog
from .checkpoint import gather_params, open_resume
from .lines import header, progress, report
from .parallelize import parallelize
from .train import train

STATES = ("params", "grads", "master", "optimizer")  # the model states: the ZeRO paper's categories
P2P = ("isend", "irecv")  # their time is spent waiting for the other side: idle, not transfer


def run(model, cfg, sizes: dict, plan, args) -> int:
    """Trains on this job's ranks as `plan` says and reports (module docstring)."""
    from refpar.comm.communicator import abort_on_error, world
    from refpar.comm.trace import Tracer
    from refpar.mesh import DeviceMesh

    comm, plain = world(Tracer()), world()  # plain: the report's own traffic, left out of the trace
    # its sentence comes from every rank alike, before any message
    mesh = DeviceMesh(comm, sizes, kv_replicas(model, sizes["tp"]))
    if args.resume is not None:
        open_resume(args.resume, model, cfg, plan)  # so do a checkpoint's that this run cannot take
    if comm.size == 1:
        return _run(model, cfg, sizes, plan, args, mesh, plain)
    # From here on ranks communicate: an error one rank meets alone (a full disk, say) must end
    # every rank, not leave the others waiting in a collective (refpar.cli returns 2 from the rank
    # that raised, which is right only for the checks every rank makes before any message).
    with abort_on_error():
        return _run(model, cfg, sizes, plan, args, mesh, plain)


def _run(model, cfg, sizes: dict, plan, args, mesh, plain) -> int:
    comm = mesh.world
    speak = comm.rank == 0

    def say(text=""):
        if speak:
            print(text, flush=True)

    peak = None
    if runlog.wants_peak(args):  # every rank at once: ranks that share cores in the run share them here
        plain.barrier()
        peak = runlog.measure_peak(runlog.gemm_dtype(model.dtype))
    check = args.check and speak
    ref = train_single_device(model, cfg, microbatches=plan.microbatches) if check else None
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
    report(say, model, cfg, sizes, plan, par, out, every, summary)
    if args.trace:
        say(f"trace: {args.trace} (open in https://ui.perfetto.dev), "
            f"{Path(args.trace).with_suffix('.jsonl')} (JSON lines)")
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
    skipped = {k - out.first_step for k in _skipped_list(out)}
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


def summarize(model, cfg, sizes, plan, par, out, every, ref, corpus) -> dict:
    """The JSON summary's fields from every rank's measurements (on rank 0)."""
    comm_rows = [{"rank": r, "axis": a, "op": o, "bytes_sent": int(s), "bytes_recv": int(rv)}
                 for r, e in enumerate(every) for (a, o), (s, rv) in sorted(e["totals"].items()) if s or rv]
    memory_rows = [{"rank": r, "category": c, "bytes": int(e["peak"][c])}
                   for r, e in enumerate(every) for c in CATEGORIES]
    expected_comm = [{"rank": r, **row} for r, e in enumerate(every) for row in e["expected_comm"]]
    expected_memory = [{"rank": r, **row} for r, e in enumerate(every) for row in e["expected_memory"]]
    fields = {"lrs": out.lrs, "grad_norms": out.grad_norms if par.clip is not None else None,
              # per rank, per step: the GEMM FLOPs it ran (refpar/model/gemm.py); on a dense model their
              # sum over the ranks is what the planner prices for a step (refpar/analysis/flops.step_flops),
              # unless Llama's tp ranks replicate kv heads (each computes their K and V projections)
              "flops_per_step": [e["flops"] for e in every],
              "val_losses": [{"step": s, "loss": v} for s, v in out.val_losses] if cfg.eval_every else None,
              "data": data_fields(corpus, cfg),
              "tokenizer": None if getattr(corpus, "tokenizer", None) is None else {
                  "name": corpus.tokenizer.name, "vocab_size": corpus.tokenizer.vocab_size},
              "planned_flops_per_step": int(step_flops(
                  from_model_config(model), cfg.batch_size, cfg.seq_len, plan.recompute,
                  scores_again=sizes["cp"] > 1 and (plan.cp_algo or "ring") == "ring"))}
    if ref is not None:
        ref_losses = ref.losses[out.first_step:]  # a resumed run has only the steps after its checkpoint
        if par.clip is not None:
            ref_norms = ref.grad_norms[out.first_step:]
            fields |= {"reference_grad_norms": ref_norms, "max_grad_norm_rel_diff": max(
                (abs(a - b) / abs(b) for a, b in zip(out.grad_norms, ref_norms, strict=True)
                 if a is not None and b is not None), default=None)}
        if cfg.eval_every:
            steps = {s for s, _ in out.val_losses}  # a resumed run's, from its checkpoint on
            fields["reference_val_losses"] = [{"step": s, "loss": v} for s, v in ref.val_losses if s in steps]
        fields |= {"reference_losses": ref_losses,
                  "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(out.losses, ref_losses,
                                                                                strict=True)),
                  "max_param_rel_diff": max(_rel(p, ref.params[n]) for e in every
                                            for n, p in e["full"].items())}
    bubble = None
    if sizes["pp"] > 1:
        bubble = {"measured": out.measured.bubble_fraction, "simulated": out.simulated.bubble_fraction,
                  "simulated_unit_costs": simulate(par.executor.schedule).bubble_fraction}
    moe = _moe_fields(model, cfg, sizes, plan, out, every, ref) if model.moe_experts else None
    return run_summary(
        model, cfg, out.losses, mesh=dict(sizes), world_size=len(every), zero=plan.stage,
        schedule=plan.kind if sizes["pp"] > 1 else None, microbatches=plan.microbatches,
        comm_bytes=comm_rows, expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
        expected_memory_peak_bytes=expected_memory, bubble_fraction=bubble, step_time_s=out.step_time_s,
        loss_floor=loss_floor(corpus), moe=moe, loss_scaling=out.loss_scaling,
        data_parallel={"strategy": plan.strategy, "model_state_bytes": [e["state"] for e in every],
                       "bucket_elems": min(plan.bucket_elems, max(e["held"] for e in every)),
                       "overlap": plan.overlap, "prefetch": plan.prefetch,
                       "reshard_after_forward": plan.reshard_after_forward}, **fields)


def _moe_fields(model, cfg, sizes, plan, out, every, ref) -> dict:
    """The "moe" summary field: every block's routing per step, gathered from the ranks holding it."""
    blocks, ep = list(model.moe_blocks), sizes["ep"]
    steps = []
    for i in range(len(out.losses)):
        step = {"tokens_per_expert": {}, "dropped": {}, "kept_counts": {}}
        microbatches = [{} for _ in range(plan.microbatches)]
        pairs = [{} for _ in range(plan.microbatches)]
        for e in every:
            *parts, per_microbatch, pairs_per_microbatch = e["moe"][i]
            for key, part in zip(step, parts, strict=True):
                step[key].update(part)
            for mine, part in zip(microbatches, per_microbatch, strict=True):
                mine.update(part)
            for mine, part in zip(pairs, pairs_per_microbatch, strict=True):
                mine.update(part)
        steps.append(step | {"microbatch_kept_counts": microbatches, "microbatch_pair_counts": pairs})
    tokens = cfg.batch_size * cfg.seq_len // plan.microbatches  # routed together: one global microbatch
    n_data = sizes["dp"] * ep
    return {
        "blocks": blocks,
        "tokens_per_expert": [[st["tokens_per_expert"][i] for i in blocks] for st in steps],
        "dropped": [[st["dropped"][i] for i in blocks] for st in steps],
        "capacity": capacity(tokens, model),
        "kept_counts": [[np.asarray(st["kept_counts"][i]).tolist() for i in blocks] for st in steps],
        # per step and microbatch, each block's (D c, E) kept counts, which add up to kept_counts: what
        # the closed forms of the routing's bytes and of a MoE block's memory read (analysis/moe.py)
        "microbatch_kept_counts": [[[np.asarray(mb[i]).tolist() for i in blocks]
                                    for mb in st["microbatch_kept_counts"]] for st in steps],
        # per step and microbatch, each block's (D c, ep) pairs (token, ep rank): the all-to-alls' rows
        "microbatch_pair_counts": [[[np.asarray(mb[i]).tolist() for i in blocks]
                                    for mb in st["microbatch_pair_counts"]] for st in steps],
        "experts_per_ep_rank": [list(owned_experts(model.moe_experts, ep, q)) for q in range(ep)],
        "aux_loss": [s.aux_loss for s in out.moe_steps], "z_loss": [s.z_loss for s in out.moe_steps],
        "expert_param_bytes_per_ep_rank": [expert_param_bytes_per_rank(model, ep, q) for q in range(ep)],
        "reference_dropped": None if ref is None else [[s.dropped[i] for i in blocks]
                                                       for s in ref.moe_steps[out.first_step:]],
        "uniform_all_to_all_bytes_per_rank_step": len(blocks) * plan.microbatches * expected_all_to_all_bytes(
            model, tokens // n_data, n_data, ep, np.dtype(model.dtype).itemsize),
    }


def data_fields(corpus, cfg) -> dict:
    """The "data" summary field: what the run trained on and the loss it is measured against."""
    label, value = baseline(corpus)
    fields = {"kind": "markov" if cfg.data is None else "text", "path": cfg.data,
              "description": corpus.describe(),
              ("loss_floor" if label == "floor" else "unigram_entropy"): value}
    if cfg.data is not None:
        fields |= {"train_tokens": int(corpus.train_tokens), "val_tokens": int(corpus.val_tokens)}
    return fields


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
    write_atomically(Path(path).with_suffix(".jsonl"), lambda f: f.write(lines.encode()))


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


def _rel(a, ref) -> float:
    """max |a - ref| / max |ref| (the plain max difference for an all-zero reference: a bias no
    step has changed yet, as when fp16 skips every step)."""
    diff = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64))))
    scale = float(np.max(np.abs(np.asarray(ref, np.float64))))
    return diff / scale if scale else diff


def _skipped_list(out) -> list[int]:
    return out.loss_scaling["skipped_steps"] if out.loss_scaling else []


def _kept(out) -> list:
    """MoE: per step, per microbatch, layer -> (kept (D, E), pairs (D, ep)) of this rank's blocks."""
    return [s.microbatch_counts for s in out.moe_steps]


