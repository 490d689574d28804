"""Lesson 2 exercise: what one training step holds, in bytes, before any parallelism.

    refpar lesson check 2

Part 1, the model states. AdamW keeps, for every parameter, the parameter itself, its gradient, and
two moments (m and v). In float64 every one of them is 8 bytes and there is no master copy. In
bf16-mixed the parameter and its gradient are bf16 and the optimizer works on an fp32 master copy of
the weights with fp32 moments: the ZeRO paper's K = 12 bytes of optimizer state per parameter.

Part 2, the activations one GPT-2 block keeps for its backward, as refpar's memory ledger counts them
(lesson 2's table lists every one): B sequences of T tokens, C channels, `heads` heads, e bytes per
element (8 in float64, 2 in bf16), dropout on. Start from Korthikanti et al.'s list (the sbh 34 and
5as/h terms, at e bytes), then add what refpar keeps beyond it: a dropout mask is an array of the
activation's dtype (e bytes, not 1), each LayerNorm keeps one 1/std per token, and the tanh-GELU keeps
its tanh beside its input.
"""


def model_state_bytes(psi: int, precision: str) -> dict[str, int]:
    """Bytes held between steps for `psi` parameters, precision "float64" or "bf16-mixed", by
    category: {"params": ..., "grads": ..., "master": ..., "optimizer": ...}."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write model_state_bytes(psi, precision) and block_activation_bytes(B, T, "
                              "C, heads, e)")
    # ---- end of your part -----------------------------------------------------------------------


def block_activation_bytes(B: int, T: int, C: int, heads: int, e: int) -> int:
    """Bytes one GPT-2 block keeps from its forward for its backward."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write block_activation_bytes(B, T, C, heads, e)")
    # ---- end of your part -----------------------------------------------------------------------
