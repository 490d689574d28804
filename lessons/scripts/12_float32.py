"""Lesson 12, pitfall 1: a float32 run is not a float64 run; how far apart should they be?

    python lessons/scripts/12_float32.py

The tiny GPT-2's loss and gradients on one batch, computed once in float64 (refpar's reference)
and once in float32 from the same weights rounded to float32, dropout off.
"""

import numpy as np

from refpar.config import model_preset
from refpar.model.gpt import init_params, loss_and_grads

config64, config32 = model_preset("tiny"), model_preset("tiny", dtype="float32")
params64 = init_params(config64, seed=0)
params32 = {name: p.astype(np.float32) for name, p in params64.items()}
rng = np.random.default_rng(0)
tokens = rng.integers(0, config64.vocab_size, size=(8, 17))  # (B, T+1)
x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs and next-token targets

loss64, grads64 = loss_and_grads(params64, x, y, config64, training=False)
loss32, grads32 = loss_and_grads(params32, x, y, config32, training=False)
worst = max(float(np.max(np.abs(grads32[n] - grads64[n])) / np.max(np.abs(grads64[n])))
            for n in grads64)
eps32 = float(np.finfo(np.float32).eps)
print(f"loss float64 {loss64:.12f}")
print(f"loss float32 {loss32:.12f}")
print(f"relative difference of the losses: {abs(loss32 - loss64) / loss64:.0e}; float32's epsilon is "
      f"{eps32:.1e}")
print(f"largest gradient difference, relative to that gradient's largest entry: {worst:.0e}")
print("so: compare a float32 framework with the float64 reference to about 1e-5 relative, never to "
      "1e-10, and expect the gap to grow with the model's depth and the number of steps")
