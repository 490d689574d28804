"""Lesson 8, reference solution: GPipe's bubble and 1F1B's memory in closed form, and a 1F1B
executor (refpar/parallel/pipeline/executor.py is refpar's own, for any schedule)."""

import numpy as np


def gpipe_bubble(p: int, m: int) -> float:
    """The share of all rank-time that GPipe's ranks sit idle in one step."""
    return (p - 1) / (m + p - 1)  # each rank works 2m of 2(m + p - 1) ticks


def one_f_one_b_peak(p: int, m: int, rank: int) -> int:
    """The most microbatches whose activations rank `rank` holds at once under 1F1B."""
    return min(p - rank, m)  # p - rank - 1 warm-up forwards, then one more before the first backward


def one_f_one_b(stage, m: int, pp) -> None:
    """Runs microbatches 0..m-1 through this rank's stage in 1F1B order. `stage.forward(j, x)` runs
    microbatch j's forward and returns its output (x: the previous stage's output, None on stage 0,
    which reads its own input); `stage.backward(j, dy)` runs its backward and returns the gradient of
    its input (dy: the next stage's gradient, None on the last stage, which starts from the loss).
    Every activation and gradient that travels is a `stage.shape` float64 array."""
    r, p = pp.rank, pp.size
    sends = []  # isends complete once the neighbour receives; waited for at the end

    def forward(j):
        x = None if r == 0 else pp.irecv(stage.shape, np.float64, r - 1, tag="act").wait()
        y = stage.forward(j, x)  # (B, D)
        if r < p - 1:
            sends.append(pp.isend(y, r + 1, tag="act"))  # one tag: MPI keeps a pair's messages in order

    def backward(j):
        dy = None if r == p - 1 else pp.irecv(stage.shape, np.float64, r + 1, tag="grad").wait()
        dx = stage.backward(j, dy)  # (B, D)
        if r > 0:
            sends.append(pp.isend(dx, r - 1, tag="grad"))

    warmup = min(p - r - 1, m)  # forwards before the first backward: the later stages' lag
    for j in range(warmup):
        forward(j)
    for j in range(m - warmup):  # steady state: one forward, then the oldest microbatch's backward
        forward(warmup + j)
        backward(j)
    for j in range(m - warmup, m):  # cool-down: the backwards left
        backward(j)
    for request in sends:
        request.wait()
