"""Each rank's partition of a set of named tensors, as runs of their flattened elements, so that two
frameworks' partitions of different layouts can be reassembled and compared element by element.

A partition is {name: (lo, values)}: this rank holds elements [lo, lo + len(values)) of `name`
flattened row-major (one contiguous run per name: every layout compared here cuts each tensor at
most once per rank).
"""

from __future__ import annotations

import numpy as np


def of_flat(names: list[str], sizes: list[int], starts: list[int], a: int, b: int, piece) -> dict:
    """The runs of a flat buffer's piece [a, b) (`piece`, (b - a,)) in which tensor i occupies
    [starts[i], starts[i] + sizes[i]); padding between or after the tensors belongs to none."""
    piece = np.array(piece)  # a copy: a framework's buffer changes under a view at its next step
    out = {}
    for name, n, s in zip(names, sizes, starts, strict=True):
        lo, hi = max(a, s), min(b, s + n)
        if lo < hi:
            out[name] = (lo - s, piece[lo - a:hi - a])
    return out


def whole(every: list[dict], shapes: dict) -> dict:
    """{name: the tensor} from every rank's partition; every element must be held exactly once."""
    flat = {n: np.full(int(np.prod(s)), np.nan) for n, s in shapes.items()}
    count = {n: np.zeros(f.size, int) for n, f in flat.items()}
    for part in every:
        for name, (lo, values) in part.items():
            flat[name][lo:lo + len(values)] = values
            count[name][lo:lo + len(values)] += 1
    for name, c in count.items():
        if not np.all(c == 1):
            raise ValueError(f"{name}: {int(np.sum(c == 0))} elements held by no rank, "
                             f"{int(np.sum(c > 1))} by several")
    return {n: f.reshape(shapes[n]) for n, f in flat.items()}


def diff(part: dict, full: dict) -> tuple[float, str]:
    """(largest max |piece - same elements of full| / max |full tensor|, its name) over `part`:
    scaled by the whole tensor, so that a piece of near-zero entries (a key bias's, whose true
    gradient is 0) is not blown up by its own tiny scale."""
    best, worst_name = 0.0, next(iter(part), "")
    for name, (lo, values) in part.items():
        want = np.asarray(full[name], np.float64).ravel()
        scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
        d = float(np.max(np.abs(np.asarray(values, np.float64) - want[lo:lo + len(values)]))) / scale
        if d > best or not best:
            best, worst_name = d, name
    return best, worst_name
