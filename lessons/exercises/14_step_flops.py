"""Lesson 14 exercise: the FLOPs of one GPT-2 training step, with and without recomputation.

    refpar lesson check 14

GPT-2 with L blocks of width h, a vocabulary of V and the head tied to the embedding, a step of B
sequences of s tokens. Count as refpar/model/gemm.py does: a product of (m, k) by (k, n) costs
2 m n k; every linear layer (c_attn h x 3h, c_proj h x h, c_fc h x 4h, the MLP's c_proj 4h x h),
the attention core's QK^T and scores @ V over the full s x s square, and the head x @ wte.T; each
backward costs twice its forward (dx and dw, or the core's four products). Elementwise work, biases
and the embedding lookup cost nothing.
"""


def step_flops(B: int, s: int, L: int, h: int, V: int, recompute: str) -> int:
    """FLOPs of one step: recompute "none" (each forward once), "selective" (each block's attention
    core run again in its backward) or "full" (each block's whole forward run again)."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write step_flops(B, s, L, h, V, recompute)")
    # ---- end of your part -----------------------------------------------------------------------
