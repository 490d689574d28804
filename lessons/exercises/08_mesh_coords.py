"""Lesson 8 exercise: where a rank sits on a pp x dp x tp mesh, and who its group is.

    refpar lesson check 8

refpar (like Megatron-LM) lays ranks out as arange(world).reshape(pp, dp, tp): tp varies fastest
(the ranks of a tp group are neighbours, one node's GPUs), pp slowest.
"""


def coords(rank: int, sizes: dict) -> dict:
    """rank, {"pp": P, "dp": D, "tp": T} -> {"pp": i, "dp": j, "tp": k}, this rank's coordinates."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write coords(rank, sizes): tp fastest, then dp, pp slowest")
    # ---- end of your part -----------------------------------------------------------------------


def group(rank: int, axis: str, sizes: dict) -> list[int]:
    """The world ranks that differ from `rank` only in their `axis` coordinate, in axis order."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write group(rank, axis, sizes)")
    # ---- end of your part -----------------------------------------------------------------------
