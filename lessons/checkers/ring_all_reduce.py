"""`refpar lesson check 1`: lesson 1's checker, the learner's ring against one device's sum, and its bytes
against lesson 1's 2 (p-1) chunks."""

from __future__ import annotations

import numpy as np

from lessons.checkers.common import Wrong, allgather, close
from refpar.sharding import shard_range


def check_01(mod, comm) -> str:
    from refpar.comm.communicator import _Link

    p, r = comm.size, comm.rank
    for n in (p * 5, p * 5 + 3, 1):
        x = np.random.default_rng([n, r]).standard_normal(n)  # (n,) a different vector per rank
        before = x.copy()
        link = _Link(comm)
        got = mod.ring_all_reduce(link, x)
        want = comm.all_reduce(before)
        problem = None
        try:
            _one_ring_result(x, before, got, want, link, n, p, r)
        except Wrong as err:
            problem = str(err)
        problems = [m for m in allgather(comm, problem) if m]  # all ranks stop together
        if problems:
            raise Wrong(problems[0])
    return (f"ring_all_reduce sums exactly like MPI on {p} ranks and each rank sends 2(p-1) chunks, "
            "2(n - n/p) elements")


def chunk_of(i: int, n: int, p: int) -> str:
    """Which of the ring's p chunks element i of n is in (the exercise's `chunks`: shard_range's)."""
    c = next(c for c in range(p) if shard_range(n, p, c)[0] <= i < shard_range(n, p, c)[1])
    a, b = shard_range(n, p, c)
    return f"in chunk {c} of {p}, elements {a}..{b - 1}"


def _one_ring_result(x, before, got, want, link, n, p, r) -> None:
    from refpar.comm import cost

    if not np.array_equal(x, before):
        raise Wrong("ring_all_reduce changed its input x; work on a copy")
    close(got, want, f"rank {r}'s sum of {n} elements", lambda i: chunk_of(i, n, p))
    expect = cost.all_reduce_bytes(n, p, r, 8, "ring").sent
    if link.sent != expect:
        raise Wrong(f"rank {r} sent {link.sent} bytes for n={n} float64 elements on {p} ranks; a "
                        f"ring all-reduce sends 2 (p-1) chunks, {expect} bytes here: reduce-scatter "
                        "p-1 chunks, then all-gather p-1 chunks")
