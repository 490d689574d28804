"""torchao's FP8 casts and scales against refpar's (refpar/fp8/), element by element, on CPU, for
each recipe both have: tensorwise and rowwise (torchao.float8), blockwise (the torch reference
functions of torchao.prototype.blockwise_fp8_training.kernels, whose module imports triton), mxfp8
with floor and rceil scales (torchao.prototype.mx_formats.mx_tensor.to_mx). Each compares the
float8 bytes and the scales. torchao's Float8Linear itself (tensorwise, rowwise) runs on CPU, and
its forward and both backward GEMMs are refpar's fp8_matmul in the three roles, to float32's order
of sums. Not here: delayed scaling (torchao deleted it; TransformerEngine's
DelayedScaling runs only on CUDA: its wheels need a GPU and nvcc to build or load). `make
conformance` runs this folder (not `make test`)."""

from dataclasses import replace

import numpy as np
import pytest

from refpar.fp8 import RECIPES, dequantize, quantize

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

TORCH_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def operand(shape, seed):
    """Entries over 2^-12 .. 2^12 with the edges: a zero tile, a saturating MX block (its largest
    element 1.9 x 2^k), elements that land on the subnormals."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)).astype(np.float32)
    x[0, :128] = 0.0
    x[1, :32] = np.clip(x[1, :32], -1.0, 1.0) * 1e-3
    x[1, 3] = 1.9 * 2.0**-5
    return x


def same_bytes(ours, theirs):
    """The float8 bytes equal wherever refpar's value is not NaN; NaN where refpar's is."""
    theirs = theirs.view(torch.uint8).numpy()
    nan = np.isnan(ours.astype(np.float32))
    return np.array_equal(ours.view(np.uint8)[~nan], theirs[~nan]), nan


@pytest.mark.parametrize("kind", ["input", "grad_output"])
def test_tensorwise_matches_torchao_dynamic_tensorwise(kind):
    """torchao's Float8LinearConfig() casts input and weight to E4M3 and grad_output to E5M2 with
    scale float32(fp8_max / amax) and no power-of-two rounding: the same scale, the same bytes."""
    x = operand((4, 256), 0)
    q = quantize(x, RECIPES["tensorwise"], kind)
    dtype = TORCH_FP8[q.data.dtype.name]
    t = torch.from_numpy(x)
    scale = tensor_to_scale(t, dtype)
    theirs = hp_tensor_and_scale_to_float8(t, scale, dtype, LinearMMConfig())
    assert q.scale[0, 0] == scale.item()
    assert same_bytes(q.data, theirs._data)[0]


def test_rowwise_matches_torchao_axiswise_power_of_2():
    """torchao's ROWWISE recipe: per-row (axiswise_dim=-1) E4M3 scales rounded down to powers of two."""
    x = operand((8, 256), 1)
    q = quantize(x, RECIPES["rowwise"], "input")
    t = torch.from_numpy(x)
    scale = tensor_to_scale(t, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=-1, round_scales_to_power_of_2=True)
    theirs = hp_tensor_and_scale_to_float8(t, scale, torch.float8_e4m3fn, LinearMMConfig(), axiswise_dim=-1)
    assert np.array_equal(q.scale, scale.numpy())
    assert same_bytes(q.data, theirs._data)[0]


def test_blockwise_matches_torchaos_deepseek_reference_quantizers():
    """torchao's torch_blockwise_scale_act_quant_lhs (1x128) and torch_blockwise_scale_weight_quant
    (128x128) return the bytes and the reciprocal scales 1/s: refpar's data and scale_inv."""
    pytest.importorskip("triton")  # the kernels module imports it at the top, to define its GPU kernels
    from torchao.prototype.blockwise_fp8_training.kernels import (
        torch_blockwise_scale_act_quant_lhs,
        torch_blockwise_scale_weight_quant,
    )
    x, w = operand((4, 256), 2), operand((256, 384), 3)
    qx, qw = quantize(x, RECIPES["blockwise"], "input"), quantize(w, RECIPES["blockwise"], "weight")
    data_x, inv_x = torch_blockwise_scale_act_quant_lhs(torch.from_numpy(x))
    data_w, inv_w = torch_blockwise_scale_weight_quant(torch.from_numpy(w))
    assert np.array_equal(qx.scale_inv, inv_x.numpy()) and same_bytes(qx.data, data_x)[0]
    assert np.array_equal(qw.scale_inv, inv_w.numpy()) and same_bytes(qw.data, data_w)[0]


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_matches_torchao_to_mx(rounding, fmt):
    """torchao's to_mx (block 32) with ScaleCalculationMode FLOOR or RCEIL: the same E8M0 bytes and
    element bytes, except where torchao departs from the rule it cites, each checked: with floor,
    a block whose exponent clamps to -127 (amax below 2^-118) is divided by 2^-126 (torchao keeps
    the divisor a float32 normal), so its bytes are those of x 2^126 while the stored scale says
    2^-127: torchao's decoded values are half the input there. The zero row below is such a block."""
    x = operand((4, 256), 4 if rounding == "floor" else 5)
    x[2, 64:96] = np.float32(2.0**-120)  # a block whose floor exponent clamps to -127
    recipe = replace(RECIPES["mxfp8"], mx_rounding=rounding,
                     formats={k: np.dtype(fmt) for k in RECIPES["mxfp8"].formats})
    q = quantize(x, recipe, "input")
    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rounding]
    scale, data = to_mx(torch.from_numpy(x), TORCH_FP8[fmt], 32, mode)
    assert np.array_equal(q.e8m0, scale.view(torch.uint8).numpy())
    clamped = np.repeat(q.e8m0 == 0, 32, axis=1) if rounding == "floor" else np.zeros(x.shape, bool)
    ours = q.data.view(np.uint8)
    theirs = data.view(torch.uint8).numpy()
    assert np.array_equal(ours[~clamped], theirs[~clamped])
    if rounding == "floor":
        assert clamped[2, 64:96].all()
        halved = data.to(torch.float32).numpy()[clamped] * 2.0
        assert np.array_equal(halved, q.data.astype(np.float32)[clamped])
        assert np.array_equal(dequantize(q)[2, 64:96], x[2, 64:96].astype(np.float64))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8-floor", "mxfp8-rceil"])
def test_a_nan_spreads_over_its_scales_tile_in_both(name):
    """A NaN makes its tile's amax and so its scale NaN: the whole tensor (tensorwise), its row
    (rowwise), its 32-block (MX, the E8M0 byte 255) decode to NaN in both, and every other tile is
    byte for byte the same. torchao's floor mode stores zeros beside the NaN (it divides by the
    255 byte read as float32 inf) where refpar stores NaNs; both decode the block to NaN."""
    x = operand((4, 256), 6)
    x[3, 70] = np.nan
    t = torch.from_numpy(x)
    if name.startswith("mxfp8"):
        rounding = name.split("-")[1]
        q = quantize(x, replace(RECIPES["mxfp8"], mx_rounding=rounding), "input")
        mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rounding]
        scale, data = to_mx(t, torch.float8_e4m3fn, 32, mode)
        assert q.e8m0[3, 2] == 255 and np.array_equal(q.e8m0, scale.view(torch.uint8).numpy())
        tile = np.zeros(x.shape, bool)
        tile[3, 64:96] = True
    else:
        granularity = {"tensorwise": {}, "rowwise": dict(scaling_granularity=ScalingGranularity.AXISWISE,
                                                         axiswise_dim=-1, round_scales_to_power_of_2=True)}
        q = quantize(x, RECIPES[name], "input")
        scale = tensor_to_scale(t, torch.float8_e4m3fn, **granularity[name])
        data = hp_tensor_and_scale_to_float8(t, scale, torch.float8_e4m3fn, LinearMMConfig(),
                                             axiswise_dim=-1 if name == "rowwise" else None)._data
        tile = np.ones(x.shape, bool) if name == "tensorwise" else np.zeros(x.shape, bool)
        tile[3] = True
    ours = dequantize(q)
    assert np.isnan(ours[tile]).all() and not np.isnan(ours[~tile]).any()
    assert np.array_equal(q.data.view(np.uint8)[~tile], data.view(torch.uint8).numpy()[~tile])


U32, UBF16 = 2.0**-24, 2.0**-8  # float32's and bfloat16's unit roundoffs


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_torchaos_float8_linear_on_cpu_is_refpars_three_gemms(name):
    """torchao's Float8Linear (convert_to_float8_training; torch._scaled_mm runs on CPU for tensor-
    and row-wise scales) against refpar's fp8_matmul in the three roles: y = x @ w.T ("output"),
    dx = dy @ w ("grad_input"), dw = dy.T @ x ("grad_weight", refpar's x.T @ dy transposed).
    The float8 operands are the same (the tests above), so only the float32 sums' order differs:
    each entry within 2 gamma_(K+3) sum |a^||b^| (gamma_n = n u32 / (1 - n u32); K + 3 roundings
    at most on either side). Rowwise adds torchao's own rounding of the output to bfloat16
    (float8_ops.addmm_float8_unwrapped: "torch._scaled_mm not having float32 output type"), twice
    where it scales after the GEMM: (2 u_bf16 + u_bf16^2) |out| more."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from refpar.fp8 import fp8_matmul
    from refpar.fp8.recipes import ROLES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(name))
    x = torch.randn(16, 64, requires_grad=True)
    y = model(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w, xn, dyn = model[0].weight.detach().numpy(), x.detach().numpy(), dy.numpy()
    recipe = RECIPES[name]
    gemms = {"output": (xn, w.T, y.detach().numpy()), "grad_input": (dyn, w, x.grad.numpy()),
             "grad_weight": (xn.T, dyn, model[0].weight.grad.numpy().T)}
    for role, (a, b, theirs) in gemms.items():
        ours = fp8_matmul(a, b, recipe, role).astype(np.float64)
        kind_a, kind_b = ROLES[role]
        qa = np.abs(dequantize(quantize(a, recipe, kind_a)))
        qb = np.abs(dequantize(quantize(b.T, recipe, kind_b)))
        n = a.shape[1] + 3
        bound = 2 * n * U32 / (1 - n * U32) * (qa @ qb.T)
        if name == "rowwise":
            bound = bound + (2 * UBF16 + UBF16**2) * (np.abs(ours) + bound)
        worst = float(np.max(np.abs(ours - theirs) / bound))
        assert worst <= 1.0, (name, role, worst)
