"""A synthetic corpus that is learnable and whose best possible loss is known exactly.

Tokens follow a random sparse Markov chain: from token i the next token is one of `branching`
successors, i+1, i+2 (mod V) and branching-2 random others, with random probabilities. Every
sequence starts from the stationary distribution pi, so each position's next token has expected
entropy sum_i pi_i H(P_i), the chain's entropy rate: the lowest mean cross-entropy any model can
reach (in nats). The i+1 and i+2 edges make the chain irreducible and aperiodic (cycles of length
V and V-1), so pi is unique.

Batches are keyed by (seed, "data", step, sample_id): a data-parallel rank that takes its slice of
the global sample ids draws exactly those rows of the global batch.

Up to DENSE_VOCAB tokens the chain is a dense (V, V) matrix and pi one linear solve. A larger
vocabulary (GPT-2's 50257: a dense P would take 20 GB, the per-row draw minutes) draws all rows'
random successors at once and finds pi by power iteration on the sparse chain, to 1e-15 in the
1-norm (the random edges make the chain mix in tens of steps); `transition` is None there.
"""

from __future__ import annotations

import numpy as np

from refpar import rng
from refpar.config import ConfigError

DENSE_VOCAB = 8192  # the largest vocabulary whose chain is a dense matrix (512 MB)


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
        dense = V <= DENSE_VOCAB
        successors = np.empty((V, branching), dtype=np.int64)  # (V, k)
        if dense:
            tokens = np.arange(V)  # (V,)
            for i in range(V):
                others = np.delete(tokens, [(i + 1) % V, (i + 2) % V])  # (V-2,) sorted, as setdiff1d's
                picked = gen.choice(others, size=branching - 2, replace=False)
                successors[i] = [(i + 1) % V, (i + 2) % V, *picked]
        else:
            successors[:, 0], successors[:, 1] = (np.arange(V) + 1) % V, (np.arange(V) + 2) % V
            successors[:, 2:] = _random_successors(gen, V, branching - 2)
        # Cubed uniforms: uneven probabilities, so the floor is well below log(branching).
        weights = gen.random((V, branching)) ** 3 + 1e-3  # (V, k)
        self.successors = successors
        self.probs = weights / weights.sum(axis=1, keepdims=True)  # (V, k), rows sum to 1
        self.transition = None
        if dense:
            self.transition = np.zeros((V, V))  # (V, V) dense P[i, j]
            np.add.at(self.transition, (np.repeat(np.arange(V), branching), successors.ravel()),
                      self.probs.ravel())
        self.stationary = self._stationary() if dense else self._stationary_by_iteration()  # (V,)
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

    def step_distribution(self, pi: np.ndarray) -> np.ndarray:
        """pi P for a distribution pi (V,) over tokens, from the sparse successors: (V,)."""
        return np.bincount(self.successors.ravel(), weights=(pi[:, None] * self.probs).ravel(),
                           minlength=self.vocab_size)

    def _stationary_by_iteration(self, tol: float = 1e-15, max_steps: int = 10_000) -> np.ndarray:
        """pi = lim pi_0 P^t from the uniform pi_0; the chain is irreducible and aperiodic."""
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)  # (V,)
        for _ in range(max_steps):
            nxt = self.step_distribution(pi)  # (V,)
            nxt /= nxt.sum()  # against drift of the rounding
            if np.abs(nxt - pi).sum() < tol:
                return nxt
            pi = nxt
        raise RuntimeError(f"the chain's stationary distribution did not converge in {max_steps} steps")

    def entropy_rate(self) -> float:
        """sum_i pi_i H(P_i) in nats: the loss floor."""
        row_entropy = -np.sum(self.probs * np.log(self.probs), axis=1)  # (V,)
        return float(self.stationary @ row_entropy)

    def batch(self, step: int, sample_ids, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets), each (len(sample_ids), seq_len) int64; targets are tokens shifted by one."""
        u = np.stack([rng.uniform(self.seed, "data", step, int(s), shape=(seq_len + 1,))
                      for s in sample_ids])  # (B, T+1)
        return self._walk(u)

    def val_batch(self, seq_len: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Held-out (tokens, targets), each (rows, seq_len): fresh sequences of the same chain under a
        key of their own ("validation"), the same on every call and every rank."""
        u = np.stack([rng.uniform(self.seed, "validation", i, shape=(seq_len + 1,))
                      for i in range(rows)])  # (rows, T+1)
        return self._walk(u)

    def describe(self) -> str:
        return f"Markov chain over {self.vocab_size} tokens"

    def _walk(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chain's sequences drawn by the uniforms u (B, T+1): the first token from pi, each next
        from its successors."""
        seq_len = u.shape[1] - 1
        B = u.shape[0]
        seq = np.empty((B, seq_len + 1), dtype=np.int64)  # (B, T+1)
        seq[:, 0] = np.minimum(np.searchsorted(self._cum_pi, u[:, 0], side="right"), self.vocab_size - 1)
        k = self.successors.shape[1]
        for t in range(seq_len):
            state = seq[:, t]  # (B,)
            choice = (u[:, t + 1, None] >= self._cum[state]).sum(axis=1)  # (B,) in 0..k
            seq[:, t + 1] = self.successors[state, np.minimum(choice, k - 1)]
        return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])


def _random_successors(gen, V: int, extra: int) -> np.ndarray:
    """(V, extra) distinct random successors per token, none of them i+1 or i+2 (mod V): offsets
    from i drawn among 0 and 3..V-1, the rows with a repeat drawn again until none has one."""
    offsets = np.empty((V, extra), dtype=np.int64)  # (V, extra)
    redraw = np.arange(V)
    while redraw.size:
        drawn = gen.integers(3, V + 1, size=(redraw.size, extra)) % V  # V wraps to offset 0: i itself
        offsets[redraw] = drawn
        ordered = np.sort(drawn, axis=1)
        redraw = redraw[(ordered[:, 1:] == ordered[:, :-1]).any(axis=1)]
    return (np.arange(V)[:, None] + offsets) % V
