"""Lesson 5: bytes into seconds. This machine's alpha and beta, measured; an all-reduce predicted
from them, then measured; the same formulas with an H100 node's numbers.

    mpiexec -n 2 python lessons/scripts/05_seconds.py

Part 1 (this machine): rank 0 and rank 1 pass messages of 8 bytes to 4 MiB back and forth; half a
round trip is one message's time t(n) = alpha + n / bandwidth (Hockney's model), fitted by least
squares. Part 2: the all-reduce of the tiny GPT-2's gradient (54,976 float64), priced by the ring's
2 (p-1) alpha + 2 (p-1)/p n / bandwidth (refpar/comm/cost.py alpha_beta_time) with the fitted
numbers, then timed. Part 3: refpar's H100 preset (refpar/analysis/hardware.py): a 7B model's bf16
gradient all-reduced inside a node and across nodes, a GEMM's roofline, and the MFU of a step.
"""

import time

import numpy as np

from refpar.analysis.hardware import hardware
from refpar.comm.communicator import world
from refpar.comm.cost import alpha_beta_time

comm = world()
r, p = comm.rank, comm.size
SIZES = [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22]  # bytes
REPEATS = 20


def one_way(nbytes: int) -> float:
    """Half the best round trip of an nbytes message between ranks 0 and 1 (best of REPEATS: the
    machine's other work only ever adds time)."""
    x = np.zeros(nbytes // 8)  # (n/8,) float64
    best = float("inf")
    for _ in range(REPEATS):
        comm.barrier()
        start = time.perf_counter()
        if r == 0:
            comm.send(x, 1)
            comm.recv(x.shape, x.dtype, 1)
        elif r == 1:
            comm.recv(x.shape, x.dtype, 0)
            comm.send(x, 0)
        best = min(best, (time.perf_counter() - start) / 2)
    return best


times = [one_way(n) for n in SIZES]
# t = alpha + n / bandwidth: alpha is what the smallest message costs, the bandwidth what the largest
# adds per byte beyond it (a least-squares line would let the large messages' noise set alpha)
alpha = times[0]
bandwidth = (SIZES[-1] - SIZES[0]) / (times[-1] - times[0])
grad = np.ones(54_976)  # (Ψ,) the tiny GPT-2's gradient in float64
best = float("inf")
for _ in range(REPEATS):
    comm.barrier()
    start = time.perf_counter()
    comm.all_reduce(grad)
    best = min(best, time.perf_counter() - start)
if r == 0:
    print("part 1, this machine: one message of n bytes between two ranks (half the best round trip)")
    for n, t in zip(SIZES, times, strict=True):
        print(f"  {n:>9,} B   {t * 1e3:.4f} ms")
    print(f"  t = alpha + n / bandwidth: alpha {alpha * 1e6:.1f} us (the 8-byte message), bandwidth "
          f"{bandwidth / 1e9:.2f} GB/s (the 4 MiB one)")
    print(f"part 2: all-reduce of {grad.nbytes:,} B on {p} ranks: ring 2 (p-1) alpha + 2 (p-1)/p n / "
          "bandwidth")
    predicted = alpha_beta_time("all_reduce", "ring", grad.nbytes, p, alpha=alpha, bandwidth=bandwidth)
    print(f"  predicted {predicted * 1e3:.3f} ms, measured {best * 1e3:.3f} ms (best of {REPEATS})")

    hw = hardware("h100")
    print(f"part 3, {hw.name}: NVLink {hw.nvlink_bandwidth / 1e9:.0f} GB/s and InfiniBand "
          f"{hw.ib_bandwidth / 1e9:.0f} GB/s per GPU each way, alpha {hw.nvlink_latency * 1e6:.1f} | "
          f"{hw.ib_latency * 1e6:.1f} us; bf16 peak {hw.flops('bfloat16') / 1e12:.1f} TFLOP/s, "
          f"HBM {hw.hbm_bandwidth / 1e12:.2f} TB/s")
    psi = 7e9
    for where, n, bw, lat in (("8 GPUs, one node", 8, hw.nvlink_bandwidth, hw.nvlink_latency),
                              ("64 GPUs, 8 nodes", 64, hw.ib_bandwidth, hw.ib_latency)):
        t = alpha_beta_time("all_reduce", "ring", 2 * psi, n, alpha=lat, bandwidth=bw)
        print(f"  all-reduce of a 7B model's bf16 gradient (14 GB) on {where}: {t:.3f} s")
    flops = 6 * psi * 8 * 4096  # 6 Ψ per token (forward 2, backward 4), 8 sequences of 4,096 per GPU
    print(f"  one GPU's step, 8 x 4,096 tokens of a 7B model: 6 Ψ tokens = {flops:.3e} FLOPs, "
          f"{flops / hw.flops('bfloat16'):.3f} s at the peak, {flops / (0.4 * hw.flops('bfloat16')):.3f} s "
          "at MFU 40%")
    mfu, peak = 0.4, hw.flops("bfloat16")
    # DP: the all-reduce of 2 Psi bytes (about 4 Psi / bw) against 6 Psi x tokens FLOPs at MFU 40%
    for where, bw in (("NVLink", hw.nvlink_bandwidth), ("InfiniBand", hw.ib_bandwidth)):
        print(f"  DP over {where}: the gradient's all-reduce outlasts the step's compute below "
              f"{2 / 3 * mfu * peak / bw:,.0f} tokens per GPU (2/3 MFU peak / bandwidth, whatever Ψ)")
    # TP over t ranks: 4 all-reduces of tokens x h bf16 per block against 72 h^2 tokens / t FLOPs
    for where, bw in (("NVLink", hw.nvlink_bandwidth), ("InfiniBand", hw.ib_bandwidth)):
        print(f"  TP=8 over {where}: the block's four all-reduces outlast its GEMMs below hidden size "
              f"{2 / 9 * 7 * mfu * peak / bw:,.0f} (2/9 (t-1) MFU peak / bandwidth, whatever the tokens)")
    for m, n, k in ((4096, 4096, 4096), (8, 4096, 4096)):
        compute = 2 * m * n * k / hw.flops("bfloat16")
        moved = 2 * (m * k + k * n + m * n) / hw.hbm_bandwidth
        bound = "compute" if compute > moved else "memory"
        print(f"  GEMM ({m}, {k}) @ ({k}, {n}) in bf16: {2 * m * n * k / (2 * (m * k + k * n + m * n)):.0f} "
              f"FLOPs per byte; compute {compute * 1e6:.1f} us, memory {moved * 1e6:.1f} us: {bound} bound")
