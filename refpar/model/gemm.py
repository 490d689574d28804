"""The matrix products of the layers, counted: `matmul(a, b)` is `a @ b`, and adds its FLOPs to one
tally of this process, which the engine reads and resets each step (`take`).

A product of (..., m, k) by (..., k, n) costs 2 m n k FLOPs per matrix of the batch (a multiply and
an add per term): 2 k times the elements of the output, whatever broadcasts. This is the convention
of the planner's closed forms (refpar/analysis/flops.py: Narayanan et al. 2021, Section 3.3), so a
run's count is comparable with them. Counted: the linear layers' forward and both halves of their
backward (dx = dout @ w.T, dw = x.T @ dout), the attention core's QK^T and scores @ V and their
four backward products, the tied head's logits and its two backward products; so a forward that
recomputation runs again is counted again. Not counted: the embeddings' backward, a scatter-add
of rows as frameworks do it (layers.scatter_add_rows; a one-hot product only in a namespace
without one, array-api-strict or CuPy), and elementwise work (norms, softmax, GELU, biases),
which the convention leaves out.
"""

from __future__ import annotations

import math

_flops = 0  # this process's GEMM FLOPs since the last `take`


def matmul(a, b):
    """a @ b, its 2 m n k FLOPs (per matrix of the batch) added to the tally."""
    global _flops
    out = a @ b
    _flops += 2 * math.prod(out.shape) * a.shape[-1]
    return out


def take() -> int:
    """The FLOPs counted since the last call; the tally starts again from 0."""
    global _flops
    counted, _flops = _flops, 0
    return counted
