"""A rank's parameters as flat units: what DP, ZeRO and FSDP (data_parallel.py, zero.py, fsdp.py)
share, and the hooks a pipeline stage (pipeline/stage.py) calls them through.

Legend: Ψ_u elements of unit u on this rank (of its tp shards), Ψl = Σ Ψ_u, s_u this rank's
`shard_range` share of u over the unit's group.

A unit (refpar/holdings.py: `wte`, `root`, `h.i`, `h.i.experts`) is one flat buffer of parameters.
Each has a replica group, the ranks holding the same weights, over which DP sums its gradient and
ZeRO shards it: the mesh's `dp_cp` group for a dense model's weights and a MoE model's experts, its
`data` group (dp x ep x cp) for a MoE model's dense weights. The rank lays its units end to end,
the dense group's first, each group's in stage order (`Units`): DP's buckets are runs of it.

A stage runs its pieces (embedding, blocks, head) and asks the strategy around each one:

    params, bases = hooks.acquire(keys, phase, hold)  # the units' parameters (ZeRO-3 gathers)
    hooks.release(keys, phase, hold)                   # (ZeRO-3 frees, unless still held)
    hooks.fold(grads)                                  # a piece's gradients into the accumulator
    hooks.done(keys)                                   # these units' gradients are complete

`hold` keeps units acquired across pieces (the head's from its forward to its backward; FSDP's root
from the embedding on): a unit is released when its last hold is. `bases` are the flat buffers the
parameters view; `detach` swaps a cache's views of them for positions, so releasing a gathered unit
really drops it, and `attach` points the cache at the buffer gathered again for the backward.

Mixed precision: parameters in bf16/fp16, gradients in that dtype (fp32 with fp32_grads), fp32
master weights and moments on the ranks that own them (`StateDtypes`), every buffer made in the
backend's namespace (`backend.zeros`); the optimizer runs `mixed_adamw_update` on flat segments.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, is_cupy_array, is_torch_array

from refpar import backend
from refpar.holdings import expert_unit, rank_units, unit_order, units
from refpar.memory import nbytes_of
from refpar.model.optim import adamw_update, decays, mixed_adamw_update, mixed_sgd_update, sgd_update
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit, loss_scaler, overflow_anywhere
from refpar.sharding import shard_range, shard_sizes


class StateDtypes:
    """The dtypes a data-parallel strategy keeps: `param` (the model's), `grad` (the param dtype, or
    fp32 with fp32_grads), `state` (master weights and moments: fp32 when mixed, else the param
    dtype); `mixed` says whether fp32 master weights exist; `wide` whether gradients accumulate
    wider than backward writes them (fp32_grads); `lowp` whether the 16-bit gradients backward
    writes then stay beside the fp32 accumulator (holdings.keeps_lowp). `scaler` is fp16's
    LossScaler or None."""

    def __init__(self, config, train, lowp: bool = True):
        self.param = dtype_of(config.dtype)
        self.mixed = is_16bit(self.param)
        self.grad = MASTER_DTYPE if self.mixed and train.fp32_grads else self.param
        self.state = MASTER_DTYPE if self.mixed else self.param
        self.wide = self.grad != self.param
        self.lowp = self.wide and lowp
        self.scaler = loss_scaler(config, train)

    @property
    def dloss(self) -> float:
        """Where backward starts: the loss scale for fp16, else 1."""
        return 1.0 if self.scaler is None else self.scaler.scale

    @property
    def inv_scale(self) -> float:
        return 1.0 if self.scaler is None else 1.0 / self.scaler.scale


class Units:
    """This rank's units: `stages` maps each of its pipeline stages to the names it holds there,
    `shapes` every held parameter's (tp-shard) shape (in the family's order), `group_of(expert: bool)`
    the replica group of dense or expert units, `uses[s]` how many microbatches stage s runs,
    `tied` the model's holdings.tied_embedding (the `wte` unit; None: no unit is tied).
    `names[u]`, `size[u]` (Ψ_u), `group[u]`, `own[u]` ([a, b) of this rank), `counts[u]` (every
    group rank's s_u), `start[u]` (where u begins in the rank's flat buffer of Ψl), `backwards[u]`
    how many backward pieces complete u in a step (m; more where two stages hold it).

    A unit two stages of the rank hold is one: a V's rank 0 runs the embedding (stage 0) and the
    tied head (stage 2p-1), so its wte sums both ends' gradients, and its root is wpe and ln_f."""

    def __init__(self, stages: dict[int, list[str]], shapes: dict, group_of, uses: dict[int, int],
                 tied: str | None = "wte.weight"):
        self.shapes = shapes
        by_stage = {s: units(names, tied) for s, names in sorted(stages.items())}
        # in GPT-2's order inside a unit: DualPipe's mirror ranks hold a root of wpe and ln_f from
        # stages in the other order, and sum_copies adds their buffers element by element
        self.names = {u: [n for n in shapes if n in names] for u, names in rank_units(by_stage).items()}
        self.backwards = {u: sum(uses[s] for s, us in by_stage.items() if u in us) for u in self.names}
        self.of_stage = {s: list(us) for s, us in by_stage.items()}
        self.offsets: dict[str, tuple[str, int, int]] = {}  # name -> (unit, start, stop) in the unit
        self.size, self.start, self.group, self.own, self.counts = {}, {}, {}, {}, {}
        total = 0
        for u, names in self.names.items():
            at = 0
            for n in names:
                self.offsets[n] = (u, at, at + int(np.prod(shapes[n])))
                at += int(np.prod(shapes[n]))
            self.size[u], self.start[u] = at, total
            total += at
            g = self.group[u] = group_of(expert_unit(u))
            self.own[u], self.counts[u] = shard_range(at, g.size, g.rank), shard_sizes(at, g.size)
        self.total = total  # Ψl

    def sum_copies(self, copies, grads) -> None:
        """DualPipe's other copy: every unit's gradient (`grads(unit)`, whole or this rank's shard)
        summed over `copies`, the mirror rank holding the same parts, in one all-reduce. The two
        lay their units out in other orders (each its own stages first), so in GPT-2's order here."""
        order = sorted(self.names, key=unit_order)
        xp = array_namespace(grads(order[0]))
        summed = copies.all_reduce(xp.concat([grads(k) for k in order]), tag="copies:grads")  # (Σ,)
        at = 0
        for k in order:
            g = grads(k)
            g[...] = summed[at:at + g.shape[0]]
            at += g.shape[0]

    def of(self, names) -> list[str]:
        """The units the parameters `names` belong to, in layout order."""
        held = {self.offsets[n][0] for n in names}
        return [u for u in self.names if u in held]

    def flatten(self, unit: str, arrays: dict):
        xp = array_namespace(arrays[self.names[unit][0]])
        return xp.concat([xp.reshape(arrays[n], (-1,)) for n in self.names[unit]])  # (Ψ_u,)

    def slice(self, unit: str, flat):
        """The unit's (Ψ_u,) part of a (Ψl,) buffer laid out as the rank's units."""
        return flat[self.start[unit]:self.start[unit] + self.size[unit]]

    def views(self, unit: str, flat) -> dict:
        """The unit's parameters as reshaped views of its flat buffer (writes go through)."""
        xp = array_namespace(flat)
        return {n: xp.reshape(flat[a:b], self.shapes[n]) for n in self.names[unit]
                for _, a, b in [self.offsets[n]]}

    def segments(self, unit: str, start: int, stop: int):
        """(name, lo, hi) of every parameter overlapping [start, stop) of the unit, in unit
        coordinates: a flat shard is updated one parameter segment at a time so that weight decay
        follows each parameter's shape, as on one device."""
        for n in self.names[unit]:
            _, a, b = self.offsets[n]
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield n, lo, hi


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


class Hooks:
    """What DP, ZeRO and FSDP share: the unit layout, the dtypes, the optimizer's step count, the
    backward pieces a unit's gradient still waits for, and the optimizer update on flat segments."""

    def __init__(self, units_: Units, config, train, ledger, lowp: bool = True):
        self.units, self.config, self.train, self.ledger = units_, config, train, ledger
        self.dtypes = StateDtypes(config, train, lowp)
        self.t = 0
        self.waiting: dict[str, int] = {}  # unit -> backward pieces whose gradient is still to come

    def begin_step(self) -> None:
        self.waiting = dict(self.units.backwards)

    def zeros(self, like, n: int, dtype=None):
        """(n,) zeros of `dtype` (default the gradients') in `like`'s namespace and device."""
        return backend.zeros(like, n, self.dtypes.grad if dtype is None else dtype)

    def last(self, unit: str) -> bool:
        """Counts one backward piece of `unit` done; whether it was the step's last."""
        self.waiting[unit] -= 1
        return self.waiting[unit] == 0

    def piece(self, grads: dict, fold) -> None:
        """A piece's gradient dict, held while `fold(name, g)` adds each into its buffer."""
        self.ledger.alloc("grads.piece", sum(nbytes_of(g) for g in grads.values()), "grads")
        for u in self.units.of(grads):
            fold(u, {n: g for n, g in grads.items() if self.units.offsets[n][0] == u})
        self.ledger.free("grads.piece")

    def held_grads(self) -> list:
        """(unit, first element, flat array) of the reduced gradient this rank keeps of each unit
        after `finish`: what the optimizer reads (DataParallel: whole units; Zero: its shards)."""
        raise NotImplementedError

    def partial_sums(self, wte, segments: list, embedding, tp, copies=None, grads=None) -> None:
        """After the backward, the sums over the ranks that each hold a part of one gradient: the
        tied wte's (`wte`: this rank's view of its gradient, or None) over the embedding group,
        DualPipe's two copies' over `copies` (`sum_copies`, each unit's gradient `grads(unit)`), and
        the sequence-sharded region's (`segments`: (array, lo, hi) of each piece of its gradients
        this rank keeps) coalesced into one all-reduce over tp."""
        if embedding is not None and wte is not None:
            wte[...] = embedding.all_reduce(wte, tag="wte.weight:tied-grad")
        if copies is not None:
            self.units.sum_copies(copies, grads)
        if segments:
            xp = array_namespace(segments[0][0])
            summed = tp.all_reduce(xp.concat([a[lo:hi] for a, lo, hi in segments]),
                                   tag="sp.replicated_grads:bwd")  # (Σ segments,)
            at = 0
            for a, lo, hi in segments:
                a[lo:hi] = summed[at:at + hi - lo]
                at += hi - lo

    def overflowed(self, comms: list) -> bool:
        """fp16 only (False otherwise, no message): whether any rank's gradients hold an inf or a
        nan, agreed over `comms`, the groups whose ranks hold different gradients; the loss scale
        backs off or grows."""
        scaler = self.dtypes.scaler
        if scaler is None:
            return False
        found = overflow_anywhere([g for _, _, g in self.held_grads()], comms)
        scaler.update(found)
        return found

    def begin_update(self, differ: list, clip=None) -> float | None:
        """What the optimizer multiplies this step's gradients by: 1/loss scale (of the scale this
        step's backward used, taken before the overflow check moves it), times the clipping
        coefficient of `clip` (refpar/parallel/clipping.py) if given. None when fp16 found an
        overflow: every rank skips the step before clipping, t not advanced."""
        factor = self.dtypes.inv_scale
        if self.overflowed(differ):
            return None
        self.t += 1
        return factor if clip is None else factor * clip.coefficient(self, factor)

    def update(self, unit: str, p, g, state: dict, start: int, master, lr: float, factor: float) -> None:
        """One optimizer step at learning rate `lr`, in place, on flat arrays covering [start,
        start + len(p)) of `unit`, the gradient multiplied by `factor` (`begin_update`). The
        update is elementwise, so a shard gets the single device's numbers; it runs one parameter
        segment at a time so weight decay follows each parameter's full shape (optim.decays).
        With `master` (mixed precision) master and moments update in fp32 and p becomes master in
        16 bits."""
        cfg = self.train
        for name, lo, hi in self.units.segments(unit, start, start + p.shape[0]):
            s = slice(lo - start, hi - start)
            decay = decays(self.units.shapes[name], cfg)  # a tp shard has its parameter's dimensions
            if master is not None and cfg.optimizer == "adamw":
                p[s], master[s], state["m"][s], state["v"][s] = mixed_adamw_update(
                    p[s], g[s], master[s], state["m"][s], state["v"][s], self.t, cfg, decay, lr, factor)
            elif master is not None:
                p[s], master[s] = mixed_sgd_update(p[s], g[s], master[s], cfg, decay, lr, factor)
            elif cfg.optimizer == "adamw":
                p[s], state["m"][s], state["v"][s] = adamw_update(
                    p[s], g[s], state["m"][s], state["v"][s], self.t, cfg, decay, lr, factor)
            else:
                p[s] = sgd_update(p[s], g[s], cfg, decay, lr, factor)


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


def detach(cache, bases: dict):
    """`cache` with every array viewing one of `bases` (unit -> flat buffer) replaced by (unit, its
    position in that buffer), so the cache does not keep the buffer alive."""
    if not bases:  # nothing was gathered (DP, ZeRO-1/2): views of buffers kept anyway hold nothing
        return cache
    owners: dict[int, tuple] = {}
    for unit, base in bases.items():  # the first unit that views a buffer names it
        owners.setdefault(id(backend.owner(base)), (unit, base))
    return _detach(cache, owners)


def _detach(cache, owners: dict):
    """`detach` below its entry: `owners` maps each buffer's owner's id to (unit, buffer)."""
    if backend.is_array(cache):
        unit_base = owners.get(id(backend.owner(cache)))
        return cache if unit_base is None else (unit_base[0], _position(cache, unit_base[1]))
    if isinstance(cache, tuple | list):
        return type(cache)(_detach(c, owners) for c in cache)
    if isinstance(cache, dict):  # a MoE block's cache (its experts' linear caches hold weights)
        return {k: _detach(c, owners) for k, c in cache.items()}
    return cache


def attach(cache, bases: dict):
    """Inverse of `detach` on buffers of the same layout (gathered again, or the same ones)."""
    if not bases:  # `detach` replaced nothing
        return cache
    if isinstance(cache, tuple) and len(cache) == 2 and isinstance(cache[1], _ParamView):
        return _view_at(bases[cache[0]], cache[1])
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, bases) for c in cache)
    if isinstance(cache, dict):
        return {k: attach(c, bases) for k, c in cache.items()}
    return cache
