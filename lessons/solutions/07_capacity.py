"""Lesson 7, reference solution: expert capacity and dropped tokens."""

import math

import numpy as np


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """The assignments one expert takes from a batch of n_tokens."""
    return math.ceil(n_tokens * top_k * factor / n_experts)


def dropped(choices: np.ndarray, n_experts: int, cap: int) -> int:
    """choices (n, top_k): the experts each token chose -> how many assignments are dropped."""
    wanted = np.bincount(choices.reshape(-1), minlength=n_experts)  # (E,) assignments per expert
    return int(np.maximum(wanted - cap, 0).sum())  # the order decides who, not how many
