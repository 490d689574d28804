"""Collectives written out over point-to-point messages, as the textbooks draw them.

Legend: p = group size, r = this rank, n = elements, chunk i = `shard_range(n, p, i)` (the first
n % p chunks one element longer). Each function takes a `link` with `rank`, `size` and
`sendrecv(sendbuf, dest, recvbuf, source)` (either side may be None) over contiguous NumPy
buffers; the Communicator's link counts every byte it moves, so what these functions send is
exactly what the trace records and what `refpar.comm.cost` predicts.

Memory traffic: every function allocates its output once and nothing else it can avoid; sends
go straight from the input or the output, receives land where their data ends up (never in a
temporary to be copied on), and reductions run in place (`ufunc(..., out=)`). Each docstring
counts, per element of the full tensor n, what one rank moves over the link and how many
reductions (two reads, one write) and copies it does: the algorithm's own memory traffic, which
benchmarks/collectives.py compares with the machine's memcpy bandwidth.

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


def ring_round(p: int, r: int, k: int) -> tuple[int, int, bool]:
    """Round k of a ring all-reduce on p ranks, seen from rank r: (the chunk it sends to its right
    neighbour r+1, the chunk it receives from its left neighbour r-1, whether it adds its own copy
    of that chunk to what arrives). Rounds 0..p-2 reduce-scatter: send chunk (r-k-1), receive chunk
    (r-k-2) and add, so after them rank r holds chunk r reduced over all ranks. Rounds p-1..2p-3
    all-gather (j = k-p+1): send chunk (r-j), store chunk (r-j-1). An all-gather alone is these
    last p-1 rounds, starting from chunk r. Every ring in refpar follows this order: the blocking
    ones below and parallel/ring.py's, which overlaps its rounds with computation."""
    if k < p - 1:
        return (r - k - 1) % p, (r - k - 2) % p, True
    j = k - (p - 1)
    return (r - j) % p, (r - j - 1) % p, False


def ring_reduce_steps(link, x: np.ndarray, bounds, ufunc, landing) -> None:
    """The p - 1 steps of a ring reduce-scatter of the flat `x` (p >= 2), ending with the reduction
    over all ranks of chunk r in `landing(p - 2, r)`.

    In step k (`ring_round`) rank r sends chunk (r - k - 1) mod p of its partial sums to its right
    neighbour and receives chunk i = (r - k - 2) mod p from its left neighbour into `landing(k, i)`
    (a buffer of chunk i's length, never the one being sent), adds its own chunk i of `x` there in
    place and forwards it in step k + 1. Step 0 sends straight from `x`. Every sum is ufunc(own, received).
    Per element: (p-1)/p sent, (p-1)/p received, (p-1)/p reductions, no copy.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    sending = x[slice(*bounds[ring_round(p, r, 0)[0]])]  # step 0 sends our own chunk r-1, not yet reduced
    for k in range(p - 1):
        _, i, _ = ring_round(p, r, k)
        into = landing(k, i)
        link.sendrecv(sending, right, into, left)
        ufunc(x[slice(*bounds[i])], into, out=into)  # our own chunk i added to the partial sum
        sending = into


def ring_all_gather_inplace(link, buf: np.ndarray, bounds) -> None:
    """Chunk r of the flat `buf` is this rank's; after the call every chunk is everyone's.

    The all-gather rounds of `ring_round`: in step k rank r sends chunk (r - k) mod p to its right
    neighbour and receives chunk (r - k - 1) mod p from its left neighbour straight into place.
    Per element: (p-1)/p sent, (p-1)/p received, no reduction, no copy.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    for k in range(p - 1, 2 * (p - 1)):
        send, recv, _ = ring_round(p, r, k)
        link.sendrecv(buf[slice(*bounds[send])], right, buf[slice(*bounds[recv])], left)


def ring_all_reduce(link, x: np.ndarray, ufunc) -> np.ndarray:
    """Ring all-reduce = ring reduce-scatter, then ring all-gather of the reduced chunks, both in
    the output: each chunk's partial sums land at their own place in it, which the all-gather then
    overwrites with the finished chunk. Per element: 2(p-1)/p sent, 2(p-1)/p received (the
    bandwidth optimum), (p-1)/p reductions, no copy (p = 1: one copy)."""
    flat = x.reshape(-1)  # (n,) a view; x stays untouched
    out = np.empty_like(flat)  # (n,) the only allocation
    if link.size == 1:
        np.copyto(out, flat)
        return out.reshape(x.shape)
    bounds = chunk_bounds(flat.size, link.size)
    ring_reduce_steps(link, flat, bounds, ufunc, lambda k, i: out[slice(*bounds[i])])
    ring_all_gather_inplace(link, out, bounds)
    return out.reshape(x.shape)


def ring_reduce_scatter(link, x: np.ndarray, ufunc) -> np.ndarray:
    """x (n, ...) on every rank -> rows shard_range(n, p, r) of the reduction, shape (n_r, ...).

    The last step's chunk lands in the output; the p - 2 steps before it in two spare buffers of
    one chunk, in turn (none for p = 2). Per element: (p-1)/p sent, (p-1)/p received, (p-1)/p
    reductions, no copy (p = 1: one copy); memory 2n/p beyond the output for p > 2."""
    p, r = link.size, link.rank
    unit = int(np.prod(x.shape[1:], dtype=np.int64))
    flat = x.reshape(-1)  # (n * unit,) a view; x stays untouched
    bounds = chunk_bounds(x.shape[0], p, unit)
    a, b = bounds[r]
    out = np.empty(((b - a) // unit if unit else 0, *x.shape[1:]), dtype=x.dtype)  # (n_r, ...)
    mine = out.reshape(-1)  # (n_r * unit,)
    if p == 1:
        np.copyto(mine, flat)
        return out
    longest = max(hi - lo for lo, hi in bounds)
    spare = [np.empty(longest, dtype=x.dtype) for _ in range(min(2, p - 2))]  # (longest,) each

    def landing(k: int, i: int) -> np.ndarray:
        lo, hi = bounds[i]
        return mine if k == p - 2 else spare[k % 2][: hi - lo]

    ring_reduce_steps(link, flat, bounds, ufunc, landing)
    return out


def ring_all_gather(link, x: np.ndarray, counts: list[int]) -> np.ndarray:
    """x (counts[r], ...) on rank r -> all pieces concatenated along axis 0, (sum(counts), ...).
    Per element of the output (even pieces): (p-1)/p sent, (p-1)/p received, 1/p copied (the own
    piece into place)."""
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
    Per element that rank r sends (even chunks): (p-1)/p sent, (p-1)/p received, 1/p copied.
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
    Per element: 1 received (not the root), 1 sent per child: up to ceil(log2 p) at the root.
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
    root sends about 2n whatever p is (a tree root sends n log2 p). Per element: 1 received (not
    the root: 1/p scattered, (p-1)/p gathered), 2(p-1)/p sent by the root, (p-1)/p by the others."""
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
