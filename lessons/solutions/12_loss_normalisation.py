"""Lesson 12, reference solution: the mean loss of a step whose microbatches differ in size."""


def global_mean_loss(loss_sums: list[float], token_counts: list[int]) -> float:
    """The mean loss per token over all microbatches."""
    return sum(loss_sums) / sum(token_counts)  # not the mean of each microbatch's mean
