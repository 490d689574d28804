"""Tensor parallelism of Llama on the `tp` axis: Megatron-LM's split (tensor_parallel.py's f and g,
its Layout) applied to RMSNorm, RoPE, grouped-query attention and SwiGLU.

    mpiexec -n 4 python -m refpar train --model llama-tiny --mesh tp=4 --check

Legend: B batch, T sequence, C channels, nh query heads, nkv kv heads, hs head size, F the SwiGLU
width, V vocab, t tp size, b = t / nkv kv replicas when t > nkv; Ta the tokens inside a region (T,
or a cp rank's), Tl the residual stream's (Ta, or its sp shard).

Weights a rank holds (Hugging Face's layout weight[out, in]; holdings.tp_param_slices); the RMSNorm
gains are replicated:
    model.embed_tokens.weight   rows shard_range(V, t, rank)             (V/t, C), vocab-parallel
    lm_head.weight              rows shard_range(V, t, rank)             (V/t, C), the head's columns
    self_attn.q_proj            rows of heads [h0, h1)                   (C/t, C)
    self_attn.k_proj, v_proj    rows of kv heads [k0, k1)                (nkv hs/t, C); t > nkv: (hs, C)
    self_attn.o_proj            columns of heads [h0, h1)                (C, C/t)
    mlp.gate_proj, up_proj      rows shard_range(F, t, rank)             (F/t, C)
    mlp.down_proj               columns shard_range(F, t, rank)          (C, F/t)

Sequence parallelism (--sp, sequence_parallel.py's pair): the RMSNorms and the residual stream run on
this rank's sequence shard (B, Tl, C); each region is entered by an all-gather and left by a
reduce-scatter. q, k, v (and gate, up) keep the norm's sharded output, not the gathered one, and
the backward gathers it again once per region (":regather"), as GPT-2's column-parallel linear
does: what Korthikanti's eq. 4 divides by t. The RMSNorm gains see only this rank's tokens, so
their gradients are summed over tp once per step (holdings.sequence_parallel_param_names).

Attention runs on whole heads: a rank's query heads and the kv heads they read (holdings.kv_heads).
With t > nkv each kv head is on b ranks (GQA's replicas, as Megatron-LM and vLLM replicate it);
each rank's dK and dV come from its own query heads only, so its k_proj and v_proj gradients are a
partial sum, which the b ranks holding that head (the mesh's "kv" group) add up, k and v in one
all-reduce per block and microbatch, before the hooks see them. Per block: the region's input is
entered once (f: its backward all-reduces dx of (B, T, C)), o_proj and down_proj leave through g
(an all-reduce of (B, T, C) each): four all-reduces of (B, T, C), GPT-2's.

Context parallelism: the block rotates q and k by the Layout's global positions (a cp rank's
zig-zag chunks under ring attention, its contiguous chunk under Ulysses) and calls the Layout's
attention core with k and v of the rank's kv heads (context_parallel.py says how ring and Ulysses
treat them); --recompute selective swaps that core (recompute.SelectiveAttention). In the blocks of
`config.moe_blocks` the MLP is the expert-parallel layer (Mixtral's experts over ep).
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.gpt import NO_DROPOUT, merge_heads, split_heads
from refpar.model.layers import as_like
from refpar.model.llama_layers import (
    linear_t_backward,
    linear_t_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    rope_cos_sin,
    rope_forward,
    swiglu_backward,
    swiglu_forward,
)
from refpar.parallel.tensor_parallel import Layout


def llama_parallel_block_forward(x, params, layer: int, lay: Layout, kv_group, moe=None):
    """x (B, Tl, C) -> (B, Tl, C): Llama's block with attention and the MLP tensor-parallel; in the
    blocks of `config.moe_blocks` the MLP is `moe.forward` (the expert-parallel layer)."""
    cfg, P = lay.config, f"model.layers.{layer}."
    pos = as_like(lay.region_pos, x)  # (Ta,) global positions (zig-zag chunks under ring cp): RoPE's angles
    cos, sin = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta, x)  # (Ta, hs) each
    a, c_ln1 = rmsnorm_forward(x, params[P + "input_layernorm.weight"], cfg.norm_eps)  # (B, Tl, C)
    xa = lay.pair.enter(a, lay.tp, P + "self_attn:fwd")  # (B, Ta, C)
    q, c_q = _kept_as(a, linear_t_forward(xa, params[P + "self_attn.q_proj.weight"]))  # (B, Ta, C/t)
    k, c_k = _kept_as(a, linear_t_forward(xa, params[P + "self_attn.k_proj.weight"]))  # (B, Ta, nkv_l hs)
    v, c_v = _kept_as(a, linear_t_forward(xa, params[P + "self_attn.v_proj.weight"]))  # (B, Ta, nkv_l hs)
    del xa  # under sp the backward gathers `a` again
    hs = cfg.head_size
    q, c_rq = rope_forward(split_heads(q, q.shape[-1] // hs), cos, sin)  # (B, nh/t, Ta, hs)
    k, c_rk = rope_forward(split_heads(k, k.shape[-1] // hs), cos, sin)  # (B, nkv_l, Ta, hs)
    v = split_heads(v, v.shape[-1] // hs)  # (B, nkv_l, Ta, hs)
    o, c_sdpa = lay.attention.forward(q, k, v, layer, lay, NO_DROPOUT)  # (B, nh/t, Ta, hs)
    o, c_o = linear_t_forward(merge_heads(o), params[P + "self_attn.o_proj.weight"])  # (B, Ta, C) partial
    x1 = x + lay.pair.leave(o, lay.tp, P + "self_attn.o_proj:fwd")  # (B, Tl, C)

    m, c_ln2 = rmsnorm_forward(x1, params[P + "post_attention_layernorm.weight"], cfg.norm_eps)
    if layer in cfg.moe_blocks:  # Mixtral's experts over ep (expert_parallel.ExpertParallelMoE)
        d, c_moe = moe.forward(m, params, layer, cfg)  # (B, Tl, C)
        cache = (c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, (moe, c_moe))
        return x1 + d, (cache, kv_group)
    ma = lay.pair.enter(m, lay.tp, P + "mlp:fwd")  # (B, Ta, C)
    g, c_gate = _kept_as(m, linear_t_forward(ma, params[P + "mlp.gate_proj.weight"]))  # (B, Ta, F/t)
    u, c_up = _kept_as(m, linear_t_forward(ma, params[P + "mlp.up_proj.weight"]))  # (B, Ta, F/t)
    del ma
    h, c_act = swiglu_forward(g, u)  # (B, Ta, F/t)
    d, c_down = linear_t_forward(h, params[P + "mlp.down_proj.weight"])  # (B, Ta, C) partial
    y = x1 + lay.pair.leave(d, lay.tp, P + "mlp.down_proj:fwd")  # (B, Tl, C)
    cache = (c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, (None, (c_gate, c_up, c_act, c_down)))
    return y, (cache, kv_group)


def llama_parallel_block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, Tl, C) -> (dx (B, Tl, C), this rank's gradients of the block, k and v summed over their
    replicas)."""
    (c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, (moe, c_mlp)), kv_group = cache
    P = f"model.layers.{layer}."
    if moe is not None:  # Mixtral's experts
        dm, g = moe.backward(dy, c_mlp)  # (B, Tl, C)
    else:
        dm, g = _mlp_backward(dy, c_mlp, P, lay)  # (B, Tl, C)
    dm, g[P + "post_attention_layernorm.weight"] = rmsnorm_backward(dm, c_ln2)  # (B, Tl, C)
    dx1 = dy + dm  # (B, Tl, C)

    do = lay.pair.leave_backward(dx1, lay.tp, P + "self_attn.o_proj:bwd")  # (B, Ta, C)
    do, g[P + "self_attn.o_proj.weight"] = linear_t_backward(do, c_o)  # (B, Ta, C/t)
    dq, dk, dv = lay.attention.backward(split_heads(do, do.shape[-1] // lay.config.head_size), c_sdpa, lay)
    dq = merge_heads(rope_backward(dq, c_rq))  # (B, Ta, C/t)
    dk = merge_heads(rope_backward(dk, c_rk))  # (B, Ta, nkv_l hs)
    c_q, c_k, c_v = _regathered(lay, P + "self_attn:regather", c_q, c_k, c_v)
    dxa, g[P + "self_attn.q_proj.weight"] = linear_t_backward(dq, c_q)  # (B, Ta, C)
    dxa_k, dwk = linear_t_backward(dk, c_k)  # (B, Ta, C), (nkv_l hs, C)
    dxa_v, dwv = linear_t_backward(merge_heads(dv), c_v)  # (B, Ta, C), (nkv_l hs, C)
    if kv_group is not None:  # a replicated kv head: each replica's query heads gave part of it
        xp = array_namespace(dwk)
        kv = kv_group.all_reduce(xp.concat([dwk, dwv]), tag=P + "self_attn.kv_proj:replica-grad")
        dwk, dwv = kv[:dwk.shape[0], ...], kv[dwk.shape[0]:, ...]  # (hs, C) each
    g[P + "self_attn.k_proj.weight"], g[P + "self_attn.v_proj.weight"] = dwk, dwv
    da = lay.pair.enter_backward(dxa + dxa_k + dxa_v, lay.tp, P + "self_attn:bwd")  # (B, Tl, C)
    da, g[P + "input_layernorm.weight"] = rmsnorm_backward(da, c_ln1)  # (B, Tl, C)
    return dx1 + da, g


def _mlp_backward(dy, cache, P: str, lay: Layout):
    """The SwiGLU MLP's backward: dy (B, Tl, C) -> (dm (B, Tl, C), its weights' gradients)."""
    c_gate, c_up, c_act, c_down = cache
    g = {}
    dd = lay.pair.leave_backward(dy, lay.tp, P + "mlp.down_proj:bwd")  # (B, Ta, C)
    dh, g[P + "mlp.down_proj.weight"] = linear_t_backward(dd, c_down)  # (B, Ta, F/t)
    dgate, dup = swiglu_backward(dh, c_act)  # (B, Ta, F/t) each
    c_gate, c_up = _regathered(lay, P + "mlp:regather", c_gate, c_up)
    dma, g[P + "mlp.gate_proj.weight"] = linear_t_backward(dgate, c_gate)  # (B, Ta, C)
    dma_up, g[P + "mlp.up_proj.weight"] = linear_t_backward(dup, c_up)  # (B, Ta, C)
    return lay.pair.enter_backward(dma + dma_up, lay.tp, P + "mlp:bwd"), g  # (B, Tl, C)


def _kept_as(x, out_cache):
    """A linear's (out, cache) with the cache keeping `x`, the region's input before it was
    entered: the gathered input itself under plain TP (f is the identity), the sequence shard
    under sp."""
    out, (_, w, has_bias) = out_cache
    return out, (x, w, has_bias)


def _regathered(lay: Layout, tag: str, *caches):
    """The caches of the linears that read one region input, with that input entered again (one
    all-gather under sp, nothing under plain TP)."""
    xa = lay.pair.enter(caches[0][0], lay.tp, tag)  # (B, Ta, C)
    return [(xa, *c[1:]) for c in caches]
