"""Lesson 13, reference solution: the model-state bytes one rank holds under ZeRO in bf16-mixed."""


def model_state_bytes(unit_sizes: dict[str, int], n: int, rank: int, stage: int,
                      fp32_grads: bool = False) -> dict[str, int]:
    """Bytes rank `rank` of `n` holds between steps, by category: {"params": ..., "grads": ...,
    "master": ..., "optimizer": ...}, for a model made of units of `unit_sizes` elements."""
    psi = sum(unit_sizes.values())
    # this rank's part of each unit: size // n, plus one on the first size % n ranks
    shard = sum(size // n + (rank < size % n) for size in unit_sizes.values())
    grad_bytes = 4 if fp32_grads else 2
    return {
        "params": 2 * (psi if stage < 3 else shard),
        # DP and ZeRO-1 with fp32 gradients hold the whole bf16 gradient and the whole fp32 buffer
        "grads": (grad_bytes + 2 * fp32_grads) * psi if stage < 2 else grad_bytes * shard,
        "master": 4 * (psi if stage == 0 else shard),
        "optimizer": 8 * (psi if stage == 0 else shard),
    }
