"""Lesson 8, reference solution: where a rank sits on a pp x dp x tp mesh, and who its group is."""

AXES = ("pp", "dp", "tp")  # slowest to fastest


def coords(rank: int, sizes: dict) -> dict:
    """rank, {"pp": P, "dp": D, "tp": T} -> {"pp": i, "dp": j, "tp": k}, this rank's coordinates."""
    out = {}
    for axis in reversed(AXES):  # peel off the fastest axis first
        rank, out[axis] = divmod(rank, sizes[axis])
    return {axis: out[axis] for axis in AXES}


def group(rank: int, axis: str, sizes: dict) -> list[int]:
    """The world ranks that differ from `rank` only in their `axis` coordinate, in axis order."""
    stride = 1
    for a in reversed(AXES[AXES.index(axis) + 1:]):
        stride *= sizes[a]  # ranks one step apart on `axis` are `stride` apart in the world
    first = rank - coords(rank, sizes)[axis] * stride
    return [first + i * stride for i in range(sizes[axis])]
