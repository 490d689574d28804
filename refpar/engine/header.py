"""What rank 0 prints before the first step of `refpar train` (refpar/engine/run.py): the model, the
data, the optimizer, and on more than one rank the strategies and, per rank, what it holds.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4
"""

from __future__ import annotations

import numpy as np

from refpar.analysis import closed_forms as closed
from refpar.config import MESH_AXES
from refpar.holdings import stage_layers
from refpar.model import param_shapes
from refpar.model.optim import decay_rule, wsd_decay_steps
from refpar.parallel.expert_parallel import owned_experts
from refpar.precision import is_16bit, precision_of
from refpar.sharding import shard_range
from refpar.trainer import baseline

LABEL = {"dp": "DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP"}


def header(model, cfg, sizes, plan, preset: str, corpus) -> list[str]:
    """What runs where: the model, the data, and on more than one rank the strategies and who holds what."""
    n_params = sum(int(np.prod(s)) for s in param_shapes(model).values())
    world = int(np.prod(list(sizes.values())))
    mesh = " x ".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes[a] > 1)
    family = {"llama": "Llama", "deepseek": "DeepSeek-V3"}.get(model.arch, "GPT-2")
    heads = f"{model.n_head} heads" + (f" over {model.n_kv_head} kv heads" if model.arch == "llama" else "")
    lines = [f"{family} {preset}: {model.n_layer} layers, {model.n_embd} channels, {heads}, "
             f"{n_params:,} parameters, {_precision(model.dtype)}, dropout {model.dropout}"
             + (f"; mesh {mesh} on {world} ranks" if world > 1 else ", 1 device"),
             f"data: {corpus.describe()}, batch {cfg.batch_size} x {cfg.seq_len} "
             f"tokens" + (f" in {plan.microbatches} microbatches" if plan.microbatches > 1 else "")
             + _baseline_words(corpus), optimizer_line(cfg)]
    if world == 1:
        return lines
    lines.append(_strategies(model, sizes, plan))
    return lines + holdings(model, cfg, sizes, plan)


def _baseline_words(corpus) -> str:
    label, value = baseline(corpus)
    if label == "floor":
        return f"; loss floor (entropy rate) {value:.4f}"
    return f"; unigram entropy {value:.4f} (the loss of a model that ignores the context)"


def optimizer_line(cfg) -> str:
    """The optimizer, its learning-rate schedule, the weight-decay rule and clipping (optim.py)."""
    name = {"adamw": "AdamW", "sgd": "SGD"}[cfg.optimizer]
    line = f"optimizer: {name} lr {cfg.lr:g}"
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        line += (f" ({cfg.warmup_steps} warmup steps" if cfg.warmup_steps else " (")
        if cfg.lr_schedule != "constant":
            decay = f"{cfg.lr_schedule} decay" + (f" over the last {wsd_decay_steps(cfg)} steps"
                                                  if cfg.lr_schedule == "wsd" else "")
            line += ("; " if cfg.warmup_steps else "") + f"{decay} to {cfg.min_lr:g} at step {cfg.steps}"
        line += ")"
    line += f", {decay_rule(cfg)}"
    if cfg.clip_grad_norm:
        line += f"; gradients clipped to global norm {cfg.clip_grad_norm:g}"
    return line


def _strategies(model, sizes, plan) -> str:
    replicas = sizes["dp"] * sizes["cp"] * (sizes["ep"] if model.moe_experts else 1) > 1
    parts = [f"{LABEL[plan.strategy]} over each unit's replicas" if replicas or plan.strategy != "dp" else ""]
    if plan.prefetch or not plan.reshard_after_forward:
        parts[-1] += " (" + ", ".join(["prefetch"] * plan.prefetch + ["no reshard after forward"]
                                      * (not plan.reshard_after_forward)) + ")"
    if plan.overlap or plan.bucket_elems < 1 << 62:
        parts[-1] += (f" (buckets of {plan.bucket_elems:,} elements" if plan.bucket_elems < 1 << 62
                      else " (one bucket") + (", overlapped)" if plan.overlap else ")")
    if sizes["pp"] > 1:
        v = closed.pipeline(sizes, plan)[1].n_stages // sizes["pp"]
        parts.append(f"schedule {plan.kind} over pp={sizes['pp']} (v={v})")
    if sizes["tp"] > 1:
        parts.append(f"tensor parallel over tp={sizes['tp']}" + (" with sp" if plan.sp else ""))
    if sizes["cp"] > 1:
        parts.append(f"{plan.cp_algo or 'ring'} attention over cp={sizes['cp']}")
    if model.moe_experts:
        parts.append(f"{model.moe_experts} experts top-{model.moe_top_k} in blocks "
                     f"{','.join(map(str, model.moe_blocks))}, over ep={sizes['ep']}")
    return "; ".join(p for p in parts if p) or "no data parallelism"


def holdings(model, cfg, sizes, plan) -> list[str]:
    """One line per rank: coordinates, stages and blocks, heads, vocabulary rows, samples, parameters."""
    t, lay = sizes["tp"], closed.pipeline(sizes, plan)[1]
    P = lay.stages_per_copy
    out = []
    for rank in range(int(np.prod(list(sizes.values())))):
        co = closed.rank_coords(sizes, rank)
        parts = []
        for s in lay.stages_of(co["pp"]):
            k = lay.part(s)
            blocks = stage_layers(model.n_layer, P, k)
            held = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
            copy = f" of copy {s // P}" if lay.copies > 1 else ""
            parts.append(f"stage {s}{copy} ({'embedding + ' if k == 0 else ''}{held}"
                         f"{' + head' if k == P - 1 else ''})")
        h0, h1 = shard_range(model.n_head, t, co["tp"])
        v0, v1 = shard_range(model.vocab_size, t, co["tp"])
        ids = [i for j in range(plan.microbatches) for i in closed.samples(model, cfg, sizes, co, plan, j)]
        experts = (f", experts {list(owned_experts(model.moe_experts, sizes['ep'], co['ep']))}"
                   if model.moe_experts else "")
        coords = " ".join(f"{a}={co[a]}" for a in MESH_AXES if sizes[a] > 1)
        out.append(f"  rank {rank} {coords}: {', '.join(parts)}; heads {h0}-{h1 - 1}, vocab rows "
                   f"{v0}-{v1 - 1}{experts}, samples {min(ids)}-{max(ids)}; "
                   f"{sum(closed.rank_param_numels(model, sizes, co, plan).values()):,} parameters")
    return out


def _precision(dtype: str) -> str:
    if not is_16bit(dtype):
        return dtype
    return f"{precision_of(dtype)} ({dtype} weights and activations, fp32 master weights)"
