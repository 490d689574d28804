"""`refpar lesson check 6`: lesson 6's checker, the tensor-parallel MLP's forward against one device's, and
its all-reduces."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lessons.checkers.common import Teaching, Wrong, close
from refpar.sharding import shard_range


def check_06(mod, comm) -> str:
    B, C, tp, r = 6, 8, comm.size, comm.rank
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, C))  # (B, C) the same on every tp rank
    w_fc, w_proj = rng.standard_normal((C, 4 * C)), rng.standard_normal((4 * C, C))
    a, b = shard_range(4 * C, tp, r)
    counting = Teaching(comm, Path(mod.__file__), {"x": x})
    got = mod.tp_mlp_forward(x, w_fc[:, a:b], w_proj[a:b, :], counting)  # (B, C)
    close(got, np.tanh(x @ w_fc) @ w_proj, f"rank {r}'s MLP output", lambda i: f"row {i} of the batch")
    if len(counting.calls) != 1:
        raise Wrong(f"your forward made {len(counting.calls)} collectives; Megatron's MLP needs "
                    "exactly one all-reduce: which of the two products leaves each rank a partial sum?")
    return f"tp_mlp_forward equals the unsharded MLP on {tp} ranks with one all-reduce"
