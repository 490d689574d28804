"""Lesson 12 exercise: the mean loss of a step whose microbatches hold different numbers of tokens.

    refpar lesson check 12

Microbatch i has token_counts[i] tokens (padding removed) and the sum of their losses
loss_sums[i]. The step's loss is the mean over every token of the step.
"""


def global_mean_loss(loss_sums: list[float], token_counts: list[int]) -> float:
    """The mean loss per token over all microbatches."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write global_mean_loss(loss_sums, token_counts)")
    # ---- end of your part -----------------------------------------------------------------------
