"""FSDP (Zhao et al. 2023): ZeRO-3 organised by units, as PyTorch's fully_shard does it.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --fsdp --check
    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --fsdp --prefetch --microbatches 2 --check

Legend: Ψ_root the ends' units (wte and the root: wpe, ln_f), Ψ_b one block's unit, N ranks.

The parameters, gradients and optimizer state of every unit are sharded exactly as in ZeRO-3
(refpar/parallel/zero.py: one flat buffer per unit split with `shard_range`, a reduce-scatter of
the unit's gradient once its backward is done). What FSDP adds is a policy for *when* a unit is
gathered, the same in every pipeline stage:

- On a stage that holds both the embedding and the head, the ends' units are gathered once per
  microbatch, before the embedding, and kept until the tied head's backward is done: PyTorch does
  not reshard the root after forward because its backward follows at once. (ZeRO-3 gathers them
  twice: for the embedding and again for the head.) Elsewhere they are gathered as in ZeRO-3.
- reshard_after_forward=True: a block is freed after its forward and gathered again for its
  backward (2 all-gathers per block); False: it stays gathered until its backward (1 all-gather,
  but a stage holds its blocks' parameters while the microbatch is in flight, as much as DP).
- prefetch=True: when a piece acquires its units, the all-gather of the next block of the same
  action (the stage's forward, or its backward) is started as a written-out ring (refpar/parallel/
  ring.py): its first round is in flight while this piece computes, the rest completes when that
  block is acquired. Two blocks are held at a time, and the trace shows the next block's messages
  spanning this block's compute. The first block of an action that no piece precedes is gathered
  at once.
"""

from __future__ import annotations

from refpar import backend
from refpar.holdings import ENDS
from refpar.parallel.ring import Ring
from refpar.parallel.zero import Zero3


class FSDP(Zero3):
    """ZeRO-3 with FSDP's policy of when a unit is gathered (module docstring)."""

    def __init__(self, units, config, train, ledger, params: dict, composition=None,
                 prefetch: bool = False, reshard_after_forward: bool = True, both_ends: bool = False,
                 lowp: bool = True):
        super().__init__(units, config, train, ledger, params, composition, lowp)
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.both_ends = both_ends  # a stage of this rank holds the embedding and the head
        self.pending: dict[str, Ring] = {}  # unit -> its all-gather still in flight

    def holds(self, unit: str, phase: str) -> bool:
        if unit in ENDS:
            return phase == "head:fwd" or (phase == "embed:fwd" and self.both_ends)
        return phase == "fwd" and not self.reshard_after_forward

    def acquire(self, keys, phase: str, hold=None, following=()):
        for k in keys:
            if k in self.pending:
                self.pending.pop(k).finish()
        out = super().acquire(keys, phase, hold)
        if self.prefetch:
            for k in following:
                if k not in ENDS and k not in self.gathered:
                    self.start_gather(k, phase)
        return out

    def start_gather(self, unit: str, phase: str) -> None:
        """Allocates the unit's full buffer with this rank's shard in place and posts the ring's
        first round; `acquire` completes it."""
        a, b = self.units.owned[unit]
        full = backend.zeros(self.shards[unit], self.units.size[unit], backend.host_dtype(self.shards[unit]))
        full[a:b] = self.shards[unit]  # (Ψ_u,)
        self.gathered[unit] = self.ledger.alloc(f"params.gathered.{unit}", full, "params")
        ring = Ring(self.units.group[unit], full, f"{unit}:params:{phase}", self.ledger, reduce=False)
        if not ring.done:
            self.pending[unit] = ring
