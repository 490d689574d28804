"""Delayed scaling: a per-tensor scale taken from the amaxes of earlier steps, not of the tensor cast.

    python -m pytest -q tests/test_fp8.py -k delayed

TransformerEngine's DelayedScaling recipe (transformer_engine/common/recipe/__init__.py; its update is
`amax_and_scale_update` in common/recipe/delayed_scaling.cu): each FP8 tensor (a layer's input,
weight, output gradient) keeps a float32 scale, starting at 1, and an amax history of
`amax_history_len` slots (1024 by default), all zero at first. A cast multiplies by the current scale
and records the tensor's amax in slot 0 (`record`; the largest if the tensor is cast more than once
in a step). After the step, `update`:
1. the amax that sets the scale is the largest in the whole history, slot 0 included ("max", the
   default), or slot 0 alone ("most_recent");
2. the history rolls by one: slot i takes slot i + 1, the last slot takes slot 0's amax, and slot 0
   is zeroed for the next step; so the window the scale is taken from is the last
   `amax_history_len` steps' amaxes;
3. scale = (fp8_max x 2^-margin) / amax, in float32, when that amax is finite and positive; otherwise
   the old scale stays (a step whose tensors were all zero, or overflowed, changes nothing).
A value beyond fp8_max / scale (the tensor grew since the history was taken) saturates at fp8_max
(refpar/fp8/formats.py:saturating_cast). torchao had a delayed recipe and deleted it (its
float8_linear.py says so); TE's is the one kept.
"""

from __future__ import annotations

import numpy as np

from refpar.fp8.formats import max_finite


class DelayedScale:
    """One tensor's delayed scale and amax history (TE's DelayedScaling state for one FP8 tensor)."""

    def __init__(self, fmt, history_len: int = 1024, algo: str = "max", margin: float = 0.0):
        if history_len < 1:
            raise ValueError(f"amax history length {history_len} must be at least 1")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"unknown amax algorithm {algo!r}; choose max or most_recent")
        self.fmt, self.algo, self.margin = np.dtype(fmt), algo, float(margin)
        self.history = np.zeros(history_len, dtype=np.float32)  # slot 0: this step's amax
        self.scale = np.float32(1.0)

    def record(self, amax) -> None:
        """This step's amax of the tensor (a step that casts it twice keeps the larger)."""
        # fmax, as CUDA's fmaxf: a NaN amax leaves the slot as it was, so no NaN enters the history
        self.history[0] = np.fmax(self.history[0], np.float32(amax))

    def update(self) -> None:
        """The scale from the history, then the history rolled (delayed_scaling.cu's kernel)."""
        rolled = np.roll(self.history, -1)  # slot i <- slot i + 1; the last <- slot 0
        amax = np.fmax.reduce(rolled) if self.algo == "max" else self.history[0]
        rolled[0] = 0.0
        self.history = rolled
        scaled_max = np.float32(max_finite(self.fmt) * 2.0 ** -self.margin)
        if np.isfinite(amax) and amax > 0:
            self.scale = np.float32(scaled_max / amax)

