"""Lesson 8 exercise: GPipe's bubble and 1F1B's memory in closed form, a V schedule by hand, and a
1F1B executor on 2 ranks.

    refpar lesson check 8                      # runs the checks on 2 ranks

Part 1: p pipeline ranks, m microbatches, every forward and every backward one tick, transfers free.
Part 2 is the CSV next to this file (the lesson says what it holds). Part 3, `one_f_one_b`, runs one
training step of a pipeline of pp.size stages (rank r runs stage r) in 1F1B's order, moving the
activations down and the gradients up with `pp.isend(x, dest, tag=...)` and `pp.irecv(shape, dtype,
source, tag=...)` (each returns a request; `wait()` completes it, irecv's returns the array).
"""

import numpy as np


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


def one_f_one_b(stage, m: int, pp) -> None:
    """Runs microbatches 0..m-1 through this rank's stage in 1F1B order. `stage.forward(j, x)` runs
    microbatch j's forward and returns its output (x: the previous stage's output, None on stage 0,
    which reads its own input); `stage.backward(j, dy)` runs its backward and returns the gradient of
    its input (dy: the next stage's gradient, None on the last stage, which starts from the loss).
    Every activation and gradient that travels is a `stage.shape` float64 array."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write part 3, one_f_one_b(stage, m, pp): warm up, then one forward "
                              "and one backward at a time")
    # ---- end of your part -----------------------------------------------------------------------
