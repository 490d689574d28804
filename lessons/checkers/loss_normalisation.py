"""`refpar lesson check 12`: lesson 12's checker, the global mean loss over microbatches of any size."""

from __future__ import annotations

import math

import numpy as np

from lessons.checkers.common import CONTRACT, Wrong


def check_12(mod, comm) -> str:
    rng = np.random.default_rng(9)
    for counts in ([16, 16, 16], [16, 3, 9, 1], [5]):
        losses = [rng.random(c) * 4 for c in counts]  # per-token losses of each microbatch
        sums = [float(v.sum()) for v in losses]
        want = float(np.concatenate(losses).mean())
        got = mod.global_mean_loss(sums, list(counts))
        if not math.isclose(got, want, rel_tol=CONTRACT):
            means = float(np.mean([s / c for s, c in zip(sums, counts, strict=True)]))
            why = ("the mean of the microbatches' means weights a token of a short microbatch more"
                   if math.isclose(got, means, rel_tol=CONTRACT) else
                   "each token's loss counts once, over the number of tokens of the whole batch")
            raise Wrong(f"global_mean_loss = {got:.6f} for microbatches of {counts} tokens; the mean "
                        f"over every token is {want:.6f} ({why})")
    return "global_mean_loss weights every token once, however the microbatches are cut"
