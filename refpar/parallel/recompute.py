"""Activation recomputation (--recompute): what a block keeps from its forward for its backward,
and what the backward runs again.

    mpiexec -n 2 python -m refpar train --mesh tp=2 --sp --recompute selective --check

    none       every piece keeps what its backward reads (refpar/analysis/activations.py's terms)
    selective  the attention core (QK^T, softmax, its dropout, the product with V) keeps only its
               inputs q, k and v; the block's backward runs the core's forward again just before
               the core's backward (Korthikanti et al. 2022, section 5)
    full       a block keeps only its input x (B, Tl, C); its backward first runs the whole block's
               forward again (Chen et al. 2016; Megatron-LM's --recompute-granularity full with
               --recompute-method uniform, one layer a group)

The gradients are bitwise those without recomputation: the forward that runs again is the same
function on the same arrays (the kept input, the parameters acquired for the backward) in the same
order, and its dropout masks are drawn again from keyed streams (refpar/model/dropout.py: one key
per seed, step, layer, site and sample, no stream position to advance), so every array the
backward reads is the one the first forward made, bit for bit. What that forward communicates
(tp's f/g or sp's gathers, cp's ring or Ulysses exchanges, ep's all-to-alls) moves again, traced
under phase "recompute"; its compute is timed into `spans`, drawn in the trace beside the actions.

Memory: what the rerun makes is a working set of one block (full) or one attention core
(selective), held while that piece's backward runs: the ledger's "recompute" entry among the
activations, beside the caches the schedule keeps (refpar/analysis/closed_forms.py replays both).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from functools import partial

from refpar.parallel.pipeline.executor import held_bytes


class Recompute:
    """A rank's recomputation: `mode` (RECOMPUTE), the `ledger` its working sets go in, `buffers`
    the arrays the parameters live in (not activations), `tracer` the rank's, or None."""

    def __init__(self, mode: str, ledger, buffers, tracer=None):
        self.mode, self.ledger, self.buffers, self.tracer = mode, ledger, list(buffers), tracer
        self.spans: list[tuple[str, float, float]] = []  # (piece, start, end) of this step's reruns

    def rerun(self, piece: str, forward, kept: tuple):
        """The cache of `forward()` -> (out, cache) run again for `piece`'s backward; its bytes
        beyond `kept` (the stored inputs, the acquired parameters' buffers) held until `done`."""
        start = time.perf_counter()
        with self.tracer.context(phase="recompute") if self.tracer else nullcontext():
            _, cache = forward()
        self.spans.append((piece, start, time.perf_counter()))
        self.ledger.alloc("recompute", held_bytes(cache, [*self.buffers, *kept]), "activations")
        return cache

    def done(self) -> None:
        self.ledger.free("recompute")


class SelectiveAttention:
    """An attention core of a tensor_parallel.Layout (pieces.LocalAttention, context_parallel's
    RingAttention or UlyssesAttention) that keeps only q, k and v and runs its forward again
    inside its backward."""

    def __init__(self, core, recompute: Recompute):
        self.core, self.recompute = core, recompute

    def forward(self, q, k, v, layer, lay, drop):  # (B, nh, Ta, hs) each
        y, _ = self.core.forward(q, k, v, layer, lay, drop)  # (B, nh, Ta, hs); its cache dropped
        return y, (q, k, v, layer, drop)

    def backward(self, dy, cache, lay):
        q, k, v, layer, drop = cache
        again = self.recompute.rerun(f"h.{layer}.attn.core",
                                     partial(self.core.forward, q, k, v, layer, lay, drop), (q, k, v))
        grads = self.core.backward(dy, again, lay)  # dq, dk, dv
        self.recompute.done()
        return grads
