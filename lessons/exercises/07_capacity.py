"""Lesson 7 exercise: expert capacity and dropped tokens.

    refpar lesson check 7

Each of n tokens chooses top_k of E experts. An expert takes at most `capacity` assignments,
ceil(n * top_k * factor / E); it keeps them in queue order (every token's first choice, in token
order, then every token's second choice, ...) and drops the rest.
"""

import numpy as np


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """The assignments one expert takes from a batch of n_tokens."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write capacity(n_tokens, n_experts, top_k, factor)")
    # ---- end of your part -----------------------------------------------------------------------


def dropped(choices: np.ndarray, n_experts: int, cap: int) -> int:
    """choices (n, top_k): the experts each token chose -> how many assignments are dropped."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write dropped(choices, n_experts, cap)")
    # ---- end of your part -----------------------------------------------------------------------
