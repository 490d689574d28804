"""The highest MFU a published measured run reached on each GPU: what a predicted plan is held against.

    python -m refpar plan --model gpt3-175b --gpus 1024 --hardware h100

Every run of published_runs.RUNS and held_out_runs.HELD_OUT that measured a whole step, its MFU
counted as Chowdhery et al. 2022 (Appendix B) count it: flops.model_flops over the measured step
time, the GPUs and the dense bf16 peak. The planner flags a plan whose predicted MFU is above the
highest of its GPU (planner._row's "above_published"): nothing published shows that a stack reaches
it, and the held-out runs show the model pricing some stacks fast (held_out_runs.py's notes).
"""

from __future__ import annotations

from functools import cache

from refpar.analysis.flops import model_flops, step_flops
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.held_out_runs import HELD_OUT
from refpar.analysis.published_runs import RUNS, Run


def measured_step(run: Run) -> float | None:
    """The run's measured step in seconds, from whichever figure it published; None for a block time."""
    gpus, peak = run.gpus, HARDWARE[run.hardware].flops("bfloat16")
    model = model_flops(run.model, run.global_batch, run.seq)
    return {"step_s": lambda: run.published,
            "tokens_per_gpu_s": lambda: run.global_batch * run.seq / (run.published * gpus),
            "mfu": lambda: model / (run.published * gpus * peak),
            "tflops_model": lambda: model / (run.published * 1e12 * gpus),
            # Narayanan et al. 2021, eq. 3: the FLOPs with full recomputation, per GPU
            "tflops_hardware": lambda: step_flops(run.model, run.global_batch, run.seq, "full")
            / (run.published * 1e12 * gpus),
            "block_ms": lambda: None}[run.metric]()


def measured_mfu(run: Run) -> float | None:
    step = measured_step(run)
    if step is None:
        return None
    peak = HARDWARE[run.hardware].flops("bfloat16")
    return model_flops(run.model, run.global_batch, run.seq) / (step * run.gpus * peak)


@cache
def ceilings() -> dict[str, tuple[float, str]]:
    """GPU -> (the highest measured MFU, the run that reached it)."""
    best: dict[str, tuple[float, str]] = {}
    for run in list(RUNS) + list(HELD_OUT):
        mfu = measured_mfu(run)
        if mfu is not None and mfu > best.get(run.hardware, (0.0, ""))[0]:
            best[run.hardware] = (mfu, run.name)
    return best


def above_published(hardware: str, mfu: float) -> str:
    """One sentence when `mfu` is above every published run on `hardware` (on any GPU where none
    ran on it), else ""."""
    table = ceilings()
    if hardware in table:
        top, name, where = *table[hardware], f"on {hardware}"
    else:
        top, name = max(table.values())
        where = "on any GPU"
    if mfu <= top:
        return ""
    return (f"predicted MFU {100 * mfu:.1f}% is above every published measured run {where} "
            f"(highest {100 * top:.1f}%: {name}); treat it as optimistic")
