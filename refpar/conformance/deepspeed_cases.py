"""DeepSpeed's ZeRO-1/2/3 next to refpar's `--mesh dp=N --zero S`, per optimizer step.

    mpiexec -n 2 python -m refpar.conformance deepspeed-zero1 deepspeed-zero2@float64 deepspeed-zero3@float32

refpar's GPT-2 in torch (torch_model.py) under `deepspeed.initialize` with DeepSpeed's own
optimizer wrapper and torch's AdamW (`"torch_adam": true`), refpar's decay rule as two parameter
groups (matrices decayed, the rest not), the loss normalised by the global token count on both
sides (each rank's token sum x N/(B T); DeepSpeed averages gradients over ranks).

After each step every rank compares its partition of the fp32 master weights and of Adam's two
moments, both ways: DeepSpeed's partition against the same elements of refpar's reassembled
tensors, refpar's against DeepSpeed's. The layouts differ (partitions.py reassembles both):
- DeepSpeed ZeRO-1/2 flattens each *parameter group* in torch's nn.Linear layout (weight[out, in]),
  pads every parameter but the last to an alignment and the group to a multiple of 2N
  (`nccl_start_alignment_factor`), and cuts it into N equal pieces: the last rank holds the padding.
- DeepSpeed ZeRO-3 cuts *each parameter* into N pieces of ceil(numel/N), the last one padded.
- refpar cuts each *unit* (wte; wpe with ln_f; each block) in GPT-2's Conv1D layout
  (weight[in, out]) with shard_range: no padding, pieces one element apart at most.

Clipping: DeepSpeed clips to a global norm of 1.0 unless told otherwise (`gradient_clipping`,
runtime/constants.py); the cases run it at its default next to refpar's `--clip-grad-norm 1.0`
(coefficient min(1, 1/(‖g‖ + 1e-6)) on both: DeepSpeed's `unscale_and_clip_grads` is torch's
formula), "-noclip" with `gradient_clipping: 0.0` next to refpar without, and "-default" DeepSpeed's
default next to refpar without: the convention mismatch, measured.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from refpar.config import ConfigError, Plan
from refpar.conformance import partitions
from refpar.conformance.cases import configs, run_steps, token_loss
from refpar.conformance.compare import worst_key
from refpar.conformance.torch_model import build, to_gpt2_layout, to_torch_layout
from refpar.holdings import microbatch_samples
from refpar.model.gpt import init_params
from refpar.trainer import corpus_for

# DeepSpeed picks its accelerator at first import and says so on stdout unless told: the CPU here
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextmanager
def patched(dtype: str):
    """DeepSpeed on CPU (and in float64 for ZeRO-1/2), each patch undone on exit:
    - `build_shm_op`: deepspeed.comm JIT-compiles a shared-memory all-reduce at first use (~2 min
      on 2 cores); gloo does the all-reduce without it.
    - float64 only: ZeRO-1/2 keep master weights and gradients in float32
      (`ZeROOptimizer._configure_master_weights` returns fp32 unless fp16/bf16 master weights are
      asked for), reduce in float32 (`DeepSpeedEngine.communication_data_type`) and accumulate in
      float32 (`get_data_types`); each then returns float64. With `reduce_scatter: false` (set in
      the config) the averaging is an all-reduce in that dtype. ZeRO-3 refuses float64 outright
      (`partition_parameters.py`: an assert on the dtype), so it runs in float32 only."""
    import deepspeed.comm.torch  # noqa: F401  (`as` would bind deepspeed.comm's own `torch`, torch itself)
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

    ds_comm_torch = sys.modules["deepspeed.comm.torch"]
    saved = [(ds_comm_torch, "build_shm_op", ds_comm_torch.build_shm_op)]
    ds_comm_torch.build_shm_op = lambda: None
    if dtype == "float64":
        saved += [(ZeROOptimizer, "_configure_master_weights", ZeROOptimizer._configure_master_weights),
                  (DeepSpeedEngine, "communication_data_type", DeepSpeedEngine.communication_data_type),
                  (DeepSpeedEngine, "get_data_types", DeepSpeedEngine.get_data_types)]
        ZeROOptimizer._configure_master_weights = lambda self, *a, **k: torch.float64
        DeepSpeedEngine.communication_data_type = property(lambda self: torch.float64)
        DeepSpeedEngine.get_data_types = lambda self: (torch.float64, torch.float64)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def ds_config(train, batch_per_rank: int, stage: int, dtype: str, clip: float | None) -> dict:
    """`clip` None: DeepSpeed's default (gradient_clipping absent from the config)."""
    cfg = {"train_micro_batch_size_per_gpu": batch_per_rank, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "betas": [train.beta1, train.beta2],
                                                     "eps": train.eps, "weight_decay": train.weight_decay,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_scatter": dtype != "float64"},
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def initialize(net, train, batch_per_rank: int, stage: int, dtype: str, clip: float | None):
    """deepspeed.initialize on the process group already started (dist.py), refpar's decay groups."""
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)  # its INFO lines go to stdout, between the cases' own
    # DeepSpeed asserts its launcher's variables; mpiexec sets MPICH's. One host: local rank = rank.
    for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()),
                       ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(key, str(value))
    deepspeed.init_distributed(dist_backend="gloo")
    params = list(net.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups,
                                      config=ds_config(train, batch_per_rank, stage, dtype, clip))
    return engine


def ds_partitions(engine, grads: dict | None = None) -> dict:
    """{"params", "m", "v": this rank's partition of DeepSpeed's fp32 master weights and moments
    (partitions.py), in torch's layout}; with `grads` ({id(master partition): its gradient}, as
    dump.from_deepspeed catches them), "grads" too."""
    opt, names = engine.optimizer, {id(p): n for n, p in engine.module.named_parameters()}
    out = {"params": {}, "m": {}, "v": {}, "grads": {}}

    def arrays(master, state):
        got = [("params", master)]
        if state:
            got += [("m", state["exp_avg"]), ("v", state["exp_avg_sq"])]
        return got + ([("grads", grads[id(master)])] if grads is not None else [])

    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2: one flat buffer per group
        rank, N = dist.get_rank(), dist.get_world_size()
        for i, master in enumerate(opt.single_partition_of_fp32_groups):
            tensors = opt.round_robin_bit16_groups[i]
            size = int(opt.partition_size[i])
            a = rank * size
            group = ([names[id(p)] for p in tensors], [p.numel() for p in tensors],
                     [int(s) for s in opt.round_robin_bit16_offsets[i]])
            for key, arr in arrays(master, opt.optimizer.state.get(master)):
                out[key] |= partitions.of_flat(*group, a, a + size, arr.detach().numpy())
            assert opt.bit16_groups_flat[i].numel() == N * size  # equal pieces, padding included
        return out
    # ZeRO-3: each parameter cut into N pieces (ds_tensor), the rank's pieces concatenated per group
    for i, master in enumerate(opt.fp32_partitioned_groups_flat):
        state, at = opt.optimizer.state.get(master), 0
        for p in opt.fp16_partitioned_groups[i]:
            param = next(q for q in opt.fp16_groups[i] if q.ds_tensor is p)
            n, size = param.ds_numel, p.numel()
            lo = dist.get_rank() * size
            for key, arr in arrays(master, state):
                run = arr.detach().numpy()[at:at + size][:max(0, min(size, n - lo))].copy()
                if run.size:
                    out[key][names[id(param)]] = (lo, run)
            at += size
    return out


def refpar_partitions(par) -> dict:
    """{"params", "m", "v": this rank's ZeRO shard of each unit (refpar/parallel/zero.py), in GPT-2's
    layout}: the master weights are the parameters themselves (no mixed precision here)."""
    z, u = par.states, par.states.units
    out = {"params": {}, "m": {}, "v": {}}
    for k, (a, b) in u.owned.items():
        names = u.names[k]
        group = (names, [u.offsets[n][2] - u.offsets[n][1] for n in names], [u.offsets[n][1] for n in names])
        p = z.param_shard(k)
        for key, arr in (("params", p), ("m", z.state[k]["m"]), ("v", z.state[k]["v"])):
            out[key] |= partitions.of_flat(*group, a, b, np.asarray(arr))
    return out


def all_gather_object(obj) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def relayout(part: dict, to) -> dict:
    """A partition's tensors whole, each moved to the other layout by `to(name, array)`."""
    return {n: to(n, a) for n, a in part.items()}


def zero(comm, dtype: str = "float32", batch_size: int = 8, stage: int = 1, clip: str = "both") -> list[dict]:
    """`clip`: "both" (DeepSpeed's default 1.0, refpar --clip-grad-norm 1.0), "none" (DeepSpeed 0.0,
    refpar none) or "default" (DeepSpeed's default, refpar none: the convention mismatch)."""
    model, train_cfg = configs(dtype, batch_size=batch_size)
    train_cfg = replace(train_cfg, clip_grad_norm=1.0 if clip == "both" else 0.0)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    full = init_params(model, train_cfg.seed)
    shapes = {n: a.shape for n, a in full.items()}
    torch_shapes = {n: to_torch_layout(n, a).shape for n, a in full.items()}
    corpus = corpus_for(model, train_cfg)
    sizes = {"dp": N, "pp": 1, "ep": 1, "cp": 1, "tp": 1}
    ids = [microbatch_samples(model, B, 1, sizes, {"dp": k}, 0) for k in range(N)]
    if len({len(i) for i in ids}) > 1:
        raise ConfigError(f"--batch-size {B} must be a multiple of the {N} ranks: DeepSpeed takes one "
                          "micro-batch size for every rank")
    with patched(dtype):
        engine = initialize(build(model, full, getattr(torch, dtype)), train_cfg, len(ids[r]), stage,
                            dtype, {"both": None, "none": 0.0, "default": None}[clip])

        def each(par, step, loss):
            tokens, targets = corpus.batch(step, ids[r], T)
            out = token_loss(engine(torch.from_numpy(tokens)), torch.from_numpy(targets), tokens.size,
                             N, B, T, "global")
            engine.backward(out)
            engine.step()
            reported = out.detach().clone()
            dist.all_reduce(reported)
            theirs, ours = ds_partitions(engine), refpar_partitions(par)
            row = {"loss_refpar": loss, "loss_torch": float(reported) / N,
                   "loss": abs(float(reported) / N - loss) / abs(loss)}
            for key in ("params", "m", "v"):
                their_whole = partitions.whole(all_gather_object(theirs[key]), torch_shapes)
                our_whole = partitions.whole(all_gather_object(ours[key]), shapes)
                d = max(partitions.diff(theirs[key], relayout(our_whole, to_torch_layout)),
                        partitions.diff(ours[key], relayout(their_whole, to_gpt2_layout)))
                row[key], row[worst_key(key)] = d
            return row

        return run_steps(model, train_cfg, comm, sizes, Plan(zero=stage), each)

