"""The one-line JSON summary of `refpar train --json` (DESIGN.md, "Command line").

Every strategy fills the same fields through `run_summary`; a field that does not apply to a run
is null. Fields may be added here, never renamed: tests and scripts read them.
"""

from __future__ import annotations

import json
import math

from refpar import backend
from refpar.config import ModelConfig, TrainConfig
from refpar.precision import precision_of

SUMMARY_FIELDS = (
    "mesh",  # {"pp": 1, "dp": 2, ...}: every axis, sizes of this run
    "world_size",
    "zero",  # ZeRO stage
    "schedule",  # pipeline schedule name
    "microbatches",
    "model",  # ModelConfig as a dict
    "dtype",
    "steps",
    "losses",  # one per step, as this run computed them
    "reference_losses",  # --check: the single-device run's
    "max_loss_rel_diff",  # --check
    "max_param_rel_diff",  # --check: over all parameters after the last step
    "comm_bytes",  # [{"rank", "axis", "op", "bytes_sent", "bytes_recv"}]
    "expected_comm_bytes",  # same rows, from the closed forms
    "memory_peak_bytes",  # [{"rank", "category", "bytes"}]
    "expected_memory_peak_bytes",  # same rows, from the closed forms
    "bubble_fraction",  # {"measured", "simulated"}
    "step_time_s",
    "config",  # {"model": ..., "train": ...}: everything needed to rerun
    "loss_floor",  # the corpus's entropy rate: the best mean loss possible
    "moe",  # MoE runs: per step tokens per expert, dropped assignments, router losses
    "data_parallel",  # DP/ZeRO/FSDP runs: {"strategy", "model_state_bytes": per rank, options}
    "backend",  # {"name", "device"}: the array library the run computed with (refpar/backend.py)
    "precision",  # fp64, fp32, bf16-mixed or fp16-mixed (refpar/precision.py)
    "loss_scaling",  # fp16-mixed: {"scales": per step, "final_scale", "skipped_steps": 0-based}
    "grad_norms",  # --clip-grad-norm: the global norm of each step, before clipping (skipped: null)
    "reference_grad_norms",  # --clip-grad-norm --check: the single device's
    "max_grad_norm_rel_diff",  # --clip-grad-norm --check
    "lrs",  # the learning rate of each step
    "flops_per_step",  # per rank, one per step: the GEMM FLOPs it ran, recomputed forwards included
    "planned_flops_per_step",  # the planner's FLOPs of one step, all ranks (analysis/flops.step_flops)
    "val_losses",  # --eval-every: [{"step": steps done, "loss": held-out loss}]
    "reference_val_losses",  # --eval-every --check: the single device's
    "tokenizer",  # --data with text: {"name", "vocab_size"}; null on the Markov corpus
    "data",  # {"kind": "markov" | "text", "path", "description", "loss_floor" | "unigram_entropy", ...}
)


def run_summary(model: ModelConfig, train: TrainConfig, losses, **fields) -> dict:
    """The summary dict in SUMMARY_FIELDS order; `fields` sets any of the others (unknown names are
    a programming error and raise)."""
    unknown = sorted(set(fields) - set(SUMMARY_FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a summary field; add it to SUMMARY_FIELDS first")
    summary = dict.fromkeys(SUMMARY_FIELDS)
    summary.update(
        model=model.to_dict(), dtype=model.dtype, steps=train.steps, losses=[float(x) for x in losses],
        config={"model": model.to_dict(), "train": train.to_dict()},
        backend={"name": backend.current().name, "device": backend.current().device},
        precision=precision_of(model.dtype),
    )
    summary.update(fields)
    return summary


def loss_scaling_summary(scales: list[float], skipped_steps: list[int]) -> dict | None:
    """The `loss_scaling` field from the scale each step used and the steps skipped (None: no
    loss scaling, every precision but fp16-mixed)."""
    if not scales:
        return None
    return {"scales": list(scales), "final_scale": scales[-1], "skipped_steps": list(skipped_steps)}


def summary_line(summary: dict) -> str:
    """One line of strict JSON (no NaN/Infinity literals: a diverged loss becomes null)."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(summary), allow_nan=False)
