"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020): data parallelism without the replicas.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --check
    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 2 --check

Legend: Ψ_u elements of unit u on this rank (of its tp shards), s_u = this rank's `shard_range`
share of unit u over the unit's group (refpar/parallel/units.py), N the group's ranks.

Every unit is one flat buffer split over its group with `shard_range`, so the last shards are one
element shorter when N does not divide Ψ_u. Rank r owns [a, b) of each unit and is the only one to
keep optimizer state for it:

- stage 1 (P_os): optimizer state partitioned. Gradients accumulate in a full flat buffer; in the
  last microbatch each unit is reduce-scattered as soon as its gradient is complete, the owner
  writes the reduced shard into its slice, updates its parameter shard, and every unit is
  all-gathered after the step. Per step: (N-1)/N·Ψ sent by reduce-scatter + (N-1)/N·Ψ by all-gather.
- stage 2 (P_os+g): gradients partitioned too. A unit's gradient exists in full only from its first
  piece's backward to its reduce-scatter (every microbatch, as DeepSpeed does), then only the shard
  is kept. Same bytes as stage 1 with one microbatch; m reduce-scatters per step with m of them,
  which is why DeepSpeed's own pipeline engine refuses stage 2: here it is counted, not hidden.
- stage 3 (P_os+g+p): parameters partitioned too. A unit is all-gathered just before each piece
  that reads it and freed right after, so per microbatch 2·(N-1)/N·Ψ gathered + (N-1)/N·Ψ
  reduce-scattered: the paper's 3Ψ, 1.5x DP. The head's units stay gathered from its forward to
  its backward (its loss gradient starts there), so they too are gathered twice on a stage that
  also holds the embedding, and once where the pipeline's last stage holds only the head.

After the backward the partial sums run on the shards (`Hooks.partial_sums`): the tied wte's (the
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
from refpar.parallel.units import Hooks, fold_grads


class Zero(Hooks):
    """ZeRO stage 1, 2 or 3 over each unit's group; the hooks of refpar.parallel.pipeline.stage."""

    def __init__(self, units_, config, train, ledger, params: dict, stage: int,
                 lowp: bool = True):
        super().__init__(units_, config, train, ledger, lowp)
        self.stage = stage
        u, dt = units_, self.dtypes
        full = {k: u.flatten(k, params) for k in u.names}  # drawn whole, then sliced
        like = next(iter(full.values()))
        self.like, xp = like, array_namespace(like)
        if stage < 3:
            self.params = ledger.alloc("params.flat", xp.concat(list(full.values())), "params")  # (Ψl,)
        else:
            self.shards = {k: ledger.alloc(f"params.shard.{k}", xp.asarray(full[k][a:b], copy=True),
                                           "params") for k, (a, b) in u.own.items()}  # (s_u,) each
        self.lowp = None  # --fp32-grads, stage 1: the 16-bit gradients, whole (BF16_Optimizer's)
        if stage == 1:
            self.grads = ledger.alloc("grads.flat", self.zeros(like, u.total), "grads")  # (Ψl,)
            if dt.lowp:
                self.lowp = ledger.alloc("grads.lowp", self.zeros(like, u.total, dt.param), "grads")
        else:
            self.grad_shards = {k: ledger.alloc(f"grads.shard.{k}", self.zeros(like, b - a), "grads")
                                for k, (a, b) in u.own.items()}  # (s_u,) each
        # fp32 master weights of the owned shard only (mixed precision): its parameters upcast
        self.master = {k: ledger.alloc(f"master.{k}", xp.astype(full[k][a:b], backend.dtype_like(
            like, dt.state)), "master") for k, (a, b) in u.own.items()} if dt.mixed else None
        self.state = {k: {} for k in u.names}
        if train.optimizer == "adamw":
            for k, (a, b) in u.own.items():
                for s in ("m", "v"):
                    self.state[k][s] = ledger.alloc(f"optimizer.{s}.{k}", self.zeros(like, b - a, dt.state),
                                                    "optimizer")  # (s_u,)
        self.gathered: dict = {}  # stage 3: unit -> its all-gathered flat buffer
        self.holders: dict[str, set] = {k: set() for k in u.names}  # stage 3: who keeps it gathered
        self.unit_grads: dict = {}  # stages 2, 3: unit -> its full gradient
        self.unit_lowp: dict = {}  # stages 2, 3 with --fp32-grads: unit -> its 16-bit gradient

    def buffers(self) -> list:
        return [self.params] if self.stage < 3 else list(self.shards.values())

    # ------------------------------------------------------------------------------ parameters
    def gather(self, unit: str, phase: str) -> None:
        full = self.units.group[unit].all_gather(self.shards[unit], tag=f"{unit}:params:{phase}",
                                                  counts=self.units.counts[unit])  # (Ψ_u,)
        self.gathered[unit] = self.ledger.alloc(f"params.gathered.{unit}", full, "params")

    def drop(self, unit: str) -> None:
        del self.gathered[unit]
        self.ledger.free(f"params.gathered.{unit}")

    def holds(self, unit: str, phase: str) -> bool:
        """Whether `phase`'s acquire keeps `unit` gathered until its backward releases it: the
        head's units, from its forward to its backward."""
        return phase == "head:fwd"

    def acquire(self, keys, phase: str, hold=None, following=()):
        """The units' parameters and the buffers they view; `hold` names the microbatch a keeping
        acquire is for (`holds`), `following` the units of the action's next piece (FSDP prefetch)."""
        u = self.units
        if self.stage < 3:
            return {n: v for k in keys for n, v in u.views(k, u.slice(k, self.params)).items()}, {}
        for k in keys:
            if k not in self.gathered:
                self.gather(k, phase)
            if self.holds(k, phase):
                self.holders[k].add(hold)
        return ({n: v for k in keys for n, v in u.views(k, self.gathered[k]).items()},
                {k: self.gathered[k] for k in keys})

    def release(self, keys, phase: str, hold=None) -> None:
        """Frees what no hold keeps: a backward releases its microbatch's hold."""
        if self.stage < 3:
            return
        for k in keys:
            if phase.endswith("bwd"):
                self.holders[k].discard(hold)
            if not self.holders[k] and k in self.gathered:
                self.drop(k)

    # ------------------------------------------------------------------------------- gradients
    def fold(self, grads: dict) -> None:
        u, dt = self.units, self.dtypes

        def add(unit, g):
            lowp = None
            if self.stage == 1:
                target = u.slice(unit, self.grads)
                if self.lowp is not None:
                    lowp = u.slice(unit, self.lowp)
            else:
                if unit not in self.unit_grads:
                    self.unit_grads[unit] = self.ledger.alloc(
                        f"grads.unit.{unit}", self.zeros(self.like, u.size[unit]), "grads")  # (Ψ_u,)
                    if dt.lowp:  # the 16-bit .grad lives from this backward to the reduce-scatter
                        self.unit_lowp[unit] = self.ledger.alloc(
                            f"grads.lowp.{unit}", self.zeros(self.like, u.size[unit], dt.param), "grads")
                target, lowp = self.unit_grads[unit], self.unit_lowp.get(unit)
            fold_grads(u.views(unit, target), g, None if lowp is None else u.views(unit, lowp))

        self.piece(grads, add)

    def done(self, keys) -> None:
        for k in keys:
            self.reduce(k, self.last(k))

    def reduce(self, unit: str, last: bool) -> None:
        """Stage 1: the unit's accumulated gradient reduce-scattered in the last microbatch; stages
        2, 3: this microbatch's, added to the shard."""
        group, (a, b) = self.units.group[unit], self.units.own[unit]
        if self.stage == 1:
            if last:
                full = self.units.slice(unit, self.grads)
                shard = self.ledger.alloc("comm.grad_shard", group.reduce_scatter(
                    full, tag=f"{unit}:grads"), "comm")  # (s_u,)
                full[a:b] = shard
                self.ledger.free("comm.grad_shard")
            return
        shard = self.ledger.alloc("comm.grad_shard", group.reduce_scatter(
            self.unit_grads.pop(unit), tag=f"{unit}:grads"), "comm")  # (s_u,)
        self.ledger.free(f"grads.unit.{unit}")
        if self.unit_lowp.pop(unit, None) is not None:
            self.ledger.free(f"grads.lowp.{unit}")
        self.grad_shards[unit] += shard
        self.ledger.free("comm.grad_shard")

    def begin_step(self) -> None:
        super().begin_step()
        if self.stage == 1:
            self.grads[...] = 0.0
        else:
            for g in self.grad_shards.values():
                g[...] = 0.0

    def grad_shard(self, unit: str):
        """This rank's reduced gradient shard of `unit`, (s_u,)."""
        a, b = self.units.own[unit]
        return self.units.slice(unit, self.grads)[a:b] if self.stage == 1 else self.grad_shards[unit]

    def finish(self, embedding=None, tp=None, sp_names=(), copies=None) -> None:
        """The partial sums on the shards (module docstring); `copies`: DualPipe's mirror rank, whose
        copy of the same parts (sharded alike over the same group) has the other gradients."""
        u, names = self.units, set(sp_names)
        wte = self.grad_shard("wte") if "wte" in u.names else None
        # the segments inside this rank's shards: the same on every tp rank
        segments = [(self.grad_shard(k), lo - a, hi - a) for k, (a, b) in u.own.items()
                    for n, lo, hi in u.segments(k, a, b) if n in names]
        self.partial_sums(wte, segments, embedding, tp, copies, self.grad_shard)

    # ------------------------------------------------------------------------------- optimizer
    def step(self, differ: list) -> bool:
        """The optimizer on this rank's shards, then (stages 1, 2) every unit all-gathered into the
        whole parameters; returns whether fp16 found an overflow (every rank then skips the step
        and the all-gathers: no parameter changed)."""
        u = self.units
        if self.overflowed([self.grad_shard(k) for k in u.own], differ):
            return True
        self.t += 1
        for k, (a, b) in u.own.items():
            p = u.slice(k, self.params)[a:b] if self.stage < 3 else self.shards[k]
            master = None if self.master is None else self.master[k]
            self.update(k, p, self.grad_shard(k), self.state[k], a, master)
        if self.stage < 3:
            for k, (a, b) in u.own.items():
                full = u.slice(k, self.params)
                gathered = self.ledger.alloc("comm.params", u.group[k].all_gather(
                    full[a:b], tag=f"{k}:params:step", counts=u.counts[k]), "comm")  # (Ψ_u,)
                full[...] = gathered
                self.ledger.free("comm.params")
        return False

    def full_params(self) -> dict:
        """Every parameter this rank holds, whole (stage 3 gathers each unit: call outside the
        traced steps)."""
        u, out = self.units, {}
        for k in u.names:
            if self.stage < 3:
                flat = u.slice(k, self.params)
            else:
                flat = u.group[k].all_gather(self.shards[k], tag=f"{k}:params:check", counts=u.counts[k])
            out.update({n: np.array(backend.to_host(v)) for n, v in u.views(k, flat).items()})
        return out

    def held(self) -> list:
        """(prefix, unit, first element, flat array, replicated) of everything this rank holds:
        stages 1, 2 every parameter whole (replicated over the unit's group), and its shard [a, b)
        of each unit's master weights and moments (stage 3 of its parameters too)."""
        u, out = self.units, []
        for k, (a, _) in u.own.items():
            out.append(("params", k, 0, u.slice(k, self.params), True) if self.stage < 3
                       else ("params", k, a, self.shards[k], False))
            if self.master is not None:
                out.append(("master", k, a, self.master[k], False))
            out += [(f"adamw.{s}", k, a, arr, False) for s, arr in self.state[k].items()]
        return out
