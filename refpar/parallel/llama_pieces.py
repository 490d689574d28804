"""Llama's pieces on a tensor_parallel.Layout: Megatron-LM's split (tensor_parallel.py's f and g,
its Layout, its column- and row-parallel linears, each backward in an input and a weight half)
applied to RMSNorm, RoPE, grouped-query attention and SwiGLU; the embedding and the final norm.
The layers are refpar/model/llama_layers.py's, in refpar/model/llama.py's order, so a layout that
splits nothing computes llama.block_forward's and llama.block_backward's numbers bit for bit.

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

Sequence parallelism (--sp, sequence_parallel.py's pair): the RMSNorms and the residual stream run
on this rank's sequence shard (B, Tl, C); each region is entered by an all-gather and left by a
reduce-scatter. q, k, v (and gate, up) keep the norm's sharded output, not the gathered one, and the
weight half gathers it again once per region (":regather"), as GPT-2's column-parallel linear does:
what Korthikanti's eq. 4 divides by t. The RMSNorm gains see only this rank's tokens, so their
gradients are summed over tp once per step (holdings.sequence_parallel_param_names).

Attention runs on whole heads: a rank's query heads and the kv heads they read (holdings.kv_heads).
With t > nkv each kv head is on b ranks (GQA's replicas, as Megatron-LM and vLLM replicate it); each
rank's dK and dV come from its own query heads only, so its k_proj and v_proj gradients are a
partial sum, which the b ranks holding that head (the mesh's "kv" group) add up, k and v in one
all-reduce per block and microbatch, in the weight half, before the model states see them. Per
block: the region's input is entered once (f: its backward all-reduces dx of (B, T, C)), o_proj and
down_proj leave through g (an all-reduce of (B, T, C) each): four all-reduces of (B, T, C), GPT-2's.

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
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    rope_cos_sin,
    rope_forward,
    swiglu_backward,
    swiglu_forward,
)
from refpar.parallel.tensor_parallel import (
    Layout,
    column_parallel_linear_backward,
    column_parallel_linear_forward,
    given,
    linears_weight,
    row_parallel_linear_backward,
    row_parallel_linear_forward,
)
from refpar.parallel.vocab_parallel import vocab_rows_backward, vocab_rows_forward

EMBED = "model.embed_tokens.weight"


def _t(w):
    """A (out, in) weight as the (in, out) one the linears multiply by: a view, no copy."""
    return array_namespace(w).matrix_transpose(w)


def block_forward(x, params, layer: int, lay: Layout, drop=None, moe=None, kv=None):
    """x (B, Tl, C) -> (B, Tl, C): Llama's block with attention and the MLP tensor-parallel; in the
    blocks of `config.moe_blocks` the MLP is `moe.forward` (the expert-parallel layer). `kv`: the
    mesh's "kv" group (replicated kv heads) or None; `drop`: GPT-2's, unused (no dropout)."""
    cfg, P, hs = lay.config, f"model.layers.{layer}.", lay.config.head_size
    pos = as_like(lay.region_pos, x)  # (Ta,) global positions (zig-zag chunks under ring cp): RoPE's angles
    cos, sin = rope_cos_sin(pos, hs, cfg.rope_theta, x)  # (Ta, hs) each
    a, c_ln1 = rmsnorm_forward(x, params[P + "input_layernorm.weight"], cfg.norm_eps)  # (B, Tl, C)
    (q, k, v), c_qkv = column_parallel_linear_forward(
        a, [(_t(params[P + f"self_attn.{n}_proj.weight"]), None) for n in "qkv"], lay, P + "self_attn")
    q, c_rq = rope_forward(split_heads(q, q.shape[-1] // hs), cos, sin)  # (B, nh/t, Ta, hs)
    k, c_rk = rope_forward(split_heads(k, k.shape[-1] // hs), cos, sin)  # (B, nkv_l, Ta, hs)
    v = split_heads(v, v.shape[-1] // hs)  # (B, nkv_l, Ta, hs)
    o, c_sdpa = lay.attention.forward(q, k, v, layer, lay, NO_DROPOUT)  # (B, nh/t, Ta, hs)
    o, c_o = row_parallel_linear_forward(merge_heads(o), _t(params[P + "self_attn.o_proj.weight"]), None, lay,
                                         P + "self_attn.o_proj")  # (B, Tl, C)
    x1 = x + o  # (B, Tl, C)

    m, c_ln2 = rmsnorm_forward(x1, params[P + "post_attention_layernorm.weight"], cfg.norm_eps)
    d, c_mlp = mlp_forward(m, params, layer, lay, moe)  # (B, Tl, C)
    return x1 + d, (c_ln1, c_qkv, c_rq, c_rk, c_sdpa, c_o, c_ln2, c_mlp, kv)


def mlp_forward(m, params, layer: int, lay: Layout, moe=None):
    """m (B, Tl, C) post_attention_layernorm's output -> (B, Tl, C): the SwiGLU MLP, gate and up
    column-parallel, down row-parallel; in the blocks of `config.moe_blocks` `moe.forward` (the
    expert-parallel layer). DeepSeek-V3's blocks (deepseek_pieces.py) run it too."""
    cfg, P = lay.config, f"model.layers.{layer}."
    if layer in cfg.moe_blocks:  # Mixtral's experts over ep (expert_parallel.ExpertParallelMoE)
        d, c_mlp = moe.forward(m, params, layer, cfg)  # (B, Tl, C)
        return d, (moe, c_mlp)
    (g, u), c_gu = column_parallel_linear_forward(
        m, [(_t(params[P + f"mlp.{n}_proj.weight"]), None) for n in ("gate", "up")], lay, P + "mlp")
    h, c_act = swiglu_forward(g, u)  # (B, Ta, F/t)
    d, c_down = row_parallel_linear_forward(h, _t(params[P + "mlp.down_proj.weight"]), None, lay,
                                            P + "mlp.down_proj")  # (B, Tl, C)
    return d, (None, (c_gu, c_act, c_down))


def mlp_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, Tl, C) -> (dm (B, Tl, C), the MLP's weight half: a MoE layer's gradients as given)."""
    moe, c_mlp = cache
    P = f"model.layers.{layer}."
    if moe is not None:  # Mixtral's experts
        dm, grads = moe.backward(dy, c_mlp)  # (B, Tl, C)
        return dm, [(given, (tuple(grads), *grads.values()))]
    c_gu, c_act, c_down = c_mlp
    dh, w_down = row_parallel_linear_backward(dy, c_down, lay, (P + "mlp.down_proj.weight", None),
                                              transposed=True)  # (B, Ta, F/t)
    dgate, dup = swiglu_backward(dh, c_act)  # (B, Ta, F/t) each
    dm, w_gu = column_parallel_linear_backward(
        [dgate, dup], c_gu, lay, [(P + f"mlp.{n}_proj.weight", None) for n in ("gate", "up")],
        transposed=True)  # (B, Tl, C)
    return dm, [w_down, w_gu]


def block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, Tl, C) -> (dx (B, Tl, C), the block's weight half: [(function, arguments)], k's and v's
    gradients summed over their replicas there)."""
    c_ln1, c_qkv, c_rq, c_rk, c_sdpa, c_o, c_ln2, c_mlp, kv = cache
    P = f"model.layers.{layer}."
    dm, work = mlp_backward(dy, c_mlp, layer, lay)  # (B, Tl, C)
    dm, dw = rmsnorm_backward(dm, c_ln2)  # (B, Tl, C)
    work.append((given, ((P + "post_attention_layernorm.weight",), dw)))
    dx1 = dy + dm  # (B, Tl, C)

    do, w_o = row_parallel_linear_backward(dx1, c_o, lay, (P + "self_attn.o_proj.weight", None),
                                           transposed=True)  # (B, Ta, C/t)
    dq, dk, dv = lay.attention.backward(split_heads(do, do.shape[-1] // lay.config.head_size), c_sdpa, lay)
    dq = merge_heads(rope_backward(dq, c_rq))  # (B, Ta, C/t)
    dk = merge_heads(rope_backward(dk, c_rk))  # (B, Ta, nkv_l hs)
    names = [(P + f"self_attn.{n}_proj.weight", None) for n in "qkv"]
    da, (_, args) = column_parallel_linear_backward([dq, dk, merge_heads(dv)], c_qkv, lay, names,
                                                    transposed=True)  # (B, Tl, C)
    da, dw = rmsnorm_backward(da, c_ln1)  # (B, Tl, C)
    work += [w_o, (_qkv_weight, (*args, kv, P)), (given, ((P + "input_layernorm.weight",), dw))]
    return dx1 + da, work


def _qkv_weight(x, linears, kv, P: str) -> dict:
    """q's, k's and v's weight gradients; a replicated kv head's (b = t / nkv > 1 ranks hold it) each
    replica's query heads gave part of, summed over the "kv" group: k and v in one all-reduce."""
    grads = linears_weight(x, linears)
    if kv is not None:
        k, v = P + "self_attn.k_proj.weight", P + "self_attn.v_proj.weight"
        xp, n = array_namespace(grads[k]), grads[k].shape[0]
        both = kv.all_reduce(xp.concat([grads[k], grads[v]]), tag=P + "self_attn.kv_proj:replica-grad")
        grads[k], grads[v] = both[:n, ...], both[n:, ...]  # (hs, C) each
    return grads


def embed_forward(tokens, params, lay: Layout, drop=None):
    """tokens (B, Ta) global ids at lay.region_pos -> x (B, Tl, C): this rank's rows of the
    embedding, summed over tp (g). No position table (RoPE), no dropout."""
    return vocab_rows_forward(tokens, params[EMBED], lay, "model.embed_tokens")


def embed_backward(dx, tokens, lay: Layout) -> list:
    """dx (B, Tl, C) -> the weight half's work: this rank's rows' gradient (V/t, C)."""
    return [vocab_rows_backward(dx, tokens, lay, "model.embed_tokens")]


def norm_forward(x, params, lay: Layout):
    """model.norm: x (B, Tl, C) -> (B, Tl, C)."""
    return rmsnorm_forward(x, params["model.norm.weight"], lay.config.norm_eps)


def norm_backward(dh, cache):
    dx, dw = rmsnorm_backward(dh, cache)  # (B, Tl, C)
    return dx, (given, (("model.norm.weight",), dw))
