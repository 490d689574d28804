"""Lesson 7, reference solution: merge attention over two blocks of keys, then ring attention
(refpar/parallel/context_parallel.py's RingAttention is refpar's own)."""

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
    lse = np.logaddexp(lse1, lse2)  # (Tq,) log of both blocks' sums of exp, without overflow
    w1, w2 = np.exp(lse1 - lse)[:, None], np.exp(lse2 - lse)[:, None]  # (Tq, 1) each block's share
    return w1 * o1 + w2 * o2, lse


def ring_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, cp):
    """q, k, v (T_local, D): this rank's positions `pos` (T_local,) of one sequence -> (o (T_local, D),
    lse (T_local,)): causal attention of these queries over every rank's keys and values."""
    D = q.shape[-1]
    right, left = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
    # keys, values and their positions travel as one block: (T_local, 2D + 1)
    block = np.concatenate([k, v, pos[:, None].astype(k.dtype)], axis=1)
    o, lse = np.zeros_like(q), np.full(q.shape[0], -np.inf)  # (T_local, D), (T_local,): nothing seen yet
    for step in range(cp.size):  # the block held at step s started on rank (r - s) mod cp
        if step < cp.size - 1:  # pass it on while computing with it
            sent = cp.isend(block, right, tag="ring:kv")
            coming = cp.irecv(block.shape, block.dtype, left, tag="ring:kv")
        ob, lb = block_attention(q, block[:, :D], block[:, D:2 * D], pos, block[:, 2 * D].astype(int))
        o, lse = merge_attention(o, lse, ob, lb)
        if step < cp.size - 1:
            sent.wait()
            block = coming.wait()
    return o, lse
