"""`refpar lesson check 3`: lesson 3's checker, the gradient averaged over 2 ranks against the whole
batch's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lessons.checkers.common import Teaching, Wrong, close
from refpar.sharding import shard_range


def _least_squares_grad(w, x, y):
    """Gradient of mean((x @ w - y)^2) over the rows of x."""
    return 2 * x.T @ (x @ w - y) / len(y)  # (C,)


def check_03(mod, comm) -> str:
    rng = np.random.default_rng(0)
    x, y, w = rng.standard_normal((8, 5)), rng.standard_normal(8), rng.standard_normal(5)
    a, b = shard_range(8, comm.size, comm.rank)
    local = {"w": _least_squares_grad(w, x[a:b], y[a:b]), "b": np.array([float(comm.rank + 1)])}
    got = mod.average_gradients(local, Teaching(comm, Path(mod.__file__),
                                                 {f"grads[{k!r}]": v for k, v in local.items()}))
    if not isinstance(got, dict) or set(got) != {"w", "b"}:
        raise Wrong("average_gradients must return a dict with the same names as its input")
    close(got["b"], [np.mean(np.arange(1, comm.size + 1))], "the average of gradients 1 and 2")
    close(got["w"], _least_squares_grad(w, x, y),
           "the averaged gradient (it should equal the gradient of the whole batch)")
    return (f"average_gradients over {comm.size} ranks gives the whole batch's gradient: the mean of "
            "equal shards' mean losses is the mean loss")
