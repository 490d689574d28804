"""Dumps of one training step made by PyTorch, for `refpar check`: correct ones, and ones with a
common bug planted.

    mpiexec -n 2 python -m refpar.conformance.dump OUT_DIR
    mpiexec -n 2 python -m refpar.conformance.dump OUT_DIR --frameworks   # Megatron-Core, DeepSpeed

Each scenario writes OUT_DIR/<scenario>/layout.json and rank{r}.npz (refpar/commands/check.py):

- tp, tp-float32, fsdp2, ddp, zero-flat, ddp-dropout: correct runs (DTensor TP with fused QKV
  interleaved per rank, in float64 and float32; FSDP2's per-parameter dim-0 shards; DDP over
  uneven shards with the loss normalised by the global token count; DDP gradients written as
  ZeRO flat pieces; DDP with refpar's keyed masks).
- tp-vocab-pad: wte padded to a multiple of 50 rows, the padded logits left in the softmax.
- ddp-per-rank-loss: each rank's loss the mean over its own tokens, shards of 3 and 2 sequences.
- sp-layernorm: LayerNorm gradients as each rank of a Megatron-style sequence-parallel run holds
  them before their all-reduce (its sequence shard's part, computed here from torch's autograd).
- ddp-dropout-rng: dropout masks drawn by torch's RNG, dumped next to the tensors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from refpar.comm.communicator import abort_on_error, world
from refpar.conformance.cases import configs, gpt2
from refpar.conformance.dist import process_group
from refpar.conformance.torch_model import build, qkv_row_order, to_gpt2_layout
from refpar.files import write_atomically
from refpar.holdings import microbatch_samples
from refpar.model.dropout import keep_mask
from refpar.model.gpt import init_params, param_shapes
from refpar.sharding import shard_range
from refpar.trainer import corpus_for

STEP = 0
SITES = ("attn", "attn_resid", "mlp_resid")


def write(out: Path, comm, layout: dict, arrays: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / f"rank{comm.rank}.npz", lambda f: np.savez(f, **arrays))
    if comm.rank == 0:
        write_atomically(out / "layout.json", lambda f: f.write(json.dumps(layout, indent=1).encode()))


def model_fields(model) -> dict:
    return {k: getattr(model, k) for k in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer",
                                           "dropout")}


def ce(logits, targets, normalizer):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="sum") / normalizer


def tensors(net, weights=True) -> dict:
    """weights.<name> and grads.<name> in GPT-2 layout; DTensors as this rank's local shard."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = {}
    for n, p in net.named_parameters():
        if weights:
            out[f"weights.{n}"] = gpt2(n, local(p))
        out[f"grads.{n}"] = gpt2(n, local(p.grad))
    return out


# ------------------------------------------------------------------------------- tensor parallel
def tp_scenarios(comm, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, train = configs("float64", batch_size=4)
    N, B, T, V = comm.size, train.batch_size, train.seq_len, model.vocab_size
    full = init_params(model, train.seed)
    tokens, targets = corpus_for(model, train).batch(STEP, range(B), T)
    order = qkv_row_order(model.n_embd, model.head_size, N)
    split = {}
    for i in range(model.n_layer):
        h = f"h.{i}."
        full[h + "attn.c_attn.weight"] = full[h + "attn.c_attn.weight"][:, order]
        full[h + "attn.c_attn.bias"] = full[h + "attn.c_attn.bias"][order]
        split |= {h + "attn.c_attn.weight": {"split": "column", "qkv": "interleaved"},
                  h + "attn.c_attn.bias": {"split": "column", "qkv": "interleaved"},
                  h + "mlp.c_fc.weight": {"split": "column"}, h + "mlp.c_fc.bias": {"split": "column"},
                  h + "attn.c_proj.weight": {"split": "row"}, h + "mlp.c_proj.weight": {"split": "row"}}
    layout = {"model": model_fields(model), "ranks": N, "axis": "tp", "inputs": "replicate",
              "tensors": split}
    mesh = init_device_mesh("cpu", (N,))
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}

    for name in ("tp", "tp-float32", "tp-vocab-pad", "sp-layernorm"):
        params, cfg = dict(full), model
        if name == "tp-vocab-pad":  # Megatron pads V to a multiple of 128 * tp; 50 here
            vp = -(-V // 50) * 50
            pad = np.random.default_rng(0).normal(0, 0.02, (vp - V, model.n_embd))
            params["wte.weight"] = np.concatenate([full["wte.weight"], pad])
            cfg = replace(model, vocab_size=vp)
        net = build(cfg, params, torch.float32 if name == "tp-float32" else torch.float64)
        for block in net.h:
            parallelize_module(block, mesh, plan)
        seen = {}

        def keep(mod, args, y, n, seen=seen):  # a LayerNorm's input, and its output's gradient
            y.retain_grad()
            seen[n] = (args[0], y)

        if name == "sp-layernorm":
            for n, mod in net.named_modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.register_forward_hook(lambda m, a, y, n=n: keep(m, a, y, n))
        loss = ce(net(torch.from_numpy(tokens)), torch.from_numpy(targets), B * T)
        loss.backward()
        arrays = {"tokens": tokens, "targets": targets, "loss": loss.detach().numpy(), **tensors(net)}
        if name == "sp-layernorm":
            a, b = shard_range(T, N, comm.rank)  # this rank's positions
            for n, (x, y) in seen.items():
                mod = net.get_submodule(n)
                xhat = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=mod.eps)
                arrays[f"grads.{n}.weight"] = (y.grad * xhat)[:, a:b].sum((0, 1)).detach().numpy()
                arrays[f"grads.{n}.bias"] = y.grad[:, a:b].sum((0, 1)).detach().numpy()
        write(root / name, comm, layout, arrays)


# --------------------------------------------------------------------------------- data parallel
def ddp_scenarios(comm, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    N, r = comm.size, comm.rank
    for name in ("ddp", "ddp-per-rank-loss", "zero-flat", "ddp-dropout", "ddp-dropout-rng", "fsdp2"):
        dropout = 0.1 if "dropout" in name else 0.0
        model, train = configs("float64", batch_size=2 * N + 1)  # uneven: 3 and 2 on 2 ranks
        model = replace(model, dropout=dropout)
        B, T = train.batch_size, train.seq_len
        ids = microbatch_samples(model, B, 1, {"dp": N, "ep": 1}, {"dp": r}, 0)
        tokens, targets = corpus_for(model, train).batch(STEP, ids, T)
        layout = {"model": model_fields(model), "ranks": N, "axis": "dp", "inputs": "batch",
                  "seed": train.seed, "step": STEP}
        masks = {}
        if dropout:
            shapes = {"embd": (T, model.n_embd), "attn": (model.n_head, T, T),
                      "attn_resid": (T, model.n_embd), "mlp_resid": (T, model.n_embd)}
            gen = torch.Generator().manual_seed(100 + r)
            for layer in range(model.n_layer):
                for site in (("embd",) if layer == 0 else ()) + SITES:
                    shape = (len(ids), *shapes[site])
                    if name.endswith("rng"):
                        masks[(layer, site)] = torch.rand(shape, generator=gen) >= dropout
                    else:
                        masks[(layer, site)] = torch.from_numpy(
                            keep_mask(train.seed, STEP, layer, site, ids, shapes[site], dropout))
        net = build(model, init_params(model, train.seed), torch.float64)
        if name == "fsdp2":
            for block in net.h:
                fully_shard(block, mesh=init_device_mesh("cpu", (N,)))
            fully_shard(net, mesh=init_device_mesh("cpu", (N,)))
            # FSDP2 splits dim 0 of torch's layout: a Linear's output features, GPT-2's columns
            layout["tensors"] = {n: {"split": "column" if p.ndim == 2 and ".h." in f".{n}" else "row"}
                                 for n, p in net.named_parameters()}
            wrapped = net
        else:
            wrapped = DistributedDataParallel(net)
        normalizer = tokens.size if name == "ddp-per-rank-loss" else B * T / N  # DDP averages over ranks
        loss = ce(wrapped(torch.from_numpy(tokens), masks, dropout), torch.from_numpy(targets), normalizer)
        loss.backward()
        arrays = {"tokens": tokens, "targets": targets, "loss": loss.detach().numpy(), **tensors(net)}
        arrays |= {f"masks.{layer}.{site}": m.numpy() for (layer, site), m in masks.items()}
        if name == "zero-flat":  # every gradient as one flat buffer, rank r keeping its piece
            names = list(param_shapes(model))
            flat = np.concatenate([np.ravel(arrays.pop(f"grads.{n}")) for n in names])
            arrays["grads.@all"] = flat[slice(*shard_range(flat.size, N, r))]
            layout["flat"] = {"all": names}
        write(root / name, comm, layout, arrays)


def framework_scenarios(comm, root: Path) -> None:
    """Dumps of Megatron-Core and DeepSpeed steps through from_megatron and from_deepspeed (the
    extras `megatron` and `deepspeed`): correct ones, and one planted bug each - c_attn copied into
    Megatron in GPT-2's [q | k | v] order (megatron-qkv-gpt2-order), and DeepSpeed at its default
    gradient_clipping 1.0 (deepspeed-clip-default)."""
    from refpar.conformance import deepspeed_cases as ds
    from refpar.conformance import megatron_cases as mg

    N, r = comm.size, comm.rank
    model, train = configs("float64", batch_size=4)
    full = init_params(model, train.seed)
    tokens, targets = corpus_for(model, train).batch(STEP, range(train.batch_size), train.seq_len)
    with mg.patched():
        for name, sp, qkv in (("megatron-tp", False, "megatron"), ("megatron-tp-sp", True, "megatron"),
                              ("megatron-qkv-gpt2-order", False, "gpt2")):
            net, opt, _ = mg.setup(model, full, N, r, sp, torch.float64, train, qkv)
            loss = mg.forward_backward(net, opt, tokens, targets)
            from_megatron(net, root / name, tokens, targets, loss, loaded=full)
    B = 2 * N
    ids = microbatch_samples(model, B, 1, {"dp": N, "ep": 1}, {"dp": r}, 0)
    tokens, targets = corpus_for(model, train).batch(STEP, ids, train.seq_len)
    for name, stage, dtype, clip in (("deepspeed-zero2", 2, "float64", 0.0),
                                     ("deepspeed-zero3@float32", 3, "float32", 0.0),
                                     ("deepspeed-clip-default", 2, "float64", None)):
        with ds.patched(dtype):
            net = build(model, full, getattr(torch, dtype))
            engine = ds.initialize(net, train, len(ids), stage, dtype, clip)
            out = ce(engine(torch.from_numpy(tokens)), torch.from_numpy(targets), B * train.seq_len / N)
            engine.backward(out)
            from_deepspeed(engine, root / name, tokens, targets, out.detach(), model)


def main(out: str, frameworks: bool = False) -> None:
    with abort_on_error():
        comm = world()
        with process_group(comm):
            if frameworks:
                framework_scenarios(comm, Path(out))
                return
            tp_scenarios(comm, Path(out))
            ddp_scenarios(comm, Path(out))



# ------------------------------------------------------------- from a user's Megatron / DeepSpeed run
def gpt2_config(vocab_size: int, n_positions: int, n_embd: int, n_head: int, n_layer: int):
    from refpar.config import ModelConfig

    return ModelConfig(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_head=n_head,
                       n_layer=n_layer, dropout=0.0)


def from_megatron(model, out, tokens, targets, loss, loaded: dict | None = None,
                  grad_dtype=np.float32) -> None:
    """Writes this rank's part of `refpar check`'s dump from a Megatron-Core GPTModel (or its
    DistributedDataParallel wrapper) at TP = world, after the backward and `finalize_model_grads`
    and before the optimizer step. Every rank calls it (inside torch.distributed).

    The gradients are main_grad (Megatron's DDP buffers; .grad without the wrapper), each rank's
    partition mapped to GPT-2's layout (megatron_layout.py) as refpar's tp slices: c_attn as
    [q_r | k_r | v_r] of the rank's heads ("qkv": "interleaved"), c_fc by columns, the projections
    by rows, wte by vocabulary rows. `loaded`: the GPT-2 state dict the run was meant to start from
    (refpar's names, Conv1D layout); its slices are written as the weights, so a model that holds
    other weights (a checkpoint converted in the wrong layout) is a mismatch. Without it the model's
    own weights are written, converted back, and only the computation is checked.
    `grad_dtype` float32 by default: Megatron's cross-entropy computes in float32, so its gradients
    carry float32 rounding and refpar check should judge them at float32's noise."""
    from refpar.conformance import megatron_layout as layout
    from refpar.conformance.megatron_cases import gpt2_indices
    from refpar.holdings import tp_param_slices

    net = getattr(model, "module", model)
    mc = net.config
    cfg = gpt2_config(net.vocab_size, net.max_sequence_length, mc.hidden_size, mc.num_attention_heads,
                      mc.num_layers)
    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    slices, index = tp_param_slices(cfg, tp, rank), gpt2_indices(cfg, tp, rank)
    shapes, theirs = param_shapes(cfg), dict(net.named_parameters())
    arrays = {"tokens": np.asarray(tokens), "targets": np.asarray(targets),
              "loss": np.asarray(float(loss), grad_dtype)}

    def as_slice(name, local):  # Megatron's partition -> refpar's slice of the GPT-2 tensor
        ti, oi = index[name]
        by_index = np.empty(int(np.prod(shapes[name])), local.dtype)
        by_index[ti] = local.ravel()
        shape = list(shapes[name])
        if name in slices:
            axis, idx = slices[name]
            shape[axis] = len(idx)
        return by_index[oi].reshape(shape)

    for name, mname in layout.names(cfg.n_layer).items():
        p = theirs[mname]
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        arrays[f"grads.{name}"] = as_slice(name, g.detach().numpy()).astype(grad_dtype)
        if loaded is None:
            arrays[f"weights.{name}"] = as_slice(name, p.detach().numpy())
        else:
            axis, idx = slices.get(name, (0, slice(None)))
            arrays[f"weights.{name}"] = loaded[name][(slice(None),) * axis + (idx,)]
    split = {}
    for name, (axis, _) in slices.items():
        split[name] = {"split": "column" if axis == 1 or name.endswith(".bias") else "row"}
        if ".attn.c_attn." in name:
            split[name]["qkv"] = "interleaved"
    write(Path(out), _Rank(rank), {"model": model_fields(cfg), "ranks": tp, "axis": "tp",
                                   "inputs": "replicate", "tensors": split}, arrays)


def from_deepspeed(engine, out, tokens, targets, loss, config) -> None:
    """Steps a DeepSpeed engine (call it after engine.backward(loss), instead of engine.step()) and
    writes this rank's part of `refpar check`'s dump: the gradients its optimizer applied (after
    DeepSpeed's averaging, loss scaling and clipping: caught as the wrapped torch optimizer's step
    reads them) and the fp32 master weights before the step, for refpar's GPT-2 in torch
    (torch_model.py names; ZeRO-1, 2 or 3). `tokens`, `targets`: this rank's rows; `loss`: its
    loss, normalised by the global token count (each rank's token sum x N/(B T)); `config`:
    refpar's ModelConfig of the model.

    DeepSpeed partitions flat groups in torch's nn.Linear layout (deepspeed_cases.py); refpar check
    reads flat groups in GPT-2's Conv1D layout. So every rank gathers the partitions into whole
    tensors, turns them into GPT-2's layout and writes its shard_range piece of their concatenation,
    one flat group "@all" (as a ZeRO run's dump)."""
    from refpar.conformance.deepspeed_cases import all_gather_object, ds_partitions
    from refpar.conformance.partitions import whole

    # torch's layout; under ZeRO-3 a parameter is an empty placeholder and ds_shape its shape
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
    before = ds_partitions(engine)["params"]
    inner = engine.optimizer.optimizer  # torch's AdamW over DeepSpeed's fp32 partitions
    applied: dict = {}
    step = inner.step

    def catching(*args, **kwargs):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    applied[id(p)] = p.grad.detach().clone()
        return step(*args, **kwargs)

    inner.step = catching
    try:
        engine.step()
    finally:
        inner.step = step
    grads = ds_partitions(engine, grads=applied)["grads"]
    rank, N = torch.distributed.get_rank(), torch.distributed.get_world_size()
    order = list(shapes)
    arrays = {"tokens": np.asarray(tokens), "targets": np.asarray(targets), "loss": np.asarray(float(loss))}
    for kind, part in (("weights", before), ("grads", grads)):
        full = whole(all_gather_object(part), shapes)
        dtype = next(iter(part.values()))[1].dtype  # the run's (whole() assembles in float64)
        flat = np.concatenate([np.ravel(to_gpt2_layout(n, full[n])) for n in order]).astype(dtype)
        arrays[f"{kind}.@all"] = flat[slice(*shard_range(flat.size, N, rank))]
    write(Path(out), _Rank(rank), {"model": model_fields(config), "ranks": N, "axis": "dp", "inputs": "batch",
                                   "flat": {"all": order}}, arrays)


class _Rank:
    """The `comm` write() reads: just the rank (these dumps run inside torch.distributed)."""

    def __init__(self, rank: int):
        self.rank = rank


if __name__ == "__main__":
    main(sys.argv[1], frameworks="--frameworks" in sys.argv[2:])
