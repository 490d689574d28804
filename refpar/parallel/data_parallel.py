"""Data parallelism: every rank holds the whole model and a slice of the global batch.

    mpiexec -n 2 python -m refpar train --mesh dp=2 --check

Each dp rank takes its `shard_range` of the global batch's sample ids, runs forward and backward
on it (in micro-batches, gradients accumulating in one flat buffer), and the ranks all-reduce
(sum) the gradients. The loss is normalised by the *global* token count B*T on every rank, so
the sum over ranks is the single device's mean and the summed gradients are its gradients; no
rank ever divides by its own batch size.

The all-reduce is done in buckets, as PyTorch DDP does: whole parameters taken from the end of
the flat buffer (the last block's gradients are complete first), a bucket sent as soon as the
backward of every parameter in it is finished, during the last micro-batch only (earlier ones
just accumulate). Per rank per step that is 2(N-1)/N·Ψ elements for a ring all-reduce.

With overlap=True a bucket is not all-reduced by one blocking call but by `RingAllReduce`: the
ring's 2(N-1) rounds written out as isend/irecv, one round advanced each time another unit's
backward finishes, so the messages of bucket k are in flight while the backward of the next
blocks computes (the trace shows bucket k's sends ending after bucket k+1's begin). Same bytes.

Ledger: params 8Ψ, grads 8Ψ (+ the largest dict a backward piece returns, until it is folded
in), optimizer 16Ψ (AdamW m, v), comm one bucket's all-reduce output (overlap: the send copy and
receive buffer of each round in flight).
"""

from __future__ import annotations

import numpy as np

from refpar.analysis.memory import bucket_sizes
from refpar.parallel.units import FlatLayout, optimizer_update
from refpar.sharding import shard_range


class RingAllReduce:
    """A sum all-reduce of `buf` (in place) over `comm` as the ring's rounds, one per `advance()`.

    Chunk i of the n elements is `shard_range(n, p, i)`. Reduce-scatter round k: rank r sends
    chunk (r-k-1) to its right neighbour and adds the chunk (r-k-2) it receives from its left, so
    after p-1 rounds it holds chunk r reduced; all-gather round k: it sends chunk (r-k) and stores
    chunk (r-k-1). Each rank sends 2n - c_r - c_{r+1} elements: `refpar.comm.cost`'s ring."""

    def __init__(self, comm, buf, tag: str, ledger):
        self.comm, self.buf, self.tag, self.ledger = comm, buf, tag, ledger
        self.p, self.r = comm.size, comm.rank
        self.round, self.pending = 0, None
        if self.p > 1:
            self._post()

    @property
    def done(self) -> bool:
        return self.round == 2 * (self.p - 1)

    def _chunks(self, k: int) -> tuple[int, int, bool]:
        p, r = self.p, self.r
        if k < p - 1:
            return (r - k - 1) % p, (r - k - 2) % p, True  # reduce-scatter: add what arrives
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


class DataParallel:
    """One replica of the model on a dp rank; the hooks of refpar.parallel.units.forward_backward."""

    def __init__(self, config, train, dp, ledger, params: dict, bucket_elems: int = 1 << 62,
                 overlap: bool = False):
        self.config, self.train, self.dp, self.ledger = config, train, dp, ledger
        self.overlap, self.in_flight = overlap, []
        self.layout = lay = FlatLayout(config)
        self.params = ledger.alloc("params.flat", np.concatenate(
            [lay.flatten(u, params) for u in lay.units]), "params")  # (Ψ,)
        self.grads = ledger.alloc("grads.flat", np.zeros_like(self.params), "grads")  # (Ψ,)
        self.state = {}
        if train.optimizer == "adamw":
            for k in ("m", "v"):
                self.state[k] = ledger.alloc(f"optimizer.{k}", np.zeros_like(self.params), "optimizer")
        self.t = 0
        # Buckets as [start, stop) of the flat buffer, in the order backward completes them, each
        # with the unit whose backward completes it (the unit of its lowest parameter).
        self.buckets = []
        stop = lay.total
        for size in bucket_sizes(config, bucket_elems):
            start = stop - size
            unit = next(u for u in reversed(list(lay.units)) if lay.starts[u] <= start)
            self.buckets.append((start, stop, unit))
            stop = start

    def unit_flat(self, unit: str, flat):
        a = self.layout.starts[unit]
        return flat[a:a + self.layout.sizes[unit]]  # (Ψ_u,)

    def begin_step(self) -> None:
        self.grads[...] = 0.0

    def acquire(self, unit: str, phase: str):
        return self.layout.views(unit, self.unit_flat(unit, self.params)), self.params

    def release(self, unit: str, phase: str) -> None:
        """Every rank keeps the whole model: nothing to free."""

    def fold(self, unit: str, grads: dict) -> None:
        self.ledger.alloc("grads.piece", sum(int(g.nbytes) for g in grads.values()), "grads")
        views = self.layout.views(unit, self.unit_flat(unit, self.grads))
        for name, g in grads.items():
            views[name] += g
        self.ledger.free("grads.piece")

    def unit_done(self, unit: str, last: bool) -> None:
        if not last:
            return
        for ring in self.in_flight:  # one round further for every bucket already on its way
            ring.advance()
        self.in_flight = [ring for ring in self.in_flight if not ring.done]
        for k, (start, stop, ready_after) in enumerate(self.buckets):
            if ready_after == unit and self.overlap:
                ring = RingAllReduce(self.dp, self.grads[start:stop], f"bucket.{k}:grad", self.ledger)
                self.in_flight += [] if ring.done else [ring]
            elif ready_after == unit:
                summed = self.dp.all_reduce(self.grads[start:stop], tag=f"bucket.{k}:grad")
                self.ledger.alloc("comm.bucket", summed, "comm")
                self.grads[start:stop] = summed
                self.ledger.free("comm.bucket")

    def optimizer_step(self) -> None:
        while self.in_flight:  # the backward is over: finish the buckets still in flight
            for ring in self.in_flight:
                ring.advance()
            self.in_flight = [ring for ring in self.in_flight if not ring.done]
        self.t += 1
        for u in self.layout.units:
            optimizer_update(self, u, self.unit_flat(u, self.params), self.unit_flat(u, self.grads),
                             {k: self.unit_flat(u, s) for k, s in self.state.items()}, 0)

    def full_params(self) -> dict:
        return {n: v.copy() for u in self.layout.units
                for n, v in self.layout.views(u, self.unit_flat(u, self.params)).items()}
