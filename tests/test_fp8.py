"""FP8's formats, scales, casts and GEMM (refpar/fp8/) against closed forms: the formats' limits from
their bit patterns, each recipe's scale from its amax rule, the cast within half an ulp of the scaled
value, saturation and the edges (amax 0, NaN, subnormals), delayed scaling's history window, and
fp8_matmul within a bound derived from the formats' unit roundoffs and float32 accumulation."""

from dataclasses import replace

import numpy as np
import pytest

from refpar.fp8 import RECIPES, dequantize, fp8_matmul, quantize
from refpar.fp8.delayed import DelayedScale
from refpar.fp8.formats import (
    E4M3,
    E5M2,
    E8M0,
    half_subnormal_spacing,
    max_finite,
    saturating_cast,
    ulp,
    unit_roundoff,
)
from refpar.fp8.recipes import ROLES, delayed_scales
from refpar.fp8.scaling import mx_scale_inv, round_down_to_power_of_2
from tests.numerics import U64, within

U32 = 2.0**-24  # float32's unit roundoff


def bits(byte, fmt):
    return float(np.array([byte], dtype=np.uint8).view(fmt).astype(np.float64)[0])


def test_format_limits_are_those_of_their_bit_patterns():
    """E4M3's largest finite is S.1111.110 = 1.75 x 2^8 (S.1111.111 is its NaN); E5M2's S.11110.11 =
    1.75 x 2^15; the smallest subnormals 0.001 x 2^-6 and 0.01 x 2^-14; E8M0's byte b is 2^(b-127)."""
    assert bits(0x7E, E4M3) == max_finite(E4M3) == 448.0 and np.isnan(bits(0x7F, E4M3))
    assert bits(0x7B, E5M2) == max_finite(E5M2) == 57344.0 and np.isinf(bits(0x7C, E5M2))
    assert bits(0x01, E4M3) == 2.0**-9 == 2 * half_subnormal_spacing(E4M3)
    assert bits(0x01, E5M2) == 2.0**-16 == 2 * half_subnormal_spacing(E5M2)
    assert unit_roundoff(E4M3) == 2.0**-4 and unit_roundoff(E5M2) == 2.0**-3
    b = np.arange(255, dtype=np.uint8)
    assert np.array_equal(mx_scale_inv(b), np.ldexp(1.0, b.astype(int) - 127))
    assert np.array_equal(mx_scale_inv(b), b.view(E8M0).astype(np.float32)) and np.isnan(mx_scale_inv(255))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_is_within_half_an_ulp_and_ties_go_to_even(fmt):
    """Over 12 binades either side of 1 and the subnormals, |cast(v) - v| <= ulp(v)/2 with ulp from
    the value's binade (the subnormals' spacing below the smallest normal); a value halfway between
    two neighbours goes to the one with an even mantissa."""
    rng = np.random.default_rng(0)
    v = (rng.uniform(1, 2, 4000) * 2.0 ** rng.integers(-20, 12, 4000) * rng.choice([-1, 1], 4000))
    v = np.clip(v, -max_finite(fmt), max_finite(fmt)).astype(np.float32)
    err = np.abs(saturating_cast(v, fmt).astype(np.float64) - v)
    assert np.all(err <= ulp(v, fmt) / 2), float(np.max(err / ulp(v, fmt)))
    step = 2 * unit_roundoff(fmt)  # the spacing in [1, 2)
    halfway = np.array([1 + step / 2, 1 + 3 * step / 2], dtype=np.float32)  # between 1|1+s, 1+s|1+2s
    assert list(saturating_cast(halfway, fmt).astype(float)) == [1.0, 1 + 2 * step]


def test_cast_saturates_where_ml_dtypes_alone_would_not():
    """Beyond the largest finite the cast clamps (torchao's to_fp8_saturated); inf clamps too; NaN
    stays NaN. ml_dtypes' plain cast gives NaN for E4M3 and inf for E5M2 there (7e4 is beyond
    57344 + half its ulp, 61440)."""
    x = np.array([500.0, -1e9, np.inf, np.nan], dtype=np.float32)
    assert np.array_equal(saturating_cast(x, E4M3)[:3].astype(float), [448.0, -448.0, 448.0])
    assert np.isnan(saturating_cast(x, E4M3)[3].astype(float))
    assert np.array_equal(saturating_cast(np.float32([7e4]), E5M2).astype(float), [57344.0])
    assert np.isnan(x[:1].astype(E4M3).astype(float)[0]) and np.isinf(np.float32([7e4]).astype(E5M2)[0])


def operand(shape, seed=0):
    rng = np.random.default_rng(seed)  # entries over several binades, so the tiles' amaxes differ
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-3, 4, shape)).astype(np.float32)


@pytest.mark.parametrize("kind,fmt", [("input", E4M3), ("grad_output", E5M2)])
def test_tensorwise_scale_maps_the_amax_onto_the_largest_value(kind, fmt):
    """scale = float32(fp8_max / amax): E4M3's 448 forward, E5M2's 57344 for gradients; the amax
    element lands within rounding of fp8_max and no element saturates beyond it."""
    x = operand((16, 64))
    q = quantize(x, RECIPES["tensorwise"], kind)
    amax = float(np.abs(x).max())
    assert q.data.dtype == fmt and q.scale.shape == (1, 1)
    assert q.scale[0, 0] == np.float32(max_finite(fmt) / amax)
    assert np.abs(q.data.astype(float)).max() == max_finite(fmt)


def test_rowwise_scales_are_powers_of_two_at_most_448_over_each_rows_amax():
    """Per row: scale = 2^floor(log2(448 / amax_row)), so each row's largest element scales into
    (224, 448], exactly representable powers of two times it."""
    x = operand((16, 64), 1)
    q = quantize(x, RECIPES["rowwise"], "weight")
    expect = 2.0 ** np.floor(np.log2(448.0 / np.abs(x).max(axis=1, keepdims=True).astype(np.float64)))
    assert q.scale.shape == (16, 1) and np.array_equal(q.scale, expect)
    top = np.abs(x).max(axis=1) * q.scale[:, 0]
    assert np.all((top > 224) & (top <= 448))


def test_power_of_two_rounding_is_exact_at_the_edges():
    """A power of two stays; a scale one ulp or a few below one goes down to the next power (torchao's
    float32 log2 would give 1024 for the second); 0, inf and NaN stay as they are."""
    s = np.array([1024.0, 1024 * (1 - 2.0**-24), 1024 * (1 - 2.0**-22), 3.0, 0.0, np.inf, np.nan], np.float32)
    got = round_down_to_power_of_2(s)
    assert list(got[:5]) == [1024.0, 512.0, 512.0, 2.0, 0.0] and np.isinf(got[5]) and np.isnan(got[6])


def test_blockwise_tiles_are_1x128_for_activations_and_128x128_for_weights():
    """DeepSeek-V3's tiles: an activation (R, K) gets one scale per row per 128 along K; a weight one
    per 128x128 block; each scale is float32(448 / the tile's amax); a shape the tiles do not
    divide is refused with a sentence."""
    x, w = operand((4, 256), 2), operand((256, 256), 3)
    qx, qw = quantize(x, RECIPES["blockwise"], "input"), quantize(w, RECIPES["blockwise"], "weight")
    amax_x = np.abs(x.reshape(4, 2, 128)).max(axis=2)
    amax_w = np.abs(w.reshape(2, 128, 2, 128)).max(axis=(1, 3))
    assert np.array_equal(qx.scale, (448.0 / amax_x.astype(np.float64)).astype(np.float32))
    assert np.array_equal(qw.scale, (448.0 / amax_w.astype(np.float64)).astype(np.float32))
    with pytest.raises(ValueError, match="128x128 tiles, which do not divide its shape 100x256"):
        quantize(operand((100, 256)), RECIPES["blockwise"], "weight")


def test_mxfp8_scales_are_e8m0_powers_of_two_per_32_elements():
    """OCP MX v1.0 (floor): X = 2^(floor(log2 amax) - 8) per 32-element block, stored as the byte
    e + 127; a block whose amax has a mantissa above 1.75 saturates its largest element at 448 (one
    of 1.9 x 2^k scales to 486.4). cuBLAS's rceil: X = 2^ceil(log2(amax / 448)), nothing saturates."""
    x = operand((2, 64), 4)
    x[0, 5] = 1.9 * 2.0**3 * np.sign(x[0, 5])  # block (0, 0): amax 15.2
    x[0, :32] = np.clip(x[0, :32], -15.2, 15.2)
    q = quantize(x, RECIPES["mxfp8"], "input")
    amax = np.abs(x.reshape(2, 2, 32)).max(axis=2).astype(np.float64)
    e = np.floor(np.log2(amax)) - 8
    assert np.array_equal(q.e8m0, (e + 127).astype(np.uint8)) and np.array_equal(q.scale_inv, 2.0**e)
    assert q.data[0, 5].astype(float) == 448.0 * np.sign(x[0, 5]) and 1.9 * 2**3 / 2.0 ** e[0, 0] > 448
    rceil = quantize(x, replace(RECIPES["mxfp8"], mx_rounding="rceil"), "input")
    assert np.array_equal(rceil.scale_inv, 2.0 ** np.ceil(np.log2(amax / 448)))
    assert np.all(np.abs(x) * np.repeat(1 / rceil.scale_inv, 32, axis=1) <= 448)


def test_edges_amax_zero_nan_and_subnormals():
    """An all-zero tensor gets the finite scale 448 / 1e-12 and zeros; a NaN makes its per-tensor
    scale NaN (torchao's rule) but only its own MX block's byte 255; an element whose scaled value
    is below E4M3's smallest normal 2^-6 lands on the subnormal grid, multiples of 2^-9."""
    q = quantize(np.zeros((2, 32), np.float32), RECIPES["tensorwise"], "input")
    assert q.scale[0, 0] == np.float32(448 / 1e-12) and not np.any(q.data.astype(float))
    x = operand((2, 64), 5)
    x[1, 40] = np.nan
    assert np.isnan(quantize(x, RECIPES["tensorwise"], "input").scale[0, 0])
    mx = quantize(x, RECIPES["mxfp8"], "input")
    assert mx.e8m0[1, 1] == 255 and np.all(mx.e8m0[[0, 0, 1], [0, 1, 0]] < 255)
    assert np.isnan(dequantize(mx)[1, 32:]).all() and not np.isnan(dequantize(mx)[1, :32]).any()
    tiny = np.array([[448.0, 0.003, 0.0045, -0.0009]], np.float32)  # scale 1: 0.003 = 1.536 x 2^-9
    got = quantize(tiny, RECIPES["tensorwise"], "input").data.astype(float)[0]
    assert list(got) == [448.0, 2 * 2.0**-9, 2 * 2.0**-9, 0.0]  # 1.536 -> 2, 2.304 -> 2, 0.46 -> 0


@pytest.mark.parametrize("name,scale", [
    ("tensorwise", np.float32(448e12)),  # 448 / 1e-12, torchao's floor on amax
    ("rowwise", np.float32(2.0**48)),  # 448e12 = 1.59 x 2^48, rounded down to a power of two
    ("blockwise", np.float32(448e12)),
    ("mxfp8", np.float64(2.0**127)),  # floor: amax 0's exponent bits read -127, -127 - 8 clamps to -127
])
def test_an_all_zero_tile_gets_a_finite_scale_and_zeros(name, scale):
    """amax 0 in one tile (the whole tensor, the first row, its first 1x128 tile or 32-block):
    the hand-computed scale, zeros in the float8 data, finite decoded values, the other tiles cast."""
    zero = {"tensorwise": np.s_[:, :], "rowwise": np.s_[0, :], "blockwise": np.s_[0, :128],
            "mxfp8": np.s_[0, :32]}[name]
    x = operand((2, 256), 8)
    x[zero] = 0.0
    q = quantize(x, RECIPES[name], "input")
    assert q.scale[0, 0] == scale and not np.any(q.data[zero].astype(float))
    assert np.all(np.isfinite(dequantize(q))) and (name == "tensorwise" or np.any(q.data[1].astype(float)))
    if name == "mxfp8":
        assert q.e8m0[0, 0] == 0 and q.scale_inv[0, 0] == np.float32(2.0**-127)


def test_delayed_scale_comes_from_the_last_history_len_amaxes():
    """TE's DelayedScaling: the first step casts with scale 1; after each step the scale is 448 /
    the largest of the last L recorded amaxes (L = 3 here), so a large amax stops counting L steps
    later; a step with amax 0 keeps the old scale; margin m divides the scale by 2^m; most_recent
    takes only the last step's amax; a value beyond 448 / scale saturates."""
    d = DelayedScale(E4M3, history_len=3)
    amaxes = [8.0, 2.0, 1.0, 0.5, 0.0, 4.0]
    scales = []
    for a in amaxes:
        scales.append(float(d.scale))
        d.record(a)
        d.update()
    window = [max(amaxes[max(0, t - 2):t + 1]) for t in range(len(amaxes))]
    assert scales[0] == 1.0
    assert scales[1:] == [float(np.float32(448 / w)) for w in window[:-1]]
    assert window[:-1] == [8.0, 8.0, 8.0, 2.0, 1.0]  # 8 falls out after three steps
    m = DelayedScale(E4M3, history_len=3, algo="most_recent", margin=1)
    for a in (8.0, 2.0):
        m.record(a)
        m.update()
    assert m.scale == np.float32(224 / 2.0)
    x = np.array([[1.0, 5.0]], np.float32)
    assert list(quantize(x, RECIPES["delayed"], "input", m).data.astype(float)[0]) == [112.0, 448.0]
    assert m.history[0] == 5.0  # the cast recorded its amax for the next update


def matmul_bound(a, b, recipe, role, delayed_before):
    """|fp8_matmul(a, b) - a @ b| per entry, derived:
    Each operand element x is cast as v = fl32(x s) = x s (1 + d1), d = fl8(clamp(v)), and the GEMM
    sees d sigma with sigma = fl32(1/s) = (1 + d2) / s, |d1|, |d2| <= u32. |d - v| is at most
    u8 |v| (normal range), half the subnormal spacing eta, or |v| - fp8_max when it saturated; so
    |d sigma - x| <= e_x = max(u8 |v|, eta, |v| - fp8_max) |sigma| + (2 u32 + u32^2) |x|.
    The products of float8 values are exact in float32; each output entry then sees at most
    tk - 1 + 2 + K/tk float32 roundings (a chunk's sum, the scale product and its multiply, the
    chunks' sum), so it is within gamma_n = n u32 / (1 - n u32) of sum |d_a sigma_a| |d_b sigma_b|.
    Together: gamma_n |A^| @ |B^| + E_a @ |B| + |A| @ E_b + E_a @ E_b, plus float64's own error in
    the reference a @ b. (By Cauchy-Schwarz each entry is at most (gamma_n + relative error) times
    the norms of a's row and b's column: this bound is the elementwise form of that.)"""
    def errors(x, kind):
        state = delayed_before and delayed_before[kind]
        q = quantize(x, recipe, kind, state)
        fmt = recipe.formats[kind]
        s = np.repeat(np.repeat(q.scale.astype(np.float64), q.tile[0], 0), q.tile[1], 1)
        sig = np.repeat(np.repeat(q.scale_inv.astype(np.float64), q.tile[0], 0), q.tile[1], 1)
        v = np.abs(x.astype(np.float64)) * s * (1 + U32)
        e = (np.maximum.reduce([unit_roundoff(fmt) * v, np.full_like(v, half_subnormal_spacing(fmt)),
                                v - max_finite(fmt)]) * sig + (2 * U32 + U32**2) * np.abs(x))
        return np.abs(dequantize(q)), e, q.tile[1]
    kind_a, kind_b = ROLES[role]
    qa, ea, tk = errors(a, kind_a)
    qb, eb, _ = errors(b.T, kind_b)
    K = a.shape[1]
    n = tk + 1 + K // tk
    gamma = n * U32 / (1 - n * U32)
    A, B = np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))
    return gamma * (qa @ qb.T) + ea @ B + A @ eb.T + ea @ eb.T + 2 * K * U64 * (A @ B)


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_matmul_is_within_its_derived_bound_of_float64(name, role):
    """Every recipe, every GEMM of a linear layer: each entry of the fp8 product within the bound
    derived in `matmul_bound` of the float64 product; and the bound is not loose: the worst entry
    uses more than a tenth of it, and fp8 is visible (the error is far above float32's)."""
    recipe = RECIPES[name]
    a, b = operand((8, 256), 6), operand((256, 128), 7)
    if recipe.history_len:  # a history whose amaxes are smaller than these operands': saturation
        delayed = delayed_scales(recipe)
        for state in delayed.values():
            state.record(2.0)
            state.update()
        before = {k: DelayedScale(s.fmt, recipe.history_len) for k, s in delayed.items()}
        for k in before:
            before[k].scale = delayed[k].scale
    else:
        delayed = before = None
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = np.abs(fp8_matmul(a, b, recipe, role, delayed).astype(np.float64) - exact)
    bound = matmul_bound(a, b, recipe, role, before)
    worst = float(np.max(err / bound))
    assert within(worst, 1.0), (name, role, worst)
    assert worst > 0.1 and np.max(err) > 1e3 * U32 * np.abs(exact).max(), (name, role, worst)
