"""Lesson 10 exercise: expert capacity, and which assignments survive it, on 2 expert-parallel ranks.

    refpar lesson check 10                      # runs the checks on 2 ranks

A batch's tokens are split over the ep ranks in order, rank 0 holding the first ones (lesson 0's
split). Each token chose top_k of E experts: on this rank `choices` (n, top_k), column j holding
every token's (j+1)-th choice. An expert takes at most `cap` assignments of the whole batch and keeps
them in queue order: every token's first choice, in token order over the whole batch, then every
token's second choice, and so on; it drops the rest.

`ep` is refpar's Communicator over the ranks: `ep.size`, `ep.rank` and `ep.all_gather(x)` (each
rank's x (k, ...) -> every rank's, concatenated in rank order). A rank sees only its own tokens'
choices. The checker counts what you exchange: the fewest bytes that suffice do not grow with the
number of tokens.
"""

import numpy as np


def capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """The assignments one expert takes from a batch of n_tokens: its even share of the batch's
    n_tokens * top_k assignments, times the capacity factor, rounded up."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write capacity(n_tokens, n_experts, top_k, factor)")
    # ---- end of your part -----------------------------------------------------------------------


def kept(choices: np.ndarray, n_experts: int, cap: int, ep) -> np.ndarray:
    """choices (n, top_k): the experts this rank's tokens chose -> (n, top_k) bool, True where that
    assignment is among the first `cap` of its expert's queue over the whole batch."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write kept(choices, n_experts, cap, ep)")
    # ---- end of your part -----------------------------------------------------------------------
