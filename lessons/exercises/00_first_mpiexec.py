"""Lesson 0 exercise: which rows of a batch does each rank take?

    refpar lesson check 0                      # runs the checks on 3 ranks
    refpar lesson check 0 --file my_copy.py

n rows are split over `size` ranks as evenly as possible: sizes differ by at most one, the first
n % size ranks take one row more, and rank 0 takes the first rows.
"""


def my_rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, stop) of the rows rank `rank` of `size` takes out of n rows."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write my_rows(n, size, rank): rank's (start, stop) of n rows")
    # ---- end of your part -----------------------------------------------------------------------
