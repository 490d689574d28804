"""A synthetic corpus that is learnable and whose best possible loss is known exactly.

Tokens follow a random sparse Markov chain: from token i the next token is one of `branching`
successors, i+1, i+2 (mod V) and branching-2 random others, with random probabilities. Every
sequence starts from the stationary distribution pi, so each position's next token has expected
entropy sum_i pi_i H(P_i), the chain's entropy rate: the lowest mean cross-entropy any model can
reach (in nats). The i+1 and i+2 edges make the chain irreducible and aperiodic (cycles of length
V and V-1), so pi is unique.

Batches are keyed by (seed, "data", step, sample_id): a data-parallel rank that takes its slice of
the global sample ids draws exactly those rows of the global batch.
"""

from __future__ import annotations

import numpy as np

from refpar import rng
from refpar.config import ConfigError


class MarkovCorpus:
    def __init__(self, vocab_size: int, seed: int, branching: int = 4):
        if vocab_size < branching:
            raise ConfigError(f"vocab_size={vocab_size} is too small for a Markov corpus with "
                              f"{branching} successors per token; use vocab_size >= {branching}")
        if branching < 3:
            raise ValueError(f"branching={branching} must be at least 3 (i+1, i+2 and a random one)")
        V = vocab_size
        self.vocab_size, self.seed = V, seed
        gen = rng.generator(seed, "data")  # the chain's own key: no step or sample id
        successors = np.empty((V, branching), dtype=np.int64)  # (V, k)
        for i in range(V):
            others = np.setdiff1d(np.arange(V), [(i + 1) % V, (i + 2) % V])
            picked = gen.choice(others, size=branching - 2, replace=False)
            successors[i] = [(i + 1) % V, (i + 2) % V, *picked]
        # Cubed uniforms: uneven probabilities, so the floor is well below log(branching).
        weights = gen.random((V, branching)) ** 3 + 1e-3  # (V, k)
        self.successors = successors
        self.probs = weights / weights.sum(axis=1, keepdims=True)  # (V, k), rows sum to 1
        self.transition = np.zeros((V, V))  # (V, V) dense P[i, j]
        np.add.at(self.transition, (np.repeat(np.arange(V), branching), successors.ravel()),
                  self.probs.ravel())
        self.stationary = self._stationary()  # (V,)
        self._cum = np.cumsum(self.probs, axis=1)  # (V, k)
        self._cum_pi = np.cumsum(self.stationary)  # (V,)

    def _stationary(self) -> np.ndarray:
        """pi with pi P = pi and sum(pi) = 1, solved as one linear system (replace one balance
        equation by the normalisation)."""
        V = self.vocab_size
        A = self.transition.T - np.eye(V)  # (V, V)
        A[-1, :] = 1.0
        rhs = np.zeros(V)
        rhs[-1] = 1.0
        return np.linalg.solve(A, rhs)

    def entropy_rate(self) -> float:
        """sum_i pi_i H(P_i) in nats: the loss floor."""
        row_entropy = -np.sum(self.probs * np.log(self.probs), axis=1)  # (V,)
        return float(self.stationary @ row_entropy)

    def batch(self, step: int, sample_ids, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets), each (len(sample_ids), seq_len) int64; targets are tokens shifted by one."""
        u = np.stack([rng.uniform(self.seed, "data", step, int(s), shape=(seq_len + 1,))
                      for s in sample_ids])  # (B, T+1)
        B = u.shape[0]
        seq = np.empty((B, seq_len + 1), dtype=np.int64)  # (B, T+1)
        seq[:, 0] = np.minimum(np.searchsorted(self._cum_pi, u[:, 0], side="right"), self.vocab_size - 1)
        k = self.successors.shape[1]
        for t in range(seq_len):
            state = seq[:, t]  # (B,)
            choice = (u[:, t + 1, None] >= self._cum[state]).sum(axis=1)  # (B,) in 0..k
            seq[:, t + 1] = self.successors[state, np.minimum(choice, k - 1)]
        return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])
