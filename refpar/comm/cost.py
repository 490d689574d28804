"""Closed forms: the bytes each rank sends and receives in each collective, and alpha-beta time.

Legend: p = group size, r = rank in the group, n = elements, c_i = size of chunk i
(`shard_sizes(n, p)`, uneven when p does not divide n), s_i = rank i's piece in an all-gather.
Byte counts are exact: the written-out algorithms in `algorithms.py` send exactly these, and a
native MPI call is traced with the bytes of the bandwidth-optimal algorithm named in
`NATIVE_ALGO` (MPICH's long-message algorithms, e.g. Rabenseifner's halving-doubling all-reduce,
move the same bytes when p is a power of two). A rank's copy of its own chunk costs nothing.

Time: Hockney's model, latency alpha per message step plus bytes / bandwidth, plus the reduction's
bytes / reduce_bandwidth for reducing ops (Thakur, Rabenseifner & Gropp 2005, section 3).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from refpar.config import ConfigError
from refpar.sharding import shard_sizes

# The written-out algorithms of each collective (refpar.comm.algorithms), selected with algo=.
ALGORITHMS = {
    "all_reduce": ("ring",),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "all_to_all": ("pairwise",),
    "broadcast": ("tree", "scatter_allgather"),
}

# The algorithm whose bytes a native call records: "native(ring)" in the trace.
NATIVE_ALGO = {
    "all_reduce": "ring",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "all_to_all": "pairwise",
    "broadcast": "scatter_allgather",
}


class Bytes(NamedTuple):
    """Bytes one rank puts on the wire and takes off it in one call. A named tuple, not a frozen
    dataclass: every traced call builds one, and a tuple is several times cheaper to build."""

    sent: int
    recv: int


def resolve_algo(op: str, algo: str) -> str:
    """The algorithm whose bytes `algo` moves in `op` (native -> NATIVE_ALGO[op]); ConfigError if none."""
    name = NATIVE_ALGO[op] if algo == "native" else algo
    if name not in ALGORITHMS[op]:
        choices = ", ".join(("native", *ALGORITHMS[op]))
        raise ConfigError(f"unknown algorithm {algo!r} for {op}; choose one of {choices}")
    return name


def add(totals: dict, key, moved, times: int = 1) -> None:
    """totals[key] += times x moved, as (sent, received): the running sums of traces and closed forms."""
    sent, recv = totals.get(key, (0, 0))
    totals[key] = (sent + times * moved[0], recv + times * moved[1])


def chunk(n: int, p: int, i: int) -> int:
    """c_i: the length of chunk i of n split p ways, as `shard_range` splits (the first n % p one
    longer), without building the list."""
    return n // p + (i < n % p)


def reduce_scatter_bytes(n: int, p: int, rank: int, itemsize: int, row_size: int = 1,
                         algo: str = "ring") -> Bytes:
    """n rows of row_size elements split by shard_range. Ring: rank r forwards every chunk but
    its own, (n - c_r) rows, and receives every chunk but its left neighbour's, (n - c_{r-1})."""
    resolve_algo("reduce_scatter", algo)
    unit = row_size * itemsize
    return Bytes((n - chunk(n, p, rank)) * unit, (n - chunk(n, p, (rank - 1) % p)) * unit)


def all_gather_bytes(counts: list[int], rank: int, itemsize: int, row_size: int = 1,
                     algo: str = "ring") -> Bytes:
    """counts[i] rows of row_size elements from rank i. Ring: rank r forwards every piece but its
    right neighbour's and receives every piece but its own."""
    resolve_algo("all_gather", algo)
    p, total = len(counts), sum(counts)
    unit = row_size * itemsize
    return Bytes((total - counts[(rank + 1) % p]) * unit, (total - counts[rank]) * unit)


def all_reduce_bytes(n: int, p: int, rank: int, itemsize: int, algo: str = "ring") -> Bytes:
    """Ring = reduce-scatter of the n elements in chunks c_i, then all-gather of the same chunks:
    sent 2n - c_r - c_{r+1}, received 2n - c_{r-1} - c_r (2 (n - n/p) when p divides n)."""
    resolve_algo("all_reduce", algo)
    left, own, right = chunk(n, p, (rank - 1) % p), chunk(n, p, rank), chunk(n, p, (rank + 1) % p)
    return Bytes((2 * n - own - right) * itemsize, (2 * n - left - own) * itemsize)


def all_to_all_bytes(send_counts: list[int], recv_counts: list[int], rank: int, itemsize: int,
                     algo: str = "pairwise") -> Bytes:
    """Elements this rank sends to / receives from each rank; the chunk to itself stays home."""
    resolve_algo("all_to_all", algo)
    return Bytes((sum(send_counts) - send_counts[rank]) * itemsize,
                 (sum(recv_counts) - recv_counts[rank]) * itemsize)


def tree_children(p: int, rank: int, root: int = 0) -> int:
    """How many ranks rank r sends to in a binomial-tree broadcast: with v = (r - root) mod p,
    one child v + 2^i for each 2^i below v's lowest set bit (below p for the root) with v + 2^i < p."""
    v = (rank - root) % p
    limit = v & -v if v else p
    count, mask = 0, 1
    while mask < limit:
        count += v + mask < p
        mask <<= 1
    return count


def broadcast_bytes(n: int, p: int, rank: int, root: int, itemsize: int,
                    algo: str = "scatter_allgather") -> Bytes:
    """tree: every rank but the root receives n once and sends n to each child.
    scatter_allgather: the root sends chunk i to each rank i, then a ring all-gather of the chunks:
    the root sends 2n - c_root - c_{root+1}; another rank receives n and sends n - c_{r+1}."""
    name = resolve_algo("broadcast", algo)
    if name == "tree":
        return Bytes(tree_children(p, rank, root) * n * itemsize, (0 if rank == root else n) * itemsize)
    ag = all_gather_bytes(shard_sizes(n, p), rank, itemsize)
    if rank == root:
        return Bytes((n - chunk(n, p, root)) * itemsize + ag.sent, ag.recv)
    return Bytes(ag.sent, chunk(n, p, rank) * itemsize + ag.recv)


def alpha_beta_time(op: str, algo: str, nbytes: int, p: int, *, alpha: float = 5e-6,
                    bandwidth: float = 10e9, reduce_bandwidth: float = math.inf) -> float:
    """Seconds for one call moving `nbytes` (the full tensor: the all-reduce input, the all-gather
    output, the broadcast message, everything one rank sends in an all-to-all) over p ranks."""
    if p == 1:
        return 0.0
    if op in ("send", "recv", "isend", "irecv"):
        return alpha + nbytes / bandwidth
    name = resolve_algo(op, algo)
    share = (p - 1) / p * nbytes  # bytes one rank moves in one pass over the ring
    reduce = share / reduce_bandwidth
    if op == "all_reduce":
        return 2 * (p - 1) * alpha + 2 * share / bandwidth + reduce
    if op == "reduce_scatter":
        return (p - 1) * alpha + share / bandwidth + reduce
    if op in ("all_gather", "all_to_all"):
        return (p - 1) * alpha + share / bandwidth
    if name == "tree":
        return math.ceil(math.log2(p)) * (alpha + nbytes / bandwidth)
    return 2 * (p - 1) * alpha + 2 * share / bandwidth  # scatter, then ring all-gather
