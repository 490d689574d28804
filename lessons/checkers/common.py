"""What every checker of lessons/checkers/ and lessons/checks.py shares: `Wrong`, the sentence a
learner is told, and `close`, float64 arrays compared to the contract with the first miss located."""

from __future__ import annotations

import traceback
from pathlib import Path

import numpy as np

from lessons.course import ROOT

# A learner's answer sums in its own order (on ranks, in its collective's order) and refpar's in
# another: float64 against one device, relative 1e-10 (DESIGN.md, "Numerics").
CONTRACT = 1e-10


class Wrong(Exception):
    """What is wrong with the learner's answer, in one or two plain sentences."""


def close(got, want, what: str, where=None) -> None:
    """got within CONTRACT of want, relative to want's largest entry or to 1 if that is smaller:
    the checks' numbers are O(1), and a sum that cancels to near 0 has no relative accuracy. A miss
    names how many elements differ and the first of them; `where(index)` adds what that index is to
    the learner (the ring's chunk, the query's row)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise Wrong(f"{what} has shape {got.shape}, it should be {want.shape}")
    bound = CONTRACT * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    # NaN compares as off; an infinity matches only the same infinity (a fully masked row's -inf lse)
    same = (got == want) | (np.abs(got - want) <= bound)
    if same.all():
        return
    bad = np.argwhere(~same)  # (k, ndim), in C order: the first is the lowest index
    first = tuple(int(i) for i in bad[0])
    index = first[0] if len(first) == 1 else first
    diff = np.abs(got - want)[~same]
    off = "not a number" if np.isnan(diff).any() else f"off by up to {float(np.max(diff)):.3g}"
    raise Wrong(f"{what} is {off} at {len(bad)} of {got.size} elements; the first is "
                f"[{', '.join(map(str, first))}]{' (' + where(index) + ')' if where else ''}: "
                f"{got[first]:.6g} where the right answer is {want[first]:.6g}")


def allgather(comm, obj) -> list:
    """Every rank's small object, on every rank, under `comm`'s timeout (MPI's own allgather would
    wait for a rank that stopped for ever)."""
    return comm.broadcast_object(comm.gather_object(obj))


def learner_line(path: Path) -> str:
    """'line N, `code`' of the innermost frame of the learner's file now on the stack."""
    frames = [f for f in traceback.extract_stack() if same_file(f.filename, path)]
    return f"line {frames[-1].lineno}, `{frames[-1].line}`" if frames else "your code"


def same_file(filename: str, path: Path) -> bool:
    try:
        return Path(filename).resolve() == path.resolve()
    except OSError:
        return False


class Teaching:
    """The communicator a learner's exercise gets: refpar's, except that before each collective the
    ranks compare what they are about to call (the op, the array's shape and dtype, and which of the
    checker's arrays it is when it is one) and stop with the difference named, instead of summing
    different arrays into silently wrong numbers. It counts the calls, too."""

    def __init__(self, comm, path: Path, known: dict[str, np.ndarray] | None = None):
        self.comm, self.rank, self.size, self.path = comm, comm.rank, comm.size, path
        self.known = known or {}
        self.calls: list[tuple[str, tuple]] = []  # (op, the input's shape) of each call, in order

    def all_reduce(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        self._agree("all_reduce", x, op)
        return self.comm.all_reduce(x, op=op, algo=algo, tag=tag)

    def reduce_scatter(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        self._agree("reduce_scatter", x, op)
        return self.comm.reduce_scatter(x, op=op, algo=algo, tag=tag)

    def all_gather(self, x, algo: str = "native", tag: str = "", counts=None):
        self._agree("all_gather", x, "", rows_may_differ=True)  # uneven shards are legitimate
        return self.comm.all_gather(x, algo=algo, tag=tag, counts=counts)

    def _agree(self, name: str, x, op: str, rows_may_differ: bool = False) -> None:
        x = np.asarray(x)
        which = next((k for k, v in self.known.items() if v.shape == x.shape and np.array_equal(v, x)), None)
        self.calls.append((name, tuple(x.shape)))
        shape = ("*", *x.shape[1:]) if rows_may_differ and x.ndim else tuple(x.shape)
        mine = (name, op, shape, x.dtype.name, which)
        every = allgather(self.comm, (mine, learner_line(self.path)))
        if len({call for call, _ in every}) == 1:
            return
        k = len(self.calls)
        said = "; ".join(f"rank {r} {c[0]}({c[4] or 'an array'} of shape {c[2]}, {c[3]}"
                         + (f", op={c[1]!r}" if c[1] else "") + f") at {line}"
                         for r, (c, line) in enumerate(every))
        raise Wrong(f"your ranks' collective number {k} differs: {said}. Every rank must call the same "
                    "collectives in the same order on matching arrays, or MPI combines the wrong ones")


def shown(path: Path) -> str:
    """The path as a learner in the repository root would type it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
