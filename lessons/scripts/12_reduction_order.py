"""Lesson 12, pitfall 2: the same numbers summed in another order give another float32 answer.

    python lessons/scripts/12_reduction_order.py

8 "ranks" each hold a gradient of a million float32 numbers. A ring all-reduce adds them in one
order, a tree in another, one device in a third: all three are correct, and they differ.
"""

import numpy as np

rng = np.random.default_rng(0)
grads = rng.standard_normal((8, 1_000_000)).astype(np.float32)  # (ranks, n)
exact = grads.astype(np.float64).sum(axis=0)  # (n,) the reference, in float64

sequential = grads[0].copy()
for g in grads[1:]:  # one device accumulating microbatch after microbatch
    sequential += g
tree = ((grads[0] + grads[1]) + (grads[2] + grads[3])) + ((grads[4] + grads[5]) + (grads[6] + grads[7]))
ring = grads[3] + grads[4] + grads[5] + grads[6] + grads[7] + grads[0] + grads[1] + grads[2]


def rel(a):
    return float(np.max(np.abs(a - exact)) / np.max(np.abs(exact)))


print("float32 sums of 8 ranks' gradients, largest error relative to the largest entry:")
print(f"  sequential {rel(sequential):.1e}, tree {rel(tree):.1e}, ring (starting at rank 3) {rel(ring):.1e}")
print(f"  elements where tree and ring disagree: {int(np.sum(tree != ring)):,} of {tree.size:,}")
g64 = rng.standard_normal((8, 1_000_000))  # (ranks, n) float64 gradients
seq64 = g64[0].copy()
for g in g64[1:]:
    seq64 += g
tree64 = ((g64[0] + g64[1]) + (g64[2] + g64[3])) + ((g64[4] + g64[5]) + (g64[6] + g64[7]))
diff64 = float(np.max(np.abs(tree64 - seq64)) / np.max(np.abs(seq64)))
print(f"float64 gradients, tree against sequential: {diff64:.1e} (why refpar's parallel runs differ "
      "from one device by about 1e-16, and a float32 framework by about 1e-7)")
