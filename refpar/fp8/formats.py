"""The float8 formats of FP8 training, as ml_dtypes' NumPy dtypes, and the saturating cast to them.

    python -m pytest -q tests/test_fp8.py -k format

Three 8-bit formats (the OCP "8-bit Floating Point Specification (OFP8)" 2023 and the OCP
"Microscaling Formats (MX) v1.0" spec; ml_dtypes names them as below):
- E4M3 (`float8_e4m3fn`): 4 exponent bits, 3 mantissa bits, no infinity (the "fn"), one NaN per
  sign; largest finite 1.75 x 2^8 = 448, smallest normal 2^-6, smallest subnormal 2^-9. Forward
  operands (activations, weights) in every recipe; gradients too in the E4M3-throughout recipes.
- E5M2 (`float8_e5m2`): IEEE-like, 5 exponent bits, 2 mantissa bits, infinities and NaNs; largest
  finite 1.75 x 2^15 = 57344, smallest normal 2^-14, smallest subnormal 2^-16. Gradients in the
  "hybrid" recipes (E4M3 forward, E5M2 backward), for its range.
- E8M0 (`float8_e8m0fnu`): an exponent only, 2^(b - 127) for the byte b in 0..254, 255 is NaN. The
  shared scale of an MX block of 32 elements (refpar/fp8/scaling.py:mx_scale_exponent).

A float32 value rounds to E4M3 or E5M2 to nearest, ties to even: within half a unit in the last
place (`ulp`) of the value, which is `unit_roundoff` = 2^-(mantissa bits + 1) relative in the normal
range, and at most `half_subnormal_spacing` absolute below the smallest normal. ml_dtypes' own cast
turns a finite value beyond the largest into NaN (E4M3) or inf (E5M2); every recipe clamps first
(`saturating_cast`), as torchao's `to_fp8_saturated` and the GPUs' `satfinite` conversions do.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}  # recipe name of a format -> dtype


def max_finite(fmt) -> float:
    """The largest finite value: 448 for E4M3, 57344 for E5M2."""
    return float(ml_dtypes.finfo(fmt).max)


def mantissa_bits(fmt) -> int:
    """Explicit mantissa bits: 3 for E4M3, 2 for E5M2."""
    return int(ml_dtypes.finfo(fmt).nmant)


def min_normal_exponent(fmt) -> int:
    """The exponent of the smallest normal: -6 for E4M3, -14 for E5M2."""
    return int(ml_dtypes.finfo(fmt).minexp)


def unit_roundoff(fmt) -> float:
    """Relative rounding error bound in the normal range: 2^-4 for E4M3, 2^-3 for E5M2."""
    return 2.0 ** -(mantissa_bits(fmt) + 1)


def half_subnormal_spacing(fmt) -> float:
    """Absolute rounding error bound below the smallest normal: 2^-10 for E4M3, 2^-17 for E5M2."""
    return 2.0 ** (min_normal_exponent(fmt) - mantissa_bits(fmt) - 1)


def ulp(value, fmt):
    """The spacing of `fmt`'s values at |value| (an array): 2^(max(e, emin) - mantissa bits), where
    2^e <= |value| < 2^(e+1): in the subnormal range the spacing stays that of the smallest normal."""
    _, e = np.frexp(np.abs(np.asarray(value, dtype=np.float64)))  # |value| = m 2^e, m in [0.5, 1)
    return np.ldexp(1.0, np.maximum(e - 1, min_normal_exponent(fmt)) - mantissa_bits(fmt))


def saturating_cast(scaled, fmt):
    """float32 values already multiplied by their scale, clamped to +-max_finite(fmt) (inf included;
    NaN stays NaN) and rounded to `fmt`, to nearest, ties to even."""
    top = max_finite(fmt)
    return np.clip(np.asarray(scaled, dtype=np.float32), -top, top).astype(fmt)
