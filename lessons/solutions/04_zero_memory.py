"""Lesson 4, reference solution: one ZeRO-2 optimizer step (refpar/parallel/zero.py is
refpar's own, for every unit of a model)."""

from types import SimpleNamespace

import numpy as np

from refpar.model.optim import adamw_update
from refpar.sharding import shard_range

ADAMW = SimpleNamespace(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR = 0.01


def adamw(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int):
    """One AdamW step (t counts from 1) of any piece: p, g, m, v of one shape -> new (p, m, v)."""
    return adamw_update(p, g, m, v, t, ADAMW, decay=True, lr=LR)


def zero2_step(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, dp):
    """param (n,), grad (n,) on every rank; m, v (rows of this rank,) -> (new param (n,) on every
    rank, new m, new v of this rank's rows)."""
    g = dp.reduce_scatter(grad, tag="param:grad") / dp.size  # (rows,) the batch's mean gradient, my rows
    a, b = shard_range(param.size, dp.size, dp.rank)  # the rows reduce_scatter gave this rank
    p, m, v = adamw(param[a:b], g, m, v, t)  # (rows,) each: only my rows' moments ever exist here
    return dp.all_gather(p, tag="param"), m, v  # (n,) every rank's updated rows, in rank order
