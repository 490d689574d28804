"""FP8 training's numerics, exact about every rounding: the float8 formats, each recipe's scales and
casts, the amax history of delayed scaling, and the GEMM that accumulates float8 products in float32.

    python -m pytest -q tests/test_fp8.py

- refpar/fp8/formats.py: E4M3, E5M2, E8M0 (ml_dtypes), their limits, the saturating cast.
- refpar/fp8/scaling.py: a scale from an amax per tile (float32, power of two, MX's E8M0).
- refpar/fp8/delayed.py: TransformerEngine's delayed scaling (amax history, scale update).
- refpar/fp8/recipes.py: the recipes tensorwise, delayed, rowwise, blockwise, mxfp8 as data, with
  their sources (torchao, TransformerEngine, DeepSeek-V3, OCP MX), and `quantize` by a recipe.
- refpar/fp8/matmul.py: `fp8_matmul(a, b, recipe, role)`.
tests/frameworks/test_torchao_fp8.py compares the casts with torchao's, element by element.
Not yet wired into training (`--precision fp8`): these are the pieces it will call.
"""

from refpar.fp8.matmul import fp8_matmul
from refpar.fp8.recipes import RECIPES, Recipe, dequantize, quantize

__all__ = ["RECIPES", "Recipe", "dequantize", "fp8_matmul", "quantize"]
