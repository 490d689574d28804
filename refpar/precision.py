"""Mixed precision: the names, the dtypes, fp32 compute around 16-bit arrays, and loss scaling.

A run's precision is one of `PRECISIONS`; it sets `ModelConfig.dtype`, the dtype of the parameters
and of every activation between ops. A 16-bit dtype always means *mixed* precision (Micikevicius
et al. 2018): the optimizer keeps fp32 master weights (`MASTER_DTYPE`) and fp32 moments, and each op
reads 16-bit inputs, computes in fp32 and rounds its outputs to 16 bits once (`fp32_compute`).
NumPy has no bfloat16: `ml_dtypes` (a NumPy extension made for this) provides it; importing this
module registers it, so `np.dtype("bfloat16")` works everywhere after `import refpar.config`.

fp16's largest finite value is 65504 and its smallest normal 2^-14, so small gradients underflow:
fp16 runs multiply the loss by a scale before backward and divide the gradients by it in the
optimizer (`LossScaler`). bf16 has fp32's exponent range and uses no loss scaling.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

# --precision name -> ModelConfig.dtype
PRECISIONS = {"fp64": "float64", "fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
MASTER_DTYPE = np.dtype(np.float32)  # master weights, moments, and what 16-bit ops compute in
_DTYPES = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32),
           "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
_SIXTEEN_BIT = ("bfloat16", "float16")
_NUMPY_SIXTEEN_BIT = frozenset(_DTYPES[name] for name in _SIXTEEN_BIT)


def dtype_of(name_or_dtype) -> np.dtype:
    """The NumPy dtype of a dtype name ("bfloat16"), a precision name ("bf16-mixed") or a dtype."""
    if isinstance(name_or_dtype, str):
        name = PRECISIONS.get(name_or_dtype, name_or_dtype)
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; choose one of "
                             f"{', '.join(_DTYPES)} or a precision {', '.join(PRECISIONS)}")
        return _DTYPES[name]
    return np.dtype(name_or_dtype)


def precision_of(dtype) -> str:
    """The --precision name of a dtype or dtype name: "bfloat16" -> "bf16-mixed"."""
    name = dtype_of(dtype).name
    return next(p for p, d in PRECISIONS.items() if d == name)


def _dtype_name(dtype) -> str:
    """"bfloat16" for NumPy's, torch's ("torch.bfloat16") or array-api-strict's bfloat16 dtypes."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def is_16bit(dtype) -> bool:
    """Whether `dtype` (any library's dtype object, or a name) is bfloat16 or float16."""
    return (dtype if isinstance(dtype, str) else _dtype_name(dtype)) in _SIXTEEN_BIT


# ------------------------------------------------------------------------------- fp32 compute
def _is_array(a) -> bool:
    return hasattr(a, "dtype") and hasattr(a, "shape") and not isinstance(a, np.generic)


def _first_16bit(values):
    """The 16-bit dtype of the first 16-bit array found in nested tuples, lists and dicts, or None."""
    for a in values:
        if type(a) is np.ndarray:  # the common case, first: this runs around every op of every step
            if a.dtype in _NUMPY_SIXTEEN_BIT:
                return a.dtype
            continue
        if isinstance(a, tuple | list):
            found = _first_16bit(a)
        elif isinstance(a, dict):
            found = _first_16bit(a.values())
        else:
            found = a.dtype if _is_array(a) and is_16bit(a.dtype) else None
        if found is not None:
            return found
    return None


def _upcast(a, originals: dict):
    """16-bit arrays in `a` (nested) as fp32 copies; `originals` maps each result's id to the input
    it came from, so that an input passed through to a cache is returned as itself."""
    if isinstance(a, tuple | list):
        return type(a)(_upcast(x, originals) for x in a)
    if isinstance(a, dict):
        return {k: _upcast(x, originals) for k, x in a.items()}
    if not _is_array(a):
        return a
    if is_16bit(a.dtype):
        from array_api_compat import array_namespace

        xp = array_namespace(a)
        up = xp.astype(a, xp.float32)
        originals[id(up)] = a
        return up
    originals[id(a)] = a
    return a


def _round(a, dtype, originals: dict):
    """fp32 arrays of one or more dimensions in `a` (nested) rounded to `dtype`; 0-d arrays (losses)
    stay fp32; inputs passed through come back as the caller's own arrays, and an array found twice
    (attention's probabilities are also its dropped ones without dropout) is rounded once, so the
    cache keeps one 16-bit array as float64 keeps one."""
    if isinstance(a, tuple | list):
        return type(a)(_round(x, dtype, originals) for x in a)
    if isinstance(a, dict):
        return {k: _round(x, dtype, originals) for k, x in a.items()}
    if not _is_array(a):
        return a
    if id(a) in originals:
        return originals[id(a)]
    if a.ndim >= 1 and _dtype_name(a.dtype) == "float32":
        from array_api_compat import array_namespace

        originals[id(a)] = array_namespace(a).astype(a, dtype)  # `a` is alive: its id stays its own
        return originals[id(a)]
    return a


def fp32_compute(fn):
    """Runs `fn` in fp32 when any of its array arguments is 16-bit, as fused GPU kernels do: the
    16-bit inputs are upcast (exact), `fn` computes in fp32 (so a matmul accumulates in fp32 like a
    tensor core), and every fp32 output of one or more dimensions, caches included, is rounded to the
    16-bit dtype once. 0-d outputs (a loss) stay fp32. With no 16-bit argument `fn` runs untouched,
    so float64 and float32 models are bit-identical with or without this decorator. Overflow to inf
    is silent, as on a GPU: fp16 loss scaling expects it and checks the gradients for it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dtype = _first_16bit(args) or _first_16bit(kwargs.values())
        if dtype is None:
            return fn(*args, **kwargs)
        originals: dict = {}
        with np.errstate(over="ignore", invalid="ignore"):
            out = fn(*_upcast(args, originals), **_upcast(kwargs, originals))
            return _round(out, dtype, originals)

    return wrapper


# ------------------------------------------------------------------------------- loss scaling
def overflow_anywhere(grads, comms, tag: str | None = None) -> bool:
    """Whether any rank found an inf or nan in its gradients (a dict or an iterable of arrays),
    agreed with one all-reduce (max) of a float32 flag over each of `comms`, the axes over which the
    gradients differ (traced, 4 bytes each; `tag` default `found_inf.{axis}`): every rank then skips
    the step, or none does. No comms: this rank's own check, no message."""
    flag = np.array([1.0 if has_overflow(grads) else 0.0], dtype=MASTER_DTYPE)
    for comm in comms:
        flag = comm.all_reduce(flag, op="max", tag=tag or f"found_inf.{comm.axis}")
    return bool(flag[0] > 0)


def has_overflow(grads) -> bool:
    """Whether any gradient (a dict or an iterable of arrays) holds an inf or a nan."""
    from array_api_compat import array_namespace

    arrays = grads.values() if isinstance(grads, dict) else grads
    for g in arrays:
        if g is None:
            continue
        xp = array_namespace(g)
        if not bool(xp.all(xp.isfinite(g))):
            return True
    return False


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018; torch.amp.GradScaler's rule).

    Backward starts from dloss = `scale`; the optimizer multiplies the gradients by 1/scale. After
    backward (and the gradient reduction) the caller checks the gradients for inf/nan and calls
    `update(found_inf)`: on overflow the step is skipped and the scale multiplied by `backoff`;
    after `growth_interval` good steps in a row it is multiplied by `growth`."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 backoff: float = 0.5, growth: float = 2.0):
        self.scale = float(init_scale)
        self.growth_interval, self.backoff, self.growth = growth_interval, backoff, growth
        self.good_steps = 0  # good steps in a row since the last change of scale
        self.skipped = 0  # steps skipped so far in this run

    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step that overflowed (`found_inf`, the step was skipped) or not."""
        if found_inf:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint stores so that a resumed run scales exactly as an unbroken one."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])


def loss_scaler(model, train) -> LossScaler | None:
    """The run's LossScaler: fp16-mixed only (`train.loss_scale`, `train.loss_scale_window` or the
    defaults 2^16 and 1000); None for every other precision."""
    if dtype_of(model.dtype) != _DTYPES["float16"]:
        return None
    defaults = LossScaler()
    return LossScaler(init_scale=train.loss_scale or defaults.scale,
                      growth_interval=train.loss_scale_window or defaults.growth_interval)
