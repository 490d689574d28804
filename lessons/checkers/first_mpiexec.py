"""`refpar lesson check 0`: lesson 0's checker, each rank's rows, checked on the ranks themselves."""

from __future__ import annotations

from lessons.checkers.common import Wrong, allgather
from refpar.sharding import shard_range


def check_00(mod, comm) -> str:
    for n in (10, 12, 3, 0):
        got = tuple(int(v) for v in mod.my_rows(n, comm.size, comm.rank))
        everyone = allgather(comm, got)  # every rank judges the same list, so all raise together
        stops = [0] + [b for _, b in everyone]
        if any(a != s for (a, _), s in zip(everyone, stops, strict=False)) or stops[-1] != n:
            raise Wrong(f"with n={n} rows on {comm.size} ranks the ranks got {everyone}: together "
                        f"they must cover rows 0..{n} once, in rank order, with no gap or overlap")
        sizes = [b - a for a, b in everyone]
        if max(sizes) - min(sizes) > 1 or sizes != sorted(sizes, reverse=True):
            raise Wrong(f"with n={n} rows on {comm.size} ranks the sizes are {sizes}: they should "
                        "differ by at most one, the extra rows going to the first ranks")
        for rank, rows in enumerate(everyone):
            if rows != shard_range(n, comm.size, rank):
                raise Wrong(f"rank {rank} got rows {rows} of n={n}, expected "
                            f"{shard_range(n, comm.size, rank)}")
    return f"my_rows splits rows evenly over {comm.size} ranks, the first ranks taking the extra ones"
