"""Lesson 11 exercise: where a rank sits on a pp x dp x tp mesh, and its groups, made with Comm_split.

    refpar lesson check 11                      # runs the checks on 4 ranks

refpar (like Megatron-LM) lays ranks out as arange(world).reshape(pp, dp, tp): tp varies fastest
(the ranks of a tp group are neighbours, one node's GPUs), pp slowest.
"""


def coords(rank: int, sizes: dict) -> dict:
    """rank, {"pp": P, "dp": D, "tp": T} -> {"pp": i, "dp": j, "tp": k}, this rank's coordinates."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write coords(rank, sizes): tp fastest, then dp, pp slowest")
    # ---- end of your part -----------------------------------------------------------------------


def mesh_groups(world, sizes: dict) -> dict:
    """world: refpar's Communicator over every rank -> {"pp": ..., "dp": ..., "tp": ...}, the
    Communicator of this rank's group along each axis: the ranks that differ from this one only in
    that coordinate, ranked in that axis's order. Make each with `world.split(color, key)` (MPI's
    Comm_split): ranks that pass the same color form one communicator, ranked by key."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write mesh_groups(world, sizes) with world.split(color, key)")
    # ---- end of your part -----------------------------------------------------------------------
