"""The run's backend: which array namespace and device a run computes in (NumPy by default).

    from refpar import backend
    backend.use("torch")                 # torch CPU tensors; backend.use("torch", "cuda") on a GPU
    params = backend.current().from_host(init_params(model, seed))

Numeric code takes its namespace from its inputs (array-api-compat), so only code that creates
arrays from nothing asks the backend: the initialisation, data batches and optimizer state are
drawn on the host with refpar.rng (the same numbers whatever the backend) and moved with
`from_host`. Communication stages device arrays through host buffers (refpar/comm/communicator.py)
after `synchronize`; `gpu_backend/` holds the CuPy and torch backends and the device transport.
Mixed precision's bfloat16 is ml_dtypes' on the host and torch's own on torch: an array crosses
between them as its 16-bit pattern (`from_host`, `as_like`, `to_host`), the same values.
"""

from __future__ import annotations

import importlib

import numpy as np
from array_api_compat import is_array_api_obj, is_cupy_array, is_numpy_array, is_torch_array

from refpar.config import ConfigError
from refpar.precision import dtype_of

BACKENDS = ("numpy", "torch", "cupy")
# Accelerator backends live in gpu_backend/ and register themselves when their module is imported:
# the core names the module (a string) and never imports it directly, so it does not depend on them.
PLUGINS = {"torch": "gpu_backend.torch_backend", "cupy": "gpu_backend.cupy_backend"}
_registered: dict[str, type] = {}


def register(name: str, cls: type) -> None:
    """Called by a plugin module as it is imported: `cls(device)` builds backend `name`."""
    _registered[name] = cls


class NumpyBackend:
    """The reference: NumPy arrays on the host; moving is a no-op."""

    name, device = "numpy", "cpu"

    def from_host(self, a):
        """A NumPy array, or a dict of them, in this backend's namespace and device."""
        if isinstance(a, dict):
            return {k: self.from_host(v) for k, v in a.items()}
        return self._move(np.asarray(a))

    def _move(self, a: np.ndarray):
        return a

    def synchronize(self) -> None:
        """Waits for the device's queued work, so a host copy sees finished results."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r})"


class StrictBackend(NumpyBackend):
    """array-api-strict: a CPU namespace that refuses anything outside the array API standard, so
    a run on it proves no NumPy-only call is left on that path (what CI runs instead of a GPU)."""

    name = "array-api-strict"

    def __init__(self):
        try:
            import array_api_strict
        except ImportError:
            raise ConfigError("the array-api-strict backend needs the array-api-strict package; "
                              "install refpar[dev]") from None
        self.xp = array_api_strict

    def _move(self, a):
        return self.xp.asarray(a, copy=True)


def get(name: str, device: str | None = None):
    """The backend called `name` (numpy, torch or cupy) on `device` (default: cpu for numpy and
    torch, the rank's GPU for cupy); ConfigError when it is unknown or cannot run here."""
    if name == "numpy":
        if device not in (None, "cpu"):
            raise ConfigError(f"the numpy backend runs on the host, not on {device!r}; use "
                              "--backend torch or cupy for a GPU")
        return NumpyBackend()
    if name in PLUGINS:
        importlib.import_module(PLUGINS[name])  # registers it
        return _registered[name](device or "cpu") if name == "torch" else _registered[name](device)
    if name == "array-api-strict" and device in (None, "cpu"):
        return StrictBackend()
    raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} (or "
                      "array-api-strict on the CPU, for tests)")


_current = NumpyBackend()


def use(name: str, device: str | None = None):
    """Makes `name` the backend of this process's runs and returns it (one call per process)."""
    global _current
    _current = get(name, device)
    return _current


def current():
    """The backend chosen with `use` (NumPy unless another was chosen)."""
    return _current


def to_host(x) -> np.ndarray:
    """Any array (NumPy, torch on any device, CuPy, array-api-strict) as a NumPy array on the host;
    device arrays are copied after their device's queued work is done."""
    if is_numpy_array(x):
        return x
    if is_torch_array(x):
        from array_api_compat import array_namespace

        x, xp = x.detach().cpu(), array_namespace(x)  # .cpu() waits for the CUDA stream
        if x.dtype == xp.bfloat16:  # NumPy reads no torch bfloat16: its bits, as ml_dtypes'
            return x.view(xp.int16).numpy().view(dtype_of("bfloat16"))
        return x.numpy()
    if is_cupy_array(x):
        return x.get()  # cupy's device-to-host copy synchronises its stream
    if is_array_api_obj(x):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            return np.asarray(x)
    return np.asarray(x)


def as_like(a, like):
    """`a` (a NumPy array from the host or a message, a list, ...) as an array of the namespace and
    device of the array `like`. A NumPy bfloat16 array (ml_dtypes') goes to torch as its bit
    pattern: torch reads no ml_dtypes array, and both formats are the top 16 bits of a float32."""
    if type(a) is np.ndarray and type(like) is np.ndarray:  # NumPy's asarray would return `a` itself
        return a
    from array_api_compat import array_namespace, device

    xp = array_namespace(like)
    if is_torch_array(like) and is_numpy_array(a) and a.dtype == dtype_of("bfloat16"):
        return xp.asarray(a.view(np.int16), device=device(like)).view(xp.bfloat16)
    return xp.asarray(a, device=device(like))


def is_array(x) -> bool:
    """True for an array of any namespace refpar computes with."""
    if type(x) is np.ndarray:  # the common case, first: caches are walked for this every action
        return True
    return is_numpy_array(x) or is_torch_array(x) or is_cupy_array(x) or is_array_api_obj(x)


def owner(a):
    """The array that owns the memory `a` views (itself when it owns it), so a buffer viewed from
    several places is counted once."""
    if is_torch_array(a):
        return a if a._base is None else a._base  # torch keeps one level: _base owns the storage
    while getattr(a, "base", None) is not None and is_array(a.base):
        a = a.base
    return a


def dtype_like(like, dtype):
    """The dtype `dtype` (a NumPy dtype or name, bfloat16 included) in the namespace of the array
    `like`: what buffers created beside it (fp32 masters, gradients, 16-bit copies) are made of."""
    if is_numpy_array(like):
        return np.dtype(dtype)
    from array_api_compat import array_namespace

    return getattr(array_namespace(like), np.dtype(dtype).name)


def zeros(like, n: int, dtype):
    """(n,) zeros of `dtype` in the namespace and on the device of `like`."""
    from array_api_compat import array_namespace, device

    return array_namespace(like).zeros(n, dtype=dtype_like(like, dtype), device=device(like))


def host_dtype(x) -> np.dtype:
    """The NumPy dtype `x`'s elements have on the host (what a receive buffer is made of)."""
    return to_host(x[:0] if x.ndim else x).dtype


def on_device(x) -> bool:
    """True for an array that lives in device memory (not on the host)."""
    if is_torch_array(x):
        return x.device.type != "cpu"
    return is_cupy_array(x)
