"""Ring collectives written out as rounds of isend/irecv, advanced one round at a time, so that
computation can run between rounds while the messages are in flight (the trace shows it).

    ring = Ring(dp, buf, tag="bucket.0:grad", ledger=ledger, reduce=True)   # posts round 0
    ...compute...
    ring.advance()                                                          # round 1, ...

Legend: p ranks, r this rank, chunk i = `shard_range(n, p, i)` of the n elements of `buf`.
All-reduce (reduce=True) = reduce-scatter, then all-gather; an all-gather alone (reduce=False)
starts from `buf` holding chunk r. Which chunk goes where in each round is the blocking ring's
(`refpar.comm.algorithms.ring_round`); only the transport differs: tagged, traced isend/irecv
instead of the Communicator's private link. Each rank sends exactly what `refpar.comm.cost` prices
for the ring: 2n - c_r - c_{r+1} for the all-reduce, n - c_{r+1} for the all-gather. The send copy
and the receive buffer of the round in flight are in the ledger as comm.
"""

from __future__ import annotations

from refpar import backend
from refpar.comm.algorithms import chunk_bounds, ring_round


class Ring:
    def __init__(self, comm, buf, tag: str, ledger, reduce: bool):
        self.comm, self.buf, self.tag, self.ledger, self.reduce = comm, buf, tag, ledger, reduce
        self.p, self.r = comm.size, comm.rank
        self.bounds = chunk_bounds(buf.shape[0], self.p)  # buf (n,): shape[0], as .size is a method in torch
        self.rounds = (2 if reduce else 1) * (self.p - 1)
        self.round, self.pending = 0, None
        if not self.done:
            self._post()

    @property
    def done(self) -> bool:
        return self.round == self.rounds

    def _post(self) -> None:
        # an all-gather alone is the all-reduce's last p-1 rounds
        k = self.round if self.reduce else self.round + self.p - 1
        send, recv, reduce = ring_round(self.p, self.r, k)
        (a, b), (c, d) = self.bounds[send], self.bounds[recv]
        right, left = (self.r + 1) % self.p, (self.r - 1) % self.p
        self.ledger.alloc(f"comm.{self.tag}.send", self.buf[a:b], "comm")  # isend's copy
        self.ledger.alloc(f"comm.{self.tag}.recv", self.buf[c:d], "comm")  # irecv's buffer
        self.pending = (self.comm.isend(self.buf[a:b], right, tag=self.tag),
                        self.comm.irecv((d - c,), backend.host_dtype(self.buf), left, tag=self.tag,
                                        like=self.buf), c, d, reduce)

    def advance(self) -> None:
        """Completes the round in flight and posts the next one."""
        sent, received, c, d, reduce = self.pending
        sent.wait()
        chunk = received.wait()  # (d - c,)
        self.ledger.free(f"comm.{self.tag}.send")
        self.ledger.free(f"comm.{self.tag}.recv")
        if reduce:
            self.buf[c:d] += chunk
        else:
            self.buf[c:d] = chunk
        self.round += 1
        if not self.done:
            self._post()

    def finish(self) -> None:
        while not self.done:
            self.advance()
