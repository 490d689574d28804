"""Lesson 12, pitfall 3: the mean loss of microbatches with different numbers of real tokens.

    python lessons/scripts/12_loss_normalisation.py

4 microbatches (or data-parallel ranks) whose sequences have padding removed: 512, 100, 300 and 60
real tokens. Averaging each microbatch's mean loss weighs a token of the short one 8.5 times a
token of the long one; the right loss (and gradient) divides the sum over all tokens by their number.
"""

import numpy as np

rng = np.random.default_rng(0)
counts = [512, 100, 300, 60]
losses = [rng.gamma(4.0, 0.5 + 0.5 * (c < 200), size=c) for c in counts]  # short ones are harder
token_mean = float(np.concatenate(losses).mean())
mean_of_means = float(np.mean([v.mean() for v in losses]))
print(f"tokens per microbatch: {counts}")
print(f"mean over every token (right):          {token_mean:.6f}")
print(f"mean of the microbatches' means (wrong): {mean_of_means:.6f}")
print(f"relative difference: {abs(mean_of_means - token_mean) / token_mean:.2%}")
print("fix: sum the losses, all-reduce the sum and the token count, divide once "
      "(refpar's `normalizer` in loss_and_grads)")
