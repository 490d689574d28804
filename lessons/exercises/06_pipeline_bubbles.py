"""Lesson 6 exercise: GPipe's bubble and 1F1B's memory, in closed form.

    refpar lesson check 6

p pipeline ranks, m microbatches, every forward and every backward one tick, transfers free.
"""


def gpipe_bubble(p: int, m: int) -> float:
    """The share of all rank-time that GPipe's ranks sit idle in one step."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write gpipe_bubble(p, m): idle rank-time / all rank-time")
    # ---- end of your part -----------------------------------------------------------------------


def one_f_one_b_peak(p: int, m: int, rank: int) -> int:
    """The most microbatches whose activations rank `rank` holds at once under 1F1B."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write one_f_one_b_peak(p, m, rank): warm-up forwards + 1, at most m")
    # ---- end of your part -----------------------------------------------------------------------
