"""Ring collectives written out as rounds of isend/irecv, advanced one round at a time, so that
computation can run between rounds while the messages are in flight (the trace shows it).

    ring = Ring(dp, buf, tag="bucket.0:grad", ledger=ledger, reduce=True)   # posts round 0
    ...compute...
    ring.advance()                                                          # round 1, ...

Legend: p ranks, r this rank, chunk i = `shard_range(n, p, i)` of the n elements of `buf`.
All-reduce (reduce=True) = reduce-scatter, then all-gather. Reduce-scatter round k: rank r sends
chunk (r-k-1) to its right neighbour and adds the chunk (r-k-2) it receives from its left, so
after p-1 rounds it holds chunk r reduced. All-gather round k: it sends chunk (r-k) and stores
chunk (r-k-1); an all-gather alone (reduce=False) starts from `buf` holding chunk r. Each rank
sends exactly what `refpar.comm.cost` prices for the ring: 2n - c_r - c_{r+1} for the all-reduce,
n - c_{r+1} for the all-gather. The send copy and the receive buffer of the round in flight are
in the ledger as comm.
"""

from __future__ import annotations

from refpar.sharding import shard_range


class Ring:
    def __init__(self, comm, buf, tag: str, ledger, reduce: bool):
        self.comm, self.buf, self.tag, self.ledger, self.reduce = comm, buf, tag, ledger, reduce
        self.p, self.r = comm.size, comm.rank
        self.rounds = (2 if reduce else 1) * (self.p - 1)
        self.round, self.pending = 0, None
        if not self.done:
            self._post()

    @property
    def done(self) -> bool:
        return self.round == self.rounds

    def _chunks(self, k: int) -> tuple[int, int, bool]:
        p, r = self.p, self.r
        if self.reduce and k < p - 1:
            return (r - k - 1) % p, (r - k - 2) % p, True  # reduce-scatter: add what arrives
        if self.reduce:
            k -= p - 1
        return (r - k) % p, (r - k - 1) % p, False  # all-gather: store what arrives

    def _post(self) -> None:
        send, recv, reduce = self._chunks(self.round)
        a, b = shard_range(self.buf.size, self.p, send)
        c, d = shard_range(self.buf.size, self.p, recv)
        right, left = (self.r + 1) % self.p, (self.r - 1) % self.p
        self.ledger.alloc(f"comm.{self.tag}.send", self.buf[a:b], "comm")  # isend's copy
        self.ledger.alloc(f"comm.{self.tag}.recv", self.buf[c:d], "comm")  # irecv's buffer
        self.pending = (self.comm.isend(self.buf[a:b], right, tag=self.tag),
                        self.comm.irecv((d - c,), self.buf.dtype, left, tag=self.tag), c, d, reduce)

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
