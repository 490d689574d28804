"""Lesson 2, reference solution: what one training step holds, in bytes."""


def model_state_bytes(psi: int, precision: str) -> dict[str, int]:
    if precision == "float64":
        return {"params": 8 * psi, "grads": 8 * psi, "master": 0, "optimizer": 16 * psi}
    # bf16 weight and gradient; fp32 master copy, m and v: 2 + 2 + (4 + 4 + 4)
    return {"params": 2 * psi, "grads": 2 * psi, "master": 4 * psi, "optimizer": 8 * psi}


def block_activation_bytes(B: int, T: int, C: int, heads: int, e: int) -> int:
    tokens = B * T
    # the paper's sbh 34 at e bytes with e-byte masks: ln inputs 2C, ln outputs 2C, two residual
    # masks 2C, q k v 3C, c_proj's input C, GELU's input 4C, the second linear's input 4C
    paper = tokens * C * (2 + 2 + 2 + 3 + 1 + 4 + 4) * e
    # 5as/h: the softmax output, its dropout mask and the dropout's output, per head a T x T square
    square = B * heads * T * T * 3 * e
    rstd = tokens * 2 * e  # one 1/std per token for each of the two LayerNorms
    tanh = tokens * 4 * C * e  # the GELU's tanh, beside its input
    return paper + square + rstd + tanh
