"""The report of a run of `refpar train`: the one-line JSON summary of --json (DESIGN.md, "Command
line"), which refpar/engine/lines.py also prints from: the losses next to the single device's
(--check), the bytes each rank sent by axis and op next to the closed forms
(refpar/analysis/closed_forms.py), the peak memory per rank by category next to the closed forms,
and what the run's strategies add: the data-parallel model states, the pipeline's bubble, the routing
of a MoE model.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --steps 3 --json

Every run fills the same fields (`summarize` through `run_summary`); a field that does not apply to a
run is null. Fields may be added here, never renamed: tests and scripts read them.
"""

from __future__ import annotations

import json
import math

import numpy as np

from refpar import backend
from refpar.analysis.flops import step_flops
from refpar.analysis.moe import expected_all_to_all_bytes, expert_param_bytes_per_rank
from refpar.analysis.presets import from_model_config
from refpar.config import ModelConfig, TrainConfig
from refpar.memory import CATEGORIES
from refpar.model.routing import capacity
from refpar.parallel.expert_parallel import owned_experts
from refpar.precision import precision_of
from refpar.schedules.simulate import simulate
from refpar.trainer import baseline, loss_floor

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


def summarize(model, cfg, sizes, plan, par, out, every, ref, corpus) -> dict:
    """The JSON summary's fields from every rank's measurements (on rank 0)."""
    comm_rows = [{"rank": r, "axis": a, "op": o, "bytes_sent": int(s), "bytes_recv": int(rv)}
                 for r, e in enumerate(every) for (a, o), (s, rv) in sorted(e["totals"].items()) if s or rv]
    memory_rows = [{"rank": r, "category": c, "bytes": int(e["peak"][c])}
                   for r, e in enumerate(every) for c in CATEGORIES]
    expected_comm = [{"rank": r, **row} for r, e in enumerate(every) for row in e["expected_comm"]]
    expected_memory = [{"rank": r, **row} for r, e in enumerate(every) for row in e["expected_memory"]]
    fields = {"lrs": out.lrs, "grad_norms": out.grad_norms if par.clip is not None else None,
              # per rank, per step: the GEMM FLOPs it ran (refpar/model/gemm.py); on a dense model their
              # sum over the ranks is what the planner prices for a step (refpar/analysis/flops.step_flops),
              # unless Llama's tp ranks replicate kv heads (each computes their K and V projections)
              "flops_per_step": [e["flops"] for e in every],
              "val_losses": [{"step": s, "loss": v} for s, v in out.val_losses] if cfg.eval_every else None,
              "data": data_fields(corpus, cfg),
              "tokenizer": None if getattr(corpus, "tokenizer", None) is None else {
                  "name": corpus.tokenizer.name, "vocab_size": corpus.tokenizer.vocab_size},
              "planned_flops_per_step": int(step_flops(
                  from_model_config(model), cfg.batch_size, cfg.seq_len, plan.recompute,
                  scores_again=sizes["cp"] > 1 and (plan.cp_algo or "ring") == "ring"))}
    if ref is not None:
        ref_losses = ref.losses[out.first_step:]  # a resumed run has only the steps after its checkpoint
        if par.clip is not None:
            ref_norms = ref.grad_norms[out.first_step:]
            fields |= {"reference_grad_norms": ref_norms, "max_grad_norm_rel_diff": max(
                (abs(a - b) / abs(b) for a, b in zip(out.grad_norms, ref_norms, strict=True)
                 if a is not None and b is not None), default=None)}
        if cfg.eval_every:
            steps = {s for s, _ in out.val_losses}  # a resumed run's, from its checkpoint on
            fields["reference_val_losses"] = [{"step": s, "loss": v} for s, v in ref.val_losses if s in steps]
        fields |= {"reference_losses": ref_losses,
                  "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(out.losses, ref_losses,
                                                                                strict=True)),
                  "max_param_rel_diff": max(_rel(p, ref.params[n]) for e in every
                                            for n, p in e["full"].items())}
    bubble = None
    if sizes["pp"] > 1:
        bubble = {"measured": out.measured.bubble_fraction, "simulated": out.simulated.bubble_fraction,
                  "simulated_unit_costs": simulate(par.executor.schedule).bubble_fraction}
    moe = _moe_fields(model, cfg, sizes, plan, out, every, ref) if model.moe_experts else None
    return run_summary(
        model, cfg, out.losses, mesh=dict(sizes), world_size=len(every), zero=plan.stage,
        schedule=plan.kind if sizes["pp"] > 1 else None, microbatches=plan.microbatches,
        comm_bytes=comm_rows, expected_comm_bytes=expected_comm, memory_peak_bytes=memory_rows,
        expected_memory_peak_bytes=expected_memory, bubble_fraction=bubble, step_time_s=out.step_time_s,
        loss_floor=loss_floor(corpus), moe=moe, loss_scaling=out.loss_scaling,
        data_parallel={"strategy": plan.strategy, "model_state_bytes": [e["state"] for e in every],
                       "bucket_elems": min(plan.bucket_elems, max(e["held"] for e in every)),
                       "overlap": plan.overlap, "prefetch": plan.prefetch,
                       "reshard_after_forward": plan.reshard_after_forward}, **fields)


def _moe_fields(model, cfg, sizes, plan, out, every, ref) -> dict:
    """The "moe" summary field: every block's routing per step, gathered from the ranks holding it."""
    blocks, ep = list(model.moe_blocks), sizes["ep"]
    steps = []
    for i in range(len(out.losses)):
        step = {"tokens_per_expert": {}, "dropped": {}, "kept_counts": {}}
        microbatches = [{} for _ in range(plan.microbatches)]
        pairs = [{} for _ in range(plan.microbatches)]
        for e in every:
            *parts, per_microbatch, pairs_per_microbatch = e["moe"][i]
            for key, part in zip(step, parts, strict=True):
                step[key].update(part)
            for mine, part in zip(microbatches, per_microbatch, strict=True):
                mine.update(part)
            for mine, part in zip(pairs, pairs_per_microbatch, strict=True):
                mine.update(part)
        steps.append(step | {"microbatch_kept_counts": microbatches, "microbatch_pair_counts": pairs})
    tokens = cfg.batch_size * cfg.seq_len // plan.microbatches  # routed together: one global microbatch
    n_data = sizes["dp"] * ep
    return {
        "blocks": blocks,
        "tokens_per_expert": [[st["tokens_per_expert"][i] for i in blocks] for st in steps],
        "dropped": [[st["dropped"][i] for i in blocks] for st in steps],
        "capacity": capacity(tokens, model),
        "kept_counts": [[np.asarray(st["kept_counts"][i]).tolist() for i in blocks] for st in steps],
        # per step and microbatch, each block's (D c, E) kept counts, which add up to kept_counts: what
        # the closed forms of the routing's bytes and of a MoE block's memory read (analysis/moe.py)
        "microbatch_kept_counts": [[[np.asarray(mb[i]).tolist() for i in blocks]
                                    for mb in st["microbatch_kept_counts"]] for st in steps],
        # per step and microbatch, each block's (D c, ep) pairs (token, ep rank): the all-to-alls' rows
        "microbatch_pair_counts": [[[np.asarray(mb[i]).tolist() for i in blocks]
                                    for mb in st["microbatch_pair_counts"]] for st in steps],
        "experts_per_ep_rank": [list(owned_experts(model.moe_experts, ep, q)) for q in range(ep)],
        "aux_loss": [s.aux_loss for s in out.moe_steps], "z_loss": [s.z_loss for s in out.moe_steps],
        "expert_param_bytes_per_ep_rank": [expert_param_bytes_per_rank(model, ep, q) for q in range(ep)],
        "reference_dropped": None if ref is None else [[s.dropped[i] for i in blocks]
                                                       for s in ref.moe_steps[out.first_step:]],
        "uniform_all_to_all_bytes_per_rank_step": len(blocks) * plan.microbatches * expected_all_to_all_bytes(
            model, tokens // n_data, n_data, ep, np.dtype(model.dtype).itemsize),
    }


def data_fields(corpus, cfg) -> dict:
    """The "data" summary field: what the run trained on and the loss it is measured against."""
    label, value = baseline(corpus)
    fields = {"kind": "markov" if cfg.data is None else "text", "path": cfg.data,
              "description": corpus.describe(),
              ("loss_floor" if label == "floor" else "unigram_entropy"): value}
    if cfg.data is not None:
        fields |= {"train_tokens": int(corpus.train_tokens), "val_tokens": int(corpus.val_tokens)}
    return fields


def _rel(a, ref) -> float:
    """max |a - ref| / max |ref| (the plain max difference for an all-zero reference: a bias no
    step has changed yet, as when fp16 skips every step)."""
    diff = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64))))
    scale = float(np.max(np.abs(np.asarray(ref, np.float64))))
    return diff / scale if scale else diff
