"""`refpar train` for Mixture-of-Experts models: the options, and the run over a dp x ep mesh.

    mpiexec -n 4 refpar train --mesh ep=4 --moe-experts 4 --moe-topk 2 --capacity-factor 1.0 --check
    mpiexec -n 4 refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 1 --dropless --json
    mpiexec -n 8 refpar train --mesh pp=2,dp=2,ep=2 --moe-experts 4 --microbatches 2 --check
    mpiexec -n 4 refpar train --mesh ep=2,cp=2 --cp-algo ulysses --moe-experts 4 --check
    mpiexec -n 4 refpar train --mesh dp=2,ep=2 --moe-experts 4 --zero 1 --check
    mpiexec -n 4 refpar train --mesh ep=2,tp=2 --sp --moe-experts 4 --check
    mpiexec -n 8 refpar train --mesh ep=2,cp=2,tp=2 --sp --moe-experts 4 --check

`refpar/commands/train.py` adds these options and hands every run with experts to `run_cli`: over
dp x ep to refpar/parallel/expert_parallel_run.py, with pp, with cp (--cp-algo ring or ulysses),
with tp (--sp; each expert a tensor-parallel MLP, refpar/parallel/expert_tensor_parallel.py; cp
and tp together too) or
with --zero/--fsdp (the dense weights sharded over the stage's data ranks, the experts over dp,
with tp of each tp rank's shards; refpar/engine_moe_zero.py) to refpar/engine_moe.py, a one-stage
pipeline when the mesh has no pp.
Besides the usual report it prints, per step, the router losses, the dropped assignments and how
many assignments each expert kept (with pp: the routing of every block after the run); `--json`
adds them under "moe". With --microbatches M each microbatch routes on its own tokens
(refpar/model/moe.py). Peak memory per rank is compared with the closed forms of
refpar/analysis/moe.py: params, grads, masters and moments, and in engine_moe's runs the
activations too (what each F's cache keeps, MoE blocks' routing and expert buffers included,
replayed over the schedule).
"""

from __future__ import annotations

import argparse

import numpy as np

STATE_KEYS = ("params", "grads", "master", "optimizer")  # the categories with closed forms in MoE runs
PIPELINE_KEYS = (*STATE_KEYS, "activations")  # engine_moe: the F caches' bytes too (the ep runner has none)
COMM_KEYS = (("data", "all_gather"), ("ep", "all_to_all"), ("data", "all_reduce"), ("dp", "all_reduce"),
             ("pp", "isend"), ("pp", "irecv"), ("pp", "all_reduce"), ("ep", "all_reduce"),
             ("cp", "isend"), ("cp", "irecv"), ("cp", "all_to_all"), ("dp_cp", "all_reduce"),
             ("data", "reduce_scatter"), ("dp", "reduce_scatter"), ("dp", "all_gather"),
             ("dp_cp", "reduce_scatter"), ("dp_cp", "all_gather"),
             ("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter"))


# The options that shape the experts, with their defaults: without --moe-experts none applies.
MOE_DEFAULTS = {"moe_topk": 1, "moe_layers": None, "capacity_factor": 1.25, "dropless": False,
                "aux_loss_weight": 0.01, "z_loss_weight": 0.001}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MOE_DEFAULTS
    group = parser.add_argument_group("Mixture of Experts (refpar/model/moe.py)")
    group.add_argument("--moe-experts", type=int, default=0,
                       help="experts per MoE block; 0 keeps GPT-2's MLP (default 0)")
    group.add_argument("--moe-topk", type=int, default=d["moe_topk"],
                       help="experts per token: 1 Switch, 2 Mixtral")
    group.add_argument("--moe-layers", default=d["moe_layers"],
                       help="blocks with experts, e.g. 1,3 (default: every block)")
    drop = group.add_mutually_exclusive_group()
    drop.add_argument("--capacity-factor", type=float, default=d["capacity_factor"],
                      help="capacity = ceil(tokens * k * factor / experts) per expert (default 1.25)")
    drop.add_argument("--dropless", action="store_true", help="no capacity: never drop a token")
    group.add_argument("--aux-loss-weight", type=float, default=d["aux_loss_weight"],
                       help="alpha of the Switch load-balancing loss (default 0.01)")
    group.add_argument("--z-loss-weight", type=float, default=d["z_loss_weight"],
                       help="beta of the router z-loss (default 0.001)")


def model_overrides(args) -> dict:
    """ModelConfig fields from the MoE options (empty without --moe-experts)."""
    from refpar.config import ConfigError

    if not args.moe_experts:
        given = [name for name, default in MOE_DEFAULTS.items() if getattr(args, name, default) != default]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} shapes the experts of a Mixture of Experts; add --moe-experts E "
                              f"or drop {flag}")
        return {}
    layers = None
    if args.moe_layers is not None:
        try:
            layers = tuple(int(i) for i in args.moe_layers.split(",") if i.strip())
        except ValueError:
            raise ConfigError(f"--moe-layers {args.moe_layers!r} needs block numbers like 1,3") from None
    return {"moe_experts": args.moe_experts, "moe_top_k": args.moe_topk, "moe_layers": layers,
            "moe_capacity_factor": args.capacity_factor, "moe_dropless": args.dropless,
            "moe_aux_loss_weight": args.aux_loss_weight, "moe_z_loss_weight": args.z_loss_weight}


# Options of the other strategies' runners (their defaults mean "not asked for"): a MoE run takes
# none of them, and says so rather than ignore one; --schedule and --chunks only with pp, --cp-algo
# only with cp, --sp only with tp; --zero and --fsdp shard (refpar/engine_moe_zero.py).
OTHER_OPTIONS = {"sp": False, "cp_algo": None, "schedule": None, "chunks": None, "overlap": False,
                 "bucket_kb": None, "prefetch": False, "reshard_after_forward": True}


def check_options(args, pipelined: bool = False, cp: bool = False, tp: bool = False) -> None:
    from refpar.config import ConfigError

    for name, default in OTHER_OPTIONS.items():
        value = getattr(args, name, default)
        if value != default and not (pipelined and name in ("schedule", "chunks")) \
                and not (cp and name == "cp_algo") and not (tp and name == "sp"):
            flag = "--no-reshard-after-forward" if name == "reshard_after_forward" else \
                "--" + name.replace("_", "-")
            hint = {"schedule": " or add pp=2 or more to --mesh", "chunks": " or add pp=2 or more to --mesh",
                    "cp_algo": " or add cp=2 or more to --mesh", "sp": " or add tp=2 or more to --mesh"
                    }.get(name, "")
            raise ConfigError(f"{flag} does not combine with --moe-experts; MoE runs over pp, dp, ep, "
                              f"cp and tp (with --zero or --fsdp), so drop {flag}{hint}")
    if getattr(args, "fsdp", False) and getattr(args, "zero", 0):
        raise ConfigError(f"--fsdp and --zero {args.zero} are two ways to shard; give one of them")


def zero_stage(args) -> tuple[int, bool]:
    """(ZeRO stage, FSDP) asked for: --fsdp is ZeRO-3 by FSDP's units."""
    fsdp = bool(getattr(args, "fsdp", False))
    return (3 if fsdp else getattr(args, "zero", 0)), fsdp


def _rel(a, b) -> float:
    from refpar.backend import to_host

    a = to_host(a)  # the run's parameters may live on a device; the reference is NumPy
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def merged_steps(steps, comm) -> list[dict] | None:
    """On rank 0: per step, every MoE block's routing statistics, gathered from the pipeline ranks
    that hold them (each rank's MoEStep covers its stages' blocks); None elsewhere. Untraced."""
    mine = [(s.tokens_per_expert, s.dropped, s.kept_counts) for s in steps]
    every = comm.gather_object(mine, root=0)
    if every is None:
        return None
    out = []
    for i in range(len(steps)):
        step = {"tokens_per_expert": {}, "dropped": {}, "kept_counts": {}}
        for rank_steps in every:
            for key, part in zip(step, rank_steps[i], strict=True):
                step[key].update(part)
        out.append(step)
    return out


def run_cli(model, train, sizes, args) -> int:
    from refpar.analysis import moe as moe_analysis
    from refpar.comm.communicator import world
    from refpar.comm.trace import Tracer, write_trace
    from refpar.engine_moe import MoEPipelineOptions, full_params, run_moe_pipeline, validate
    from refpar.mesh import DeviceMesh
    from refpar.model.moe import capacity
    from refpar.parallel.expert_parallel import owned_experts
    from refpar.parallel.expert_parallel_run import check_run, reference_run, train_expert_parallel
    from refpar.parallel.pipeline.schedules import simulate
    from refpar.report import run_summary, summary_line
    from refpar.trainer import corpus_for

    # pp, cp, tp or ZeRO: refpar/engine_moe.py (without pp a one-stage pipeline)
    m, c, t = args.microbatches, sizes.get("cp", 1), sizes.get("tp", 1)
    check_options(args, sizes["pp"] > 1, c > 1, t > 1)
    zero, fsdp = zero_stage(args)
    pipelined = sizes["pp"] > 1 or c > 1 or t > 1 or zero > 0
    opts = None
    if pipelined:
        kind = args.schedule or "1f1b"
        v = args.chunks if args.chunks is not None else (2 if kind == "interleaved-1f1b" else 1)
        opts = MoEPipelineOptions(kind, m, v, args.cp_algo, zero, fsdp, sp=bool(getattr(args, "sp", False)))
        validate(model, train, sizes, opts)
    else:
        check_run(model, train, sizes, m)
    comm = world(Tracer(rank=None))
    mesh = DeviceMesh(comm, sizes)
    speak = comm.rank == 0
    blocks = model.moe_blocks
    ep = mesh.sizes["ep"]
    floor = corpus_for(model, train).entropy_rate()
    tokens = train.batch_size * train.seq_len // m  # routed together: one global microbatch

    def say(text: str) -> None:
        if speak:
            print(text, flush=True)

    where = f"mesh {mesh}" if comm.size > 1 else "1 device"
    limit = "dropless" if model.moe_dropless else (
        f"capacity factor {model.moe_capacity_factor}: {capacity(tokens, model)} assignments per "
        f"expert" + (f" and microbatch of {tokens} tokens" if m > 1 else ""))
    say(f"GPT-2 {args.model} with {model.moe_experts} experts, top-{model.moe_top_k}, {limit}, in blocks "
        f"{','.join(map(str, blocks))}; {where}; experts per ep rank: "
        + " ".join(f"{list(owned_experts(model.moe_experts, ep, q))}" for q in range(ep)))
    if zero:
        cp_text = f" x cp = {sizes['dp'] * ep * c}" if c > 1 else f" = {sizes['dp'] * ep}"
        say(f"{'FSDP' if fsdp else f'ZeRO-{zero}'}: dense weights sharded over each stage's dp x ep"
            f"{cp_text} ranks, each expert's over dp{' x cp' if c > 1 else ''}={sizes['dp'] * c}"
            + (f", of each tp rank's shards (tp={t})" if t > 1 else ""))
    if t > 1:
        say(f"tensor parallelism over tp={t}{' with sp' if opts.sp else ''}: each expert's c_fc split by "
            f"columns and c_proj by rows, routing replicated over tp")
    if pipelined:
        if sizes["pp"] > 1 or c > 1:
            cp_text = f", {opts.cp_algo or 'ring'} attention over cp={c}" if c > 1 else ""
            say(f"pipeline: {opts.schedule} over pp={sizes['pp']} with {opts.chunks} chunk(s) per rank, "
                f"{m} microbatches{cp_text}; each stage's dp x ep{' x cp' if c > 1 else ''} ranks route "
                f"its MoE blocks")
        say(f"{'step':>5} {'loss':>8} {'aux':>7} {'z':>7}")
    else:
        say(f"{'step':>5} {'loss':>8} {'aux':>7} {'z':>7} {'dropped':>7}  tokens per expert "
            f"(block {blocks[0]})")

    def row(s) -> None:
        tail = "" if pipelined else (f" {sum(s.dropped.values()):>7}  {s.tokens_per_expert[blocks[0]]}")
        say(f"{s.step + 1:>5} {s.loss:>8.4f} {s.aux_loss:>7.4f} {s.z_loss:>7.4f}{tail}")

    saving = {"save": args.save, "save_every": args.save_every, "resume": args.resume}
    if pipelined:
        run = run_moe_pipeline(model, train, mesh, opts, on_step=row, **saving)
        totals = run.totals
    else:
        run = train_expert_parallel(model, train, mesh, on_step=row, microbatches=m, **saving)
        totals = comm.tracer.totals()
    say(f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f} (floor {floor:.4f}); "
        f"{run.step_time_s * 1e3:.1f} ms per step")
    if run.loss_scaling:
        from refpar.parallel.intra_layer_runner import loss_scaling_line

        say(loss_scaling_line(run.loss_scaling))
    steps = merged_steps(run.steps, comm)  # every block's statistics, on rank 0

    fields = {}
    if args.check:
        ref = reference_run(model, train, microbatches=m)
        ref_steps = ref.steps[run.first_step:]  # a resumed run has only the steps after its checkpoint
        loss_diff = max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(run.steps, ref_steps, strict=True))
        whole = full_params(run, model, mesh) if pipelined else run.params  # gathered over tp
        local_diff = max(_rel(p, ref.params[n]) for n, p in whole.items())
        param_diff = float(comm.all_reduce(np.array([local_diff]), op="max")[0])
        same = all(s.dropped == {i: r.dropped[i] for i in s.dropped}
                   for s, r in zip(run.steps, ref_steps, strict=True))
        same_drops = bool(comm.all_reduce(np.array([int(same)]), op="min")[0])
        say(f"check against one device: loss rel diff {loss_diff:.2e}, parameter rel diff "
            f"{param_diff:.2e}, dropped assignments {'equal' if same_drops else 'DIFFER'}")
        fields = {"reference_losses": [s.loss for s in ref_steps], "max_loss_rel_diff": loss_diff,
                  "max_param_rel_diff": param_diff,
                  "reference_dropped": [[s.dropped[i] for i in blocks] for s in ref_steps]}

    expected: dict = {}
    for s in run.steps:
        if pipelined:
            step_bytes = moe_analysis.pipeline_step_comm_bytes(
                model, mesh.sizes, mesh.coords, opts.chunks, run.rows, train.seq_len,
                [list(k.values()) for k in s.microbatch_kept_counts], 4 if train.fp32_grads else None,
                opts.cp_algo, train.batch_size, zero, fsdp, opts.sp)
        else:
            step_bytes = moe_analysis.step_comm_bytes(
                model, mesh.sizes, mesh.coords, [k for mb in s.microbatch_kept_counts for k in mb.values()],
                4 if train.fp32_grads else None)
        for key, b in step_bytes.items():
            old = expected.get(key, (0, 0))
            expected[key] = (old[0] + b.sent, old[1] + b.recv)
    mine = np.array([[*totals.get(k, (0, 0)), *expected.get(k, (0, 0))] for k in COMM_KEYS])
    every = comm.all_gather(mine[None, ...])  # (world, keys, 4)
    if pipelined:
        states = moe_analysis.pipeline_state_bytes(model, mesh.sizes, mesh.coords, opts.chunks,
                                                   train.optimizer, train.fp32_grads, zero, fsdp)
        states["activations"] = moe_analysis.pipeline_activation_peak(
            model, train, mesh.sizes, mesh.coords, opts.schedule, m, opts.chunks, run.rows,
            [s.microbatch_kept_counts for s in run.steps], opts.cp_algo, opts.sp)
    else:
        states = moe_analysis.model_state_bytes(model, ep, mesh.coords["ep"], train.optimizer, m,
                                                train.fp32_grads)
    keys = PIPELINE_KEYS if pipelined else STATE_KEYS
    memory = comm.all_gather(np.array([[[run.ledger.peak[c], states[c]] for c in keys]]))
    trace_path = getattr(args, "trace", None)
    events = comm.gather_object(comm.tracer.events) if trace_path else None
    if not speak:
        return 0
    if events is not None:
        write_trace(trace_path, [e for rank_events in events for e in rank_events])
        say(f"trace of every rank's communication written to {trace_path}")
    rows = [[{"rank": r, "axis": a, "op": o, "bytes_sent": int(every[r, i, j]),
              "bytes_recv": int(every[r, i, j + 1])} for r in range(comm.size)
             for i, (a, o) in enumerate(COMM_KEYS) if every[r, i].any()] for j in (0, 2)]
    for key in COMM_KEYS:
        sent = int(every[:, COMM_KEYS.index(key), 0].sum())
        if sent:
            say(f"{key[0]:>5} {key[1]:<10} {sent:>12,} bytes sent over all ranks")
    n_data = mesh.sizes["dp"] * ep
    uniform = len(blocks) * m * moe_analysis.expected_all_to_all_bytes(
        model, tokens // n_data, n_data, ep, np.dtype(model.dtype).itemsize)
    # the data ranks of one stage (all ranks without pp) between them run every block once
    # (every tp rank of them sends the same rows again)
    measured = every[:, COMM_KEYS.index(("ep", "all_to_all")), 0].sum() / (
        len(run.steps) * n_data * mesh.sizes["tp"])
    what = "per data rank and step, every MoE block" if pipelined else "per rank and step"
    say(f"ep all-to-all {what}: {measured:,.0f} bytes; uniform routing would send {uniform:,.0f}")
    memory_rows = [[{"rank": r, "category": c, "bytes": int(memory[r, i, j])}
                    for r in range(comm.size) for i, c in enumerate(keys)] for j in (0, 1)]
    kept = [i for i, c in enumerate(keys) if c != "master" or memory[:, i].any()]  # fp64: none
    if pipelined:  # activations differ by rank and routing: each next to its closed form
        say("peak memory per rank in bytes, measured | closed form:")
        for r in range(comm.size):
            say(f"  rank {r}: " + ", ".join(
                f"{keys[i]} {int(memory[r, i, 0]):,} | {int(memory[r, i, 1]):,}"
                + ("" if memory[r, i, 0] == memory[r, i, 1] else " MISMATCH") for i in kept))
    else:
        say(f"peak {' / '.join(keys[i] for i in kept)} bytes per rank: " + "; ".join(
            f"rank {r}: " + " / ".join(f"{int(memory[r, i, 0]):,}" for i in kept)
            for r in range(comm.size)))
    bubble = None
    if pipelined:  # the step rows leave out the routing, which lives on the stages holding the blocks
        say("dropped assignments per block over the run: " + ", ".join(
            f"{i}: {sum(st['dropped'][i] for st in steps)}" for i in blocks))
    if sizes["pp"] > 1:
        bubble = {"measured": run.measured.bubble_fraction, "simulated": run.simulated.bubble_fraction,
                  "simulated_unit_costs": simulate(run.executor.schedule).bubble_fraction}
        say(f"bubble of the last step: measured {bubble['measured']:.1%}, simulated with the measured "
            f"action times {bubble['simulated']:.1%}, with unit costs {bubble['simulated_unit_costs']:.1%}")
    if args.json:
        moe = {
            "blocks": list(blocks),
            "tokens_per_expert": [[st["tokens_per_expert"][i] for i in blocks] for st in steps],
            "dropped": [[st["dropped"][i] for i in blocks] for st in steps],
            "capacity": capacity(tokens, model),
            "kept_counts": [[st["kept_counts"][i].tolist() for i in blocks] for st in steps],
            "experts_per_ep_rank": [list(owned_experts(model.moe_experts, ep, q)) for q in range(ep)],
            "aux_loss": [s.aux_loss for s in run.steps], "z_loss": [s.z_loss for s in run.steps],
            "expert_param_bytes_per_ep_rank": [
                moe_analysis.expert_param_bytes_per_rank(model, ep, q) for q in range(ep)],
            "reference_dropped": fields.pop("reference_dropped", None),
            "uniform_all_to_all_bytes_per_rank_step": uniform,
        }
        summary = run_summary(model, train, run.losses, mesh=mesh.sizes, world_size=comm.size,
                              schedule=opts.schedule if sizes["pp"] > 1 else None, microbatches=m, zero=zero,
                              comm_bytes=rows[0], expected_comm_bytes=rows[1],
                              memory_peak_bytes=memory_rows[0], expected_memory_peak_bytes=memory_rows[1],
                              bubble_fraction=bubble, step_time_s=run.step_time_s, loss_floor=floor,
                              moe=moe, loss_scaling=run.loss_scaling, **fields)
        say(summary_line(summary))
    return 0
