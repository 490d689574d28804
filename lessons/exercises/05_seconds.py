"""Lesson 5 exercise: bytes and FLOPs into seconds.

    refpar lesson check 5

Part 1: the time of a ring all-reduce of `nbytes` bytes over p ranks in Hockney's model: every message
costs alpha seconds plus its bytes over the link's bandwidth (bytes/s), and the ring's steps follow
one another (lesson 1 counted them, and the bytes each moves).

Part 2: the roofline time of one GEMM (M, K) @ (K, N) on an accelerator with `peak_flops` FLOP/s and
`hbm_bandwidth` bytes/s of memory, `itemsize` bytes per element: the kernel cannot finish before its
FLOPs are done at the peak, nor before its operands and its result have gone through memory once,
and it does both at the same time.

Part 3: the model FLOPs utilization of a step (PaLM's MFU): the FLOPs the model needs for the step
against what the GPUs that ran it could have done in that time.
"""


def ring_all_reduce_seconds(nbytes: float, p: int, alpha: float, bandwidth: float) -> float:
    """Seconds for a ring all-reduce of an `nbytes` buffer over p ranks."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write ring_all_reduce_seconds(nbytes, p, alpha, bandwidth), "
                              "gemm_seconds(...) and mfu(...)")
    # ---- end of your part -----------------------------------------------------------------------


def gemm_seconds(M: int, N: int, K: int, peak_flops: float, hbm_bandwidth: float, itemsize: int) -> float:
    """The roofline's seconds for (M, K) @ (K, N)."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write gemm_seconds(M, N, K, peak_flops, hbm_bandwidth, itemsize)")
    # ---- end of your part -----------------------------------------------------------------------


def mfu(model_flops: float, step_seconds: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization, a fraction between 0 and 1."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write mfu(model_flops, step_seconds, n_gpus, peak_flops)")
    # ---- end of your part -----------------------------------------------------------------------
