"""Lesson 4 exercise: one ZeRO-2 optimizer step, on 2 data-parallel ranks.

    refpar lesson check 4                      # runs the checks on 2 ranks

Every rank holds the whole parameter `param` (n,) and the gradient `grad` (n,) of the mean loss over
its own equal share of the batch. Under ZeRO-2 rank r keeps AdamW's moments `m` and `v` for its rows
only, `refpar.sharding.shard_range(n, dp.size, dp.rank)` (lesson 0's split), and the step must leave
every rank with the same parameter a single device would have after one AdamW step on the whole
batch's gradient, without any rank ever holding the whole reduced gradient.

`dp` is refpar's Communicator over the data-parallel ranks: `dp.size`, `dp.rank`,
`dp.reduce_scatter(x)` (x (n,) on every rank -> this rank's rows of the sum over the ranks) and
`dp.all_gather(x)` (each rank's rows -> every rank's, concatenated in rank order). `adamw` below
updates any piece of the parameter: every element's update is its own. The checker counts your
collectives and their bytes.
"""

from types import SimpleNamespace

import numpy as np

from refpar.model.optim import adamw_update

ADAMW = SimpleNamespace(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR = 0.01


def adamw(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int):
    """One AdamW step (t counts from 1) of any piece: p, g, m, v of one shape -> new (p, m, v)."""
    return adamw_update(p, g, m, v, t, ADAMW, decay=True, lr=LR)


def zero2_step(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, dp):
    """param (n,), grad (n,) on every rank; m, v (rows of this rank,) -> (new param (n,) on every
    rank, new m, new v of this rank's rows)."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write zero2_step(param, grad, m, v, t, dp): shard the gradient, update "
                              "your rows, share them")
    # ---- end of your part -----------------------------------------------------------------------
