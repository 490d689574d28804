"""Tensor parallelism of Llama on the `tp` axis: Megatron-LM's split (tensor_parallel.py's f and g,
its Layout) applied to RMSNorm, RoPE, grouped-query attention and SwiGLU.

    mpiexec -n 4 python -m refpar train --model llama-tiny --mesh tp=4 --check

Legend: B batch, T sequence, C channels, nh query heads, nkv kv heads, hs head size, F the SwiGLU
width, V vocab, t tp size, b = t / nkv kv replicas when t > nkv.

Weights a rank holds (Hugging Face's layout weight[out, in]; holdings.tp_param_slices); the RMSNorm
gains are replicated:
    model.embed_tokens.weight   rows shard_range(V, t, rank)             (V/t, C), vocab-parallel
    lm_head.weight              rows shard_range(V, t, rank)             (V/t, C), the head's columns
    self_attn.q_proj            rows of heads [h0, h1)                   (C/t, C)
    self_attn.k_proj, v_proj    rows of kv heads [k0, k1)                (nkv hs/t, C); t > nkv: (hs, C)
    self_attn.o_proj            columns of heads [h0, h1)                (C, C/t)
    mlp.gate_proj, up_proj      rows shard_range(F, t, rank)             (F/t, C)
    mlp.down_proj               columns shard_range(F, t, rank)          (C, F/t)

Attention runs on whole heads: a rank's query heads and the kv heads they read (holdings.kv_heads).
With t > nkv each kv head is on b ranks (GQA's replicas, as Megatron-LM and vLLM replicate it);
each rank's dK and dV come from its own query heads only, so its k_proj and v_proj gradients are a
partial sum, which the b ranks holding that head (the mesh's "kv" group) add up, k and v in one
all-reduce per block and microbatch, before the hooks see them. Per block: the region's input is
entered once (f: its backward all-reduces dx of (B, T, C)), o_proj and down_proj leave through g
(an all-reduce of (B, T, C) each): four all-reduces of (B, T, C), GPT-2's.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.gpt import merge_heads, split_heads
from refpar.model.layers import as_like
from refpar.model.llama_layers import (
    gqa_attention_backward,
    gqa_attention_forward,
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


def llama_parallel_block_forward(x, params, layer: int, lay: Layout, kv_group, attention=None):
    """x (B, T, C) -> (B, T, C): Llama's block with attention and the MLP tensor-parallel.
    `attention`, an attention core with forward(q, k, v, layer, lay, drop) (refpar/serving's
    CachedAttention), replaces causal GQA over the rows in hand; forward only, as serving needs."""
    cfg, P = lay.config, f"model.layers.{layer}."
    pos = as_like(lay.region_pos, x)  # (T,) global positions: RoPE's angles and the causal mask
    cos, sin = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta, x)  # (T, hs) each
    a, c_ln1 = rmsnorm_forward(x, params[P + "input_layernorm.weight"], cfg.norm_eps)  # (B, T, C)
    xa = lay.pair.enter(a, lay.tp, P + "self_attn:fwd")  # (B, T, C)
    q, c_q = linear_t_forward(xa, params[P + "self_attn.q_proj.weight"])  # (B, T, C/t)
    k, c_k = linear_t_forward(xa, params[P + "self_attn.k_proj.weight"])  # (B, T, nkv_l hs)
    v, c_v = linear_t_forward(xa, params[P + "self_attn.v_proj.weight"])  # (B, T, nkv_l hs)
    hs = cfg.head_size
    q, c_rq = rope_forward(split_heads(q, q.shape[-1] // hs), cos, sin)  # (B, nh/t, T, hs)
    k, c_rk = rope_forward(split_heads(k, k.shape[-1] // hs), cos, sin)  # (B, nkv_l, T, hs)
    v = split_heads(v, v.shape[-1] // hs)  # (B, nkv_l, T, hs)
    if attention is None:
        o, c_sdpa = gqa_attention_forward(q, k, v, pos, pos)  # (B, nh/t, T, hs)
    else:
        o, c_sdpa = attention.forward(q, k, v, layer, lay, None)  # (B, nh/t, T, hs)
    o, c_o = linear_t_forward(merge_heads(o), params[P + "self_attn.o_proj.weight"])  # (B, T, C) partial
    x1 = x + lay.pair.leave(o, lay.tp, P + "self_attn.o_proj:fwd")  # (B, T, C)

    m, c_ln2 = rmsnorm_forward(x1, params[P + "post_attention_layernorm.weight"], cfg.norm_eps)
    ma = lay.pair.enter(m, lay.tp, P + "mlp:fwd")  # (B, T, C)
    g, c_gate = linear_t_forward(ma, params[P + "mlp.gate_proj.weight"])  # (B, T, F/t)
    u, c_up = linear_t_forward(ma, params[P + "mlp.up_proj.weight"])  # (B, T, F/t)
    h, c_act = swiglu_forward(g, u)  # (B, T, F/t)
    d, c_down = linear_t_forward(h, params[P + "mlp.down_proj.weight"])  # (B, T, C) partial
    y = x1 + lay.pair.leave(d, lay.tp, P + "mlp.down_proj:fwd")  # (B, T, C)
    cache = (c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, c_gate, c_up, c_act, c_down)
    return y, (cache, kv_group)


def llama_parallel_block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, T, C) -> (dx (B, T, C), this rank's gradients of the block, k and v summed over their
    replicas)."""
    (c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, c_gate, c_up, c_act, c_down), kv_group = cache
    P, g = f"model.layers.{layer}.", {}
    dd = lay.pair.leave_backward(dy, lay.tp, P + "mlp.down_proj:bwd")  # (B, T, C)
    dh, g[P + "mlp.down_proj.weight"] = linear_t_backward(dd, c_down)  # (B, T, F/t)
    dgate, dup = swiglu_backward(dh, c_act)  # (B, T, F/t) each
    dma, g[P + "mlp.gate_proj.weight"] = linear_t_backward(dgate, c_gate)  # (B, T, C)
    dma_up, g[P + "mlp.up_proj.weight"] = linear_t_backward(dup, c_up)  # (B, T, C)
    dm = lay.pair.enter_backward(dma + dma_up, lay.tp, P + "mlp:bwd")  # (B, T, C)
    dm, g[P + "post_attention_layernorm.weight"] = rmsnorm_backward(dm, c_ln2)  # (B, T, C)
    dx1 = dy + dm  # (B, T, C)

    do = lay.pair.leave_backward(dx1, lay.tp, P + "self_attn.o_proj:bwd")  # (B, T, C)
    do, g[P + "self_attn.o_proj.weight"] = linear_t_backward(do, c_o)  # (B, T, C/t)
    dq, dk, dv = gqa_attention_backward(split_heads(do, do.shape[-1] // lay.config.head_size), c_sdpa)
    dq = merge_heads(rope_backward(dq, c_rq))  # (B, T, C/t)
    dk = merge_heads(rope_backward(dk, c_rk))  # (B, T, nkv_l hs)
    dxa, g[P + "self_attn.q_proj.weight"] = linear_t_backward(dq, c_q)  # (B, T, C)
    dxa_k, dwk = linear_t_backward(dk, c_k)  # (B, T, C), (nkv_l hs, C)
    dxa_v, dwv = linear_t_backward(merge_heads(dv), c_v)  # (B, T, C), (nkv_l hs, C)
    if kv_group is not None:  # a replicated kv head: each replica's query heads gave part of it
        xp = array_namespace(dwk)
        kv = kv_group.all_reduce(xp.concat([dwk, dwv]), tag=P + "self_attn.kv_proj:replica-grad")
        dwk, dwv = kv[:dwk.shape[0], ...], kv[dwk.shape[0]:, ...]  # (hs, C) each
    g[P + "self_attn.k_proj.weight"], g[P + "self_attn.v_proj.weight"] = dwk, dwv
    da = lay.pair.enter_backward(dxa + dxa_k + dxa_v, lay.tp, P + "self_attn:bwd")  # (B, T, C)
    da, g[P + "input_layernorm.weight"] = rmsnorm_backward(da, c_ln1)  # (B, T, C)
    return dx1 + da, g
