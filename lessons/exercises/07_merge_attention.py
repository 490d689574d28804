"""Lesson 7 exercise: merge attention over two blocks of keys, then ring attention on 2 ranks.

    refpar lesson check 7                      # runs the checks on 2 ranks

For queries q and a block of keys/values, attention gives an output o (Tq, D) and, per query, the
log-sum-exp of its scores lse (Tq,): lse = log(sum_j exp(s_j)). Given the results of two disjoint
blocks of keys, return what attention over both blocks together would give, without the keys.

Scores can be large (the checker tries lse near 800, where exp overflows float64), and a causal mask
can hide a whole block from a query: that block then gives the query o = 0 and lse = -inf.

Part 2, once part 1 passes: `ring_attention`, causal attention over a sequence split over the cp
ranks with zig-zag chunks (rank r holds chunks r and 2cp - 1 - r of 2cp). `cp` is refpar's
Communicator: `cp.rank`, `cp.size`, `cp.isend(x, dest, tag=...)` and `cp.irecv(shape, dtype, source,
tag=...)`, each returning a request whose `wait()` completes it (irecv's returns the array).
`block_attention` below is one block's causal attention; the checker counts the bytes you send.
"""

import numpy as np


def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray):
    """Causal attention of queries q (Tq, D) at positions q_pos (Tq,) over one block of keys and
    values k, v (Tk, D) at positions k_pos (Tk,) -> (o (Tq, D), lse (Tq,)); a query that sees no key
    of the block (all at later positions) gets o = 0 and lse = -inf."""
    s = q @ k.T / np.sqrt(q.shape[-1])  # (Tq, Tk)
    s = np.where(k_pos[None, :] <= q_pos[:, None], s, -np.inf)  # a query sees itself and earlier keys
    m = s.max(axis=-1, keepdims=True)  # (Tq, 1)
    m = np.where(np.isfinite(m), m, 0.0)  # rows that see nothing: exp(-inf) = 0, no NaN
    e = np.exp(s - m)  # (Tq, Tk)
    z = e.sum(axis=-1, keepdims=True)  # (Tq, 1)
    seen = z[:, 0] > 0
    o = np.where(seen[:, None], e @ v / np.where(z > 0, z, 1.0), 0.0)  # (Tq, D)
    return o, np.where(seen, m[:, 0] + np.log(np.where(seen, z[:, 0], 1.0)), -np.inf)


def merge_attention(o1: np.ndarray, lse1: np.ndarray, o2: np.ndarray, lse2: np.ndarray):
    """(o1 (Tq, D), lse1 (Tq,)), (o2, lse2) -> (o (Tq, D), lse (Tq,)) over both blocks of keys."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write merge_attention: weight each block by exp(lse_i - lse)")
    # ---- end of your part -----------------------------------------------------------------------


def ring_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, cp):
    """q, k, v (T_local, D): this rank's positions `pos` (T_local,) of one sequence -> (o (T_local, D),
    lse (T_local,)): causal attention of these queries over every rank's keys and values."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write part 2, ring_attention(q, k, v, pos, cp): pass the key/value "
                              "blocks around the ring and merge")
    # ---- end of your part -----------------------------------------------------------------------
