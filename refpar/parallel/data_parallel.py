"""Data parallelism: the replicas of a unit each see a slice of the batch; their gradients are summed.

    mpiexec -n 2 python -m refpar train --mesh dp=2 --check
    mpiexec -n 4 python -m refpar train --mesh dp=4 --bucket-kb 24 --overlap --check

Legend: Ψl the elements this rank holds, laid end to end as its units (refpar/parallel/units.py).

Each unit's replica group (dp, or dp x cp, or a MoE model's dp x ep x cp for its dense weights)
holds the same weights and sees different tokens. The loss is normalised by the *global* token
count B*T on every rank, so the sum over a group of its ranks' gradients is the single device's
gradient; no rank ever divides by its own batch size.

The sum is done in buckets, as PyTorch DDP does: whole parameters taken from the end of each
group's run of the flat buffer (the last block's gradients are complete first), a bucket sent as
soon as every unit in it has its gradient complete, in the step's last microbatch (earlier ones
just accumulate). Per rank and step that is 2(N-1)/N·Ψl elements for a ring all-reduce.

With `overlap` a bucket is not all-reduced by one blocking call but by a `Ring` (ring.py): the
ring's 2(N-1) rounds written out as isend/irecv, one round advanced each time another piece's
backward finishes, so the messages of bucket k are in flight while the backward of the next
blocks computes (the trace shows bucket k's sends ending after bucket k+1's begin). Same bytes.

After the backward the partial sums follow (`ModelStates.partial_sums`: the tied wte, DualPipe's two
copies of every part over the mesh's mirror group, pipeline ranks r and p-1-r, the
sequence-sharded region). Ledger: params Ψl, grads Ψl (+ the largest dict a backward piece
returns, until it is folded in), optimizer 2Ψl (AdamW m, v), comm one bucket's all-reduce output
(overlap: the send copy and receive buffer of each round in flight); in mixed precision the ZeRO
paper's 16Ψ, 20Ψ with --fp32-grads (analysis/memory.py counts each category).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.holdings import buckets
from refpar.parallel.model_states import ModelStates
from refpar.parallel.ring import Ring


class DataParallel(ModelStates):
    """This rank's replicas of its units; `params` the parameters it holds (drawn whole, tp-sliced).
    `bucket_elems` caps a bucket (a parameter is never split); `overlap` all-reduces by rings."""

    def __init__(self, units, config, train, ledger, params: dict, composition=None,
                 bucket_elems: int = 1 << 62, overlap: bool = False, lowp: bool = True):
        super().__init__(units, config, train, ledger, composition, lowp)
        dt, u = self.dtypes, units
        xp = array_namespace(next(iter(params.values())))
        self.params = ledger.alloc("params.flat", xp.concat([u.flatten(k, params) for k in u.names]),
                                   "params")  # (Ψl,)
        self.grads = ledger.alloc("grads.flat", self.zeros(self.params, u.total), "grads")  # (Ψl,)
        # --fp32-grads: the 16-bit gradient backward writes (every parameter's .grad) stays beside
        # the fp32 accumulator, as in DeepSpeed's BF16_Optimizer: the Playbook's 20Ψ
        self.lowp = ledger.alloc("grads.lowp", self.zeros(self.params, u.total, dt.param), "grads") \
            if dt.lowp else None  # (Ψl,)
        # fp32 master weights: the 16-bit parameters upcast, exactly (mixed precision only)
        self.master = ledger.alloc("master.flat", xp.astype(self.params, backend.dtype_like(
            self.params, dt.state)), "master") if dt.mixed else None  # (Ψl,)
        # each unit's parameters and gradients as views of the buffers above, made once: the buffers
        # live as long as the model states, and every microbatch's acquire and fold reads them
        self.param_views = {k: u.views(k, u.slice(k, self.params)) for k in u.names}
        self.grad_views = {k: u.views(k, u.slice(k, self.grads)) for k in u.names}
        self.lowp_views = None if self.lowp is None else {
            k: u.views(k, u.slice(k, self.lowp)) for k in u.names}
        self.state = {k: ledger.alloc(f"optimizer.{k}", self.zeros(self.params, u.total, dt.state),
                                      "optimizer") for k in ("m", "v") if train.optimizer == "adamw"}
        self.overlap, self.in_flight, self.sent = overlap, [], set()
        layout = [(k, b - a, u.group[k]) for k, a, b in u.offsets.values()]  # every parameter, in order
        self.buckets = buckets(layout, bucket_elems)  # [(start, stop, units)], in backward order

    def buffers(self) -> list:
        return [self.params]

    def acquire(self, keys, phase: str, hold=None, following=()):
        """The units' parameters, views of the flat buffer every rank keeps whole; nothing moves."""
        return {n: v for k in keys for n, v in self.param_views[k].items()}, {}

    def release(self, keys, phase: str, hold=None) -> None:
        """Every rank keeps its whole replica: nothing to free."""

    def accumulator(self, unit: str):
        return self.grad_views[unit], None if self.lowp_views is None else self.lowp_views[unit]

    def done(self, keys) -> None:
        """In the step's last microbatch: one round further for every bucket already on its way,
        then every bucket whose units are all complete is sent."""
        complete = [k for k in keys if self.last(k)]
        if not complete:
            return
        for ring in self.in_flight:
            ring.advance()
        self.in_flight = [ring for ring in self.in_flight if not ring.done]
        finished = {k for k, left in self.waiting.items() if left == 0}
        for i, (start, stop, members) in enumerate(self.buckets):
            if i in self.sent or not members <= finished:
                continue
            self.sent.add(i)
            group = self.units.group[next(iter(members))]
            if self.overlap:
                ring = Ring(group, self.grads[start:stop], f"bucket.{i}:grad", self.ledger, reduce=True)
                self.in_flight += [] if ring.done else [ring]
            else:
                summed = self.ledger.alloc("comm.bucket", group.all_reduce(
                    self.grads[start:stop], tag=f"bucket.{i}:grad"), "comm")
                self.grads[start:stop] = summed
                self.ledger.free("comm.bucket")

    def begin_step(self) -> None:
        super().begin_step()
        self.grads[...] = 0.0
        self.sent = {i for i, (_, _, members) in enumerate(self.buckets)
                     if self.units.group[next(iter(members))].size == 1}  # nothing to sum

    def finish(self) -> None:
        """After the backward: the rings still in flight, then the partial sums (module docstring);
        DualPipe's mirror rank's copy of the same parts has the other gradients."""
        while self.in_flight:
            for ring in self.in_flight:
                ring.advance()
            self.in_flight = [ring for ring in self.in_flight if not ring.done]
        u = self.units
        wte = u.slice("wte", self.grads) if "wte" in u.names else None
        spans = [(self.grads, u.start[k] + a, u.start[k] + b)
                 for k, a, b in map(u.offsets.get, self.sp_names)]
        self.partial_sums(wte, spans, lambda k: u.slice(k, self.grads))

    def held_grads(self) -> list:
        return [(k, 0, self.units.slice(k, self.grads)) for k in self.units.names]

    def step(self, lr: float) -> bool:
        """The optimizer on every unit, whole."""
        factor = self.begin_update()
        if factor is None:
            return True
        u = self.units
        for k in u.names:
            master = None if self.master is None else u.slice(k, self.master)
            self.update(k, u.slice(k, self.params), u.slice(k, self.grads),
                        {s: u.slice(k, a) for s, a in self.state.items()}, 0, master, lr, factor)
        return False

    def full_params(self) -> dict:
        u = self.units
        return {n: np.array(backend.to_host(v)) for k in u.names
                for n, v in u.views(k, u.slice(k, self.params)).items()}

    def held(self) -> list:
        """(prefix, unit, first element, flat array) of everything this rank holds: every unit whole,
        the same on each rank of its group (the checkpoint writes each element once)."""
        arrays = {"params": self.params} | ({"master": self.master} if self.master is not None else {})
        arrays |= {f"adamw.{k}": a for k, a in self.state.items()}
        return [(prefix, k, 0, self.units.slice(k, a), True) for prefix, a in arrays.items()
                for k in self.units.names]
