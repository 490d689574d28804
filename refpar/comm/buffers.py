"""What MPI moves for a Communicator (communicator.py): contiguous host copies of the caller's
arrays, device arrays staged through the host (the MPI library is not GPU-aware), 16-bit floats as
their bit patterns, and the counts and displacements of the v-collectives. No mpi4py here.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import is_array_api_obj

from refpar import backend
from refpar.precision import dtype_of


def to_host(x):
    """(contiguous NumPy array, the input as a template for results, or None for NumPy input).

    Device arrays (torch CUDA, CuPy) are staged: copied to the host after their device's queued
    work, and results copied back to the same device; the MPI library here is not GPU-aware."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x), None
    if not is_array_api_obj(x):
        return np.ascontiguousarray(np.asarray(x)), None
    return np.ascontiguousarray(backend.to_host(x)), x


def from_host(a: np.ndarray, like):
    """`a` in the namespace and on the device of `like` (None: NumPy as it is)."""
    return a if like is None else backend.as_like(a, like)


def staged(like) -> bool:
    """Whether a call's data went through host buffers on its way from and to a device."""
    return like is not None and backend.on_device(like)


_DTYPE_NAMES: dict = {}  # dtype.name runs Python code in NumPy; a traced call should cost microseconds


def dtype_name(dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return _DTYPE_NAMES[dtype]


# The 16-bit floats of mixed precision: MPI has no bfloat16 (and NumPy exports no buffer of one),
# so both travel as their 2-byte bit patterns, a uint16 view of the same memory. The trace still
# records the real dtype and its 2-byte itemsize.
SIXTEEN_BIT = frozenset({dtype_of("bfloat16"), dtype_of("float16")})


def wire(a: np.ndarray) -> np.ndarray:
    """What MPI moves for `a`: the array itself, or the uint16 view of a 16-bit float array."""
    return a.view(np.uint16) if a.dtype in SIXTEEN_BIT else a


def require_axis0(a: np.ndarray, op: str) -> None:
    if a.ndim == 0:
        raise ValueError(f"{op} splits or joins axis 0; give it an array of at least one dimension")


def row_size(a: np.ndarray) -> int:
    return int(np.prod(a.shape[1:], dtype=np.int64))


def displacements(counts: list[int], unit: int) -> list[int]:
    return [int(d) * unit for d in np.concatenate([[0], np.cumsum(counts)[:-1]])]
