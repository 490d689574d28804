"""ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020): data parallelism without the replicas.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --check

Legend: Ψ parameters, Ψ_u those of unit u, s_u = this rank's `shard_range` share of unit u, N ranks.

Every unit (see refpar/parallel/units.py) is one flat buffer split over the dp ranks with
`shard_range`, so the last shards are one element shorter when N does not divide Ψ_u. Rank r
owns [a, b) of each unit and is the only one to keep optimizer state for it:

- stage 1 (P_os): optimizer state partitioned. Gradients accumulate in a full flat buffer; in the
  last micro-batch each unit is reduce-scattered as soon as its backward is done, the owner writes
  the reduced shard into its slice, updates its parameter shard, and every unit is all-gathered
  after the step. Per step: (N-1)/N·Ψ sent by reduce-scatter + (N-1)/N·Ψ by all-gather.
- stage 2 (P_os+g): gradients partitioned too. A unit's gradient exists in full only from its
  backward to its reduce-scatter (every micro-batch, as DeepSpeed does), then only the shard is
  kept. Same bytes as stage 1 with one micro-batch.
- stage 3 (P_os+g+p): parameters partitioned too. A unit is all-gathered just before each piece
  that reads it (forward, and again for backward) and freed right after, so per micro-batch
  2·(N-1)/N·Ψ gathered + (N-1)/N·Ψ reduce-scattered: the paper's 3Ψ, 1.5x DP.

Ledger (exact closed forms in refpar.analysis.memory.peak_bytes): params 8Ψ or 8Σs_u (+ one
gathered unit), grads 8Ψ or 8Σs_u (+ transients), optimizer 16Σs_u, comm collective outputs.

Mixed precision (bf16/fp16): the paper's own setting. The 16-bit parameters (2Ψ, or 2Σs_u at
stage 3) and gradients (2Ψ, or 2Σs_u from stage 2) are what moves:
gradients are reduce-scattered in their dtype, parameters all-gathered in 16 bits. Only the owner
of a shard keeps its fp32 master weights (4Σs_u, "master") and moments (8Σs_u, "optimizer") and
runs `mixed_adamw_update` on it. With fp16 the ranks hold different gradient shards, so they agree
on an overflow with one max all-reduce of a float32 flag, and all skip the step together.

--fp32-grads (the Playbook's 20Ψ, partitioned as DeepSpeed does; refpar/analysis/memory.py):
gradients accumulate and are reduce-scattered in fp32, and backward still writes 16-bit ones.
Stage 1 keeps both whole (BF16_Optimizer: 2Ψ + 4Ψ of gradients, 2Ψ + 6Ψ + 12Σs_u in all); from
stage 2 a unit's 16-bit gradient lives from its backward to its reduce-scatter and only the fp32
shard stays (2Ψ + 16Σs_u, stage 3 18Σs_u).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.analysis.memory import ROOT
from refpar.config import ConfigError
from refpar.memory import nbytes_of
from refpar.parallel.units import FlatLayout, StateDtypes, fold_grads, optimizer_update, overflowed
from refpar.sharding import shard_sizes


class Zero:
    """ZeRO stage 1, 2 or 3 on one dp rank; the hooks of refpar.parallel.units.forward_backward."""

    def __init__(self, config, train, dp, ledger, params: dict, stage: int):
        if stage not in (1, 2, 3):
            raise ConfigError(f"--zero {stage} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3")
        self.config, self.train, self.dp, self.ledger, self.stage = config, train, dp, ledger, stage
        self.layout = lay = FlatLayout(config)
        self.dtypes = dt = StateDtypes(config, train)
        self.own = {u: lay.shard(u, dp.size, dp.rank) for u in lay.units}  # [a, b) per unit
        self.counts = {u: shard_sizes(lay.sizes[u], dp.size) for u in lay.units}  # every rank's s_u
        full = {u: lay.flatten(u, params) for u in lay.units}  # drawn whole, then sliced
        xp = array_namespace(full[ROOT])
        if stage < 3:
            self.params = ledger.alloc("params.flat", xp.concat(list(full.values())), "params")
        else:
            self.shards = {u: ledger.alloc(f"params.shard.{u}", xp.asarray(full[u][a:b], copy=True),
                                           "params") for u, (a, b) in self.own.items()}  # (s_u,) each
        self.zeros = lambda n, dtype=dt.grad: dt.zeros(full[ROOT], n, dtype)  # a gradient buffer
        self.lowp = None  # --fp32-grads, stage 1: the 16-bit gradients, whole (BF16_Optimizer's)
        if stage == 1:
            self.grads = ledger.alloc("grads.flat", self.zeros(lay.total), "grads")  # (Ψ,)
            if dt.wide:
                self.lowp = ledger.alloc("grads.lowp", self.zeros(lay.total, dt.param), "grads")  # (Ψ,)
        else:
            self.grad_shards = {u: ledger.alloc(f"grads.shard.{u}", self.zeros(b - a), "grads")
                                for u, (a, b) in self.own.items()}  # (s_u,) each
        # fp32 master weights of the owned shard only (mixed precision): its parameters upcast
        self.master = {u: ledger.alloc(f"master.{u}", xp.astype(full[u][a:b], dt.state), "master")
                       for u, (a, b) in self.own.items()} if dt.mixed else None  # (s_u,) each
        self.state = {u: {} for u in lay.units}
        if train.optimizer == "adamw":
            for u, (a, b) in self.own.items():
                for k in ("m", "v"):
                    self.state[u][k] = ledger.alloc(
                        f"optimizer.{k}.{u}", dt.zeros(full[ROOT], b - a, dt.state), "optimizer")  # (s_u,)
        self.gathered: dict = {}  # stage 3: unit -> its all-gathered flat buffer
        self.unit_grads: dict = {}  # stages 2, 3: unit -> its full gradient
        self.unit_lowp: dict = {}  # stages 2, 3 with --fp32-grads: unit -> its 16-bit gradient
        self.t = 0

    def unit_slice(self, unit: str, flat):
        a = self.layout.starts[unit]
        return flat[a:a + self.layout.sizes[unit]]  # (Ψ_u,)

    def begin_step(self) -> None:
        if self.stage == 1:
            self.grads[...] = 0.0
        else:
            for g in self.grad_shards.values():
                g[...] = 0.0

    # ------------------------------------------------------------------------------ parameters
    def gather(self, unit: str, phase: str) -> None:
        full = self.dp.all_gather(self.shards[unit], tag=f"{unit}:params:{phase}",
                                  counts=self.counts[unit])  # (Ψ_u,)
        self.gathered[unit] = self.ledger.alloc(f"params.gathered.{unit}", full, "params")

    def drop(self, unit: str) -> None:
        del self.gathered[unit]
        self.ledger.free(f"params.gathered.{unit}")

    def acquire(self, unit: str, phase: str):
        if self.stage < 3:
            return self.layout.views(unit, self.unit_slice(unit, self.params)), self.params
        if unit not in self.gathered:
            self.gather(unit, phase)
        return self.layout.views(unit, self.gathered[unit]), self.gathered[unit]

    def release(self, unit: str, phase: str) -> None:
        if self.stage == 3:
            self.drop(unit)

    # ------------------------------------------------------------------------------- gradients
    def fold(self, unit: str, grads: dict) -> None:
        self.ledger.alloc("grads.piece", sum(nbytes_of(g) for g in grads.values()), "grads")
        lowp = None
        if self.stage == 1:
            target = self.unit_slice(unit, self.grads)
            if self.lowp is not None:
                lowp = self.unit_slice(unit, self.lowp)
        else:
            size = self.layout.sizes[unit]
            if unit not in self.unit_grads:
                self.unit_grads[unit] = self.ledger.alloc(
                    f"grads.unit.{unit}", self.zeros(size), "grads")  # (Ψ_u,)
                if self.dtypes.wide:  # the 16-bit .grad lives from this backward to the reduce-scatter
                    self.unit_lowp[unit] = self.ledger.alloc(
                        f"grads.lowp.{unit}", self.zeros(size, self.dtypes.param), "grads")  # (Ψ_u,)
            target, lowp = self.unit_grads[unit], self.unit_lowp.get(unit)
        fold_grads(self.layout.views(unit, target), grads,
                   None if lowp is None else self.layout.views(unit, lowp))
        self.ledger.free("grads.piece")

    def unit_done(self, unit: str, last: bool) -> None:
        a, b = self.own[unit]
        if self.stage == 1:
            if last:
                full = self.unit_slice(unit, self.grads)
                shard = self.ledger.alloc("comm.grad_shard", self.dp.reduce_scatter(
                    full, tag=f"{unit}:grads"), "comm")  # (s_u,)
                full[a:b] = shard
                self.ledger.free("comm.grad_shard")
            return
        shard = self.ledger.alloc("comm.grad_shard", self.dp.reduce_scatter(
            self.unit_grads.pop(unit), tag=f"{unit}:grads"), "comm")  # (s_u,)
        self.ledger.free(f"grads.unit.{unit}")
        if self.unit_lowp.pop(unit, None) is not None:
            self.ledger.free(f"grads.lowp.{unit}")
        self.grad_shards[unit] += shard
        self.ledger.free("comm.grad_shard")

    # ------------------------------------------------------------------------------- optimizer
    def grad_shard(self, unit: str):
        """This rank's reduced gradient shard of `unit`, (s_u,)."""
        a, b = self.own[unit]
        return self.unit_slice(unit, self.grads)[a:b] if self.stage == 1 else self.grad_shards[unit]

    def optimizer_step(self) -> None:
        if overflowed(self, [self.grad_shard(u) for u in self.own], agree=True):
            return  # fp16: every rank skips the step (and the all-gather: no parameter changed)
        self.t += 1
        for u, (a, b) in self.own.items():
            if self.stage < 3:
                p = self.unit_slice(u, self.params)[a:b]
            else:
                p = self.shards[u]
            master = None if self.master is None else self.master[u]
            optimizer_update(self, u, p, self.grad_shard(u), self.state[u], a, master)
        if self.stage < 3:
            for u, (a, b) in self.own.items():
                full = self.unit_slice(u, self.params)
                gathered = self.ledger.alloc("comm.params", self.dp.all_gather(
                    full[a:b], tag=f"{u}:params:step", counts=self.counts[u]), "comm")  # (Ψ_u,)
                full[...] = gathered
                self.ledger.free("comm.params")

    def full_params(self) -> dict:
        """Every parameter, whole (stage 3 gathers each unit: call outside the traced steps)."""
        out = {}
        for u in self.layout.units:
            if self.stage < 3:
                flat = self.unit_slice(u, self.params)
            else:
                flat = self.dp.all_gather(self.shards[u], tag=f"{u}:params:check",
                                          counts=self.counts[u])
            out.update({n: np.array(backend.to_host(v)) for n, v in self.layout.views(u, flat).items()})
        return out
