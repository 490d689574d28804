"""Storage views: a cache's views of a unit's flat buffer swapped for their positions and back, so
that releasing a gathered unit (ZeRO-3, FSDP: refpar/parallel/zero.py) really drops it.

    params, bases = states.acquire(keys, phase, hold)   # bases: unit -> the flat buffer params view
    cache = detach(cache, bases)                         # positions, not views: the buffer can go
    cache = attach(cache, states.acquire(keys, "bwd", hold)[1])  # views of the buffer gathered again

refpar/parallel/pipeline/stage.py calls both around each piece; refpar/parallel/model_states.py
says what `acquire` and `release` do.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import is_cupy_array, is_torch_array

from refpar import backend


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
