"""Tensor parallelism on the `tp` axis (Megatron-LM: Shoeybi et al. 2019; Narayanan et al. 2021 §3.2).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check

Legend: B batch, T sequence, C channels, nh heads, hs head size, V vocab, t tp size;
Ta tokens inside a tensor-parallel region, Tl tokens of the residual stream on this rank (both T
under plain TP; sequence_parallel.py and context_parallel.py change them through a `Layout`).

A block is two tensor-parallel regions, attention and MLP. Each is entered through f and left
through g, Megatron's conjugate pair:

    f = copy_to_tp       identity forward   | all-reduce backward
    g = reduce_from_tp   all-reduce forward | identity backward

so a block does two all-reduces forward (g after attention, g after the MLP) and two backward
(f before each): four, each of (B, T, C). Inside a region nothing moves: the column-parallel linear
(c_attn, c_fc) splits its output columns, the row-parallel linear (c_proj) its input rows, and
attention runs on whole heads (the fused c_attn is split per head, so a head's Q, K, V stay together).

Weights a rank holds (GPT-2 Conv1D layout weight[in, out]); all others are replicated:
    wte.weight            rows shard_range(V, t, rank)              (V/t, C), uneven allowed
    h.i.attn.c_attn       columns of heads [h0, h1) of q, k and v   (C, 3C/t), (3C/t,)
    h.i.attn.c_proj.w     rows of heads [h0, h1)                    (C/t, C)
    h.i.mlp.c_fc          columns shard_range(4C, t, rank)          (C, 4C/t), (4C/t,)
    h.i.mlp.c_proj.w      rows shard_range(4C, t, rank)             (4C/t, C)
In MoE blocks each expert is such an MLP (Megatron-LM's expert tensor parallelism, expert tp size
= t): h.i.mlp.experts.e.c_fc by columns, its c_proj.weight by rows, c_proj.bias whole
(refpar/parallel/expert_tensor_parallel.py); the router stays whole. The embedding and the LM head
over the vocabulary rows: refpar/parallel/vocab_parallel.py.

Mixed precision (bf16 / fp16 activations, refpar/precision.py): every piece reads 16-bit arrays,
computes in float32 (`compute`) and rounds its output once (`rounded`), as the model's layers do.
What crosses tp is what Megatron-LM sends: the row-parallel partial sums and the f/g activation
gradients in 16 bits (so a sum over ranks rounds where one device's GEMM does not). For float64 and
float32 models both helpers return their input: the numbers are unchanged, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace

from refpar.config import ConfigError, ModelConfig
from refpar.holdings import tp_param_slices
from refpar.model.attention import attention_backward, attention_forward
from refpar.model.gemm import matmul
from refpar.model.layers import (
    as_like,
    compute,
    dropout_backward,
    dropout_forward,
    gelu_backward,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    rounded,
)
from refpar.model.llama_layers import gqa_attention_backward, gqa_attention_forward
from refpar.sharding import shard_range


# f and g, each with its backward next to it. `tp` is the tp Communicator.
def copy_to_tp(x, tp, tag):
    """f forward: the region's input is already on every rank."""
    return x


def copy_to_tp_backward(dx, tp, tag):
    """f backward: each rank's heads or columns give part of the input's gradient; sum them."""
    return tp.all_reduce(dx, tag=tag)


def reduce_from_tp(x, tp, tag):
    """g forward: each rank's rows give a partial sum of the output; sum them."""
    return tp.all_reduce(x, tag=tag)


def reduce_from_tp_backward(dx, tp, tag):
    """g backward: the gradient of a replicated output is already on every rank."""
    return dx


def _identity(x, comm, tag):
    return x


@dataclass(frozen=True)
class RegionPair:
    """How activations enter (f) and leave (g) a tensor-parallel region, each with its backward."""

    enter: Callable
    enter_backward: Callable
    leave: Callable
    leave_backward: Callable


TP_PAIR = RegionPair(copy_to_tp, copy_to_tp_backward, reduce_from_tp, reduce_from_tp_backward)
NO_PAIR = RegionPair(_identity, _identity, _identity, _identity)  # tp == 1: nothing to split


@dataclass(frozen=True)
class Layout:
    """What this rank holds of a step's activations and weights, and how regions are entered."""

    config: ModelConfig
    seq_len: int  # T, the global sequence length
    tp: object  # the tp Communicator, None when tp == 1
    pair: RegionPair
    heads: tuple[int, int]  # global heads [h0, h1) of this rank
    vocab: tuple[int, int]  # global vocabulary rows [v0, v1) of this rank
    region_pos: np.ndarray  # (Ta,) global positions inside a region (attention, MLP, LM head)
    resid_pos: np.ndarray  # (Tl,) global positions of the residual stream (LayerNorm, dropout)
    attention: object  # the attention core: forward(q, k, v, layer, lay, drop) / backward(dy, cache, lay)


def check_tp(config: ModelConfig, tp: int) -> None:
    if config.n_head % tp != 0:
        choices = [d for d in range(1, config.n_head + 1) if config.n_head % d == 0]
        raise ConfigError(f"tp={tp} does not divide n_head={config.n_head}; choose tp in {set(choices)}")
    if config.vocab_size < tp:
        raise ConfigError(f"tp={tp} is larger than vocab_size={config.vocab_size}; use tp <= vocab_size")
    kv = config.n_kv_head
    if config.arch == "llama" and kv % tp and tp % kv:
        choices = sorted({d for d in range(1, config.n_head + 1) if config.n_head % d == 0 and (kv % d == 0
                                                                                          or d % kv == 0)})
        raise ConfigError(f"tp={tp} neither divides n_kv_head={kv} nor is a multiple of it, so a rank's "
                          f"query heads would read two kv heads; choose tp in {set(choices)}")


def tp_layout(config: ModelConfig, seq_len: int, tp_comm) -> Layout:
    """Plain TP: every rank holds the whole sequence, its heads, its vocabulary rows."""
    t, r = (1, 0) if tp_comm is None else (tp_comm.size, tp_comm.rank)
    check_tp(config, t)
    pos = np.arange(seq_len)
    return Layout(config, seq_len, tp_comm, TP_PAIR if t > 1 else NO_PAIR,
                  shard_range(config.n_head, t, r), shard_range(config.vocab_size, t, r),
                  pos, pos, LocalAttention())


def shard_params_tp(full: dict, config: ModelConfig, t: int, rank: int) -> dict:
    """This rank's parameters: a slice of the full initialisation, so any t starts from the same model."""
    slices = tp_param_slices(config, t, rank)
    return {name: (np.take(w, slices[name][1], axis=slices[name][0]) if name in slices else w.copy())
            for name, w in full.items()}


# Dropout keyed by global indices (DropoutContext.keep draws a site's mask whole per sample and then
# slices it): replicated regions get identical masks on every tp rank, shards get their own part.
def resid_dropout_forward(x, drop, layer: int, site: str, lay: Layout):
    shape = (lay.seq_len, lay.config.n_embd)
    return dropout_forward(x, drop.keep(layer, site, shape, x, (lay.resid_pos, slice(None))), drop.p)


def resid_dropout_backward(dout, cache):
    return dropout_backward(dout, cache)


# Column- and row-parallel linear (weight [in, out]).
def column_parallel_linear_forward(x, w, b, lay: Layout, tag: str):
    """x (B, Tl, C) -> (B, Ta, out/t). Keeps x as given, not as entered: the backward enters it again,
    free under TP (f is the identity), an all-gather under SP, which keeps only the sequence shard
    (Korthikanti et al. 2022 §4.2.2)."""
    xa = lay.pair.enter(x, lay.tp, f"{tag}:fwd")  # (B, Ta, C)
    out = matmul(compute(xa), compute(w))  # (B, Ta, out/t)
    if b is not None:
        out = out + compute(b)
    return rounded(out, x.dtype), (x, w, b is not None, tag)


def column_parallel_linear_backward(dout, cache, lay: Layout):
    x, w, has_bias, tag = cache
    xa = compute(lay.pair.enter(x, lay.tp, f"{tag}:regather"))  # (B, Ta, C)
    xp, dt, dc = array_namespace(dout), dout.dtype, compute(dout)
    dw = matmul(xp.reshape(xa, (-1, xa.shape[-1])).T, xp.reshape(dc, (-1, dc.shape[-1])))  # (C, out/t)
    db = rounded(xp.sum(dc, axis=(0, 1)), w.dtype) if has_bias else None  # (out/t,)
    dx = lay.pair.enter_backward(rounded(matmul(dc, compute(w).T), dt), lay.tp, f"{tag}:bwd")  # (B, Tl, C)
    return dx, rounded(dw, w.dtype), db


def row_parallel_linear_forward(x, w, b, lay: Layout, tag: str):
    """x (B, Ta, in/t) -> (B, Tl, C): each rank's rows give a partial sum; g adds them, then the bias
    is added once."""
    partial = rounded(matmul(compute(x), compute(w)), x.dtype)  # (B, Ta, C), partial over t
    out = lay.pair.leave(partial, lay.tp, f"{tag}:fwd")  # (B, Tl, C)
    return rounded(compute(out) + compute(b), x.dtype), (x, w, tag)


def row_parallel_linear_backward(dout, cache, lay: Layout):
    x, w, tag = cache
    xp, dt = array_namespace(dout), dout.dtype
    db = rounded(xp.sum(compute(dout), axis=(0, 1)), w.dtype)  # (C,): over this rank's residual tokens
    dpartial = compute(lay.pair.leave_backward(dout, lay.tp, f"{tag}:bwd"))  # (B, Ta, C)
    xc = compute(x)
    dpartial2 = xp.reshape(dpartial, (-1, dpartial.shape[-1]))  # (B*Ta, C)
    dw = matmul(xp.reshape(xc, (-1, xc.shape[-1])).T, dpartial2)  # (in/t, C)
    return rounded(matmul(dpartial, compute(w).T), dt), rounded(dw, w.dtype), db  # dx (B, Ta, in/t)


class LocalAttention:
    """The whole sequence is on this rank: the model's causal attention on this rank's heads
    (Llama's grouped-query attention, k and v of its kv heads, without dropout)."""

    def forward(self, q, k, v, layer, lay: Layout, drop):  # (B, nh/t, Ta, hs); Llama's k, v nkv heads
        cfg, pos = lay.config, lay.region_pos
        if cfg.arch == "llama":
            return gqa_attention_forward(q, k, v, as_like(pos, q), as_like(pos, q))
        keep = drop.keep(layer, "attn", (cfg.n_head, lay.seq_len, lay.seq_len), q,
                         np.ix_(np.arange(*lay.heads), pos, pos))  # (B, nh/t, Ta, Ta)
        return attention_forward(q, k, v, as_like(pos, q), as_like(pos, q), keep, drop.p)

    def backward(self, dy, cache, lay: Layout):
        return (gqa_attention_backward if lay.config.arch == "llama" else attention_backward)(dy, cache)


def parallel_attention_forward(x, params, layer: int, lay: Layout, drop):
    """x (B, Tl, C), ln_1's output -> (B, Tl, C), before the residual dropout."""
    P, hs = f"h.{layer}.attn.", lay.config.head_size
    nh = lay.heads[1] - lay.heads[0]
    qkv, c_attn = column_parallel_linear_forward(
        x, params[P + "c_attn.weight"], params[P + "c_attn.bias"], lay, P + "c_attn")  # (B, Ta, 3C/t)
    xp, (B, Ta, _) = array_namespace(qkv), qkv.shape
    qkv = xp.permute_dims(xp.reshape(qkv, (B, Ta, 3, nh, hs)), (2, 0, 3, 1, 4))  # (3, B, nh/t, Ta, hs)
    q, k, v = qkv[0, ...], qkv[1, ...], qkv[2, ...]  # (B, nh/t, Ta, hs) each
    y, core = lay.attention.forward(q, k, v, layer, lay, drop)  # (B, nh/t, Ta, hs)
    y = xp.reshape(xp.permute_dims(y, (0, 2, 1, 3)), (B, Ta, nh * hs))  # (B, Ta, C/t)
    out, c_proj = row_parallel_linear_forward(
        y, params[P + "c_proj.weight"], params[P + "c_proj.bias"], lay, P + "c_proj")  # (B, Tl, C)
    return out, (c_attn, core, c_proj)


def parallel_attention_backward(dout, cache, layer: int, lay: Layout):
    c_attn, core, c_proj = cache
    P, hs = f"h.{layer}.attn.", lay.config.head_size
    nh = lay.heads[1] - lay.heads[0]
    dy, dw_proj, db_proj = row_parallel_linear_backward(dout, c_proj, lay)  # (B, Ta, C/t)
    xp, (B, Ta, _) = array_namespace(dy), dy.shape
    dy = xp.permute_dims(xp.reshape(dy, (B, Ta, nh, hs)), (0, 2, 1, 3))  # (B, nh/t, Ta, hs)
    dqkv = xp.stack(lay.attention.backward(dy, core, lay))  # (3, B, nh/t, Ta, hs)
    dqkv = xp.reshape(xp.permute_dims(dqkv, (1, 3, 0, 2, 4)), (B, Ta, 3 * nh * hs))  # (B, Ta, 3C/t)
    dx, dw_attn, db_attn = column_parallel_linear_backward(dqkv, c_attn, lay)  # (B, Tl, C)
    return dx, {P + "c_attn.weight": dw_attn, P + "c_attn.bias": db_attn,
                P + "c_proj.weight": dw_proj, P + "c_proj.bias": db_proj}


def parallel_mlp_forward(x, params, layer: int, lay: Layout):
    """x (B, Tl, C), ln_2's output -> (B, Tl, C), before the residual dropout."""
    P = f"h.{layer}.mlp."
    h, c_fc = column_parallel_linear_forward(
        x, params[P + "c_fc.weight"], params[P + "c_fc.bias"], lay, P + "c_fc")  # (B, Ta, 4C/t)
    g, gelu = gelu_forward(h)  # (B, Ta, 4C/t)
    out, c_proj = row_parallel_linear_forward(
        g, params[P + "c_proj.weight"], params[P + "c_proj.bias"], lay, P + "c_proj")  # (B, Tl, C)
    return out, (c_fc, gelu, c_proj)


def parallel_mlp_backward(dout, cache, layer: int, lay: Layout):
    c_fc, gelu, c_proj = cache
    P = f"h.{layer}.mlp."
    dg, dw_proj, db_proj = row_parallel_linear_backward(dout, c_proj, lay)  # (B, Ta, 4C/t)
    dx, dw_fc, db_fc = column_parallel_linear_backward(gelu_backward(dg, gelu), c_fc, lay)  # (B, Tl, C)
    return dx, {P + "c_fc.weight": dw_fc, P + "c_fc.bias": db_fc,
                P + "c_proj.weight": dw_proj, P + "c_proj.bias": db_proj}


def parallel_block_forward(x, params, layer: int, lay: Layout, drop, moe=None):
    """x (B, Tl, C) -> (B, Tl, C): GPT-2's pre-LayerNorm block with both sublayers tensor-parallel.
    In the blocks of `config.moe_blocks` the MLP is `moe.forward` (the expert-parallel layer
    refpar/engine/parallelize.py builds)."""
    P, eps = f"h.{layer}.", lay.config.layer_norm_eps
    a, ln_1 = layernorm_forward(x, params[P + "ln_1.weight"], params[P + "ln_1.bias"], eps)
    a, attn = parallel_attention_forward(a, params, layer, lay, drop)  # f ... g
    a, drop_a = resid_dropout_forward(a, drop, layer, "attn_resid", lay)
    x = x + a
    m, ln_2 = layernorm_forward(x, params[P + "ln_2.weight"], params[P + "ln_2.bias"], eps)
    if layer in lay.config.moe_blocks:
        m, mlp = moe.forward(m, params, layer, lay.config)  # (B, Tl, C)
        mlp = (moe, mlp)
    else:
        m, mlp = parallel_mlp_forward(m, params, layer, lay)  # f ... g
    m, drop_m = resid_dropout_forward(m, drop, layer, "mlp_resid", lay)
    return x + m, (ln_1, attn, drop_a, ln_2, mlp, drop_m)


def parallel_block_backward(dy, cache, layer: int, lay: Layout):
    ln_1, attn, drop_a, ln_2, mlp, drop_m = cache
    P = f"h.{layer}."
    if layer in lay.config.moe_blocks:
        moe, c_moe = mlp
        dm, grads = moe.backward(resid_dropout_backward(dy, drop_m), c_moe)  # (B, Tl, C)
    else:
        dm, grads = parallel_mlp_backward(resid_dropout_backward(dy, drop_m), mlp, layer, lay)
    dx, grads[P + "ln_2.weight"], grads[P + "ln_2.bias"] = layernorm_backward(dm, ln_2)
    dx = dx + dy
    da, attn_grads = parallel_attention_backward(resid_dropout_backward(dx, drop_a), attn, layer, lay)
    grads |= attn_grads
    dx0, grads[P + "ln_1.weight"], grads[P + "ln_1.bias"] = layernorm_backward(da, ln_1)
    return dx + dx0, grads
