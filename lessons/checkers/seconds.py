"""Lesson 5's checker: a ring all-reduce's alpha-beta time against refpar/comm/cost.py's, a GEMM's
roofline against the two bounds written out here, and MFU against refpar/engine/runlog.py's
definition (model FLOPs / (step time x GPUs x peak)). A wrong answer is matched against the
formulas a learner typically writes instead, and told which one it is."""

from __future__ import annotations

import math

from lessons.checkers.common import Wrong
from refpar.analysis.hardware import hardware
from refpar.comm.cost import alpha_beta_time

REL = 1e-12  # the answers are a handful of float64 operations: a few ulps apart at most


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


def _which(got: float, known: dict[str, float]) -> str:
    return next((f"; that is {name}" for name, v in known.items() if _same(got, v)), "")


def _all_reduce(mod) -> None:
    for nbytes, p, alpha, bw in ((439_808, 2, 5e-6, 10e9), (14e9, 8, 5.7e-6, 450e9), (1024, 64, 6.6e-6, 50e9),
                                 (3e6, 5, 2e-5, 1e9)):
        want = alpha_beta_time("all_reduce", "ring", nbytes, p, alpha=alpha, bandwidth=bw)
        got = mod.ring_all_reduce_seconds(nbytes, p, alpha, bw)
        if _same(got, want):
            continue
        known = {
            "one message of the whole buffer: a ring all-reduce is 2 (p-1) steps, each a message of its own":
                alpha + nbytes / bw,
            "a reduce-scatter's time (or an all-gather's): the all-reduce is both, one after the other":
                (p - 1) * (alpha + nbytes / p / bw),
            "2 (p-1) messages of the whole buffer: each step of the ring moves one chunk, n/p bytes":
                2 * (p - 1) * (alpha + nbytes / bw),
            "the bytes' time with a single alpha: every step of the ring waits for its own message":
                alpha + 2 * (p - 1) * nbytes / p / bw,
        }
        raise Wrong(f"ring_all_reduce_seconds({nbytes:,.0f} B, p={p}, alpha={alpha:g} s, bandwidth={bw:g} "
                    f"B/s) = {got:.6g} s; refpar's cost model gives {want:.6g} s" + _which(got, known))


def _gemm(mod) -> None:
    h100 = hardware("h100")
    peak, hbm = h100.flops("bfloat16"), h100.hbm_bandwidth
    for (M, N, K), item in (((4096, 4096, 4096), 2), ((8, 4096, 4096), 2), ((1, 50257, 768), 4),
                            ((2048, 11008, 4096), 2)):
        compute = 2 * M * N * K / peak
        memory = item * (M * K + K * N + M * N) / hbm
        want = max(compute, memory)
        got = mod.gemm_seconds(M, N, K, peak, hbm, item)
        if _same(got, want):
            continue
        bound = "compute" if compute > memory else "memory"
        known = {
            "compute plus memory: a GEMM reads and writes while it multiplies, so the slower of the two "
            "sets its time": compute + memory,
            f"its FLOPs' time alone, but this GEMM is {bound} bound: {memory * 1e6:.3g} us through memory":
                compute,
            f"its memory time alone, but this GEMM is {bound} bound: {compute * 1e6:.3g} us of FLOPs": memory,
            "max(M N K / peak, ...): a multiply-add is 2 FLOPs": max(M * N * K / peak, memory),
        }
        raise Wrong(f"gemm_seconds(M={M}, N={N}, K={K}, {item}-byte elements) on an H100 = {got:.6g} s; the "
                    f"roofline gives {want:.6g} s ({bound} bound)" + _which(got, known))


def _mfu(mod) -> None:
    for flops, seconds, n, peak in ((1.376e15, 3.477, 1, 989.5e12), (6 * 7e9 * 4e6, 9.1, 512, 989.5e12),
                                    (2.2e9, 0.2, 2, 3.1e9)):
        want = flops / (seconds * n * peak)
        got = mod.mfu(flops, seconds, n, peak)
        if _same(got, want):
            continue
        known = {"the model FLOPs over one GPU's peak: the step ran on every GPU of the job":
                 flops / (seconds * peak),
                 "a percentage: return the fraction (0.4, not 40)": 100 * want}
        raise Wrong(f"mfu({flops:.4g} FLOPs, {seconds} s, {n} GPUs, peak {peak:.4g}) = {got:.6g}; PaLM's "
                    f"definition gives {want:.6g}" + _which(got, known))


def check_05(mod, comm) -> str:
    _all_reduce(mod)
    _gemm(mod)
    _mfu(mod)
    return ("ring_all_reduce_seconds, gemm_seconds and mfu agree with refpar's cost model, the roofline and "
            "PaLM's MFU")
