"""Collectives written out over point-to-point messages, as the textbooks draw them.

Legend: p = group size, r = this rank, n = elements, chunk i = `shard_range(n, p, i)` (the first
n % p chunks one element longer). Each function takes a `link` with `rank`, `size` and
`sendrecv(sendbuf, dest, recvbuf, source)` (either side may be None) over contiguous NumPy
buffers; the Communicator's link counts every byte it moves, so what these functions send is
exactly what the trace records and what `refpar.comm.cost` predicts.

Buffers are allocated once per call and every step works on views (`np.add(..., out=)`), so the
ring all-reduce keeps up with MPI's own (benchmarks/collectives.py).

References: ring reduce-scatter / all-gather / all-reduce: Patarasuk & Yuan 2009 and Thakur,
Rabenseifner & Gropp 2005 ("Optimization of Collective Communication Operations in MPICH");
binomial-tree and scatter + all-gather broadcast: the same paper, section 4 (van de Geijn).
"""

from __future__ import annotations

import numpy as np

from refpar.sharding import shard_range


def chunk_bounds(n: int, p: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each rank's chunk of n items of `unit` elements each, in elements."""
    return [(start * unit, stop * unit) for start, stop in (shard_range(n, p, i) for i in range(p))]


def ring_reduce_scatter_inplace(link, buf: np.ndarray, bounds, ufunc) -> None:
    """After the call chunk r of the flat `buf` holds the reduction over all ranks of chunk r.

    p - 1 steps; in step k rank r sends chunk (r - k - 1) mod p to its right neighbour and adds
    the chunk (r - k - 2) mod p arriving from its left neighbour into its own copy, which it
    forwards in step k + 1. In the last step chunk r arrives, summed over the other p - 1 ranks.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    tmp = np.empty(max(b - a for a, b in bounds), dtype=buf.dtype)  # one receive buffer for all steps
    for k in range(p - 1):
        s0, s1 = bounds[(r - k - 1) % p]  # step k: send chunk (r-k-1) mod p to the right neighbour,
        r0, r1 = bounds[(r - k - 2) % p]  # receive chunk (r-k-2) mod p from the left one
        link.sendrecv(buf[s0:s1], right, tmp[: r1 - r0], left)
        ufunc(buf[r0:r1], tmp[: r1 - r0], out=buf[r0:r1])  # and add it into our copy, in place


def ring_all_gather_inplace(link, buf: np.ndarray, bounds) -> None:
    """Chunk r of the flat `buf` is this rank's; after the call every chunk is everyone's.

    p - 1 steps; in step k rank r sends chunk (r - k) mod p to its right neighbour and receives
    chunk (r - k - 1) mod p from its left neighbour straight into place.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    for k in range(p - 1):
        s0, s1 = bounds[(r - k) % p]  # step k: send chunk (r-k) mod p to the right neighbour,
        r0, r1 = bounds[(r - k - 1) % p]  # receive chunk (r-k-1) mod p from the left one, in place
        link.sendrecv(buf[s0:s1], right, buf[r0:r1], left)


def ring_all_reduce(link, x: np.ndarray, ufunc) -> np.ndarray:
    """Ring all-reduce = ring reduce-scatter, then ring all-gather of the reduced chunks: each
    rank sends 2 (n - n/p) elements, the bandwidth optimum."""
    buf = x.reshape(-1).copy()  # (n,) the output, reduced in place; x stays untouched
    bounds = chunk_bounds(buf.size, link.size)
    ring_reduce_scatter_inplace(link, buf, bounds, ufunc)
    ring_all_gather_inplace(link, buf, bounds)
    return buf.reshape(x.shape)


def ring_reduce_scatter(link, x: np.ndarray, ufunc) -> np.ndarray:
    """x (n, ...) on every rank -> rows shard_range(n, p, r) of the reduction, shape (n_r, ...)."""
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    buf = x.reshape(-1).copy()  # (n * unit,) reduced in place chunk by chunk
    bounds = chunk_bounds(x.shape[0], link.size, unit)
    ring_reduce_scatter_inplace(link, buf, bounds, ufunc)
    a, b = bounds[link.rank]
    return buf[a:b].reshape((b - a) // unit if unit else 0, *x.shape[1:]).copy()


def ring_all_gather(link, x: np.ndarray, counts: list[int]) -> np.ndarray:
    """x (counts[r], ...) on rank r -> all pieces concatenated along axis 0, (sum(counts), ...)."""
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((sum(counts), *x.shape[1:]), dtype=x.dtype)  # (N, ...)
    flat = out.reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(counts)]) * unit
    bounds = [(int(offsets[i]), int(offsets[i + 1])) for i in range(link.size)]
    a, b = bounds[link.rank]
    flat[a:b] = x.reshape(-1)
    ring_all_gather_inplace(link, flat, bounds)
    return out


def pairwise_all_to_all(link, chunks: list[np.ndarray], received: list[np.ndarray]) -> None:
    """chunks[j] goes to rank j; `received[i]` (preallocated) is filled with rank i's chunk for r.

    p - 1 steps; in step k rank r sends to (r + k) mod p and receives from (r - k) mod p, so every
    pair meets exactly once and no rank waits on two partners at a time. Its own chunk is a copy.
    """
    p, r = link.size, link.rank
    received[r][...] = chunks[r]
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p  # step k: send to r+k, receive from r-k
        link.sendrecv(chunks[dest], dest, received[source], source)


def tree_broadcast(link, buf: np.ndarray, root: int) -> None:
    """Binomial tree: the root's `buf` reaches every rank in ceil(log2 p) rounds.

    With v = (r - root) mod p, rank v receives from v - 2^j where 2^j is v's lowest set bit, then
    forwards to v + 2^i for every 2^i below that bit (largest first), so the number of ranks that
    hold the data doubles each round.
    """
    p = link.size
    v = (link.rank - root) % p
    mask = 1
    while mask < p:  # receive from the parent: clear the lowest set bit of v
        if v & mask:
            link.sendrecv(None, None, buf, (v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # send to the children: set each lower bit in turn, largest first
        if v + mask < p:
            link.sendrecv(buf, (v + mask + root) % p, None, None)
        mask >>= 1


def scatter_allgather_broadcast(link, buf: np.ndarray, root: int) -> None:
    """van de Geijn's broadcast for long messages: the root scatters chunk i of the flat `buf` to
    rank i, then a ring all-gather completes it everywhere; each rank receives n elements, the
    root sends about 2n whatever p is (a tree root sends n log2 p)."""
    p, r = link.size, link.rank
    flat = buf.reshape(-1)
    bounds = chunk_bounds(flat.size, p)
    if r == root:  # scatter: one message to each other rank
        for i in range(p):
            if i != root:
                a, b = bounds[i]
                link.sendrecv(flat[a:b], i, None, None)
    else:
        a, b = bounds[r]
        link.sendrecv(None, None, flat[a:b], root)
    ring_all_gather_inplace(link, flat, bounds)
