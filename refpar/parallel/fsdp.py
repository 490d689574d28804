"""FSDP (Zhao et al. 2023): ZeRO-3 organised by units, as PyTorch's fully_shard does it.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --fsdp --check

Legend: Ψ_root the root unit (wte, wpe, ln_f), Ψ_b one block's unit, L blocks, N ranks.

The parameters, gradients and optimizer state of every unit are sharded exactly as in ZeRO-3
(refpar/parallel/zero.py: one flat buffer per unit split with `shard_range`, a reduce-scatter of
the unit's gradient after its backward). What FSDP adds is a policy for *when* a unit is gathered:

- The root is gathered once per micro-batch, before the embedding, and kept until the tied head's
  backward is done: PyTorch does not reshard the root after forward because its backward follows
  at once. (ZeRO-3 gathers it twice: for the embedding and again for the head.)
- reshard_after_forward=True: a block is freed after its forward and gathered again for its
  backward (2 all-gathers per block); False: it stays gathered until its backward (1 all-gather,
  but at the head all L blocks are held, as much as DP).
- prefetch=True: when a unit is acquired, the all-gather of the next unit in execution order is
  started as a written-out ring (refpar/parallel/ring.py): its first round is in flight while this
  unit computes, the rest completes when the next unit is acquired. Two blocks are held at a
  time, and the trace shows the next block's messages spanning this block's compute.
"""

from __future__ import annotations

import numpy as np

from refpar.analysis.memory import ROOT
from refpar.parallel.ring import Ring
from refpar.parallel.zero import Zero


class FSDP(Zero):
    def __init__(self, config, train, dp, ledger, params: dict, prefetch: bool = False,
                 reshard_after_forward: bool = True):
        super().__init__(config, train, dp, ledger, params, stage=3)
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.pending: dict[str, Ring] = {}  # unit -> its all-gather still in flight
        L = config.n_layer
        # Every piece that reads parameters, in execution order; the embedding's backward reads
        # none (refpar/parallel/units.py), so the order ends with block 0's backward.
        self.uses = ([(ROOT, "embed:fwd")] + [(f"h.{i}", "fwd") for i in range(L)] + [(ROOT, "head")]
                     + [(f"h.{i}", "bwd") for i in reversed(range(L))])

    def acquire(self, unit: str, phase: str):
        if unit in self.pending:
            self.pending.pop(unit).finish()
        if unit not in self.gathered:
            self.gather(unit, phase)
        if self.prefetch:
            k = self.uses.index((unit, phase))
            if k + 1 < len(self.uses):
                nxt, nxt_phase = self.uses[k + 1]
                if nxt not in self.gathered:
                    self.start_gather(nxt, nxt_phase)
        return self.layout.views(unit, self.gathered[unit]), self.gathered[unit]

    def start_gather(self, unit: str, phase: str) -> None:
        """Allocates the unit's full buffer with this rank's shard in place and posts the ring's
        first round; `acquire` completes it."""
        a, b = self.own[unit]
        full = np.empty(self.layout.sizes[unit], self.shards[unit].dtype)  # (Ψ_u,)
        full[a:b] = self.shards[unit]
        self.gathered[unit] = self.ledger.alloc(f"params.gathered.{unit}", full, "params")
        ring = Ring(self.dp, full, f"{unit}:params:{phase}", self.ledger, reduce=False)
        if not ring.done:
            self.pending[unit] = ring

    def release(self, unit: str, phase: str) -> None:
        if unit == ROOT:
            if phase == "head":
                self.drop(unit)
        elif phase == "bwd" or self.reshard_after_forward:
            self.drop(unit)
