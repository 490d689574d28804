"""How a length is split into parts: the one helper every uneven shard goes through."""

from __future__ import annotations


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are split into `parts` contiguous parts.

    The first n % parts parts get one item more, so sizes differ by at most one:
    shard_range(10, 4, i) -> (0, 3), (3, 6), (6, 8), (8, 10).
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"shard index {index} is outside 0..{parts - 1}")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_sizes(n: int, parts: int) -> list[int]:
    """The size of every part, in order: shard_sizes(10, 4) -> [3, 3, 2, 2]."""
    return [stop - start for start, stop in (shard_range(n, parts, i) for i in range(parts))]
