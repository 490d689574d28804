"""Lesson 4: model states per GPU under ZeRO, the ZeRO paper's Figure 1 (Rajbhandari et al. 2020).

    python lessons/scripts/04_zero_table.py

Mixed-precision Adam: 2 bytes of fp16 parameter, 2 of fp16 gradient and K = 12 of optimizer state
(fp32 master weights, momentum, variance) per parameter. 7.5B parameters on N GPUs.
"""

from refpar.analysis.memory import paper_model_state_bytes

psi = 7.5e9
print("model states per GPU in GB, 7.5B parameters, mixed-precision Adam (2 + 2 + 12 bytes each)")
print(f"{'N GPUs':>7} {'DP':>8} {'ZeRO-1':>8} {'ZeRO-2':>8} {'ZeRO-3':>8}")
for n in (1, 4, 16, 64, 1024):
    row = [paper_model_state_bytes(psi, n, stage) / 1e9 for stage in range(4)]
    print(f"{n:>7} " + " ".join(f"{gb:8.2f}" for gb in row))
