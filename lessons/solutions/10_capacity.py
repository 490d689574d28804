"""Lesson 10, reference solution: expert capacity, and which assignments survive it, on ep ranks
(refpar/model/routing.py's queue_offsets and kept_counts are refpar's own)."""

import math

import numpy as np


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """The assignments one expert takes from a batch of n_tokens: its even share of the batch's
    n_tokens * top_k assignments, times the capacity factor, rounded up."""
    return math.ceil(n_tokens * top_k * factor / n_experts)


def kept(choices: np.ndarray, n_experts: int, cap: int, ep) -> np.ndarray:
    """choices (n, top_k): the experts this rank's tokens chose -> (n, top_k) bool, True where that
    assignment is among the first `cap` of its expert's queue over the whole batch."""
    k = choices.shape[1]
    hot = choices[:, :, None] == np.arange(n_experts)  # (n, k, E): assignment -> its expert
    counts = hot.sum(axis=0)  # (k, E) this rank's slot-j choices of each expert
    every = ep.all_gather(counts[None], tag="moe.counts").reshape(ep.size, k, n_experts)  # (P, k, E)
    # ahead of my slot-j choices of e: every rank's earlier slots, then the earlier ranks' slot j
    ahead = np.cumsum(every.sum(axis=0), axis=0) - every.sum(axis=0) + every[:ep.rank].sum(axis=0)  # (k, E)
    mine = np.cumsum(hot, axis=0) - hot  # (n, k, E): my earlier tokens' same-slot choices of e
    position = ((ahead[None] + mine) * hot).sum(axis=-1)  # (n, k): place in its expert's queue
    return position < cap
