"""Flat parameter units and the piecewise training step that DP, ZeRO and FSDP share.

Legend: B batch, T sequence, C channels, L layers, Ψ parameters, N data-parallel ranks.

A *unit* is one flat buffer of parameters: the root (wte, wpe, ln_f: used by the embedding and by
the tied head) and one per transformer block (`refpar.analysis.memory.units`). A strategy decides
where each unit's parameters, gradients and optimizer state live; the step below runs the model
piece by piece (embed, blocks, head; then head, blocks reversed, embed) and asks the strategy for
a unit's parameters just before a piece needs them, so ZeRO-3 and FSDP can gather just in time.

A piece's cache may hold views of the parameters it read. `detach` swaps those views for their
place in the unit's flat buffer, so releasing a gathered unit after the forward really drops it,
and `attach` points the cache at the buffer gathered again for the backward.
"""

from __future__ import annotations

import contextlib

import numpy as np

from refpar.analysis.memory import ROOT, numel, param_shapes, units
from refpar.model.gpt import (
    DropoutContext,
    block_backward,
    block_forward,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
)
from refpar.model.optim import adamw_update, sgd_update
from refpar.sharding import shard_range


class FlatLayout:
    """Where each parameter sits inside its unit's flat buffer, and units inside the whole model."""

    def __init__(self, config):
        self.config = config
        self.shapes = param_shapes(config)
        self.units = units(config)
        self.offsets: dict[str, tuple[str, int, int]] = {}  # name -> (unit, start, stop) in the unit
        self.sizes: dict[str, int] = {}
        self.starts: dict[str, int] = {}  # unit -> start in the whole model's flat buffer
        total = 0
        for u, names in self.units.items():
            start = 0
            for n in names:
                self.offsets[n] = (u, start, start + numel(self.shapes[n]))
                start += numel(self.shapes[n])
            self.sizes[u], self.starts[u] = start, total
            total += start
        self.total = total  # Ψ

    def flatten(self, unit: str, arrays: dict) -> np.ndarray:
        return np.concatenate([np.ravel(arrays[n]) for n in self.units[unit]])  # (Ψ_u,)

    def views(self, unit: str, flat) -> dict:
        """The unit's parameters as reshaped views of its flat buffer (writes go through)."""
        out = {}
        for n in self.units[unit]:
            _, a, b = self.offsets[n]
            out[n] = flat[a:b].reshape(self.shapes[n])
        return out

    def shard(self, unit: str, n: int, rank: int) -> tuple[int, int]:
        return shard_range(self.sizes[unit], n, rank)

    def segments(self, unit: str, start: int, stop: int):
        """(name, lo, hi) of every parameter overlapping [start, stop) of the unit, in unit
        coordinates: a flat shard is updated one parameter segment at a time so that weight decay
        follows each parameter's shape, as on one device."""
        for n in self.units[unit]:
            _, a, b = self.offsets[n]
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield n, lo, hi


class _ParamView:
    """A cached view of a unit's flat buffer, kept as its position so it can be rebuilt."""

    def __init__(self, offset: int, shape, strides):
        self.offset, self.shape, self.strides = offset, shape, strides


def _owner(a):
    return a if a.base is None else a.base


def detach(cache, base):
    """`cache` with every array viewing `base`'s memory replaced by its position in `base`."""
    if isinstance(cache, np.ndarray):
        if base is not None and _owner(cache) is _owner(base):
            offset = cache.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            return _ParamView(offset, cache.shape, cache.strides)
        return cache
    if isinstance(cache, tuple | list):
        return type(cache)(detach(c, base) for c in cache)
    return cache


def attach(cache, base):
    """Inverse of `detach` on a (possibly newly gathered) buffer with the same layout."""
    if isinstance(cache, _ParamView):
        if base is None:
            raise RuntimeError("a cached parameter view needs its unit's parameters in backward")
        return np.lib.stride_tricks.as_strided(base[cache.offset // base.itemsize:], cache.shape,
                                               cache.strides, writeable=False)
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, base) for c in cache)
    return cache


def cached_arrays(cache, out: dict):
    """id -> owning array of every array a cache keeps alive (views count their base once)."""
    if isinstance(cache, np.ndarray):
        owner = _owner(cache)
        out[id(owner)] = owner
    elif isinstance(cache, tuple | list):
        for c in cache:
            cached_arrays(c, out)
    return out


class Activations:
    """Registers, per piece, the bytes of arrays its cache keeps that no earlier piece kept."""

    def __init__(self, ledger):
        self.ledger, self.seen = ledger, {}

    def keep(self, piece: str, cache) -> None:
        new = {k: a for k, a in cached_arrays(cache, {}).items() if k not in self.seen}
        self.seen.update(new)
        self.ledger.alloc(f"activations.{piece}", sum(int(a.nbytes) for a in new.values()),
                          "activations")

    def drop(self, piece: str) -> None:
        self.ledger.free(f"activations.{piece}")

    def reset(self) -> None:
        self.seen = {}


def microbatch_ids(batch_size: int, dp: int, rank: int, microbatches: int, m: int) -> list[int]:
    """Global sample ids of micro-batch m on data-parallel rank `rank`: the rank's `shard_range` of
    the global batch 0..B-1, then micro-batch m's `shard_range` of that."""
    a, b = shard_range(batch_size, dp, rank)
    lo, hi = shard_range(b - a, microbatches, m)
    return list(range(a + lo, a + hi))


def forward_backward(strategy, tokens, targets, config, drop: DropoutContext, normalizer,
                     last: bool, acts: Activations) -> float:
    """One micro-batch through the pieces; returns its share of the global mean loss. The strategy
    supplies parameters (`acquire`/`release`) and takes gradients (`fold`, `unit_done`)."""
    L = config.n_layer
    params, base = strategy.acquire(ROOT, "embed:fwd")
    x, c_embed = embed_forward(tokens, params, drop)  # (B, T, C)
    c_embed = detach(c_embed, base)
    # Drop every reference to the unit before releasing it, so a gathered unit is really freed.
    del params, base
    strategy.release(ROOT, "embed:fwd")
    acts.keep("embed", c_embed)
    c_blocks = []
    for i in range(L):
        params, base = strategy.acquire(f"h.{i}", "fwd")
        x, c = block_forward(x, params, i, config, drop)  # (B, T, C)
        c_blocks.append(detach(c, base))
        del params, base, c
        strategy.release(f"h.{i}", "fwd")
        acts.keep(f"h.{i}", c_blocks[-1])

    params, base = strategy.acquire(ROOT, "head")
    loss, c_head = head_forward(x, params, targets, config, normalizer)  # ()
    acts.keep("head", detach(c_head, base))  # the parameters it views are not activations
    dx, grads = head_backward(c_head)  # (B, T, C)
    del c_head, params, base
    acts.drop("head")
    strategy.fold(ROOT, grads)
    strategy.release(ROOT, "head")

    for i in reversed(range(L)):
        base = strategy.acquire(f"h.{i}", "bwd")[1]  # the cache holds what backward reads
        dx, grads = block_backward(dx, attach(c_blocks.pop(), base))  # (B, T, C)
        del base
        acts.drop(f"h.{i}")
        strategy.fold(f"h.{i}", grads)
        strategy.release(f"h.{i}", "bwd")
        strategy.unit_done(f"h.{i}", last)
    # The embedding's backward scatters dx into rows of wte and wpe without reading their values,
    # so no strategy needs the root's parameters here (ZeRO-3 and FSDP gather nothing for it).
    grads = embed_backward(dx, attach(c_embed, None))
    acts.drop("embed")
    strategy.fold(ROOT, grads)
    strategy.unit_done(ROOT, last)
    acts.reset()
    return float(loss)


def optimizer_update(strategy, unit: str, p, g, state: dict, start: int) -> None:
    """One optimizer step, in place, on flat arrays covering [start, start + len(p)) of `unit`.
    The update is elementwise, so a shard gets the single device's numbers; it runs one parameter
    segment at a time so weight decay follows each parameter's full shape (matrices only)."""
    cfg, layout = strategy.train, strategy.layout
    for name, lo, hi in layout.segments(unit, start, start + p.shape[0]):
        s = slice(lo - start, hi - start)
        decay = len(layout.shapes[name]) >= 2  # refpar.model.optim.decays on the full parameter
        if cfg.optimizer == "adamw":
            p[s], state["m"][s], state["v"][s] = adamw_update(
                p[s], g[s], state["m"][s], state["v"][s], strategy.t, cfg, decay)
        else:
            p[s] = sgd_update(p[s], g[s], cfg, decay)


def train_step(strategy, corpus, step: int, microbatches: int, tracer=None) -> float:
    """One optimizer step on the global batch 0..B-1; returns the global mean loss (all ranks)."""
    s, train = strategy, strategy.train
    B, T = train.batch_size, train.seq_len
    acts = Activations(s.ledger)
    s.begin_step()
    loss = 0.0
    for m in range(microbatches):
        ids = microbatch_ids(B, s.dp.size, s.dp.rank, microbatches, m)
        tokens, targets = corpus.batch(step, ids, T)  # (b, T) each
        # Owned (b, T): for one sequence the loader's rows view a (1, T+1) buffer, which the
        # embedding's and the head's caches would otherwise keep alive whole.
        tokens, targets = np.array(tokens), np.array(targets)  # (b, T) each
        drop = DropoutContext(train.seed, step, tuple(ids), s.config.dropout, True)
        with _context(tracer, step=step, microbatch=m):
            loss += forward_backward(s, tokens, targets, s.config, drop, B * T,
                                     m == microbatches - 1, acts)
    with _context(tracer, step=step, microbatch=None):
        s.optimizer_step()
        # Each rank's loss is its share of the global mean (normalised by B*T): their sum is it.
        return float(s.dp.all_reduce(np.array([loss]), tag="loss")[0])


def _context(tracer, **fields):
    return contextlib.nullcontext() if tracer is None else tracer.context(**fields)
