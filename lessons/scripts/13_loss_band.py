"""Lesson 13: the single-device bf16-mixed run next to the float64 run, step by step.

    python lessons/scripts/13_loss_band.py

Same weights (bf16's are float64's rounded once), same batches, same dropout masks: the only
difference is the precision, so the gap between the two loss curves is what bf16 costs.
"""

from refpar.config import TrainConfig, model_preset
from refpar.trainer import train_single_device

train = TrainConfig(steps=16)
fp64 = train_single_device(model_preset("tiny"), train).losses
bf16 = train_single_device(model_preset("tiny", dtype="bfloat16"), train).losses
print(" step     fp64 loss   bf16-mixed loss   relative gap")
for step, (a, b) in enumerate(zip(fp64, bf16, strict=True), 1):
    if step in (1, 2, 3) or step % 4 == 0:
        print(f"{step:>5}  {a:12.6f}  {b:16.6f}  {abs(b - a) / a:13.1e}")
gaps = [abs(b - a) / a for a, b in zip(fp64, bf16, strict=True)]
print(f"largest gap over {len(gaps)} steps: {max(gaps):.1e} (bf16's unit roundoff 2^-8 = 3.9e-03; "
      "tests/test_precision.py allows 4e-2 over 30 steps)")
