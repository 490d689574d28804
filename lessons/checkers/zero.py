"""`refpar lesson check 4`: lesson 4's checker, a ZeRO-2 AdamW step on 2 ranks against one device's, and
its collectives."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lessons.checkers.common import Teaching, Wrong, close
from refpar.sharding import shard_range

# AdamW's settings in exercise 4's file, repeated: the learner's file must not set the checker's answer
ADAMW_03, LR_03 = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}, 0.01


def check_04(mod, comm) -> str:
    from types import SimpleNamespace

    from refpar.model.optim import adamw_update

    P, r, path = comm.size, comm.rank, Path(mod.__file__)
    for n, t in ((10, 1), (7, 3)):  # 7 rows: uneven shards; t = 3: moments from earlier steps
        rng = np.random.default_rng([3, n])
        param = rng.standard_normal(n)  # (n,) the same on every rank
        grads = rng.standard_normal((P, n))  # (P, n) every rank's gradient: the checker knows them all
        m0, v0 = (0.1 * rng.standard_normal(n), 0.01 * rng.random(n)) if t > 1 else (np.zeros(n), np.zeros(n))
        # the single device: one AdamW step of the whole parameter on the whole batch's mean gradient
        want = adamw_update(param.copy(), grads.mean(axis=0), m0.copy(), v0.copy(), t,
                            SimpleNamespace(**ADAMW_03), decay=True, lr=LR_03)
        a, b = shard_range(n, P, r)
        dp = Teaching(comm, path, {"grad": grads[r], "param": param})
        got = mod.zero2_step(param.copy(), grads[r].copy(), m0[a:b].copy(), v0[a:b].copy(), t, dp)
        if not isinstance(got, tuple) or len(got) != 3:
            raise Wrong("zero2_step must return three arrays: (param, m, v)")
        ops = [op for op, _ in dp.calls]
        if "all_reduce" in ops:
            raise Wrong(f"your step calls {', '.join(ops)}: an all-reduce leaves every rank the whole "
                        "summed gradient, which ZeRO-2 never holds; which collective gives each rank "
                        "only its rows of the sum?")
        def row(i, a=a):
            return f"row {a + i}"

        def owner(i, n=n):
            return f"row {i}, which rank {next(q for q in range(P) if i < shard_range(n, P, q)[1])} updates"

        close(got[1], want[1][a:b], f"rank {r}'s new m, rows {a}..{b - 1} of n={n}, step t={t}", row)
        close(got[2], want[2][a:b], f"rank {r}'s new v, rows {a}..{b - 1} of n={n}, step t={t}", row)
        close(got[0], want[0], f"rank {r}'s new parameter (n={n}, step t={t})", owner)
        if dp.calls != [("reduce_scatter", (n,)), ("all_gather", (b - a,))]:
            raise Wrong(f"your step calls {', '.join(f'{op}{shape}' for op, shape in dp.calls)}; ZeRO-2 "
                        f"moves exactly an all-reduce's bytes, 2 (n - n/{P}) elements per rank: one "
                        "collective of the whole gradient, one of this rank's rows")
    return (f"zero2_step equals one AdamW step on one device over {P} ranks, uneven rows included, "
            "each rank holding only its rows' moments and sending an all-reduce's bytes")
