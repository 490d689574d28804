"""Lesson 14, reference solution: the FLOPs of one GPT-2 training step, with and without
recomputation."""


def step_flops(B: int, s: int, L: int, h: int, V: int, recompute: str) -> int:
    """FLOPs of one step: recompute "none" (each forward once), "selective" (each block's attention
    core run again in its backward) or "full" (each block's whole forward run again)."""
    tokens = B * s
    linears = 2 * tokens * (3 * h * h + h * h + 4 * h * h + 4 * h * h) * L  # 24 B s h^2 per block
    core = 2 * 2 * tokens * s * h * L  # QK^T and scores @ V: 2 B s^2 h each per block
    head = 2 * tokens * h * V
    forwards = {"none": 0, "selective": core, "full": linears + core}[recompute]  # run again
    return 3 * (linears + core + head) + forwards  # = 72 B s L h^2 (1 + s/6h + V/12Lh) + forwards
