"""Lesson 11, reference solution: where a rank sits on a pp x dp x tp mesh, and its groups."""

AXES = ("pp", "dp", "tp")  # slowest to fastest


def coords(rank: int, sizes: dict) -> dict:
    """rank, {"pp": P, "dp": D, "tp": T} -> {"pp": i, "dp": j, "tp": k}, this rank's coordinates."""
    out = {}
    for axis in reversed(AXES):  # peel off the fastest axis first
        rank, out[axis] = divmod(rank, sizes[axis])
    return {axis: out[axis] for axis in AXES}


def mesh_groups(world, sizes: dict) -> dict:
    """world: refpar's Communicator over every rank -> {"pp": ..., "dp": ..., "tp": ...}, the
    Communicator of this rank's group along each axis (refpar/mesh.py's DeviceMesh is refpar's own)."""
    mine = coords(world.rank, sizes)
    groups = {}
    for i, axis in enumerate(AXES):  # the same order on every rank: Comm_split is collective over world
        stride = 1
        for faster in AXES[i + 1:]:
            stride *= sizes[faster]  # ranks one step apart on `axis` are `stride` apart in the world
        first = world.rank - mine[axis] * stride  # the group's rank with coordinate 0: one color per group
        groups[axis] = world.split(first, key=mine[axis], axis=axis)
    return groups
