"""The N-D engine: pipeline stages of tensor-parallel blocks, replicated over dp (Narayanan et al.
2021, "3D parallelism").

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --check
    mpiexec -n 8 python -m refpar train --mesh pp=2,cp=2,tp=2 --microbatches 2 --check
    mpiexec -n 8 python -m refpar train --mesh dp=2,cp=2,pp=2 --zero 3 --microbatches 2 --check

Legend: b microbatch rows, T sequence, Ta this cp rank's tokens (T without cp), Tl tokens of the
residual stream on this rank (Ta, or Ta/t under sequence parallelism), C channels, t tp size, Ψl
elements of the parameters this rank holds, d the ranks ZeRO shards over (dp, or dp x cp).

A rank at mesh coordinates (pp, dp, cp, tp) holds the tp shard (tensor_parallel.shard_params_tp) of
the parameters of its pipeline stages (stage.Stage.param_names). One step composes the strategies'
own pieces, nothing is written again:

    pipeline     executor.PipelineExecutor walks schedule[pp rank]; each stage is a
                 `TensorParallelStage`, whose F and B are tensor_parallel's vocab-parallel
                 embedding, parallel blocks (f/g or the SP pair inside) and vocab-parallel head.
                 Activations (b, Tl, C) go to the same (cp, tp) rank of the next stage.
    cp           the stages' attention is context_parallel's ring (zig-zag tokens) or Ulysses
                 core on the cp_layout, every other piece runs on this rank's tokens; the
                 gradients, each over this rank's tokens only, summed over cp (one all-reduce)
                 under --zero 0; ZeRO sums them in its own reduce over dp x cp (below)
    tied wte     the executor's embedding group: first and last pp rank, per tp rank (same rows)
    sp           the sequence-sharded region's gradients summed over tp (one all-reduce); with
                 cp the sp pair runs inside each cp rank's tokens (sequence_parallel.sp_cp_layout)
    dp           --zero 0: every gradient summed over dp (intra_layer.all_reduce_replicated_grads)
                 --zero 1: the flat gradient reduce-scattered over d ranks, AdamW on this
                 rank's shard only, the updated shard all-gathered (Rajbhandari et al. 2020, P_os)
                 --zero 2: each microbatch's gradients reduce-scattered block by block in B,
                 units all-gathered after the update (P_os+g; refpar/engine_zero3.py)
                 --zero 3: parameters sharded too, gathered around every action (P_os+g+p)
                 --fsdp: ZeRO-3 by FSDP's units, a block gathered around each piece
                 (refpar/engine_fsdp.py)
                 ZeRO's d ranks are `zero_group`: dp, or dp x cp when the mesh has cp (cp ranks
                 hold the same weights and see different tokens: Megatron-LM's dp-cp group)
    loss         the last stage's microbatch losses summed over pp, then over cp, then over dp

A tensor-parallel piece computes its input and weight gradients together, so a stage's B is the
full backward and its W hands over what B computed: schedules that split B from W (zb-h1, zb-h2)
run, but gain nothing under tp.

Mixed precision (16-bit ModelConfig.dtype): the pieces are the strategies' own, 16-bit in and out;
gradients sum over cp and dp in their dtype; AdamW runs on fp32 master weights (under ZeRO of this
rank's shard only). fp16 starts backward from the loss scale; the ranks whose gradients differ (tp,
pp, and ZeRO's group) agree on an overflow (`precision.overflow_anywhere`) and all skip the step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace, device

from refpar import backend
from refpar.config import ConfigError, ModelConfig, TrainConfig
from refpar.engine_fsdp import UnitStage, fsdp_units
from refpar.engine_zero3 import ZeroThree, ZeroTwo, attach, detach
from refpar.memory import MemoryLedger
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import add_embedding_grads, init_params
from refpar.model.optim import (
    adamw_update,
    fp32,
    mixed_adamw_update,
    mixed_sgd_update,
    optimizer_init,
    optimizer_step,
    sgd_update,
)
from refpar.parallel.context_parallel import check_cp, cp_layout
from refpar.parallel.intra_layer import all_reduce_replicated_grads
from refpar.parallel.intra_layer_runner import resumed_position, saved_position
from refpar.parallel.pipeline.executor import PipelineExecutor
from refpar.parallel.pipeline.runner import microbatches
from refpar.parallel.pipeline.schedules import Timeline, build
from refpar.parallel.pipeline.stage import Stage, stage_layers
from refpar.parallel.sequence_parallel import (
    check_sp,
    check_sp_cp,
    sequence_parallel_param_names,
    sp_cp_layout,
    sp_layout,
)
from refpar.parallel.tensor_parallel import (
    check_tp,
    gather_params_tp,
    parallel_block_backward,
    parallel_block_forward,
    shard_params_tp,
    tp_layout,
    vocab_parallel_embedding_backward,
    vocab_parallel_embedding_forward,
    vocab_parallel_head_backward,
    vocab_parallel_head_forward,
)
from refpar.precision import MASTER_DTYPE, is_16bit, loss_scaler, overflow_anywhere
from refpar.report import loss_scaling_summary
from refpar.sharding import shard_range, shard_sizes

AXES = ("pp", "dp", "cp", "tp")  # the axes the engine composes; ep runs in its own runner


@dataclass(frozen=True)
class EngineOptions:
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1  # v, model chunks per pipeline rank (interleaved-1f1b)
    sp: bool = False
    zero: int = 0
    cp_algo: str | None = None  # ring (default) or ulysses, when the mesh has cp
    fsdp: bool = False  # with zero 3: FSDP's units, a block at a time (refpar/engine_fsdp.py)


def validate(model: ModelConfig, train: TrainConfig, sizes: dict, opts: EngineOptions) -> None:
    """Every check of an engine run, with no communication: each rank raises the same ConfigError."""
    other = [f"{a}={s}" for a, s in sizes.items() if a not in AXES and s > 1]
    if other:
        raise ConfigError(f"the dense engine composes pp, dp, cp and tp; {other[0]} spreads experts: "
                          f"give the model --moe-experts (refpar/engine_moe.py runs it)")
    if model.moe_blocks:
        raise ConfigError("the dense engine runs GPT-2 blocks without experts; MoE models run in "
                          "refpar/engine_moe.py (refpar train picks it for --moe-experts)")
    if opts.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {opts.zero} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3")
    if opts.fsdp and opts.zero != 3:
        raise ConfigError("FSDP shards parameters, gradients and optimizer state; run it as zero 3")
    c = sizes.get("cp", 1)
    if opts.cp_algo is not None and c < 2:
        raise ConfigError("--cp-algo chooses how cp ranks share attention; give the mesh cp=2 or more")
    if opts.zero and sizes["dp"] * c < 2:
        flag = "--fsdp" if opts.fsdp else f"--zero {opts.zero}"
        raise ConfigError(f"{flag} shards over the dp (and cp) ranks; give the mesh dp=2 or more")
    train.check_model(model)
    t, p, d = sizes["tp"], sizes["pp"], sizes["dp"]
    check_tp(model, t)
    if opts.sp:
        if t < 2:
            raise ConfigError("--sp shards along the sequence over tp ranks; give the mesh tp=2 or more")
        check_sp(model, train.seq_len, t)
    if c > 1:
        check_cp(model, train.seq_len, c, opts.cp_algo or "ring", t)
        if opts.sp:
            check_sp_cp(model, train.seq_len, t, c, opts.cp_algo or "ring")
    if train.batch_size // d < opts.microbatches:
        raise ConfigError(f"--batch-size {train.batch_size} over dp={d} leaves fewer sequences per "
                          f"pipeline than --microbatches {opts.microbatches}; use --batch-size "
                          f"{d * opts.microbatches} or more")
    stage_layers(model.n_layer, p * opts.chunks, 0)  # "pp x chunks stages need as many blocks"
    build(opts.schedule, p, opts.microbatches, opts.chunks)  # last: it costs p x m x v; its own sentences


class TensorParallelStage(Stage):
    """Stage `stage` of `n_stages` with tensor-parallel pieces on layout `lay`; the same blocks,
    parameter names and ends as stage.Stage."""

    def __init__(self, config: ModelConfig, n_stages: int, stage: int, lay, moe=None):
        super().__init__(config, n_stages, stage)
        self.lay = lay
        self.moe = moe  # the MoE blocks' layer (refpar/engine_moe.py); None in dense models

    def forward(self, params, x, targets, drop, normalizer):
        """F: tokens (b, T) on the first stage or (b, Tl, C) -> (b, Tl, C), or the loss on the last."""
        lay = self.lay
        c_embed = c_head = None
        if self.first:
            x, c_embed = vocab_parallel_embedding_forward(x[:, lay.region_pos], params, lay, drop)
        c_blocks = []
        for layer in self.layers:
            x, c = parallel_block_forward(x, params, layer, lay, drop, self.moe)  # (b, Tl, C)
            c_blocks.append(c)
        if self.last:
            x, c_head = vocab_parallel_head_forward(x, params, targets[:, lay.region_pos], lay,
                                                    normalizer)
        # the dict of parameters rides along for the embedding backward's shapes; held_bytes
        # skips dicts keyed by parameter names, so it is not counted as an activation
        return x, (c_embed, c_blocks, c_head, params)

    def backward_input(self, dout, cache):
        """B, the whole backward: dx (b, Tl, C) (None on the first stage) and this rank's gradients."""
        c_embed, c_blocks, c_head, params = cache
        grads = {}
        d = dout
        if self.last:
            d, grads = vocab_parallel_head_backward(c_head, self.lay, self.dloss)  # (b, Tl, C)
        for layer, c in zip(reversed(self.layers), reversed(c_blocks), strict=True):
            d, g = parallel_block_backward(d, c, layer, self.lay)  # (b, Tl, C)
            grads |= g
        if self.first:
            g = vocab_parallel_embedding_backward(d, c_embed, self.lay, params)
            add_embedding_grads(grads, g)  # the last stage holds the tied head's share too
            d = None
        return d, grads

    def backward_weight(self, saved) -> dict:
        """W: B already computed the weight gradients (tensor-parallel pieces fuse the halves)."""
        return saved


class EngineExecutor(PipelineExecutor):
    """The pipeline executor with tensor-parallel stages; receives are (b, Tl, C).
    `make_stage(config, n_stages, stage, lay)`: TensorParallelStage or a subclass (engine_moe)."""

    def __init__(self, schedule, config: ModelConfig, pp, lay, ledger: MemoryLedger,
                 make_stage=TensorParallelStage):
        super().__init__(schedule, config, pp, ledger, lambda c, n, s: make_stage(c, n, s, lay))
        self.lay = lay

    def _post_receives(self, mbs, like):
        dtype, Tl, C = np.dtype(self.config.dtype), len(self.lay.resid_pos), self.config.n_embd
        return {a: self.pp.irecv((len(mbs[a.microbatch].sample_ids), Tl, C), dtype, src, tag, like=like)
                for a, src, dst, tag in self._messages() if dst == self.rank}


class ZeroThreeGather:
    """Mixed in before a stage class (TensorParallelStage or engine_moe.MoEStage): ZeRO-3 (`zero`, a
    ZeroThree) gathers the stage's units for each action and frees them after."""

    zero: ZeroThree

    def forward(self, params, x, targets, drop, normalizer):
        full, bases = self.zero.gather(self.stage, "fwd")
        out, cache = super().forward(full, x, targets, drop, normalizer)
        cache = detach(cache[:-1], bases)  # without the parameters: they are freed now
        self.zero.release(bases)
        return out, cache

    def backward_input(self, dout, cache):
        full, bases = self.zero.gather(self.stage, "bwd")
        dx, grads = super().backward_input(dout, (*attach(cache, bases), full))
        self.zero.release(bases)
        self.zero.reduce(self.stage, grads)
        return dx, {}  # the gradients are in the shards already


class ZeroThreeStage(ZeroThreeGather, TensorParallelStage):
    """A tensor-parallel stage whose parameters ZeRO-3 gathers for each action and frees after."""

    def __init__(self, config: ModelConfig, n_stages: int, stage: int, lay, zero: ZeroThree):
        super().__init__(config, n_stages, stage, lay)
        self.zero = zero


def zero_group(mesh):
    """The ranks ZeRO shards over and sums gradients across: dp, or dp x cp when the mesh has cp.
    cp ranks hold the same weights and see different tokens, so, as Megatron-LM's data-parallel
    group with context parallelism, one reduce-scatter sums both axes' gradients and the optimizer
    state splits d*c ways. Its rank is dp * c + cp; its traffic is traced as axis "dp_cp"."""
    sizes, co = mesh.sizes, mesh.coords
    if sizes["cp"] == 1:
        return mesh.dp
    others = (co["pp"], co["ep"], co["tp"])  # the dp x cp plane through this rank
    color = int(np.ravel_multi_index(others, (sizes["pp"], sizes["ep"], sizes["tp"])))
    return mesh.world.split(color, key=co["dp"] * sizes["cp"] + co["cp"], axis="dp_cp")


class ZeroOne:
    """ZeRO-1 over `dp` (zero_group: dp or dp x cp) of this rank's flat parameters: optimizer state
    for its shard_range only. `label` names its ledger entries apart from another instance's on the
    same ledger (a MoE run keeps one for the dense weights and one for the experts)."""

    def __init__(self, params: dict, train: TrainConfig, dp, ledger: MemoryLedger, label: str = ""):
        self.names = list(params)
        self.shapes = {n: params[n].shape for n in self.names}
        self.sizes = [int(np.prod(self.shapes[n])) for n in self.names]
        self.starts = np.cumsum([0, *self.sizes]).tolist()
        self.total = self.starts[-1]
        self.train, self.dp, self.ledger, self.t, self.label = train, dp, ledger, 0, label
        self.counts = shard_sizes(self.total, dp.size)
        self.a, self.b = shard_range(self.total, dp.size, dp.rank)
        like = params[self.names[0]]
        xp = array_namespace(like)
        mixed = is_16bit(like.dtype)
        moments = MASTER_DTYPE if mixed else like.dtype
        self.m = ledger.alloc(f"optimizer.m{label}", xp.zeros(self.b - self.a, dtype=moments,
                                                              device=device(like)), "optimizer")
        self.v = ledger.alloc(f"optimizer.v{label}", xp.zeros_like(self.m), "optimizer")
        # a 16-bit model's fp32 master weights of this rank's shard only (P_os)
        self.master = ledger.alloc(f"master{label}", fp32(self.flatten(params, self.a, self.b)),
                                   "master") if mixed else None

    def flatten(self, arrays: dict, a: int = 0, b: int | None = None):
        """Elements [a, b) of the arrays laid end to end, copying only those."""
        b = self.total if b is None else b
        xp = array_namespace(arrays[self.names[0]])
        pieces = [xp.reshape(arrays[n], (-1,))[max(a - s, 0):max(min(b - s, size), 0)]
                  for n, s, size in zip(self.names, self.starts, self.sizes, strict=False)]
        return xp.concat(pieces)  # (b - a,)

    def step(self, params: dict, grads: dict, inv_scale: float = 1.0, overflow=None) -> dict:
        """Reduce-scatter, update the shard segment by segment (decay follows each parameter's full
        shape), all-gather; returns the new parameters, views of the gathered buffer. fp16:
        `overflow(shard)` says whether any rank's shard overflowed, and then the step is skipped
        (the parameters returned as they are); `inv_scale` undoes the loss scale."""
        g = self.reduce(grads)
        return self.update(params, g, inv_scale, overflow is not None and overflow(g))

    def reduce(self, grads: dict):
        """The first half of `step`: this rank's shard (Ψl/d,) of the gradients summed over dp."""
        label = self.label
        flat = self.ledger.alloc(f"comm.grads{label}", self.flatten(grads), "comm")  # (Ψl,)
        g = self.ledger.alloc(f"comm.grad_shard{label}", self.dp.reduce_scatter(
            flat, tag=f"grads.{self.dp.axis}:zero1"), "comm")  # (Ψl/d,)
        self.ledger.free(f"comm.grads{label}")
        return g

    def update(self, params: dict, g, inv_scale: float = 1.0, skip: bool = False) -> dict:
        """The second half of `step` on the reduced shard `g`: the update and the all-gather, or,
        with `skip` (an fp16 overflow somewhere), nothing (the parameters returned as they are)."""
        if skip:
            self.ledger.free(f"comm.grad_shard{self.label}")
            return params
        self.t += 1
        p = self.flatten(params, self.a, self.b)  # (Ψl/d,)
        for i, n in enumerate(self.names):
            lo, hi = max(self.starts[i], self.a), min(self.starts[i + 1], self.b)
            if lo >= hi:
                continue
            s, decay = slice(lo - self.a, hi - self.a), len(self.shapes[n]) >= 2
            if self.master is not None:
                w = self.master
                if self.train.optimizer == "adamw":
                    p[s], w[s], self.m[s], self.v[s] = mixed_adamw_update(
                        p[s], g[s], w[s], self.m[s], self.v[s], self.t, self.train, decay, inv_scale)
                else:
                    p[s], w[s] = mixed_sgd_update(p[s], g[s], w[s], self.train, decay, inv_scale)
            elif self.train.optimizer == "adamw":
                p[s], self.m[s], self.v[s] = adamw_update(p[s], g[s], self.m[s], self.v[s], self.t,
                                                          self.train, decay)
            else:
                p[s] = sgd_update(p[s], g[s], self.train, decay)
        full = self.ledger.alloc(f"comm.params{self.label}", self.dp.all_gather(
            p, tag=f"params.{self.dp.axis}:zero1", counts=self.counts), "comm")  # (Ψl,)
        self.ledger.free(f"comm.grad_shard{self.label}")
        self.ledger.free(f"comm.params{self.label}")
        return {n: full[self.starts[i]:self.starts[i + 1]].reshape(self.shapes[n])
                for i, n in enumerate(self.names)}


@dataclass
class EngineRun:
    """One rank's view of a finished run."""

    losses: list[float]
    step_times: list[float]
    windows: list[tuple[float, float]]  # (start, end) of each step on the tracer's clock
    params: dict  # this rank's shards after the last step
    executor: EngineExecutor
    ledger: MemoryLedger
    totals: dict  # traced (axis, op) -> (sent, received) of the training steps only
    tracer: object  # the world's Tracer (None when untraced)
    measured: Timeline
    simulated: Timeline
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    loss_scaling: dict | None = None  # fp16: report.loss_scaling_summary (scales, skipped steps)


def checkpoint_arrays(model: ModelConfig, mesh, params: dict, state: dict | None, zero, saving: bool,
                      sharded=None) -> list:
    """(checkpoint.Piece, view) for what this rank holds: its stages' tp shards (boxes of the global
    tensors, `tp_param_slices`), their AdamW moments and fp32 master weights (16-bit models), whole
    or, under ZeRO-1, the range [a, b) of this rank's parameters laid end to end
    (`checkpoint.shard_pieces` cuts either into boxes).
    Saving writes each element once: each (dp, cp) rank its [a, b) of the replicated tensors, tp rank 0
    what every tp rank holds whole, pp rank 0 the tied wte (the last stage holds it too). ZeRO-2
    and 3 (`sharded`) add their unit shards (`sharded_checkpoint_arrays`); ZeRO-3 holds no whole
    parameters, so `params` is empty."""
    from refpar import checkpoint
    from refpar.parallel.tensor_parallel import tp_param_slices

    coords, names, c = mesh.coords, list(params), mesh.sizes["cp"]
    slices = tp_param_slices(model, mesh.sizes["tp"], coords["tp"])
    starts = np.cumsum([0] + [params[n].size for n in names]).tolist()
    # ZeRO-1's [a, b) over zero_group's dp x cp ranks (which hold the same parameters)
    own = shard_range(starts[-1], mesh.sizes["dp"] * c, coords["dp"] * c + coords["cp"])
    every = own if saving else (0, starts[-1])

    def whole(arrays):  # elements [lo, hi) of tensor n as a view (copy=False): loading writes into it
        return lambda i, n, lo, hi: np.reshape(arrays[n], -1, copy=False)[lo:hi]

    def flat(buffer):  # ZeRO-1's moments: one buffer over [a, b) of the parameters laid end to end
        return lambda i, n, lo, hi: buffer[starts[i] + lo - own[0]:starts[i] + hi - own[0]]

    held = [("params", every, whole(params))]
    if zero is not None and zero.train.optimizer == "adamw":
        held += [("adamw.m", own, flat(zero.m)), ("adamw.v", own, flat(zero.v))]
    elif state is not None and "m" in state:
        held += [("adamw.m", every, whole(state["m"])), ("adamw.v", every, whole(state["v"]))]
    if zero is not None and zero.master is not None:
        held += [("master", own, flat(zero.master))]
    elif state is not None and "master" in state:
        held += [("master", every, whole(state["master"]))]
    out = []
    for prefix, (a, b), segment in held:
        for i, n in enumerate(names):
            lo, hi = max(a - starts[i], 0), min(b - starts[i], params[n].size)
            skip = saving and ((n == "wte.weight" and coords["pp"]) or (n not in slices and coords["tp"]))
            if lo < hi and not skip:
                axis, index = slices.get(n, (None, None))
                out += checkpoint.shard_pieces(f"{prefix}/{n}", segment(i, n, lo, hi), params[n].shape,
                                               lo, axis, index)
    return out + (sharded_checkpoint_arrays(model, mesh, sharded, saving) if sharded is not None else [])


def sharded_checkpoint_arrays(model: ModelConfig, mesh, sharded, saving: bool) -> list:
    """(checkpoint.Piece, view) of ZeRO-2's and 3's shards: the AdamW moments (and ZeRO-3's
    parameters) of this rank's [a, b) of each unit, segment by segment, as flat ranges of the tp
    shards they cut. The dp x cp ranks' shards are disjoint; saving, tp rank 0 writes what every
    tp rank holds whole and pp rank 0 the tied wte (the last stage's wte shard is the same)."""
    from refpar import checkpoint
    from refpar.parallel.tensor_parallel import tp_param_slices

    coords = mesh.coords
    slices = tp_param_slices(model, mesh.sizes["tp"], coords["tp"])
    held = [("params", sharded.shards)] if isinstance(sharded, ZeroThree) else []
    if sharded.train.optimizer == "adamw":
        held += [("adamw.m", sharded.m), ("adamw.v", sharded.v)]
    held += [("master", sharded.master)] if sharded.master else []
    out = []
    for prefix, buffers in held:
        for key in sharded.own:
            for n, lo, hi, first in sharded.segments(key):
                if saving and ((n == "wte.weight" and coords["pp"]) or (n not in slices and coords["tp"])):
                    continue
                axis, index = slices.get(n, (None, None))
                out += checkpoint.shard_pieces(f"{prefix}/{n}", buffers[key][lo:hi], sharded.shapes[n],
                                               first, axis, index)
    return out


def sharded_grads(executor: EngineExecutor, params: dict, train: TrainConfig, group, ledger, lay,
                  zero: int, fsdp: bool = False):
    """ZeRO-2 or 3 (engine_zero3) or FSDP (engine_fsdp): (its state, the embedding group) with the
    executor's stages replaced by ones that reduce-scatter every microbatch's gradients, ZeRO-2's
    and FSDP's a block at a time (engine_fsdp.UnitStage; FSDP gathers each block around each
    piece), ZeRO-3's a stage at a time (it gathers the stage around each action); the tied wte's
    sum then runs on the shards. (None, None) for ZeRO 0 and 1."""
    if zero < 2:
        return None, None
    grad_dtype = executor.grad_dtype
    tied, n_stages = executor.embedding_group, executor.layout.n_stages
    executor.embedding_group = None  # ShardedGrads.sum_tied
    if zero == 2 or fsdp:  # unit by unit: a block's gradient is reduce-scattered after its backward
        kind = ZeroTwo if zero == 2 else ZeroThree
        state = kind(params, executor.stages, train, group, ledger, fsdp_units, grad_dtype)
        executor.stages = {s: UnitStage(executor.config, n_stages, s, lay, state) for s in executor.stages}
    else:
        state = ZeroThree(params, executor.stages, train, group, ledger, grad_dtype=grad_dtype)
        executor.stages = {s: ZeroThreeStage(executor.config, n_stages, s, lay, state)
                           for s in executor.stages}
    if zero == 3:  # the step is given no parameters: receives take the shards' namespace and device
        executor.like = next(iter(state.shards.values()))
    return state, tied


def layout_for(model: ModelConfig, seq_len: int, mesh, sp: bool = False, cp_algo: str | None = None):
    """The tensor_parallel.Layout of this rank's tokens and weights on `mesh` (its tp and cp axes)."""
    tp = mesh.tp if mesh.sizes["tp"] > 1 else None
    cp = mesh.cp if mesh.sizes.get("cp", 1) > 1 else None
    if cp is not None and sp:  # sp inside each cp rank's tokens
        return sp_cp_layout(model, seq_len, cp, cp_algo or "ring", mesh.tp)
    if cp is not None:  # each cp rank runs its zig-zag (ring) or contiguous (ulysses) tokens
        return cp_layout(model, seq_len, cp, cp_algo or "ring", tp)
    if sp:
        return sp_layout(model, seq_len, mesh.tp)
    return tp_layout(model, seq_len, tp)


def run_engine(model: ModelConfig, train: TrainConfig, mesh, opts: EngineOptions,
               on_step=None, *, save: str | None = None, save_every: int | None = None,
               resume: str | None = None) -> EngineRun:
    """Trains `train.steps` steps on `mesh`; `on_step(step, loss, seconds, totals)` after each.
    `resume`: start from that checkpoint (any mesh's); `save`: checkpoint every `save_every` steps
    and after the last (refpar/checkpoint.py)."""
    validate(model, train, mesh.sizes, opts)
    pp, dp, tp = mesh.pp, mesh.dp, mesh.tp
    t = mesh.sizes["tp"]
    cp = mesh.cp if mesh.sizes.get("cp", 1) > 1 else None
    lay = layout_for(model, train.seq_len, mesh, opts.sp, opts.cp_algo)
    ledger = MemoryLedger()
    executor = EngineExecutor(build(opts.schedule, pp.size, opts.microbatches, opts.chunks), model,
                              pp, lay, ledger)
    scaler = loss_scaler(model, train)  # fp16 only
    executor.grad_dtype = MASTER_DTYPE if train.fp32_grads else None
    full = shard_params_tp(init_params(model, train.seed), model, t, mesh.coords["tp"])
    # Drawn whole on the host, sliced by tp, then by pp, then moved to the run's backend.
    params = backend.current().from_host({n: full[n] for n in executor.param_names()})
    group = zero_group(mesh) if opts.zero else None  # dp, or dp x cp
    # the axes over which this rank's gradients differ from others' (where an overflow is agreed)
    differ = [comm for comm in (tp, pp, group) if comm is not None and comm.size > 1]
    sharded, tied = sharded_grads(executor, params, train, group, ledger, lay, opts.zero, opts.fsdp)
    if opts.zero == 3:
        params = {}  # the stages gather what they need
    for n, p in params.items():
        ledger.alloc(f"param:{n}", p, "params")
    zero = ZeroOne(params, train, group, ledger) if opts.zero == 1 else None
    state = optimizer_init(params, train) if opts.zero == 0 else None
    for key in [k for k in ("m", "v", "master") if state is not None and k in state]:
        for n in params:
            ledger.alloc(f"opt:{key}:{n}", state[key][n], "master" if key == "master" else "optimizer")
    sp_names = ([n for n in sequence_parallel_param_names(model) if n in executor.param_names()]
                if opts.sp else [])
    start_step = 0
    if resume is not None:
        from refpar import checkpoint

        manifest = checkpoint.open_training(resume, model, train)
        pairs = checkpoint_arrays(model, mesh, params, state, zero, saving=False, sharded=sharded)
        for (_, view), loaded in zip(pairs, checkpoint.load(resume, [p for p, _ in pairs], manifest),
                                     strict=True):
            view[...] = loaded
        start_step, t_done = resumed_position(manifest, scaler)
        for optimizer in (zero, sharded):
            if optimizer is not None:
                optimizer.t = t_done
        if state is not None:
            state["t"] = t_done
    corpus = MarkovCorpus(model.vocab_size, train.seed)
    first, stop = shard_range(train.batch_size, dp.size, dp.rank)
    normalizer = train.batch_size * train.seq_len  # global tokens: the losses add up to the mean
    tracer = mesh.world.tracer
    losses, times, windows, scales, skipped_steps = [], [], [], [], []
    for step in range(start_step, train.steps):
        start = time.perf_counter()
        with tracer.context(step=step) if tracer else nullcontext():
            tokens, targets = corpus.batch(step, range(first, stop), train.seq_len)  # (B/d, T) each
            if sharded is not None:
                sharded.begin_step()
            scale = 1.0 if scaler is None else scaler.scale
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                loss, grads = executor.step(params, microbatches(tokens, targets, first, opts.microbatches),
                                            step=step, seed=train.seed, normalizer=normalizer, dloss=scale)
            if sp_names and sharded is None:
                grads |= all_reduce_replicated_grads({n: grads[n] for n in sp_names}, tp,
                                                     "sp.replicated_grads:bwd")
            if cp is not None and not opts.zero:  # each cp rank's gradients cover its tokens only
                grads = all_reduce_replicated_grads(grads, cp, "grads.cp:bwd")
            skipped = False
            if sharded is not None:  # ZeRO-2 or 3: the sums and the update on the gradient shards
                sharded.sum_tied(tied)
                if sp_names:
                    sharded.sum_sequence_parallel(tp, set(sp_names))
                skipped = scaler is not None and overflow_anywhere(sharded.grads, differ)
                if not skipped and opts.zero == 3:
                    sharded.step(1.0 / scale)
                elif not skipped:
                    sharded.step(params, 1.0 / scale)  # ZeRO-2 writes the gathered units into params
            elif zero is not None:
                t_before = zero.t
                params = zero.step(params, grads, 1.0 / scale, None if scaler is None else
                                   lambda shard: overflow_anywhere({"shard": shard}, differ))
                skipped = zero.t == t_before
            else:
                if dp.size > 1:
                    grads = all_reduce_replicated_grads(grads, dp, "grads.dp:bwd")
                skipped = scaler is not None and overflow_anywhere(grads, differ)
                params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale,
                                               skip=skipped)
            if scaler is not None:
                scaler.update(skipped)
                scales.append(scale)
                skipped_steps += [step] * skipped
            loss = pp.all_reduce(np.array([loss]), tag="loss.pp:report")  # only the last stage's is not 0
            if cp is not None:  # each cp rank's loss is over its tokens
                loss = cp.all_reduce(loss, tag="loss.cp:report")
            losses.append(float(dp.all_reduce(loss, tag="loss.dp:report")[0]))
        windows.append((start, time.perf_counter()))
        times.append(windows[-1][1] - start)
        if on_step is not None:
            on_step(step, losses[-1], times[-1], tracer.totals() if tracer else {})
        if save is not None:
            from refpar import checkpoint

            if checkpoint.should_save(step + 1, train.steps, save_every):
                t_done = next(o.t for o in (zero, sharded) if o is not None) if state is None else state["t"]
                checkpoint.save_training(save, step + 1, checkpoint_arrays(
                    model, mesh, params, state, zero, saving=True, sharded=sharded), model, train, mesh.sizes,
                    "engine fsdp" if opts.fsdp else f"engine zero{opts.zero}", mesh.world,
                    **saved_position({"t": t_done}, scaler))
    totals = tracer.totals() if tracer else {}  # before the gathers below add their own
    if opts.zero == 3:
        params = sharded.full_params()
    measured = executor.measured_timeline()
    return EngineRun(losses, times, windows, params, executor, ledger, totals, tracer, measured,
                     executor.simulated_timeline(measured), start_step,
                     loss_scaling_summary(scales, skipped_steps))


def full_params(run: EngineRun, model: ModelConfig, mesh) -> dict:
    """This rank's stages' parameters, whole over tp (for the comparison with one device)."""
    return gather_params_tp({n: backend.to_host(p) for n, p in run.params.items()}, model,
                            mesh.tp if mesh.sizes["tp"] > 1 else None)
