"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020): data parallelism without the replicas.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --check
    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 2 --check

Legend: Ψ_u elements of unit u on this rank (of its tp shards), s_u = this rank's `shard_range`
share of unit u over the unit's group (refpar/parallel/units.py), N the group's ranks.

Every unit is one flat buffer split over its group with `shard_range`, so the last shards are one
element shorter when N does not divide Ψ_u. Rank r owns [a, b) of each unit (Units.owned) and is
the only one to keep optimizer state for it. One class per stage, each partitioning one more state:

- stage 1 (P_os, `Zero1`): optimizer state partitioned. Gradients accumulate in a full flat buffer; in the
  last microbatch each unit is reduce-scattered as soon as its gradient is complete, the owner
  writes the reduced shard into its slice, updates its parameter shard, and every unit is
  all-gathered after the step. Per step: (N-1)/N·Ψ sent by reduce-scatter + (N-1)/N·Ψ by all-gather.
- stage 2 (P_os+g, `Zero2`): gradients partitioned too. A unit's gradient exists in full only from its first
  piece's backward to its reduce-scatter (every microbatch, as DeepSpeed does), then only the shard
  is kept. Same bytes as stage 1 with one microbatch; m reduce-scatters per step with m of them,
  which is why DeepSpeed's own pipeline engine refuses stage 2: here it is counted, not hidden.
- stage 3 (P_os+g+p, `Zero3`): parameters partitioned too. A unit is all-gathered just before each piece
  that reads it and freed right after, so per microbatch 2·(N-1)/N·Ψ gathered + (N-1)/N·Ψ
  reduce-scattered: the paper's 3Ψ, 1.5x DP. The head's units stay gathered from its forward to
  its backward (its loss gradient starts there), so they too are gathered twice on a stage that
  also holds the embedding, and once where the pipeline's last stage holds only the head.

After the backward the partial sums run on the shards (`ModelStates.partial_sums`): the tied wte's (the
first and the last stage shard it alike), DualPipe's two copies' over the mirror group (ranks r
and p-1-r hold the same units, sharded alike over the same replicas) and the sequence-sharded
region's segments inside this rank's shards (tp divides the heads, so every tp rank's unit has the
same layout).

Mixed precision (bf16/fp16): the paper's own setting. Gradients are reduce-scattered in their
dtype, parameters all-gathered in 16 bits; only the owner of a shard keeps its fp32 master weights
and moments. With fp16 the ranks hold different gradient shards, so they agree on an overflow with
one max all-reduce of a float32 flag and all skip the step together. --fp32-grads is partitioned
as DeepSpeed does (analysis/memory.py gives each stage's bytes).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.parallel.model_states import ModelStates


class Zero(ModelStates):
    """What the three stages share: of each unit this rank keeps the reduced gradient of the range
    it owns (`grad_shards`, unit -> (s_u,)), that range's master weights and moments, and runs the
    partial sums and the optimizer on them. The parameters are whole on every rank, all-gathered
    after each step (stages 1, 2; `Zero3` shards them). `params`: the rank's, drawn whole, tp-sliced."""

    def __init__(self, units, config, train, ledger, params: dict, composition=None, lowp: bool = True):
        super().__init__(units, config, train, ledger, composition, lowp)
        dt = self.dtypes
        full = {k: units.flatten(k, params) for k in units.names}  # drawn whole, then sliced
        self.like = next(iter(full.values()))
        xp = array_namespace(self.like)
        self.keep_params(full)
        self.grad_shards = self.keep_grads()  # unit -> (s_u,) the reduced gradient of the owned range
        # fp32 master weights of the owned shard only (mixed precision): its parameters upcast
        self.master = {k: ledger.alloc(f"master.{k}", xp.astype(full[k][a:b], backend.dtype_like(
            self.like, dt.state)), "master") for k, (a, b) in units.owned.items()} if dt.mixed else None
        self.state = {k: {} for k in units.names}
        if train.optimizer == "adamw":
            for k, (a, b) in units.owned.items():
                for s in ("m", "v"):
                    self.state[k][s] = ledger.alloc(
                        f"optimizer.{s}.{k}", self.zeros(self.like, b - a, dt.state), "optimizer")  # (s_u,)

    # ------------------------------------------------------------------------------ parameters
    def keep_params(self, full: dict) -> None:
        """Every unit's parameters whole, end to end in one flat buffer."""
        xp = array_namespace(self.like)
        self.params = self.ledger.alloc("params.flat", xp.concat(list(full.values())), "params")  # (Ψl,)

    def buffers(self) -> list:
        return [self.params]

    def whole(self, unit: str, phase: str):
        """The unit's parameters whole, (Ψ_u,)."""
        return self.units.slice(unit, self.params)

    def param_shard(self, unit: str):
        """The owned range of the unit's parameters, (s_u,): what the optimizer updates."""
        a, b = self.units.owned[unit]
        return self.units.slice(unit, self.params)[a:b]

    def acquire(self, keys, phase: str, hold=None, following=()):
        """Views of the flat buffer every rank keeps whole: nothing moves."""
        return {n: v for k in keys for n, v in self.units.views(k, self.whole(k, phase)).items()}, {}

    def release(self, keys, phase: str, hold=None) -> None:
        """Every rank keeps the whole parameters: nothing to free."""

    def share_updated(self) -> None:
        """After the update: every unit all-gathered from its owners into the whole parameters."""
        u = self.units
        for k, (a, b) in u.owned.items():
            full = u.slice(k, self.params)
            gathered = self.ledger.alloc("comm.params", u.group[k].all_gather(
                full[a:b], tag=f"{k}:params:step", counts=u.counts[k]), "comm")  # (Ψ_u,)
            full[...] = gathered
            self.ledger.free("comm.params")

    # ------------------------------------------------------------------------------- gradients
    def keep_grads(self) -> dict:
        """Allocates where gradients accumulate; returns each unit's (s_u,) reduced gradient."""
        raise NotImplementedError

    def reduce(self, unit: str, full):
        """`full`, this rank's (Ψ_u,) gradient of `unit`, reduce-scattered over the unit's group: the
        (s_u,) sum of the owned range, in the ledger as comm.grad_shard until the caller frees it."""
        return self.ledger.alloc("comm.grad_shard", self.units.group[unit].reduce_scatter(
            full, tag=f"{unit}:grads"), "comm")  # (s_u,)

    def finish(self) -> None:
        """The partial sums on the shards (module docstring); DualPipe's mirror rank holds the same
        parts sharded alike over the same group."""
        u, names = self.units, set(self.sp_names)
        wte = self.grad_shards["wte"] if "wte" in u.names else None
        # the segments inside this rank's shards: the same on every tp rank
        segments = [(self.grad_shards[k], lo - a, hi - a) for k, (a, b) in u.owned.items()
                    for n, lo, hi in u.segments(k, a, b) if n in names]
        self.partial_sums(wte, segments, self.grad_shards.__getitem__)

    # ------------------------------------------------------------------------------- optimizer
    def held_grads(self) -> list:
        return [(k, a, self.grad_shards[k]) for k, (a, _) in self.units.owned.items()]

    def step(self, lr: float) -> bool:
        """The optimizer on this rank's shards, then (stages 1, 2) every unit all-gathered; an fp16
        overflow skips both (no parameter changed)."""
        factor = self.begin_update()
        if factor is None:
            return True
        for k, (a, _) in self.units.owned.items():
            master = None if self.master is None else self.master[k]
            self.update(k, self.param_shard(k), self.grad_shards[k], self.state[k], a, master, lr, factor)
        self.share_updated()
        return False

    def full_params(self) -> dict:
        u = self.units
        return {n: np.array(backend.to_host(v)) for k in u.names
                for n, v in u.views(k, self.whole(k, "check")).items()}

    def held_params(self, unit: str) -> tuple:
        return ("params", unit, 0, self.units.slice(unit, self.params), True)

    def held(self) -> list:
        """Stages 1, 2 every parameter whole (replicated over the unit's group), and the owned range
        [a, b) of each unit's master weights and moments (stage 3 of its parameters too)."""
        out = []
        for k, (a, _) in self.units.owned.items():
            out.append(self.held_params(k))
            if self.master is not None:
                out.append(("master", k, a, self.master[k], False))
            out += [(f"adamw.{s}", k, a, arr, False) for s, arr in self.state[k].items()]
        return out


class Zero1(Zero):
    """Stage 1: the optimizer state partitioned; gradients accumulate whole, reduce-scattered once a
    step, in the last microbatch, as each unit completes."""

    def keep_grads(self) -> dict:
        u, dt = self.units, self.dtypes
        self.grads = self.ledger.alloc("grads.flat", self.zeros(self.like, u.total), "grads")  # (Ψl,)
        # --fp32-grads: the 16-bit gradients, whole (BF16_Optimizer's)
        self.lowp = self.ledger.alloc("grads.lowp", self.zeros(self.like, u.total, dt.param), "grads") \
            if dt.lowp else None  # (Ψl,)
        return {k: u.slice(k, self.grads)[a:b] for k, (a, b) in u.owned.items()}  # views, (s_u,) each

    def begin_step(self) -> None:
        super().begin_step()
        self.grads[...] = 0.0

    def accumulator(self, unit: str):
        u = self.units
        lowp = None if self.lowp is None else u.views(unit, u.slice(unit, self.lowp))
        return u.views(unit, u.slice(unit, self.grads)), lowp

    def done(self, keys) -> None:
        """The step's sum of each unit completed in this microbatch, written over its owned range."""
        for k in keys:
            if self.last(k):
                self.grad_shards[k][...] = self.reduce(k, self.units.slice(k, self.grads))
                self.ledger.free("comm.grad_shard")


class Zero2(Zero):
    """Stage 2: gradients partitioned too; a unit's whole gradient lives from its first piece's
    backward to its reduce-scatter, every microbatch, then only the owned range is kept."""

    def keep_grads(self) -> dict:
        self.unit_grads: dict = {}  # unit -> its whole gradient in this microbatch
        self.unit_lowp: dict = {}  # with --fp32-grads: unit -> its 16-bit gradient
        return {k: self.ledger.alloc(f"grads.shard.{k}", self.zeros(self.like, b - a), "grads")
                for k, (a, b) in self.units.owned.items()}  # (s_u,) each

    def begin_step(self) -> None:
        super().begin_step()
        for g in self.grad_shards.values():
            g[...] = 0.0

    def accumulator(self, unit: str):
        u, dt = self.units, self.dtypes
        if unit not in self.unit_grads:
            self.unit_grads[unit] = self.ledger.alloc(
                f"grads.unit.{unit}", self.zeros(self.like, u.size[unit]), "grads")  # (Ψ_u,)
            if dt.lowp:  # the 16-bit .grad lives from this backward to the reduce-scatter
                self.unit_lowp[unit] = self.ledger.alloc(
                    f"grads.lowp.{unit}", self.zeros(self.like, u.size[unit], dt.param), "grads")
        lowp = self.unit_lowp.get(unit)
        return u.views(unit, self.unit_grads[unit]), None if lowp is None else u.views(unit, lowp)

    def done(self, keys) -> None:
        """Each unit's gradient of this microbatch reduce-scattered and added to the owned range."""
        for k in keys:
            shard = self.reduce(k, self.unit_grads.pop(k))
            self.ledger.free(f"grads.unit.{k}")
            if self.unit_lowp.pop(k, None) is not None:
                self.ledger.free(f"grads.lowp.{k}")
            self.grad_shards[k] += shard
            self.ledger.free("comm.grad_shard")


class Zero3(Zero2):
    """Stage 3: parameters partitioned too; a unit is all-gathered just before each piece that reads
    it and freed right after, unless a hold keeps it (`holds`)."""

    def keep_params(self, full: dict) -> None:
        xp, owned = array_namespace(self.like), self.units.owned
        self.shards = {k: self.ledger.alloc(f"params.shard.{k}", xp.asarray(full[k][a:b], copy=True),
                                            "params") for k, (a, b) in owned.items()}  # (s_u,) each
        self.gathered: dict = {}  # unit -> its all-gathered flat buffer
        self.holders: dict[str, set] = {k: set() for k in self.units.names}  # who keeps it gathered

    def buffers(self) -> list:
        return list(self.shards.values())

    def whole(self, unit: str, phase: str):
        return self.units.group[unit].all_gather(self.shards[unit], tag=f"{unit}:params:{phase}",
                                                 counts=self.units.counts[unit])  # (Ψ_u,)

    def param_shard(self, unit: str):
        return self.shards[unit]

    def share_updated(self) -> None:
        """Nothing: the next acquire gathers the updated shards."""

    def held_params(self, unit: str) -> tuple:
        return ("params", unit, self.units.owned[unit][0], self.shards[unit], False)

    def gather(self, unit: str, phase: str) -> None:
        self.gathered[unit] = self.ledger.alloc(f"params.gathered.{unit}", self.whole(unit, phase), "params")

    def drop(self, unit: str) -> None:
        del self.gathered[unit]
        self.ledger.free(f"params.gathered.{unit}")

    def holds(self, unit: str, phase: str) -> bool:
        """Whether `phase`'s acquire keeps `unit` gathered until its backward releases it: the
        head's units, from its forward to its backward."""
        return phase == "head:fwd"

    def acquire(self, keys, phase: str, hold=None, following=()):
        """The units gathered (those not already), with the buffers their parameters view."""
        u = self.units
        for k in keys:
            if k not in self.gathered:
                self.gather(k, phase)
            if self.holds(k, phase):
                self.holders[k].add(hold)
        return ({n: v for k in keys for n, v in u.views(k, self.gathered[k]).items()},
                {k: self.gathered[k] for k in keys})

    def release(self, keys, phase: str, hold=None) -> None:
        """Frees what no hold keeps: a backward releases its microbatch's hold."""
        for k in keys:
            if phase.endswith("bwd"):
                self.holders[k].discard(hold)
            if not self.holders[k] and k in self.gathered:
                self.drop(k)
