"""Lesson 3 exercise: the bytes of model states per rank under ZeRO.

    refpar lesson check 3

refpar trains in float64 with AdamW: per parameter, 8 bytes of weight, 8 of gradient and 16 of
optimizer state (two moments). With n data-parallel ranks, ZeRO stage 1 shards the optimizer state
over the n ranks, stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain data
parallelism, every rank holding everything.
"""


def model_state_bytes(psi: int, n: int, stage: int) -> float:
    """Bytes of parameters + gradients + optimizer state one rank holds, for psi parameters."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write model_state_bytes(psi, n, stage) for stages 0, 1, 2 and 3")
    # ---- end of your part -----------------------------------------------------------------------
