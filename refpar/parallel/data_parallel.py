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

With overlap=True a bucket is not all-reduced by one blocking call but by a `Ring` (ring.py): the
ring's 2(N-1) rounds written out as isend/irecv, one round advanced each time another unit's
backward finishes, so the messages of bucket k are in flight while the backward of the next
blocks computes (the trace shows bucket k's sends ending after bucket k+1's begin). Same bytes.

Ledger: params 8Ψ, grads 8Ψ (+ the largest dict a backward piece returns, until it is folded
in), optimizer 16Ψ (AdamW m, v), comm one bucket's all-reduce output (overlap: the send copy and
receive buffer of each round in flight). bf16/fp16-mixed: params 2Ψ, grads 2Ψ (all-reduced in 16
bits), master 4Ψ, optimizer 8Ψ: the ZeRO paper's 16Ψ. --fp32-grads keeps the 16-bit gradient
backward writes (2Ψ) beside an fp32 accumulator (4Ψ, all-reduced in fp32): the Playbook's 20Ψ. With fp16
every rank checks its all-reduced (identical) gradients for overflow, so no flag is exchanged.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.analysis.memory import bucket_sizes
from refpar.memory import nbytes_of
from refpar.parallel.ring import Ring
from refpar.parallel.units import FlatLayout, StateDtypes, fold_grads, optimizer_update, overflowed


class DataParallel:
    """One replica of the model on a dp rank; the hooks of refpar.parallel.units.forward_backward."""

    def __init__(self, config, train, dp, ledger, params: dict, bucket_elems: int = 1 << 62,
                 overlap: bool = False):
        self.config, self.train, self.dp, self.ledger = config, train, dp, ledger
        self.overlap, self.in_flight = overlap, []
        self.layout = lay = FlatLayout(config)
        self.dtypes = dt = StateDtypes(config, train)
        xp = array_namespace(params["wte.weight"])
        self.params = ledger.alloc("params.flat", xp.concat(
            [lay.flatten(u, params) for u in lay.units]), "params")  # (Ψ,)
        self.grads = ledger.alloc("grads.flat", dt.zeros(self.params, lay.total, dt.grad), "grads")  # (Ψ,)
        # --fp32-grads: the 16-bit gradient backward writes (every parameter's .grad) stays beside
        # the fp32 accumulator, as in DeepSpeed's BF16_Optimizer: the Playbook's 20Ψ
        self.lowp = ledger.alloc("grads.lowp", dt.zeros(self.params, lay.total, dt.param), "grads") \
            if dt.wide else None  # (Ψ,)
        # fp32 master weights: the 16-bit parameters upcast, exactly (mixed precision only)
        self.master = ledger.alloc("master.flat", xp.astype(self.params, dt.state), "master") \
            if dt.mixed else None  # (Ψ,)
        self.state = {}
        if train.optimizer == "adamw":
            for k in ("m", "v"):
                self.state[k] = ledger.alloc(f"optimizer.{k}", dt.zeros(self.params, lay.total, dt.state),
                                             "optimizer")  # (Ψ,)
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
        self.ledger.alloc("grads.piece", sum(nbytes_of(g) for g in grads.values()), "grads")
        lowp = None if self.lowp is None else self.layout.views(unit, self.unit_flat(unit, self.lowp))
        fold_grads(self.layout.views(unit, self.unit_flat(unit, self.grads)), grads, lowp)
        self.ledger.free("grads.piece")

    def unit_done(self, unit: str, last: bool) -> None:
        if not last:
            return
        for ring in self.in_flight:  # one round further for every bucket already on its way
            ring.advance()
        self.in_flight = [ring for ring in self.in_flight if not ring.done]
        for k, (start, stop, ready_after) in enumerate(self.buckets):
            if ready_after == unit and self.overlap:
                ring = Ring(self.dp, self.grads[start:stop], f"bucket.{k}:grad", self.ledger, reduce=True)
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
        if overflowed(self, [self.grads], agree=False):
            return  # fp16: skip the step, t not advanced
        self.t += 1
        for u in self.layout.units:
            master = None if self.master is None else self.unit_flat(u, self.master)
            optimizer_update(self, u, self.unit_flat(u, self.params), self.unit_flat(u, self.grads),
                             {k: self.unit_flat(u, s) for k, s in self.state.items()}, 0, master)

    def full_params(self) -> dict:
        return {n: np.array(backend.to_host(v)) for u in self.layout.units
                for n, v in self.layout.views(u, self.unit_flat(u, self.params)).items()}
