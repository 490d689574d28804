"""Flat parameter units and the piecewise training step that DP, ZeRO and FSDP share.

Legend: B batch, T sequence, C channels, L layers, Ψ parameters, N data-parallel ranks.

A *unit* is one flat buffer of parameters: the root (wte, wpe, ln_f: used by the embedding and by
the tied head) and one per transformer block (`refpar.analysis.memory.units`). A strategy decides
where each unit's parameters, gradients and optimizer state live; the step below runs the model
piece by piece (embed, blocks, head; then head, blocks reversed, embed) and asks the strategy for
a unit's parameters just before a piece needs them, so ZeRO-3 and FSDP can gather just in time.

Mixed precision (refpar/precision.py): parameters in bf16/fp16, gradients in the same dtype (fp32
with TrainConfig.fp32_grads), fp32 master weights and moments on the ranks that own them
(`StateDtypes`); the optimizer runs `mixed_adamw_update` on flat shards. fp16 scales the loss
(`dloss` = the scale) and skips a step whose gradients overflowed on any rank (`overflowed`).

A piece's cache may hold views of the parameters it read. `detach` swaps those views for their
place in the unit's flat buffer, so releasing a gathered unit after the forward really drops it,
and `attach` points the cache at the buffer gathered again for the backward.
"""

from __future__ import annotations

import contextlib

import numpy as np
from array_api_compat import array_namespace, device, is_cupy_array, is_torch_array

from refpar import backend
from refpar.analysis.memory import ROOT, numel, param_shapes, units
from refpar.memory import nbytes_of
from refpar.model.gpt import (
    DropoutContext,
    block_backward,
    block_forward,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
)
from refpar.model.optim import adamw_update, mixed_adamw_update, mixed_sgd_update, sgd_update
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit, loss_scaler, overflow_anywhere
from refpar.sharding import shard_range


class StateDtypes:
    """The dtypes a data-parallel strategy keeps: `param` (the model's), `grad` (the param dtype, or
    fp32 with fp32_grads), `state` (master weights and moments: fp32 when mixed, else the param
    dtype); `mixed` says whether fp32 master weights exist; `wide` whether gradients accumulate
    wider than backward writes them (fp32_grads). `scaler` is fp16's LossScaler or None."""

    def __init__(self, config, train):
        self.param = dtype_of(config.dtype)
        self.mixed = is_16bit(self.param)
        self.grad = MASTER_DTYPE if self.mixed and train.fp32_grads else self.param
        self.state = MASTER_DTYPE if self.mixed else self.param
        self.wide = self.grad != self.param
        self.scaler = loss_scaler(config, train)

    def zeros(self, like, n: int, dtype):
        """(n,) zeros of `dtype` in the namespace and on the device of `like` (a parameter array):
        in `like`'s own dtype when `dtype` is the parameters' (every backend), else NumPy's fp32."""
        xp = array_namespace(like)
        return xp.zeros(n, dtype=like.dtype if dtype == self.param else dtype, device=device(like))

    @property
    def dloss(self) -> float:
        """Where backward starts: the loss scale for fp16, else 1."""
        return 1.0 if self.scaler is None else self.scaler.scale

    @property
    def inv_scale(self) -> float:
        return 1.0 if self.scaler is None else 1.0 / self.scaler.scale


def fold_grads(views: dict, grads: dict, lowp: dict | None) -> None:
    """Adds a backward piece's `grads` into the accumulator `views` (name -> view). With wide
    gradients `lowp` holds the parameters' 16-bit gradient buffers: backward writes each gradient
    there (its .grad, cleared by the previous accumulation, so writing is adding to zero) and the
    fp32 accumulator adds it at once, as DeepSpeed's BF16_Optimizer does per parameter."""
    for name, g in grads.items():
        if lowp is not None:
            lowp[name][...] = g
            g = lowp[name]
        views[name] += g


def overflowed(strategy, shards, agree: bool) -> bool:
    """fp16 only (False otherwise, no communication): whether the reduced gradients `shards` (a
    list of arrays) hold an inf or a nan on any rank. With `agree` the ranks hold different shards
    and take the max of a float32 flag over dp (traced, 4 bytes); plain DP's all-reduced gradients
    are the same everywhere and need no message. The scaler backs off or grows."""
    scaler = strategy.dtypes.scaler
    if scaler is None:
        return False
    found = overflow_anywhere(shards, [strategy.dp] if agree else [], tag="found_inf")
    scaler.update(found)
    return found


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

    def flatten(self, unit: str, arrays: dict):
        xp = array_namespace(arrays[self.units[unit][0]])
        return xp.concat([xp.reshape(arrays[n], (-1,)) for n in self.units[unit]])  # (Ψ_u,)

    def views(self, unit: str, flat) -> dict:
        """The unit's parameters as reshaped views of its flat buffer (writes go through)."""
        xp, out = array_namespace(flat), {}
        for n in self.units[unit]:
            _, a, b = self.offsets[n]
            out[n] = xp.reshape(flat[a:b], self.shapes[n])
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
    """A cached view of a unit's flat buffer, kept as its position so it can be rebuilt: offset and
    strides in elements."""

    def __init__(self, offset: int, shape, strides):
        self.offset, self.shape, self.strides = offset, shape, strides


def _position(a, base) -> _ParamView:
    """Where the view `a` sits in `base`'s memory. NumPy and torch say it differently (bytes from
    an address, elements from the storage's start); the array API has no word for it."""
    if is_torch_array(a):
        return _ParamView(a.storage_offset() - base.storage_offset(), tuple(a.shape), a.stride())
    item = a.itemsize
    offset = _address(a) - _address(base)  # bytes, as NumPy and CuPy count strides
    return _ParamView(offset // item, a.shape, tuple(s // item for s in a.strides))


def _address(a) -> int:
    return a.data.ptr if is_cupy_array(a) else a.__array_interface__["data"][0]


def _view_at(base, view: _ParamView):
    """The read-only view of `base` at `view`'s position (inverse of `_position`)."""
    if is_torch_array(base):
        import torch

        return torch.as_strided(base, view.shape, view.strides, base.storage_offset() + view.offset)
    item = base.itemsize
    strides = tuple(s * item for s in view.strides)
    if is_cupy_array(base):
        import cupy

        return cupy.lib.stride_tricks.as_strided(base[view.offset:], view.shape, strides)
    return np.lib.stride_tricks.as_strided(base[view.offset:], view.shape, strides, writeable=False)


def detach(cache, base):
    """`cache` with every array viewing `base`'s memory replaced by its position in `base`."""
    if backend.is_array(cache):
        if base is not None and backend.owner(cache) is backend.owner(base):
            return _position(cache, base)
        return cache
    if isinstance(cache, tuple | list):
        return type(cache)(detach(c, base) for c in cache)
    return cache


def attach(cache, base):
    """Inverse of `detach` on a (possibly newly gathered) buffer with the same layout."""
    if isinstance(cache, _ParamView):
        if base is None:
            raise RuntimeError("a cached parameter view needs its unit's parameters in backward")
        return _view_at(base, cache)
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, base) for c in cache)
    return cache


def cached_arrays(cache, out: dict):
    """id -> owning array of every array a cache keeps alive (views count their base once)."""
    if backend.is_array(cache):
        owner = backend.owner(cache)
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
        self.ledger.alloc(f"activations.{piece}", sum(nbytes_of(a) for a in new.values()),
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
    dx, grads = head_backward(c_head, strategy.dtypes.dloss)  # (B, T, C)
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


def optimizer_update(strategy, unit: str, p, g, state: dict, start: int, master=None) -> None:
    """One optimizer step, in place, on flat arrays covering [start, start + len(p)) of `unit`.
    The update is elementwise, so a shard gets the single device's numbers; it runs one parameter
    segment at a time so weight decay follows each parameter's full shape (matrices only). With
    `master` (mixed precision) master and moments update in fp32 and p becomes master in 16 bits."""
    cfg, layout = strategy.train, strategy.layout
    inv_scale = strategy.dtypes.inv_scale
    for name, lo, hi in layout.segments(unit, start, start + p.shape[0]):
        s = slice(lo - start, hi - start)
        decay = len(layout.shapes[name]) >= 2  # refpar.model.optim.decays on the full parameter
        if master is not None and cfg.optimizer == "adamw":
            p[s], master[s], state["m"][s], state["v"][s] = mixed_adamw_update(
                p[s], g[s], master[s], state["m"][s], state["v"][s], strategy.t, cfg, decay, inv_scale)
        elif master is not None:
            p[s], master[s] = mixed_sgd_update(p[s], g[s], master[s], cfg, decay, inv_scale)
        elif cfg.optimizer == "adamw":
            p[s], state["m"][s], state["v"][s] = adamw_update(
                p[s], g[s], state["m"][s], state["v"][s], strategy.t, cfg, decay)
        else:
            p[s] = sgd_update(p[s], g[s], cfg, decay)


def train_step(strategy, corpus, step: int, microbatches: int, tracer=None) -> float:
    """One optimizer step on the global batch 0..B-1; returns the global mean loss (all ranks)."""
    s = strategy
    s.begin_step()
    # fp16 loss scaling expects an overflow to inf now and then, and checks for it: no warnings.
    quiet = np.errstate(over="ignore", invalid="ignore") if s.dtypes.scaler else contextlib.nullcontext()
    with quiet:
        loss = _microbatches(s, corpus, step, microbatches, tracer)
    with _context(tracer, step=step, microbatch=None):
        s.optimizer_step()
        # Each rank's loss is its share of the global mean (normalised by B*T): their sum is it.
        return float(s.dp.all_reduce(np.array([loss]), tag="loss")[0])


def _microbatches(s, corpus, step: int, microbatches: int, tracer) -> float:
    """Forward and backward of this rank's micro-batches; returns its share of the loss."""
    train, acts = s.train, Activations(s.ledger)
    B, T = train.batch_size, train.seq_len
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
    return loss


def _context(tracer, **fields):
    return contextlib.nullcontext() if tracer is None else tracer.context(**fields)
