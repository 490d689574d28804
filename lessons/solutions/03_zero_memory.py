"""Lesson 3, reference solution: the bytes of model states per rank under ZeRO."""


def model_state_bytes(psi: int, n: int, stage: int) -> float:
    """Bytes of parameters + gradients + optimizer state one rank holds, for psi parameters."""
    params, grads, optimizer = 8 * psi, 8 * psi, 16 * psi
    return {0: params + grads + optimizer,
            1: params + grads + optimizer / n,
            2: params + (grads + optimizer) / n,
            3: (params + grads + optimizer) / n}[stage]
