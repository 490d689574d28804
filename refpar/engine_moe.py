"""Mixture of Experts inside pipeline stages: the mesh pp x dp x ep x cp x tp (and --sp).

    mpiexec -n 4 python -m refpar train --mesh pp=2,ep=2 --moe-experts 4 --microbatches 2 --check
    mpiexec -n 8 python -m refpar train --mesh pp=2,dp=2,ep=2 --moe-experts 4 --moe-topk 2 \
        --schedule 1f1b --microbatches 4 --check
    mpiexec -n 4 python -m refpar train --mesh ep=2,cp=2 --cp-algo ring --moe-experts 4 --check
    mpiexec -n 8 python -m refpar train --mesh pp=2,ep=2,tp=2 --sp --moe-experts 4 --microbatches 2 --check
    mpiexec -n 8 python -m refpar train --mesh ep=2,cp=2,tp=2 --sp --cp-algo ulysses --moe-experts 4 --check

Legend: B global batch, M microbatches, D = dp x ep data ranks of a stage, c cp size, b_j rows of
this rank's part of microbatch j, T sequence, Ta this cp rank's positions (T without cp), Tl the
residual stream's (Ta, or its shard_range(Ta, t, rank) under sp), C channels, E experts, t tp size.

Layout (Megatron-Core's): every pipeline stage's ranks form the expert-parallel runner's dp x ep
grid of data ranks (data rank d = dp rank * ep + ep rank, in batch order; refpar/parallel/
expert_parallel.py), each split over c cp ranks by position (group rank d * c + cp rank: the mesh
order pp, dp, ep, cp puts cp innermost), the ranks of one tp coordinate only (the mesh's `data` group). A rank
holds the tp shard (tensor_parallel.tp_param_slices; whole without tp) of its stages' dense
weights and, of each MoE block in them, of the experts of its ep rank; cp ranks hold the same
weights. One step composes the strategies' own pieces:

    pipeline   engine.EngineExecutor walks schedule[pp rank] (any schedule it runs); each stage
               is a `MoEStage`, the engine's stage (tensor_parallel's pieces, on whole blocks here)
               with the expert-parallel layer in the MoE blocks; B is the whole backward (an
               expert's all-to-alls carry input and weight gradients together, so schedules that
               split B from W run, but gain nothing here).
               Activations (b_j, Tl, C) go to the same (dp, ep, cp, tp) rank of the next stage.
    cp         the stages' attention is context_parallel's ring (zig-zag chunks) or Ulysses core on
               engine.layout_for's cp layout, every other piece (the MoE blocks too) runs on this
               rank's Ta positions of its rows
    tp         attention, embedding and head are the engine's tensor-parallel pieces (f/g, or the
               sp pair); the MoE layer runs replicated over tp outside its experts, each expert a
               tensor-parallel MLP (refpar/parallel/expert_tensor_parallel.py: one all-reduce of
               the expert buffer forward and one backward; under sp the layer all-gathers its Ta
               tokens around itself, sequence_parallel.sp_cp_layout's sp inside cp). Routing,
               all-to-alls and the data ranks' sums run among the ranks of one tp coordinate: each
               tp rank routes the same tokens, so the same runs as cp alone
    ep         inside each MoE block, ExpertParallelMoE: the selection counts of each run of
               consecutive tokens (one per data rank without cp; with cp the runs of positions of
               each row, `expert_parallel.token_runs`) all-gathered over the stage's D x c ranks,
               put in global order from the microbatch's rows and the cp layout (computed by every
               rank, nothing sent for it), tokens to their experts and back by all-to-all over ep
    microbatch global microbatch j is the slice shard_range(B, M, j) of the batch, cut over the D
               data ranks (expert_parallel_run.microbatch_samples); it is routed on its own tokens
               and its router losses weigh 1/M (refpar/model/moe.py), so the single device with the
               same microbatches (expert_parallel_run.reference_run) is the reference
    tied wte   the executor's embedding group: first and last pp rank, per data rank
    dp, ep, cp dense gradients summed over the stage's D x c ranks, an expert's over dp x cp (the
               ranks holding copies of it: the mesh's dp_cp group, axis dp_cp; dp alone
               without cp)
    sp         the sequence-sharded LayerNorms' and attention biases' gradients summed over tp (the
               MoE layer's, router and expert c_proj.bias, are the same on every tp rank already)
    ZeRO       --zero 1/2/3 and --fsdp (refpar/engine_moe_zero.py): the dense weights sharded over
               the stage's D x c ranks, an expert's over dp x cp (DeepSpeed-MoE's and
               Megatron-Core's expert-data-parallel group); without pp the run is a one-stage
               pipeline
    loss       the last stage's cross-entropy plus every stage's router-loss shares (each cp
               rank's over its tokens), summed over pp, then over the D x c ranks (every tp rank
               holds the whole loss)

pp = 1 runs here too whenever the mesh has cp or tp or the run asks for ZeRO (one stage, the
schedule's single-rank case). With tp, ZeRO shards each rank's tp shards once more (as the dense
engine does); under sp the sequence-sharded gradients are summed over tp before ZeRO-1's
reduce-scatter, on the shards under ZeRO-2/3.

Mixed precision: as the dp x ep runner (16-bit tokens and activations, gradients summed in their
dtype, fp32 masters); fp16 starts the last stage's backward and the router losses' gradients from
the loss scale, and the pp, ep and tp ranks, whose gradients differ, agree on an overflow (under
ZeRO the pp and data ranks, whose gradient shards differ). Under tp the pieces compute in fp32 and
round once, as the engine's (tensor_parallel.compute/rounded): the expert buffer's partial sums
cross tp in 16 bits, as Megatron-LM sends them.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from refpar import backend, checkpoint
from refpar.config import ConfigError, ModelConfig, TrainConfig
from refpar.engine import EngineExecutor, TensorParallelStage, ZeroThreeGather, layout_for
from refpar.holdings import sequence_parallel_param_names, stage_layers, tp_param_slices
from refpar.memory import MemoryLedger
from refpar.model.gpt import init_params
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.parallel.context_parallel import check_cp, cp_positions
from refpar.parallel.expert_parallel import ExpertParallelMoE, routing_runs, token_runs
from refpar.parallel.expert_parallel_run import (
    MoERun,
    check_microbatches,
    check_run,
    local_params,
    microbatch_samples,
    reduce_grads,
    resume_from,
    router_shares,
    step_record,
)
from refpar.parallel.expert_parallel_run import checkpoint_arrays as expert_parallel_checkpoint_arrays
from refpar.parallel.expert_tensor_parallel import TensorParallelExpertMoE
from refpar.parallel.intra_layer_runner import saved_position
from refpar.parallel.pipeline.executor import Microbatch
from refpar.parallel.pipeline.schedules import Timeline, build
from refpar.parallel.sequence_parallel import check_sp, check_sp_cp
from refpar.parallel.tensor_parallel import check_tp, gather_params_tp, shard_params_tp
from refpar.precision import MASTER_DTYPE, loss_scaler, overflow_anywhere
from refpar.report import loss_scaling_summary
from refpar.trainer import corpus_for

AXES = ("pp", "dp", "ep", "cp", "tp")


@dataclass(frozen=True)
class MoEPipelineOptions:
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1  # v, model chunks per pipeline rank (interleaved-1f1b)
    cp_algo: str | None = None  # ring (default) or ulysses, when the mesh has cp
    zero: int = 0  # ZeRO stage 0-3 (refpar/engine_moe_zero.py)
    fsdp: bool = False  # with zero 3: FSDP's units, a block at a time
    sp: bool = False  # sequence parallelism over tp


def validate(model: ModelConfig, train: TrainConfig, sizes: dict, opts: MoEPipelineOptions) -> None:
    """Every check of a MoE pipeline run, with no communication: each rank raises the same ConfigError."""
    c, t = sizes.get("cp", 1), sizes.get("tp", 1)
    if opts.cp_algo is not None and c < 2:
        raise ConfigError("--cp-algo chooses how cp ranks share attention; give the mesh cp=2 or more")
    train.check_model(model)
    check_run(model, train, sizes, opts.microbatches, allowed=("pp", "cp", "tp"))
    check_tp(model, t)
    if c > 1:
        check_cp(model, train.seq_len, c, opts.cp_algo or "ring", t)  # Ulysses: cp <= n_head / tp
    if opts.sp:
        check_sp(model, train.seq_len, t)  # "give the mesh tp=2 or more", seq_len >= tp
        if c > 1:  # every cp rank's tokens split over tp
            check_sp_cp(model, train.seq_len, t, c, opts.cp_algo or "ring")
    p = sizes.get("pp", 1)
    build(opts.schedule, p, opts.microbatches, opts.chunks)  # the schedule's own sentences
    stage_layers(model.n_layer, p * opts.chunks, 0)  # "pp x chunks stages need as many blocks"
    if opts.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {opts.zero} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3")
    if opts.fsdp and opts.zero != 3:
        raise ConfigError("FSDP shards parameters, gradients and optimizer state; run it as zero 3")
    if opts.zero and sizes.get("dp", 1) * sizes.get("ep", 1) * c < 2:
        flag = "--fsdp" if opts.fsdp else f"--zero {opts.zero}"
        raise ConfigError(f"{flag} shards each stage's weights over its dp x ep x cp ranks; give the "
                          f"mesh dp=2, ep=2 or cp=2 or more")


class MoEStage(TensorParallelStage):
    """The engine's stage (its embedding, blocks and head on layout `lay`) whose MoE blocks run
    `moe` (ExpertParallelMoE). Each F routes the microbatch with its runs, `runs[sample ids]`
    (expert_parallel.RoutingRuns), and files its MoE blocks' routing under the microbatch's sample
    ids in `routings` (shared by the rank's stages), for the step's record."""

    dense_only = False

    def __init__(self, config: ModelConfig, n_stages: int, stage: int, lay, moe, routings: dict,
                 runs: dict):
        super().__init__(config, n_stages, stage, lay, moe)
        self.routings, self.runs = routings, runs

    def forward(self, params, x, targets, drop, normalizer):
        """F: tokens (b, T) on the first stage or (b, Tl, C) -> (b, Tl, C), or the loss on the last."""
        self.moe.runs = self.runs[drop.sample_ids]
        out, cache = super().forward(params, x, targets, drop, normalizer)
        for layer in self.layers:
            if layer in self.config.moe_blocks:
                self.routings.setdefault(drop.sample_ids, {})[layer] = self.moe.last_routing[layer]
        return out, cache


class MoEZeroThreeStage(ZeroThreeGather, MoEStage):
    """A MoE stage whose units ZeRO-3 gathers for each action and frees after (engine.ZeroThreeStage
    for MoE stages); MoEStage's arguments, then the ZeroThree."""

    def __init__(self, *args, zero):
        super().__init__(*args)
        self.zero = zero


def resume_sharded(path: str, model: ModelConfig, train: TrainConfig, mesh, params: dict, zero,
                   scaler, microbatches: int) -> int:
    """Loads this rank's whole tensors and ZeRO shards (engine_moe_zero.MoESharding) from the
    checkpoint `path` (any MoE mesh's, with or without ZeRO); returns the step it was saved after."""
    from refpar.parallel.intra_layer_runner import resumed_position

    manifest = checkpoint.open_training(path, model, train)
    check_microbatches(manifest, microbatches)
    pairs = zero.checkpoint_arrays(model, mesh, checkpoint_arrays(model, params, {}, mesh, False), False)
    for (_, view), loaded in zip(pairs, checkpoint.load(path, [p for p, _ in pairs], manifest), strict=True):
        view[...] = loaded
    step, zero.t = resumed_position(manifest, scaler)
    return step


@dataclass
class MoEPipelineRun(MoERun):
    """MoERun (steps: the routing of this rank's MoE blocks only) with the pipeline's timelines."""

    executor: EngineExecutor | None = None
    totals: dict | None = None  # traced (axis, op) -> (sent, received) of the training steps only
    measured: Timeline | None = None
    simulated: Timeline | None = None
    rows: list[int] | None = None  # this rank's rows b_j of each microbatch


def run_moe_pipeline(model: ModelConfig, train: TrainConfig, mesh, opts: MoEPipelineOptions,
                     on_step=None, *, save: str | None = None, save_every: int | None = None,
                     resume: str | None = None) -> MoEPipelineRun:
    """Trains `train.steps` steps on `mesh` (pp, dp, ep, cp, tp), or from the checkpoint
    `resume` (any mesh's, MoE runs with and without pp, cp or tp alike); with `save`, checkpoints
    every `save_every` steps and after the last. `on_step(MoEStep)` after each step."""
    validate(model, train, mesh.sizes, opts)
    m, pp, world, c = opts.microbatches, mesh.pp, mesh.world, mesh.sizes.get("cp", 1)
    t = mesh.sizes["tp"]
    data = mesh.axis("data")  # the stage's dp x ep x cp ranks of this tp coordinate, in batch order
    # whole blocks on cp's tokens, or the engine's tp (or sp) pieces
    lay = layout_for(model, train.seq_len, mesh, opts.sp, opts.cp_algo)  # sp inside cp with both
    layer = (ExpertParallelMoE(data, mesh.ep, model, weight=1 / m, cp=c) if t == 1 else
             TensorParallelExpertMoE(data, mesh.ep, model, lay, opts.sp, weight=1 / m, cp=c))
    ledger = MemoryLedger()
    routings: dict[tuple, dict] = {}  # sample ids of a microbatch -> layer -> routing
    B, T, n_data = train.batch_size, train.seq_len, data.size // c
    held = [cp_positions(T, c, r, opts.cp_algo) for r in range(c)]  # (Ta,) of each cp rank
    runs = {}  # sample ids of this rank's part of microbatch j -> its RoutingRuns
    for j in range(m):
        rows = [microbatch_samples(B, m, n_data, d, j) for d in range(n_data)]
        every = [token_runs(rows[g // c], held[g % c], T) for g in range(data.size)]
        runs[tuple(rows[data.rank // c])] = routing_runs(every, data.rank)

    def make(cls, cfg, n, s, **kw):  # a stage of class cls (MoEStage or engine_moe_zero's)
        return cls(cfg, n, s, lay, layer, routings, runs, **kw)

    executor = EngineExecutor(build(opts.schedule, pp.size, m, opts.chunks), model, pp, lay, ledger,
                              lambda cfg, n, s, lay: make(MoEStage, cfg, n, s),
                              embedding=mesh.axis("embedding"))
    full = init_params(model, train.seed)  # drawn whole; this rank keeps its stages', experts', tp part
    mine = local_params({n: full[n] for n in executor.param_names()}, model, mesh.sizes["ep"],
                        mesh.coords["ep"])
    params = backend.current().from_host(shard_params_tp(mine, model, t, mesh.coords["tp"]))
    scaler = loss_scaler(model, train)  # fp16 only
    executor.grad_dtype = MASTER_DTYPE if train.fp32_grads else None
    copies = mesh.axis("dp_cp")  # the ranks holding this rank's experts: dp, or dp x cp
    zero = None
    if opts.zero:  # refpar/engine_moe_zero.py: dense weights sharded over data, experts over dp
        from refpar.engine_moe_zero import MoESharding

        zero = MoESharding(executor, params, train, data, copies, ledger, opts.zero, opts.fsdp, make,
                           MoEZeroThreeStage)
        params = zero.params  # {} under ZeRO-3
    for n, p in params.items():
        ledger.alloc(f"param:{n}", p, "params")
    state = optimizer_init(params, train) if zero is None else {}
    for key in [k for k in ("m", "v", "master") if k in state]:  # masters: 16-bit models
        for n in params:
            ledger.alloc(f"opt:{key}:{n}", state[key][n], "master" if key == "master" else "optimizer")
    # the ranks whose gradients differ: stages, experts and tp shards (dense sums agree), and under
    # ZeRO the data ranks, each holding other shards
    differ = [comm for comm in (pp, mesh.ep if zero is None else data, mesh.tp) if comm.size > 1]
    scales, skipped_steps = [], []
    start_step = 0
    if resume is not None and zero is None:
        start_step = resume_from(resume, model, train, params, state, mesh.coords, scaler, m,
                                 arrays=checkpoint_arrays(model, params, state, mesh, saving=False))
    elif resume is not None:
        start_step = resume_sharded(resume, model, train, mesh, params, zero, scaler, m)
    # applied to this rank's part of the sequence only (the MoE blocks' experts are not)
    # the executor's names: under ZeRO-3 `params` is empty (the stages gather what they need)
    sp_names = ([n for n in sequence_parallel_param_names(model) if n in executor.param_names()]
                if opts.sp else [])
    dense = [n for n in params if ".mlp.experts." not in n]
    experts = [n for n in params if ".mlp.experts." in n]
    corpus = corpus_for(model, train)
    ids = [list(microbatch_samples(B, m, n_data, data.rank // c, j)) for j in range(m)]
    run = MoEPipelineRun(first_step=start_step, rows=[len(i) for i in ids])
    tracer = world.tracer
    for step in range(start_step, train.steps):
        start = time.perf_counter()
        routings.clear()
        with tracer.context(step=step) if tracer else nullcontext():
            mbs = []
            for j in range(m):
                tokens, targets = corpus.batch(step, ids[j], T)  # (b_j, T) each
                mbs.append(Microbatch(tokens, targets, tuple(ids[j])))
            scale = layer.grad_scale = 1.0 if scaler is None else scaler.scale
            if zero is not None:
                zero.begin_step()
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                loss, grads = executor.step(params, mbs, step=step, seed=train.seed, normalizer=B * T,
                                            dloss=scale)
            if zero is not None:  # the sums and the update on the shards
                params, skip = zero.step(params, grads, 1.0 / scale, None if scaler is None else differ,
                                         mesh.tp, sp_names)
            else:
                reduce_grads(grads, sp_names, mesh.tp, "sp.replicated_grads:bwd")
                reduce_grads(grads, dense, data, "dense:grad")  # over the stage's dp x ep x cp ranks
                reduce_grads(grads, experts, copies, "experts:grad")  # over the copies of each expert
                skip = scaler is not None and overflow_anywhere(grads, differ)
                params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale,
                                               skip=skip)
            if scaler is not None:
                scaler.update(skip)
                scales.append(scale)
                skipped_steps += [step] * skip
            mine = [routings[tuple(i)] for i in ids if tuple(i) in routings]  # microbatch order
            aux, z = router_shares(mine)  # this rank's shares; the loss counts them too
            shares = np.array([loss + aux + z, aux, z])
            if pp.size > 1:  # one stage (cp without pp) holds the whole loss already
                shares = pp.all_reduce(shares, tag="loss.pp:report")
            totals = data.all_reduce(shares, tag="loss")
        run.steps.append(step_record(step, loss, mine, start, totals))
        if on_step is not None:
            on_step(run.steps[-1])
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            whole = checkpoint_arrays(model, params, state if zero is None else {}, mesh, True)
            arrays = whole if zero is None else zero.checkpoint_arrays(model, mesh, whole, True)
            kind = "moe pipeline" + ("" if zero is None else " fsdp" if opts.fsdp else f" zero{opts.zero}")
            checkpoint.save_training(save, step + 1, arrays, model, train, mesh.sizes, kind, world,
                                     moe_microbatches=m, **saved_position(
                                         state if zero is None else {"t": zero.t}, scaler))
    run.totals = tracer.totals() if tracer else {}  # before the timeline gather adds its own
    run.params = params if zero is None else zero.full_params(params)
    run.ledger, run.executor = ledger, executor
    run.loss_scaling = loss_scaling_summary(scales, skipped_steps)
    run.measured = executor.measured_timeline()
    run.simulated = executor.simulated_timeline(run.measured)
    return run


def checkpoint_arrays(model: ModelConfig, params: dict, state: dict, mesh, saving: bool) -> list:
    """(checkpoint.Piece, view) of what this rank holds: expert_parallel_run's whole tensors without
    tp; with tp its tp shards as boxes of the global tensors (tp_param_slices, experts included),
    their AdamW moments and fp32 masters. Saving writes each element once: dense tensors from
    dp = ep = 0 (wte from pp rank 0), experts from dp = 0, all from cp rank 0, and what every tp
    rank holds whole from tp rank 0."""
    co = mesh.coords
    if mesh.sizes["tp"] == 1:
        return expert_parallel_checkpoint_arrays(params, state, co, saving)
    slices = tp_param_slices(model, mesh.sizes["tp"], co["tp"])

    def writes(n: str) -> bool:
        if (n not in slices and co["tp"]) or co.get("cp", 0):  # cp ranks hold the same weights
            return False
        if ".mlp.experts." in n:
            return co["dp"] == 0
        return co["dp"] == co["ep"] == 0 and not (n == "wte.weight" and co["pp"])

    held = [("params", params)] + [(f"adamw.{k}", state[k]) for k in ("m", "v") if k in state]
    held += [("master", state["master"])] if "master" in state else []
    out = []
    for prefix, arrays in held:
        for n, a in arrays.items():
            if not saving or writes(n):
                axis, index = slices.get(n, (None, None))
                out += checkpoint.shard_pieces(f"{prefix}/{n}", np.reshape(a, -1, copy=False),
                                               a.shape, 0, axis, index)
    return out


def full_params(run: MoEPipelineRun, model: ModelConfig, mesh) -> dict:
    """This rank's stages' dense weights and its experts, whole over tp (for the comparison with
    one device; traced as ":check")."""
    local = {n: backend.to_host(p) for n, p in run.params.items()}
    return gather_params_tp(local, model, mesh.tp if mesh.sizes["tp"] > 1 else None)
