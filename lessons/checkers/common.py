"""What every checker of lessons/checkers/ and lessons/checks.py shares: `Wrong`, the sentence a
learner is told, and `close`, float64 arrays compared to the contract with the first miss located."""

from __future__ import annotations

import numpy as np

# A learner's answer sums in its own order (on ranks, in its collective's order) and refpar's in
# another: float64 against one device, relative 1e-10 (DESIGN.md, "Numerics").
CONTRACT = 1e-10


class Wrong(Exception):
    """What is wrong with the learner's answer, in one or two plain sentences."""


def close(got, want, what: str, where=None) -> None:
    """got within CONTRACT of want, relative to want's largest entry or to 1 if that is smaller:
    the checks' numbers are O(1), and a sum that cancels to near 0 has no relative accuracy. A miss
    names how many elements differ and the first of them; `where(index)` adds what that index is to
    the learner (the ring's chunk, the query's row)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise Wrong(f"{what} has shape {got.shape}, it should be {want.shape}")
    bound = CONTRACT * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    # NaN compares as off; an infinity matches only the same infinity (a fully masked row's -inf lse)
    same = (got == want) | (np.abs(got - want) <= bound)
    if same.all():
        return
    bad = np.argwhere(~same)  # (k, ndim), in C order: the first is the lowest index
    first = tuple(int(i) for i in bad[0])
    index = first[0] if len(first) == 1 else first
    diff = np.abs(got - want)[~same]
    off = "not a number" if np.isnan(diff).any() else f"off by up to {float(np.max(diff)):.3g}"
    raise Wrong(f"{what} is {off} at {len(bad)} of {got.size} elements; the first is "
                f"[{', '.join(map(str, first))}]{' (' + where(index) + ')' if where else ''}: "
                f"{got[first]:.6g} where the right answer is {want[first]:.6g}")
