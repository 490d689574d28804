"""A rank's parameters as flat units: the layout DP, ZeRO and FSDP (data_parallel.py, zero.py,
fsdp.py) keep their model states in (refpar/parallel/model_states.py).

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --check

Legend: Ψ_u elements of unit u on this rank (of its tp shards), Ψl = Σ Ψ_u, s_u this rank's
`shard_range` share of u over the unit's group.

A unit (refpar/holdings.py: `wte`, `root`, `h.i`, `h.i.experts`) is one flat buffer of parameters.
Each has a replica group, the ranks holding the same weights, over which DP sums its gradient and
ZeRO shards it: the mesh's `dp_cp` group for a dense model's weights and a MoE model's experts, its
`data` group (dp x ep x cp) for a MoE model's dense weights. The rank lays its units end to end,
the dense group's first, each group's in stage order (`Units`): DP's buckets are runs of it.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar.holdings import expert_unit, rank_units, unit_order, units
from refpar.sharding import shard_range, shard_sizes


class Units:
    """This rank's units: `stages` maps each of its pipeline stages to the names it holds there,
    `shapes` every held parameter's (tp-shard) shape (in the family's order), `group_of(expert: bool)`
    the replica group of dense or expert units, `uses[s]` how many microbatches stage s runs,
    `tied` the model's holdings.tied_embedding (the `wte` unit; None: no unit is tied).
    `names[u]`, `size[u]` (Ψ_u), `group[u]`, `owned[u]` (the range [a, b) of u this rank owns),
    `counts[u]` (every group rank's s_u), `start[u]` (where u begins in the rank's flat buffer of
    Ψl), `backwards[u]` how many backward pieces complete u in a step (m; more where two stages
    hold it).

    A unit two stages of the rank hold is one: a V's rank 0 runs the embedding (stage 0) and the
    tied head (stage 2p-1), so its wte sums both ends' gradients, and its root is wpe and ln_f."""

    def __init__(self, stages: dict[int, list[str]], shapes: dict, group_of, uses: dict[int, int],
                 tied: str | None = "wte.weight"):
        self.shapes = shapes
        by_stage = {s: units(names, tied) for s, names in sorted(stages.items())}
        # in GPT-2's order inside a unit: DualPipe's mirror ranks hold a root of wpe and ln_f from
        # stages in the other order, and sum_copies adds their buffers element by element
        self.names = {u: [n for n in shapes if n in names] for u, names in rank_units(by_stage).items()}
        self.backwards = {u: sum(uses[s] for s, us in by_stage.items() if u in us) for u in self.names}
        self.of_stage = {s: list(us) for s, us in by_stage.items()}
        self.offsets: dict[str, tuple[str, int, int]] = {}  # name -> (unit, start, stop) in the unit
        self.size, self.start, self.group, self.owned, self.counts = {}, {}, {}, {}, {}
        total = 0
        for u, names in self.names.items():
            at = 0
            for n in names:
                self.offsets[n] = (u, at, at + int(np.prod(shapes[n])))
                at += int(np.prod(shapes[n]))
            self.size[u], self.start[u] = at, total
            total += at
            g = self.group[u] = group_of(expert_unit(u))
            self.owned[u], self.counts[u] = shard_range(at, g.size, g.rank), shard_sizes(at, g.size)
        self.total = total  # Ψl

    def sum_copies(self, copies, grads) -> None:
        """DualPipe's other copy: every unit's gradient (`grads(unit)`, whole or this rank's shard)
        summed over `copies`, the mirror rank holding the same parts, in one all-reduce. The two
        lay their units out in other orders (each its own stages first), so in GPT-2's order here."""
        order = sorted(self.names, key=unit_order)
        xp = array_namespace(grads(order[0]))
        summed = copies.all_reduce(xp.concat([grads(k) for k in order]), tag="copies:grads")  # (Σ,)
        at = 0
        for k in order:
            g = grads(k)
            g[...] = summed[at:at + g.shape[0]]
            at += g.shape[0]

    def of(self, names) -> list[str]:
        """The units the parameters `names` belong to, in layout order."""
        held = {self.offsets[n][0] for n in names}
        return [u for u in self.names if u in held]

    def flatten(self, unit: str, arrays: dict):
        xp = array_namespace(arrays[self.names[unit][0]])
        return xp.concat([xp.reshape(arrays[n], (-1,)) for n in self.names[unit]])  # (Ψ_u,)

    def slice(self, unit: str, flat):
        """The unit's (Ψ_u,) part of a (Ψl,) buffer laid out as the rank's units."""
        return flat[self.start[unit]:self.start[unit] + self.size[unit]]

    def views(self, unit: str, flat) -> dict:
        """The unit's parameters as reshaped views of its flat buffer (writes go through)."""
        xp = array_namespace(flat)
        return {n: xp.reshape(flat[a:b], self.shapes[n]) for n in self.names[unit]
                for _, a, b in [self.offsets[n]]}

    def segments(self, unit: str, start: int, stop: int):
        """(name, lo, hi) of every parameter overlapping [start, stop) of the unit, in unit
        coordinates: a flat shard is updated one parameter segment at a time so that weight decay
        follows each parameter's shape, as on one device."""
        for n in self.names[unit]:
            _, a, b = self.offsets[n]
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield n, lo, hi
