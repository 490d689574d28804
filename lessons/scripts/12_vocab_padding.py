"""Lesson 12, pitfall 4: padding the vocabulary changes the loss unless the padded logits are masked.

    python lessons/scripts/12_vocab_padding.py

Megatron-LM pads the vocabulary to a multiple of 128 x tp so that it splits evenly and the matmuls
are aligned: GPT-2's 50,257 becomes 50,304. The padded rows of the embedding produce logits too.
Here refpar's 96-token vocabulary padded to 128, with the padded rows zero (a common
initialisation) and their logits left in or masked to -inf before the softmax.
"""

import numpy as np

rng = np.random.default_rng(0)
V, V_padded, N, C = 96, 128, 64, 32
h = rng.standard_normal((N, C))  # (N, C) final hidden states
wte = rng.standard_normal((V, C)) * 0.3  # (V, C) the tied embedding
targets = rng.integers(0, V, size=N)  # (N,)


def cross_entropy(logits):
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]  # (N,)
    return float(np.mean(lse - logits[np.arange(N), targets]))


padded = np.concatenate([wte, np.zeros((V_padded - V, C))])  # (V_padded, C)
reference = cross_entropy(h @ wte.T)
unmasked = cross_entropy(h @ padded.T)
masked_logits = h @ padded.T
masked_logits[:, V:] = -np.inf
masked = cross_entropy(masked_logits)
print(f"vocabulary {V}, padded to {V_padded}")
print(f"loss over the real vocabulary:       {reference:.12f}")
print(f"padded, padded logits left in (0):   {unmasked:.12f}  (+{unmasked - reference:.4f})")
print(f"padded, padded logits set to -inf:   {masked:.12f}  (difference {abs(masked - reference):.1e})")
print("each padded logit 0 adds exp(0) to every softmax denominator: mask them, and compare a "
      "framework's loss with refpar's only after you have")
