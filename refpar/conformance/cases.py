"""Each PyTorch strategy next to refpar's run of the same mesh, per optimizer step.

Every case returns, for each step, this rank's differences (refpar.conformance.compare.step_row):
the global loss, this rank's gradient shard (in the layout the PyTorch strategy keeps it, compared
with the same elements of refpar's gradient) and the updated parameters, whole.

Conventions (the mismatches production users report most):
- loss averaging across dp: DDP and FSDP2 average gradients over ranks, so with each rank's loss
  the mean over its own tokens ("mean", PyTorch's habit) the result is the global mean only when
  every rank holds as many tokens. refpar normalises every token by the global count B*T and sums
  over ranks ("global"). The torch side offers both; "global" scales the rank's token sum by
  world/(B*T) so that the average over ranks is refpar's sum.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from refpar.config import ModelConfig, Plan, TrainConfig
from refpar.conformance.compare import step_row, worst
from refpar.conformance.torch_model import build, qkv_row_order, to_gpt2_layout, to_torch_layout
from refpar.engine import parallelize, train
from refpar.holdings import microbatch_samples
from refpar.mesh import DeviceMesh
from refpar.model.gpt import init_params
from refpar.trainer import corpus_for


def configs(dtype: str, n_layer: int = 2, batch_size: int = 8, steps: int = 3):
    """Dropout 0 on both sides: the torch model draws no masks (torch_model.py)."""
    model = ModelConfig(n_layer=n_layer, dropout=0.0, dtype=dtype)
    return model, TrainConfig(steps=steps, batch_size=batch_size, seq_len=8)


def adamw(model: torch.nn.Module, train: TrainConfig):
    """torch's AdamW with refpar's hyper-parameters and its decay rule (matrices only)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    # foreach=False: the single-tensor loop works alike for plain tensors and DTensors.
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             foreach=False)


def token_loss(logits, targets, tokens_here: int, world: int, B: int, T: int, convention: str):
    """This rank's loss: its token sum over its own count ("mean") or over B*T/world ("global")."""
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              targets.reshape(-1), reduction="sum")
    return total / tokens_here if convention == "mean" else total * (world / (B * T))


def whole_batch_step(forward, opt, tokens, targets, vocab: int) -> float:
    """torch's step on the whole batch, as every tp rank holds it: the mean cross-entropy's backward,
    then the optimizer. Returns the loss."""
    opt.zero_grad()
    logits = forward(torch.from_numpy(tokens))  # (B, T, V)
    out = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(targets).reshape(-1))
    out.backward()
    opt.step()
    return float(out.detach())


def gpt2(name: str, t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(to_gpt2_layout(name, t.detach().numpy()))


def run_steps(model, train_cfg, comm, sizes: dict, plan: Plan, each) -> list[dict]:
    """Trains refpar's side with the engine on `comm` as `sizes` and `plan` say; after each of its
    steps, `each(par, step, loss)` runs the torch side's step and returns the comparison row."""
    par = parallelize(model, train_cfg, DeviceMesh(comm, sizes), plan)
    rows = []
    train(par, lambda step, loss, *_, **__: rows.append(each(par, step, loss)))
    return rows


def held_grads(par) -> dict:
    """This rank's summed gradients by name (plain DP's flat buffer; tp shards under tp)."""
    u, g = par.states.units, par.states.grads
    return {n: np.array(v) for k in u.names for n, v in u.views(k, u.slice(k, g)).items()}


# ------------------------------------------------------------------------------------------- DDP
def ddp(comm, dtype: str = "float64", convention: str = "global", batch_size: int = 8,
        microbatches: int = 1) -> list[dict]:
    """torch DDP against refpar's DP (refpar/parallel/data_parallel.py) on dp = world, accumulating
    `microbatches` per step (DDP's `no_sync` until the last). refpar normalises every microbatch
    by B*T and sums; the "mean" convention takes each microbatch's own mean and does not divide by
    the number of microbatches, the usual accumulation bug: gradients about that many times too
    large, parameters less far off (AdamW's m / sqrt(v) is nearly blind to a gradient's scale)."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    model, train_cfg = configs(dtype, batch_size=batch_size)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    full = init_params(model, train_cfg.seed)
    net = DistributedDataParallel(build(model, full, getattr(torch, dtype)))
    opt = adamw(net, train_cfg)
    corpus = corpus_for(model, train_cfg)
    sizes = {"dp": N, "pp": 1, "ep": 1, "cp": 1, "tp": 1}

    def each(par, step, loss):
        grads = held_grads(par)
        opt.zero_grad()
        reported = torch.zeros((), dtype=getattr(torch, dtype))
        for m in range(microbatches):
            ids = microbatch_samples(model, B, microbatches, sizes, {"dp": r}, m)
            tokens, targets = corpus.batch(step, ids, T)
            with net.no_sync() if m < microbatches - 1 else nullcontext():
                out = token_loss(net(torch.from_numpy(tokens)), torch.from_numpy(targets), tokens.size,
                                 N, B, T, convention)
                out.backward()
            reported += out.detach()
        opt.step()
        dist.all_reduce(reported)  # DDP averages gradients, so the loss it optimises is the average
        theirs = {n: gpt2(n, p.grad) for n, p in net.module.named_parameters()}
        params = {n: gpt2(n, p) for n, p in net.module.named_parameters()}
        return step_row(loss, float(reported) / N, worst(theirs, grads),
                        worst(params, par.states.full_params()))

    return run_steps(model, train_cfg, comm, sizes, Plan(microbatches=microbatches), each)


# ----------------------------------------------------------------------------------------- FSDP2
def fsdp2(comm, dtype: str = "float64", convention: str = "global", batch_size: int = 8) -> list[dict]:
    """FSDP2 (`fully_shard` on every block, then the root) against refpar's FSDP (ZeRO-3 units).

    The two shard differently: FSDP2 splits every parameter on dim 0 (torch.chunk: ceil-sized
    pieces, the last ones shorter or empty); refpar splits each unit's flat buffer (wte; the root of
    wpe and ln_f; one per block) with shard_range. Each rank compares both of its shards: FSDP2's against
    the same rows of refpar's reassembled gradient, refpar's against the same elements of FSDP2's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, train_cfg = configs(dtype, batch_size=batch_size)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    full = init_params(model, train_cfg.seed)
    net = build(model, full, getattr(torch, dtype))
    mesh = init_device_mesh("cpu", (N,))
    for block in net.h:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = adamw(net, train_cfg)
    corpus = corpus_for(model, train_cfg)
    sizes = {"dp": N, "pp": 1, "ep": 1, "cp": 1, "tp": 1}

    def each(par, step, loss):
        ours, lay = par.states, par.states.units
        whole = {}
        for u in lay.names:
            flat = comm.all_gather(ours.grad_shards[u], tag=f"{u}:grads:check", counts=lay.counts[u])
            whole.update({n: v.copy() for n, v in lay.views(u, flat).items()})
        tokens, targets = corpus.batch(step, microbatch_samples(model, B, 1, sizes, {"dp": r}, 0), T)
        opt.zero_grad()
        out = token_loss(net(torch.from_numpy(tokens)), torch.from_numpy(targets), tokens.size, N, B, T,
                         convention)
        out.backward()
        opt.step()
        reported = out.detach().clone()
        dist.all_reduce(reported)
        theirs_full, theirs_rows, want_rows = {}, {}, {}
        for n, p in net.named_parameters():
            theirs_full[n] = gpt2(n, p.grad.full_tensor())
            local = p.grad.to_local()  # (rows of this rank, ...) in torch layout
            chunk = -(-p.shape[0] // N)  # torch.chunk's piece size
            lo = min(r * chunk, p.shape[0])
            theirs_rows[n] = local.detach().numpy()
            want_rows[n] = to_torch_layout(n, whole[n])[lo:lo + local.shape[0]]
        g_fsdp = worst(theirs_rows, want_rows)
        g_ours = worst({u: lay.flatten(u, theirs_full)[slice(*lay.owned[u])] for u in lay.names},
                       {u: ours.grad_shards[u] for u in lay.names})
        params = {n: gpt2(n, p.full_tensor()) for n, p in net.named_parameters()}
        return step_row(loss, float(reported) / N, max(g_fsdp, g_ours), worst(params, ours.full_params()))

    return run_steps(model, train_cfg, comm, sizes, Plan(fsdp=True), each)


# ------------------------------------------------------------------------------------ DTensor TP
def tp(comm, dtype: str = "float64", convention: str = "global", batch_size: int = 8,
       sp: bool = False) -> list[dict]:
    """DTensor tensor parallelism (`parallelize_module`: c_attn and mlp.c_fc ColwiseParallel,
    attn.c_proj and mlp.c_proj RowwiseParallel) against refpar's TP on tp = world. With `sp`,
    sequence parallelism too: ln_1 and ln_2 SequenceParallel, attn and mlp gather the sequence
    (PrepareModuleInput Shard(1) -> Replicate), the projections scatter it back (RowwiseParallel
    to Shard(1)), against refpar's `--sp`; DTensor all-reduces the LayerNorm gradients itself.

    Two layouts differ and are mapped, not assumed equal: c_attn's rows are reordered
    (torch_model.qkv_row_order) so ColwiseParallel's contiguous chunk r holds rank r's heads of q, k
    and v, which is the slice refpar keeps; and the embedding and tied head stay replicated on the
    torch side while refpar splits the vocabulary, so rank r compares the rows of the torch
    gradient that refpar's vocabulary shard holds. Every rank sees the whole batch (dp = 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from refpar.engine.run import full_params
    from refpar.holdings import tp_param_slices

    model, train_cfg = configs(dtype, batch_size=batch_size)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    full = init_params(model, train_cfg.seed)
    slices = tp_param_slices(model, N, r)

    order = qkv_row_order(model.n_embd, model.head_size, N)
    undo = np.argsort(order)
    permuted = dict(full)
    for i in range(model.n_layer):
        w, b = f"h.{i}.attn.c_attn.weight", f"h.{i}.attn.c_attn.bias"
        permuted[w], permuted[b] = full[w][:, order], full[b][order]  # Conv1D columns = Linear rows
    net = build(model, permuted, getattr(torch, dtype))
    mesh = init_device_mesh("cpu", (N,))
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    if sp:
        # attn(x, keep_att, p) and mlp(x): only x is a tensor to gather
        plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                 "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                 "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                 "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    for block in net.h:
        parallelize_module(block, mesh, plan)
    opt = adamw(net, train_cfg)

    def forward(tokens):
        if not sp:
            return net(tokens)
        x = net.wte(tokens) + net.wpe(torch.arange(T))  # (B, T, C), the same on every rank
        x = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
        x = x.to_local()  # (B, T/tp, C)
        for block in net.h:
            x = block(x)  # (B, T/tp, C)
        x = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
        x = x.to_local()  # (B, T, C)
        return net.ln_f(x) @ net.wte.weight.t()  # (B, T, V)
    corpus = corpus_for(model, train_cfg)

    def unpermute(n, a):  # GPT-2 layout, c_attn back in q, k, v order
        return a[..., undo] if ".attn.c_attn." in n else a

    def each(par, step, loss):
        grads = held_grads(par)  # this rank's shards, the sequence-sharded region summed over tp
        tokens, targets = corpus.batch(step, range(B), T)
        theirs_loss = whole_batch_step(forward, opt, tokens, targets, model.vocab_size)
        theirs = {}
        for n, p in net.named_parameters():
            if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                # SequenceParallel LayerNorms: DTensor keeps each rank's sequence part as a Partial
                # gradient and sums it when read whole (the optimizer's arithmetic does)
                theirs[n] = gpt2(n, p.grad.full_tensor())
            elif isinstance(p.grad, DTensor):  # this rank's shard, in GPT-2 layout
                theirs[n] = gpt2(n, p.grad.to_local())
            elif n in slices:  # replicated here, split by refpar: the rows refpar's shard holds
                axis, idx = slices[n]
                theirs[n] = np.take(gpt2(n, p.grad), idx, axis=axis)
            else:
                theirs[n] = gpt2(n, p.grad)
        params = {n: unpermute(n, gpt2(n, p.full_tensor() if isinstance(p, DTensor) else p))
                  for n, p in net.named_parameters()}
        return step_row(loss, theirs_loss, worst(theirs, grads), worst(params, full_params(par)))

    sizes = {"tp": N, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
    return run_steps(model, train_cfg, comm, sizes, Plan(sp=sp), each)


# ------------------------------------------------------------------------------ DTensor TP, Llama
def llama_tp(comm, dtype: str = "float64", convention: str = "global", batch_size: int = 8) -> list[dict]:
    """DTensor tensor parallelism of Llama (refpar/conformance/torch_llama.py; q_proj, k_proj,
    v_proj, gate_proj and up_proj ColwiseParallel, o_proj and down_proj RowwiseParallel, as
    torchtitan's parallelize_llama) against refpar's TP (refpar/parallel/llama_pieces.py)
    on tp = world, llama-tiny's 4 query heads over 2 kv heads with 2 blocks: grouped-query attention
    with 2 query heads reading each kv head. ColwiseParallel's contiguous chunk r of q_proj, k_proj
    and v_proj is rank r's query heads and the kv heads they read, the rows refpar keeps, so no
    layout is remapped; the embedding and the head stay replicated on the torch side and rank r
    compares the vocabulary rows refpar's shard holds. Ranks must divide the kv heads: past that a
    kv head would be cut in pieces by DTensor's chunking, where refpar replicates it whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from refpar.config import ConfigError, model_preset
    from refpar.conformance import torch_llama
    from refpar.engine.run import full_params
    from refpar.holdings import tp_param_slices
    from refpar.model import llama

    model = model_preset("llama-tiny", n_layer=2, dtype=dtype)
    train_cfg = TrainConfig(steps=3, batch_size=batch_size, seq_len=8)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    if model.n_kv_head % N:
        raise ConfigError(f"llama-tp compares DTensor's contiguous chunks, which split llama-tiny's "
                          f"{model.n_kv_head} kv heads whole only on 1 or {model.n_kv_head} ranks; "
                          f"run it on {model.n_kv_head} ranks")
    full = llama.init_params(model, train_cfg.seed)
    slices = tp_param_slices(model, N, r)
    net = torch_llama.build(model, full, getattr(torch, dtype))
    mesh = init_device_mesh("cpu", (N,))
    plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in net.model.layers:
        parallelize_module(layer, mesh, plan)
    opt = adamw(net, train_cfg)
    corpus = corpus_for(model, train_cfg)

    def each(par, step, loss):
        grads = held_grads(par)  # this rank's shards
        tokens, targets = corpus.batch(step, range(B), T)
        theirs_loss = whole_batch_step(net, opt, tokens, targets, model.vocab_size)
        theirs = {}
        for n, p in net.named_parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # DTensor: this rank's shard
            g = g.detach().numpy()
            if not isinstance(p.grad, DTensor) and n in slices:  # replicated here, split by refpar
                g = np.take(g, slices[n][1], axis=slices[n][0])
            theirs[n] = g
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy()
                  for n, p in net.named_parameters()}
        return step_row(loss, theirs_loss, worst(theirs, grads), worst(params, full_params(par)))

    sizes = {"tp": N, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
    return run_steps(model, train_cfg, comm, sizes, Plan(), each)
