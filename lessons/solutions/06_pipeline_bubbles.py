"""Lesson 6, reference solution: GPipe's bubble and 1F1B's memory, in closed form."""


def gpipe_bubble(p: int, m: int) -> float:
    """The share of all rank-time that GPipe's ranks sit idle in one step."""
    return (p - 1) / (m + p - 1)  # each rank works 2m of 2(m + p - 1) ticks


def one_f_one_b_peak(p: int, m: int, rank: int) -> int:
    """The most microbatches whose activations rank `rank` holds at once under 1F1B."""
    return min(p - rank, m)  # p - rank - 1 warm-up forwards, then one more before the first backward
