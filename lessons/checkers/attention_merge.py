"""`refpar lesson check 7`: lesson 7's checker, the log-sum-exp merge (stable at lse = 800, fully masked
blocks) and ring attention with the causal zig-zag."""

from __future__ import annotations

import numpy as np

from lessons.checkers.common import Wrong, close


def _attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])  # (Tq, Tk)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(axis=-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[:, 0]


def check_07(mod, comm) -> str:
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((6, 4)) * 3 for _ in range(3))
    o_full, lse_full = _attention(q, k, v)
    for split in (1, 3, 5):
        o1, l1 = _attention(q, k[:split], v[:split])
        o2, l2 = _attention(q, k[split:], v[split:])
        # Scores 800 higher give the same attention and every lse 800 higher: exp(800) overflows float64
        for shift in (0.0, 800.0):
            _merged_matches(mod, (o1, l1 + shift, o2, l2 + shift), (o_full, lse_full + shift),
                            f"keys split at {split}" + (", every score and lse 800 higher" if shift else ""))
    # A causal mask hides a whole block from some queries (ring attention's blocks of later keys):
    # there the block's output is 0 and its lse -inf, and the merge must give the other block's own.
    o1, l1 = _attention(q, k[:3], v[:3])
    o2, l2 = _attention(q, k[3:], v[3:])
    hidden1, hidden2 = np.array([0, 1, 0, 0, 0, 0], bool), np.array([0, 0, 0, 1, 1, 0], bool)  # (Tq,)
    o1, l1 = np.where(hidden1[:, None], 0.0, o1), np.where(hidden1, -np.inf, l1)
    o2, l2 = np.where(hidden2[:, None], 0.0, o2), np.where(hidden2, -np.inf, l2)
    want_o = np.where(hidden1[:, None], o2, np.where(hidden2[:, None], o1, o_full))  # (Tq, D)
    want_lse = np.where(hidden1, l2, np.where(hidden2, l1, lse_full))  # (Tq,)
    for shift in (0.0, 800.0):
        _merged_matches(mod, (o1, l1 + shift, o2, l2 + shift), (want_o, want_lse + shift),
                        "query 1 sees no key of block 1, queries 3 and 4 none of block 2 (o 0, lse -inf "
                        "there)" + (", every score and lse 800 higher" if shift else ""))
    return ("merge_attention combines two blocks of keys exactly, at scores of 800 and with blocks a query "
            "cannot see; " + _check_ring(mod, comm))


class _CountingP2P:
    """The cp communicator exercise 7's ring gets: refpar's point-to-point calls, counting the bytes
    this rank sends."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.sent = comm, comm.rank, comm.size, 0

    def isend(self, x, dest: int, tag: str = ""):
        self.sent += np.asarray(x).nbytes
        return self.comm.isend(x, dest, tag=tag)

    def irecv(self, shape, dtype, source: int, tag: str = ""):
        return self.comm.irecv(shape, dtype, source, tag=tag)

    def send(self, x, dest: int, tag: str = ""):
        self.sent += np.asarray(x).nbytes
        return self.comm.send(x, dest, tag=tag)

    def recv(self, shape, dtype, source: int, tag: str = ""):
        return self.comm.recv(shape, dtype, source, tag=tag)


def _causal_attention(q, k, v):
    """(T, D) each, one sequence -> (o (T, D), lse (T,)) of causal attention, on one device."""
    T = q.shape[0]
    s = np.where(np.tril(np.ones((T, T), bool)), q @ k.T / np.sqrt(q.shape[-1]), -np.inf)  # (T, T)
    m = s.max(axis=-1, keepdims=True)  # (T, 1): finite, every query sees itself
    e = np.exp(s - m)
    return e @ v / e.sum(axis=-1, keepdims=True), m[:, 0] + np.log(e.sum(axis=-1))


def _check_ring(mod, comm) -> str:
    """Part 2: ring attention over the cp ranks with zig-zag chunks, against one device's."""
    from refpar.parallel.context_parallel import zigzag_positions

    P, r = comm.size, comm.rank
    for T, D in ((8, 4), (14, 3)):  # 14: chunks of 4 and 3 positions
        rng = np.random.default_rng([5, T])
        q, k, v = (rng.standard_normal((T, D)) * 3 for _ in range(3))  # (T, D) each, the whole sequence
        want_o, want_lse = _causal_attention(q, k, v)
        pos = zigzag_positions(T, P, r)  # (T_local,) chunks r and 2P - 1 - r
        cp = _CountingP2P(comm)
        got = mod.ring_attention(q[pos].copy(), k[pos].copy(), v[pos].copy(), pos.copy(), cp)
        if not isinstance(got, tuple) or len(got) != 2:
            raise Wrong("ring_attention must return two arrays: (out, lse)")

        def at(i, pos=pos):
            return f"the query at position {pos[i if isinstance(i, int) else i[0]]}"

        case = f"T={T} over {P} ranks, rank {r} holding positions {pos.tolist()}"
        close(got[1], want_lse[pos], f"rank {r}'s log-sum-exp ({case})", at)
        close(got[0], want_o[pos], f"rank {r}'s attention output ({case})", at)
        most = (P - 1) * (2 * k[pos].nbytes + pos.size * 8)
        if cp.sent > most:
            raise Wrong(f"rank {r} sent {cp.sent} bytes for T={T}; passing each other rank's keys, values "
                        f"and their positions once around the ring takes {most}: what else travels?")
    return f"ring_attention over {P} ranks with zig-zag chunks equals causal attention on one device"


def _merged_matches(mod, blocks, want, case: str) -> None:
    got = mod.merge_attention(*(b.copy() for b in blocks))
    if not isinstance(got, tuple) or len(got) != 2:
        raise Wrong("merge_attention must return two arrays: (out, lse)")
    def query(i):
        return f"query {i if isinstance(i, int) else i[0]}"
    close(got[1], want[1], f"the merged log-sum-exp ({case})", query)
    close(got[0], want[0], f"the merged attention output ({case})", query)
