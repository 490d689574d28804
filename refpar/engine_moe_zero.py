"""ZeRO-1, 2, 3 and FSDP for Mixture-of-Experts pipelines (refpar/engine_moe.py), sharded over two
groups as DeepSpeed-MoE and Megatron-Core shard an MoE model.

    mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --zero 1 --check
    mpiexec -n 4 python -m refpar train --mesh pp=2,ep=2 --moe-experts 4 --fsdp --microbatches 2 --check

Legend: D = dp x ep data ranks of a stage (engine_moe's `data` communicator), Ψ_u elements of unit
u on this rank, s_u its shard_range share over the unit's group.

Who holds the same weights decides who shards them:

    dense    embeddings, attention, LayerNorms and routers are replicated over the stage's D data
             ranks: ZeRO shards them, and reduce-scatters their gradients, over `data`
    experts  an expert's weights are replicated over dp only (the expert-data-parallel group, the
             ranks with the same ep coordinate): ZeRO shards them, and their gradients, over dp;
             with dp=1 each ep rank keeps its experts' state whole
    cp, tp   with cp both groups grow by the cp ranks (they hold the same weights: data is
             dp x ep x cp, an expert's copies dp x cp, axis dp_cp); with tp every group is one tp
             coordinate's and ZeRO shards this rank's tp shards once more, as the dense engine does
             (under sp the sequence-sharded region's gradients are summed over tp first: before
             ZeRO-1's reduce-scatter, on the gradient shards under ZeRO-2/3)

ZeRO-1 (`ZeroOneMoE`): two engine.ZeroOne, one over the dense weights laid end to end (axis
"data"), one over this rank's experts (axis "dp"); both reduce-scatter first, the fp16 overflow is
agreed on both shards at once, then each updates its shard and all-gathers it.
ZeRO-2, ZeRO-3 and FSDP: engine_zero3.ShardedGrads with a group per unit, and units that never mix
dense weights with experts:

    ZeRO-3   per stage: wte alone, the dense rest, the experts (`moe_units_of`); the stage's units
             gathered around each action (`MoEZeroThreeStage`, as engine.ZeroThreeStage)
    ZeRO-2,  per stage: wte alone, the root (wpe, ln_f), and per block its dense weights ("h.3")
    FSDP     and, in a MoE block, its experts ("h.3.experts") (`moe_fsdp_units`); a block's two
             units gathered around its piece (FSDP) and reduce-scattered once its backward is done
             (`MoEUnitStage`, an engine_fsdp.UnitStage; ZeRO-2's gather moves nothing)

Per step, a dense unit moves over the D data ranks and an expert unit over dp what the dense
engine's units move over its ZeRO group: ZeRO-1 one reduce-scatter and one all-gather of Ψ_d and of
Ψ_e; ZeRO-2 a reduce-scatter per microbatch and stage, one all-gather after the update; ZeRO-3 two
all-gathers and a reduce-scatter per microbatch and stage; FSDP the same, the ends' units gathered
once on the first stage and twice on the last (refpar/analysis/moe.py has the closed forms).

Checkpoints (`MoESharding.checkpoint_arrays`): the whole tensors (tp shards) a rank holds as
engine_moe.checkpoint_arrays writes them, ZeRO-1's moments as flat ranges [a, b) of each group's
parameters laid end to end (of tp shards: boxes of the global tensors through tp_param_slices),
ZeRO-2/3's shards through engine.sharded_checkpoint_arrays; all cut into boxes of the global
tensors, so any MoE mesh, with or without ZeRO, resumes any other's.
"""

from __future__ import annotations

from refpar import checkpoint
from refpar.engine import ZeroOne, sharded_checkpoint_arrays
from refpar.engine_fsdp import UnitStage
from refpar.engine_zero3 import ZeroThree, ZeroTwo
from refpar.holdings import expert_unit, is_expert, moe_fsdp_units, moe_units_of, tp_param_slices
from refpar.parallel.expert_parallel_run import reduce_grads
from refpar.precision import overflow_anywhere


class MoEUnitStage(UnitStage):
    """engine_fsdp.UnitStage (a unit gathered around each piece, reduced once complete) whose MoE
    blocks run `moe` and gather and reduce two units, the block's dense weights and its experts;
    like MoEStage it routes with the microbatch's `runs` and files each F's routing in `routings`."""

    dense_only = False

    def __init__(self, config, n_stages: int, stage: int, lay, moe, routings: dict, runs: dict, *,
                 zero: ZeroThree):
        super().__init__(config, n_stages, stage, lay, zero)
        self.moe, self.routings, self.runs = moe, routings, runs

    def block_units(self, layer: int) -> tuple[str, ...]:
        return f"h.{layer}", f"h.{layer}.experts"  # a dense block has no experts unit: none gathered

    def forward(self, params, x, targets, drop, normalizer):
        self.moe.runs = self.runs[drop.sample_ids]  # as MoEStage: this microbatch's token runs
        out, cache = super().forward(params, x, targets, drop, normalizer)
        for layer in self.layers:
            if layer in self.config.moe_blocks:
                self.routings.setdefault(drop.sample_ids, {})[layer] = self.moe.last_routing[layer]
        return out, cache


class ZeroOneMoE:
    """ZeRO-1 of a MoE rank: engine.ZeroOne over the dense weights (group `data`) and one over its
    experts (group `dp`), stepped together so that an fp16 overflow in either skips both."""

    def __init__(self, params: dict, train, data, dp, ledger):
        dense = {n: p for n, p in params.items() if not is_expert(n)}
        experts = {n: p for n, p in params.items() if is_expert(n)}
        self.train = train
        self.parts = [ZeroOne(dense, train, data, ledger, ".dense")]
        if experts:  # a stage without MoE blocks holds none
            self.parts.append(ZeroOne(experts, train, dp, ledger, ".experts"))

    @property
    def t(self) -> int:
        return self.parts[0].t

    @t.setter
    def t(self, value: int) -> None:
        for z in self.parts:
            z.t = value

    def step(self, params: dict, grads: dict, inv_scale: float, differ: list | None) -> tuple[dict, bool]:
        """(the new parameters, whether the step was skipped); `differ`: the communicators over
        which the gradient shards differ, where an fp16 overflow is agreed (None: no loss scale)."""
        shards = [z.reduce(grads) for z in self.parts]
        skip = differ is not None and overflow_anywhere(shards, differ)
        new = {}
        for z, g in zip(self.parts, shards, strict=True):
            new |= z.update(params, g, inv_scale, skip)
        return {n: new[n] for n in params}, skip

    def checkpoint_arrays(self, model, mesh, saving: bool) -> list:
        """(checkpoint.Piece, view) of the AdamW moments (and fp32 masters) of each group's range
        [a, b) of its parameters (tp shards under tp) laid end to end, as boxes of the global tensors;
        the group's ranks' ranges partition them, so each writes its own, except the tied wte of the
        last stage (pp rank 0 writes it) and, under tp, what every tp rank holds whole (tp rank 0)."""
        coords = mesh.coords
        slices = tp_param_slices(model, mesh.sizes["tp"], coords["tp"])
        out = []
        for z in self.parts:
            held = [("adamw.m", z.m), ("adamw.v", z.v)] if self.train.optimizer == "adamw" else []
            held += [("master", z.master)] if z.master is not None else []
            for prefix, buffer in held:
                for i, n in enumerate(z.names):
                    lo, hi = max(z.a - z.starts[i], 0), min(z.b - z.starts[i], z.sizes[i])
                    skip = saving and ((n == "wte.weight" and coords.get("pp", 0))
                                       or (n not in slices and coords["tp"]))
                    if lo < hi and not skip:
                        segment = buffer[z.starts[i] + lo - z.a:z.starts[i] + hi - z.a]
                        axis, index = slices.get(n, (None, None))
                        out += checkpoint.shard_pieces(f"{prefix}/{n}", segment, z.shapes[n], lo, axis,
                                                       index)
        return out


class MoESharding:
    """The optimizer side of a MoE pipeline under ZeRO (`zero` 1, 2 or 3; `fsdp` with 3): the
    state, the stages that reduce (and gather) unit by unit, the step and the checkpoint pieces.
    `make(cls, config, n_stages, stage, **kw)` builds a stage of class `cls` (a MoEStage) the way
    the run builds its own; `zero3_stage` is the MoE stage class ZeRO-3 gathers a stage for. After
    construction `params` is what the rank holds whole ({} under ZeRO-3, whose stages gather what
    they need)."""

    def __init__(self, executor, params: dict, train, data, dp, ledger, zero: int, fsdp: bool, make,
                 zero3_stage):
        self.zero, self.fsdp, self.one, self.sharded, self.tied = zero, fsdp, None, None, None
        self.params = params
        if zero == 1:
            self.one = ZeroOneMoE(params, train, data, dp, ledger)
            return
        self.tied = executor.embedding_group
        executor.embedding_group = None  # ShardedGrads.sum_tied sums the shards instead
        n_stages = executor.layout.n_stages
        by_unit = zero == 2 or fsdp
        kind = ZeroTwo if zero == 2 else ZeroThree
        unit_fn = moe_fsdp_units if by_unit else moe_units_of
        # a stage names every expert; this rank holds (and shards) its ep rank's only
        self.sharded = kind(params, executor.stages, train, data, ledger,
                            lambda names: unit_fn([n for n in names if n in params]), executor.grad_dtype,
                            lambda unit: dp if expert_unit(unit) else data)
        stage = MoEUnitStage if by_unit else zero3_stage
        executor.stages = {s: make(stage, executor.config, n_stages, s, zero=self.sharded)
                           for s in executor.stages}
        if zero == 3:  # the step gets no parameters: receives take the shards' namespace and device
            executor.like = next(iter(self.sharded.shards.values()))
            self.params = {}

    @property
    def t(self) -> int:
        return (self.one or self.sharded).t

    @t.setter
    def t(self, value: int) -> None:
        (self.one or self.sharded).t = value

    def begin_step(self) -> None:
        if self.sharded is not None:
            self.sharded.begin_step()

    def step(self, params: dict, grads: dict, inv_scale: float, differ: list | None, tp=None,
             sp_names=()) -> tuple[dict, bool]:
        """The gradients' sums and the update: (the new parameters, whether fp16 skipped the step).
        ZeRO-1 takes the executor's whole gradients; ZeRO-2/3 hold theirs in the shards already.
        `sp_names`: under sp, the sequence-sharded region's parameters, whose gradients cover this
        tp rank's tokens only: summed over `tp` before ZeRO-1's reduce-scatter, on the shards after
        ZeRO-2/3's (ShardedGrads.sum_sequence_parallel)."""
        if self.one is not None:
            if sp_names:
                reduce_grads(grads, list(sp_names), tp, "sp.replicated_grads:bwd")
            return self.one.step(params, grads, inv_scale, differ)
        self.sharded.sum_tied(self.tied)
        if sp_names:
            self.sharded.sum_sequence_parallel(tp, set(sp_names))
        skip = differ is not None and overflow_anywhere(self.sharded.grads, differ)
        if not skip and self.zero == 3:
            self.sharded.step(inv_scale)
        elif not skip:
            self.sharded.step(params, inv_scale)  # ZeRO-2 writes the gathered units into params
        return params, skip

    def full_params(self, params: dict) -> dict:
        """This rank's parameters whole, for the check (ZeRO-3 gathers them a unit at a time)."""
        return self.sharded.full_params() if self.zero == 3 else params

    def checkpoint_arrays(self, model, mesh, whole: list, saving: bool) -> list:
        """(checkpoint.Piece, view) of everything this rank holds: its whole tensors as the MoE
        runners write them (`whole`, engine_moe.checkpoint_arrays), and its shards' flat ranges
        (module docstring)."""
        out = list(whole)
        if self.one is not None:
            return out + self.one.checkpoint_arrays(model, mesh, saving)
        return out + sharded_checkpoint_arrays(model, mesh, self.sharded, saving)
