"""Lesson 0, reference solution: which rows of a batch does each rank take?"""


def my_rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, stop) of the rows rank `rank` of `size` takes out of n rows."""
    base, extra = divmod(n, size)  # every rank takes base rows; the first `extra` one more
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
