"""How a recipe's scale comes from an amax: per tile of a 2-D operand, as a float32 factor or as an
MX block's power-of-two E8M0 exponent.

    python -m pytest -q tests/test_fp8.py -k scale

Legend: R = rows of an operand laid out (R, K), K = the GEMM's contraction axis, last; a tile is
(tr, tk) elements and every recipe's scale is one number per tile: the whole (R, K) for per-tensor
scaling, (1, K) per row, (1, 128) or (128, 128) for DeepSeek-V3's blocks, (1, 32) for MX.

The float scale (torchao's float8/float8_utils.py:amax_to_scale, TransformerEngine's
compute_scale_from_amax) maps the tile's amax onto the format's largest value: scale = fp8_max / amax,
divided in float64 and rounded to float32, amax floored at 1e-12 so that an all-zero tile gets a
finite scale. Optionally rounded down to a power of two (torchao's rowwise recipe, TE's
`force_pow_2_scales`): exactly, from the float32 bits as TE does. torchao takes exp2(floor(log2(s)))
in float32, whose log2 rounds a scale a few ulps below a power of two up to it (1024 (1 - 2^-22)
gives 1024 there, 512 here). A NaN or inf amax gives a NaN or zero scale here and in torchao, where
TE keeps a scale of 1.

MX's scale (OCP "Microscaling Formats (MX) v1.0", section 6.3) is 2^e with e stored as an E8M0 byte
e + 127. "floor" (the spec's rule, torchao's default ScaleCalculationMode.FLOOR):
e = floor(log2(amax)) - floor(log2(fp8_max)), from amax's float32 exponent bits; the block's largest
element then scales into [256, 512) for E4M3, so one above 448 saturates. "rceil" (cuBLAS's and
TransformerEngine's MXFP8 rule): e = ceil(log2(amax / fp8_max)), so nothing saturates; a NaN amax
gives the NaN byte 255 and an inf amax the byte 254 (2^127); as TE's exp2f_rcp, the byte 0 scales
the elements by 1, not by 2^127.
"""

from __future__ import annotations

import numpy as np

from refpar.fp8.formats import max_finite

AMAX_FLOOR = 1e-12  # torchao's float8_utils.EPS: the least amax a float scale is computed from
E8M0_BIAS = 127
E8M0_NAN = 255


def tile_amax(x, tile: tuple[int, int]):
    """max |x| over each (tr, tk) tile of x (R, K) -> (R // tr, K // tk) float32; NaN if the tile
    holds one. The caller has checked that the tiles divide the shape."""
    (R, K), (tr, tk) = x.shape, tile
    blocks = np.abs(x).reshape(R // tr, tr, K // tk, tk)  # (R/tr, tr, K/tk, tk)
    return blocks.max(axis=(1, 3)).astype(np.float32)  # (R/tr, K/tk)


def per_element(per_tile, tile: tuple[int, int]):
    """A per-tile array (R // tr, K // tk) repeated onto every element (R, K)."""
    return np.repeat(np.repeat(per_tile, tile[0], axis=0), tile[1], axis=1)


def round_down_to_power_of_2(scale):
    """The largest power of two <= each positive finite float32 scale (its mantissa bits cleared, as
    TE's compute_scale_from_amax); zero, inf and NaN are left as they are."""
    bits = np.asarray(scale, dtype=np.float32).view(np.uint32)
    return np.where(np.isfinite(scale), (bits & np.uint32(0xFF800000)).view(np.float32), scale)


def amax_to_scale(amax, fmt, power_of_2: bool = False):
    """float32 scale = fp8_max / max(amax, 1e-12), the division in float64 (torchao's
    amax_to_scale), optionally rounded down to a power of two."""
    amax64 = np.maximum(np.asarray(amax, dtype=np.float64), AMAX_FLOOR)  # NaN stays NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = (max_finite(fmt) / amax64).astype(np.float32)
    return round_down_to_power_of_2(scale) if power_of_2 else scale


def mx_scale_exponent(amax, fmt, rounding: str = "floor"):
    """Each block's E8M0 byte (uint8, exponent + 127; 255 for a NaN amax) from its float32 amax."""
    amax = np.asarray(amax, dtype=np.float32)
    emax = int(np.floor(np.log2(max_finite(fmt))))  # 8 for E4M3, 15 for E5M2
    if rounding == "floor":
        # floor(log2 amax) is amax's unbiased float32 exponent (its bits, as torchao reads them: a
        # float32 subnormal reads as -127, which clamps to the same byte)
        exponent = ((amax.view(np.uint32) >> 23) & 0xFF).astype(np.int64) - E8M0_BIAS
        e = np.clip(exponent - emax, -E8M0_BIAS, E8M0_BIAS + 1)
        return np.where(np.isnan(amax), E8M0_NAN, e + E8M0_BIAS).astype(np.uint8)
    if rounding == "rceil":
        descale = amax / np.float32(max_finite(fmt))  # float32, as the GPUs compute it
        m, exponent = np.frexp(descale)  # descale = m 2^exponent, m in [0.5, 1): ceil(log2) exactly
        e = np.where(m == 0.5, exponent - 1, exponent)
        e = np.where(descale == 0, -E8M0_BIAS, np.clip(e, -E8M0_BIAS, E8M0_BIAS))
        e = np.where(np.isinf(descale), E8M0_BIAS, e)  # byte 254
        return np.where(np.isnan(descale), E8M0_NAN, e + E8M0_BIAS).astype(np.uint8)
    raise ValueError(f"unknown MX scale rounding {rounding!r}; choose floor (OCP MX v1.0) or rceil "
                     "(cuBLAS, TransformerEngine)")


def mx_scale_inv(byte):
    """2^(byte - 127) as float32 (exact: 2^-127 is a float32 subnormal); NaN for the byte 255. The
    same numbers as ml_dtypes' E8M0 dtype: `byte.view(E8M0).astype(np.float32)`."""
    byte = np.asarray(byte, dtype=np.uint8)
    exponent = np.where(byte == E8M0_NAN, 0, byte.astype(np.int32) - E8M0_BIAS)
    value = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    return np.where(byte == E8M0_NAN, np.float32(np.nan), value)


def mx_multiplier(byte, rounding: str):
    """What each element is multiplied by before the cast: 2^-(byte - 127), exact. TE's rceil (and
    torchao's, after it) multiplies by 1 for the byte 0 (exp2f_rcp in TE's util/ptx.cuh); NaN for 255."""
    byte = np.asarray(byte, dtype=np.uint8)
    value = np.ldexp(1.0, E8M0_BIAS - byte.astype(np.int64))  # float64: 2^127 exact
    if rounding == "rceil":
        value = np.where(byte == 0, 1.0, value)
    return np.where(byte == E8M0_NAN, np.nan, value)
