"""`refpar lesson check 10`: lesson 10's checker, expert capacity and the keep decision in queue order over
every rank."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lessons.checkers.common import Teaching, Wrong
from refpar.sharding import shard_range


def _queue_positions(choices: np.ndarray, n_experts: int) -> np.ndarray:
    """(N, k) the whole batch's choices -> (N, k) each assignment's place in its expert's queue:
    slot 0 of every token in token order, then slot 1, ... (an independent loop, not refpar's router)."""
    seen, place = np.zeros(n_experts, dtype=int), np.zeros(choices.shape, dtype=int)
    for j in range(choices.shape[1]):
        for t in range(choices.shape[0]):
            place[t, j] = seen[choices[t, j]]
            seen[choices[t, j]] += 1
    return place


def check_10(mod, comm) -> str:
    P, r = comm.size, comm.rank
    for n, e, k, f in ((16, 4, 2, 1.0), (10, 4, 1, 1.25), (7, 3, 2, 0.5)):
        want = math.ceil(n * k * f / e)
        if mod.capacity(n, e, k, f) != want:
            raise Wrong(f"capacity(n_tokens={n}, experts={e}, top_k={k}, factor={f}) = "
                        f"{mod.capacity(n, e, k, f)}, expected {want}")
    rng = np.random.default_rng(7)
    for n, e, k, cap in ((16, 4, 2, 3), (9, 3, 1, 2), (16, 4, 2, 8), (12, 4, 2, 4)):
        choices = np.stack([rng.permutation(e)[:k] for _ in range(n)])  # (N, k) the whole batch's
        place = _queue_positions(choices, e)  # (N, k)
        a, b = shard_range(n, P, r)
        ep = Teaching(comm, Path(mod.__file__), {"choices": choices[a:b]})
        got = np.asarray(mod.kept(choices[a:b].copy(), e, cap, ep))
        if got.shape != (b - a, k):
            raise Wrong(f"kept(...) returned shape {got.shape} on rank {r}; it should be {(b - a, k)}, "
                        "one entry per assignment of this rank's tokens")
        wrong = np.argwhere(got.astype(bool) != (place[a:b] < cap))  # (w, 2)
        if len(wrong):
            t, j = (int(i) for i in wrong[0])
            said = "keep" if got[t, j] else "drop"
            raise Wrong(f"rank {r}'s kept(...) is wrong for {len(wrong)} of {got.size} assignments ({n} "
                        f"tokens on {P} ranks, {e} experts, top-{k}, capacity {cap}); the first is token "
                        f"{a + t}'s choice {j + 1}, expert {choices[a + t, j]}: you {said} it, but "
                        f"{place[a + t, j]} assignments are ahead of it in that expert's queue")
        sent = sum(math.prod(shape) for _, shape in ep.calls)
        if sent > k * e:
            raise Wrong(f"kept(...) exchanged {sent} numbers per rank for {b - a} tokens; {k * e} suffice "
                        "whatever the number of tokens: what does a rank need to know about the others?")
    return ("capacity and kept agree with the queue order over the whole batch on "
            f"{P} ranks, exchanging a few counts per rank")
