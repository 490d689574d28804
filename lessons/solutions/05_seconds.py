"""Lesson 5, reference solution: bytes and FLOPs into seconds."""


def ring_all_reduce_seconds(nbytes: float, p: int, alpha: float, bandwidth: float) -> float:
    if p == 1:
        return 0.0
    # 2 (p - 1) steps (reduce-scatter, then all-gather), each one message of a 1/p chunk
    return 2 * (p - 1) * (alpha + nbytes / p / bandwidth)


def gemm_seconds(M: int, N: int, K: int, peak_flops: float, hbm_bandwidth: float, itemsize: int) -> float:
    compute = 2 * M * N * K / peak_flops  # a multiply and an add per (m, n, k)
    memory = itemsize * (M * K + K * N + M * N) / hbm_bandwidth  # read A and B, write C
    return max(compute, memory)  # the two overlap: the slower one sets the time


def mfu(model_flops: float, step_seconds: float, n_gpus: int, peak_flops: float) -> float:
    return model_flops / (step_seconds * n_gpus * peak_flops)
