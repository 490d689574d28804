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
"""

from __future__ import annotations

import numpy as np

from refpar.analysis.memory import ROOT
from refpar.config import ConfigError
from refpar.parallel.units import FlatLayout, optimizer_update
from refpar.sharding import shard_sizes


class Zero:
    """ZeRO stage 1, 2 or 3 on one dp rank; the hooks of refpar.parallel.units.forward_backward."""

    def __init__(self, config, train, dp, ledger, params: dict, stage: int):
        if stage not in (1, 2, 3):
            raise ConfigError(f"--zero {stage} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3")
        self.config, self.train, self.dp, self.ledger, self.stage = config, train, dp, ledger, stage
        self.layout = lay = FlatLayout(config)
        self.own = {u: lay.shard(u, dp.size, dp.rank) for u in lay.units}  # [a, b) per unit
        self.counts = {u: shard_sizes(lay.sizes[u], dp.size) for u in lay.units}  # every rank's s_u
        full = {u: lay.flatten(u, params) for u in lay.units}  # drawn whole, then sliced
        if stage < 3:
            self.params = ledger.alloc("params.flat", np.concatenate(list(full.values())), "params")
        else:
            self.shards = {u: ledger.alloc(f"params.shard.{u}", full[u][a:b].copy(), "params")
                           for u, (a, b) in self.own.items()}  # (s_u,) each
        dtype = full[ROOT].dtype
        if stage == 1:
            self.grads = ledger.alloc("grads.flat", np.zeros(lay.total, dtype), "grads")  # (Ψ,)
        else:
            self.grad_shards = {u: ledger.alloc(f"grads.shard.{u}", np.zeros(b - a, dtype), "grads")
                                for u, (a, b) in self.own.items()}  # (s_u,) each
        self.state = {u: {} for u in lay.units}
        if train.optimizer == "adamw":
            for u, (a, b) in self.own.items():
                for k in ("m", "v"):
                    self.state[u][k] = ledger.alloc(f"optimizer.{k}.{u}", np.zeros(b - a, dtype),
                                                    "optimizer")  # (s_u,)
        self.gathered: dict[str, np.ndarray] = {}  # stage 3: unit -> its all-gathered flat buffer
        self.unit_grads: dict[str, np.ndarray] = {}  # stages 2, 3: unit -> its full gradient
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
        self.ledger.alloc("grads.piece", sum(int(g.nbytes) for g in grads.values()), "grads")
        if self.stage == 1:
            target = self.unit_slice(unit, self.grads)
        else:
            if unit not in self.unit_grads:
                self.unit_grads[unit] = self.ledger.alloc(
                    f"grads.unit.{unit}", np.zeros(self.layout.sizes[unit], self.grad_shards[unit].dtype),
                    "grads")  # (Ψ_u,)
            target = self.unit_grads[unit]
        views = self.layout.views(unit, target)
        for name, g in grads.items():
            views[name] += g
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
        self.grad_shards[unit] += shard
        self.ledger.free("comm.grad_shard")

    # ------------------------------------------------------------------------------- optimizer
    def optimizer_step(self) -> None:
        self.t += 1
        for u, (a, b) in self.own.items():
            if self.stage < 3:
                p = self.unit_slice(u, self.params)[a:b]
            else:
                p = self.shards[u]
            g = self.unit_slice(u, self.grads)[a:b] if self.stage == 1 else self.grad_shards[u]
            optimizer_update(self, u, p, g, self.state[u], a)
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
            out.update({n: v.copy() for n, v in self.layout.views(u, flat).items()})
        return out
