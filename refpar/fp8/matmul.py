"""An FP8 GEMM as the hardware computes it: both operands cast by a recipe, products of float8
values accumulated in float32, and the sums unscaled per tile of the contraction axis.

    python -m pytest -q tests/test_fp8.py -k matmul

Legend: a (M, K) @ b (K, N) -> (M, N); tk = the recipe's tile extent along K (K itself for per-tensor
and per-row scales, 128 for blockwise, 32 for MX).

Why chunks of K: a scale that changes along K cannot be taken out of the dot product. DeepSeek-V3
(arXiv:2412.19437, section 3.3.2, "Increasing accumulation precision") sums each 128-wide chunk on
the tensor cores, multiplies the partial sums by the two tiles' scales and adds them in float32 on
the CUDA cores; an MX GEMM applies its block scales inside the tensor core in the same way. With one
scale along K (tensorwise, delayed, rowwise) there is one chunk and the scales multiply the result
once, as cuBLAS's scaled GEMM does with its scale_inv arguments. The product of two float8 values is
exact in float32 (4 significant bits each at most), so every rounding of the GEMM is a float32 one.
"""

from __future__ import annotations

import numpy as np

from refpar.fp8.recipes import ROLES, Recipe, quantize


def fp8_matmul(a, b, recipe: Recipe, role: str = "output", delayed: dict | None = None):
    """a (M, K) @ b (K, N) in FP8 by `recipe`, as the GEMM `role` ("output", "grad_input" or
    "grad_weight": refpar/fp8/recipes.py's ROLES name the operands' kinds) -> float32 (M, N).
    The delayed recipe takes each operand's DelayedScale from `delayed` (kind -> DelayedScale)."""
    if role not in ROLES:
        raise ValueError(f"unknown GEMM role {role!r}; choose one of {', '.join(ROLES)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {a.shape[0]}x{a.shape[1]} by {b.shape[0]}x{b.shape[1]}")
    kind_a, kind_b = ROLES[role]
    qa = quantize(a, recipe, kind_a, delayed and delayed[kind_a])  # data (M, K)
    qb = quantize(np.asarray(b).T, recipe, kind_b, delayed and delayed[kind_b])  # data (N, K)
    tk = qa.tile[1]
    sa = np.repeat(qa.scale_inv, qa.tile[0], axis=0)  # (M, K/tk)
    sb = np.repeat(qb.scale_inv, qb.tile[0], axis=0)  # (N, K/tk)
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)  # (M, N)
    with np.errstate(over="ignore", invalid="ignore"):
        for c in range(a.shape[1] // tk):
            chunk = slice(c * tk, (c + 1) * tk)
            partial = qa.data[:, chunk].astype(np.float32) @ qb.data[:, chunk].astype(np.float32).T  # (M, N)
            out += partial * (sa[:, c:c + 1] * sb[:, c][None, :])  # (M, N), float32 throughout
    return out
