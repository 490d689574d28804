"""The FP8 recipes as data, and the cast of one GEMM operand by a recipe (`quantize`).

    python -m pytest -q tests/test_fp8.py

Legend: an operand is laid out (R, K) with K, the GEMM's contraction axis, last: `a` (M, K) as it is
and `b` (K, N) as b.T (N, K) (refpar/fp8/matmul.py:fp8_matmul). A tile (tr, tk) shares one scale.

The three GEMMs of a linear layer y = x @ w and their operands' kinds (torchao's names; the kind
picks the format and, in blockwise, the tile):
    output       y  = x  @ w       input,       weight
    grad_input   dx = dy @ w.T     grad_output, weight
    grad_weight  dw = x.T @ dy     input,       grad_output

The recipes (`RECIPES`; each names its source):
- tensorwise: one float32 scale per tensor from its current amax; E4M3 forward, E5M2 gradients.
  torchao's Float8LinearConfig() ("tensorwise"), TransformerEngine's Float8CurrentScaling(HYBRID).
- delayed: one scale per tensor from an amax history (refpar/fp8/delayed.py), E4M3 forward, E5M2
  gradients. TE's DelayedScaling(fp8_format=HYBRID, amax_history_len=1024, amax_compute_algo="max").
- rowwise: a scale per row along K (per token of an activation, per output channel of a weight),
  rounded down to a power of two; E4M3 throughout. torchao's Float8LinearRecipeName.ROWWISE.
- blockwise: E4M3 throughout, float32 scales per 1x128 tile along K of activations and gradients and
  per 128x128 block of weights. DeepSeek-V3 technical report (arXiv:2412.19437), section 3.3.1
  "Fine-grained quantization"; torchao's prototype/blockwise_fp8_training; TE's Float8BlockScaling
  (whose scales are powers of two by default; DeepSeek-V3's and torchao's are not).
- mxfp8: E4M3 throughout, 32-element blocks along K sharing an E8M0 power-of-two scale. OCP
  "Microscaling Formats (MX) v1.0"; TE's MXFP8BlockScaling(fp8_format=E4M3); torchao's MX training
  (prototype/mx_formats). `mx_rounding` "floor" is the spec's rule and torchao's default; "rceil" is
  cuBLAS's and TE's (refpar/fp8/scaling.py).

A cast multiplies the float32 operand by its tile's scale in float32, clamps and rounds to the format
(refpar/fp8/formats.py:saturating_cast), as torchao's hp_tensor_and_scale_to_float8 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.fp8 import scaling
from refpar.fp8.delayed import DelayedScale
from refpar.fp8.formats import E4M3, E5M2, saturating_cast

KINDS = ("input", "weight", "grad_output")
ROLES = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
         "grad_weight": ("input", "grad_output")}  # GEMM -> the kinds of its operands a and b
HYBRID = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}  # E4M3 forward, E5M2 gradients
ALL_E4M3 = {"input": E4M3, "weight": E4M3, "grad_output": E4M3}


@dataclass(frozen=True)
class Recipe:
    """How each operand kind is scaled and cast. `granularity`: "tensor", "row", "block" (1 x
    `block` tiles, `block` x `block` for weights) or "mx" (1 x `block` tiles, E8M0 scales)."""
    name: str
    formats: dict  # kind -> float8 dtype
    granularity: str
    block: int = 0  # the tile's extent along K (blockwise 128, MX 32)
    power_of_2: bool = False  # float scales rounded down to a power of two
    mx_rounding: str = "floor"  # MX scales: "floor" (OCP MX v1.0) or "rceil" (cuBLAS, TE)
    history_len: int = 0  # delayed scaling's amax history; 0: scales from the current amax
    amax_algo: str = "max"  # delayed: "max" over the history or "most_recent"
    margin: float = 0.0  # delayed: scales are fp8_max 2^-margin / amax

    def tile(self, kind: str, shape: tuple[int, int]) -> tuple[int, int]:
        """The (tr, tk) tile of an operand of this kind laid out (R, K), checked to divide it."""
        R, K = shape
        if self.granularity == "tensor":
            return R, K
        if self.granularity == "row":
            return 1, K
        weight_block = self.granularity == "block" and kind == "weight"
        tile = (self.block, self.block) if weight_block else (1, self.block)
        if R % tile[0] or K % tile[1]:
            raise ValueError(f"the {self.name} recipe scales {kind} in {tile[0]}x{tile[1]} tiles, which do "
                             f"not divide its shape {R}x{K} (contraction axis last); choose sizes that are "
                             f"multiples of {self.block}")
        return tile


RECIPES = {
    "tensorwise": Recipe("tensorwise", HYBRID, "tensor"),
    "delayed": Recipe("delayed", HYBRID, "tensor", history_len=1024),
    "rowwise": Recipe("rowwise", ALL_E4M3, "row", power_of_2=True),
    "blockwise": Recipe("blockwise", ALL_E4M3, "block", block=128),
    "mxfp8": Recipe("mxfp8", ALL_E4M3, "mx", block=32),
}


def delayed_scales(recipe: Recipe) -> dict:
    """A fresh DelayedScale per operand kind for the delayed recipe (scale 1, empty history)."""
    return {kind: DelayedScale(fmt, recipe.history_len, recipe.amax_algo, recipe.margin)
            for kind, fmt in recipe.formats.items()}


@dataclass
class Quantized:
    """An operand (R, K) cast to float8: `data` (R, K) in the format; per tile (R/tr, K/tk):
    `scale`, the float32 factor the operand was multiplied by before the cast (float64 for MX's
    exact powers of two), and `scale_inv`, the float32 factor the GEMM multiplies its products by
    (TE's scale_inv: 1/scale rounded to float32; MX's 2^e exactly). `e8m0`: MX's scale bytes."""
    data: np.ndarray
    scale: np.ndarray
    scale_inv: np.ndarray
    tile: tuple[int, int]
    e8m0: np.ndarray | None = None


def quantize(x, recipe: Recipe, kind: str, delayed: DelayedScale | None = None) -> Quantized:
    """x (R, K) cast by `recipe` as an operand of `kind`; the delayed recipe takes the scale from
    `delayed` (and records x's amax there). x is first rounded to float32, the widest high-precision
    type the GPUs' cast kernels read."""
    if kind not in KINDS:
        raise ValueError(f"unknown operand kind {kind!r}; choose one of {', '.join(KINDS)}")
    x = np.asarray(x, dtype=np.float32)  # (R, K)
    fmt, tile = recipe.formats[kind], recipe.tile(kind, x.shape)
    amax = scaling.tile_amax(x, tile)  # (R/tr, K/tk)
    if recipe.granularity == "mx":
        e8m0 = scaling.mx_scale_exponent(amax, fmt, recipe.mx_rounding)  # (R/tr, K/tk)
        scale = scaling.mx_multiplier(e8m0, recipe.mx_rounding)
        with np.errstate(invalid="ignore"):  # x * 2^-e exactly, in float64, then to float32
            data = saturating_cast((x * scaling.per_element(scale, tile)).astype(np.float32), fmt)
        return Quantized(data, scale, scaling.mx_scale_inv(e8m0), tile, e8m0)
    if recipe.history_len:
        if delayed is None:
            raise ValueError("the delayed recipe casts with a scale from an amax history: pass the "
                             "operand's DelayedScale (refpar.fp8.recipes.delayed_scales)")
        scale = np.full(amax.shape, delayed.scale, dtype=np.float32)
        delayed.record(np.fmax.reduce(amax, axis=None))
    else:
        scale = scaling.amax_to_scale(amax, fmt, recipe.power_of_2)
    with np.errstate(over="ignore", invalid="ignore"):
        data = saturating_cast(x * scaling.per_element(scale, tile), fmt)  # float32 product, then round
        scale_inv = np.float32(1.0) / scale
    return Quantized(data, scale, scale_inv, tile)


def dequantize(q: Quantized):
    """The float64 values the GEMM sees: data x scale_inv per tile (x 2^e for MX)."""
    with np.errstate(invalid="ignore"):
        return q.data.astype(np.float64) * scaling.per_element(q.scale_inv.astype(np.float64), q.tile)
