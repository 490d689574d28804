"""Lesson 13: what bf16 and fp16 keep and lose, and why a 16-bit product is exact in fp32.

    python lessons/scripts/13_formats.py

NumPy has no bfloat16; ml_dtypes (the NumPy extension JAX and refpar use) adds it.
"""

import ml_dtypes
import numpy as np

bf16, f16, f32 = ml_dtypes.bfloat16, np.float16, np.float32
print("format     bits  exponent  mantissa  unit roundoff u        largest   smallest normal")
for name, dt in (("float32", f32), ("bfloat16", bf16), ("float16", f16)):
    fi = ml_dtypes.finfo(dt)
    u = float(fi.eps) / 2  # round to nearest: relative error at most half a unit in the last place
    print(f"{name:9} {fi.bits:>5} {fi.nexp:>9} {fi.nmant:>9}   2^{int(np.log2(u))} = {u:.2e}  "
          f"{float(fi.max):>12.4g}   {float(fi.smallest_normal):.3g}")

print("rounding to each format (values stored, printed exactly):")
for x in (1 + 2.0 ** -9, 257.0, 70000.0, 1e-8):
    with np.errstate(over="ignore"):  # fp16(70000) is inf: that is the point
            print(f"  {x!r:>20}:  bf16 {float(bf16(x))!r:>22}   fp16 {float(f16(x))!r:>22}")
print("so fp16 overflows above 65504 and rounds gradients below 2^-25 (3e-8) to zero; bf16 has "
      "fp32's range and gives up precision instead")
scaled = 1e-8 * 65536
print(f"a gradient of 1e-8 times a loss scale of 65536 is {scaled:.4g}: fp16 stores "
      f"{float(f16(scaled)):.4g}, and dividing by the scale in fp32 gives back "
      f"{float(f32(f16(scaled)) / f32(65536)):.4g}")

rng = np.random.default_rng(10)
a = rng.standard_normal(1_000_000).astype(bf16)  # (N,) bf16: 8 significant bits
b = rng.standard_normal(1_000_000).astype(bf16)  # (N,)
exact = a.astype(np.float64) * b.astype(np.float64)  # (N,)
in_fp32 = a.astype(f32) * b.astype(f32)  # (N,) 8 + 8 = 16 significant bits fit in fp32's 24
in_bf16 = a * b  # (N,) the product rounded back to 8 bits
print(f"1,000,000 products of two bf16 numbers: computed in fp32, {np.sum(in_fp32 == exact):,} equal "
      f"the exact product; rounded to bf16, {np.sum(in_bf16.astype(np.float64) == exact):,}")
k = 4096
dot64 = float(np.dot(a[:k].astype(np.float64), b[:k].astype(np.float64)))
dot32 = float(np.sum(in_fp32[:k]))  # exact products, summed in fp32 (NumPy's pairwise order)
acc = bf16(0)
for p in in_fp32[:k]:
    acc = bf16(f32(acc) + p)  # each partial sum rounded to bf16, as a 16-bit accumulator would
print(f"a dot product of {k:,} of them: exact {dot64:.6f}, accumulated in fp32 {dot32:.6f} "
      f"(relative error {abs(dot32 - dot64) / abs(dot64):.1e}), in bf16 {float(acc):.6f} "
      f"({abs(float(acc) - dot64) / abs(dot64):.1e})")
