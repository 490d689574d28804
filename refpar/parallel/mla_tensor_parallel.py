"""Multi-head latent attention (refpar/model/mla.py) on a tensor_parallel.Layout, split as
Megatron-Core 0.16.1's MLASelfAttention splits it (megatron/core/transformer/multi_latent_attention.py
with `Linear` down-projections, parallel_mode "duplicated"): heads over tp, the low-rank down-
projections and their RMSNorms replicated, the up-projections column-parallel by head, o_proj
row-parallel.

    mpiexec -n 2 python -m refpar train --model deepseek-tiny --mesh tp=2 --sp --check

Legend: B batch, Ta the tokens inside a tp region, Tl the residual stream's (Ta, or its sp shard), C
channels, nh heads, t tp size, dn qk_nope_head_dim, dr qk_rope_head_dim, dq = dn + dr, dv v_head_dim,
rq q_lora_rank, rkv kv_lora_rank.

Weights a rank holds (Hugging Face's layout weight[out, in]; holdings.tp_param_slices):
    q_a_proj, q_a_layernorm              whole                              (rq, C), (rq,)
    kv_a_proj_with_mqa, kv_a_layernorm   whole                              (rkv + dr, C), (rkv,)
    q_b_proj (q_proj without rq)         rows of heads [h0, h1)             (nh dq / t, rq)
    kv_b_proj                            rows of heads [h0, h1)             (nh (dn + dv) / t, rkv)
    o_proj                               columns of heads [h0, h1)          (C, nh dv / t)

The down-projections run on the residual stream's tokens (the sequence shard under sp) outside the
tensor-parallel region; the region is entered at the latents, which are narrower than the hidden
state: the normalised query latent (B, Tl, rq) by q_b_proj's column-parallel linear, the key-value
latent (B, Tl, rkv) by kv_b_proj's, and the decoupled RoPE key (B, Tl, dr), which every head reads,
by the pair alone. Each is entered through f (tensor_parallel.py: identity forward, all-reduce of
its gradient backward, where each rank's heads give part of it) or, under sp, through the all-gather
whose backward reduce-scatters. So per block the attention's backward sums (B, T, rq), (B, T, rkv)
and (B, T, dr) over tp where Llama's sums one (B, T, C), and o_proj leaves through g as Llama's does.
Past the sums the down-projections' backward is replicated: under plain tp every rank computes the
same gradients of q_a_proj, kv_a_proj_with_mqa and their norms; under sp each rank's come from its
own tokens, so they join the sequence-parallel region's gradients summed over tp once per step
(holdings.sequence_parallel_param_names), as Megatron-Core marks its duplicated linears.
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
)
from refpar.model.mla import LATENT_NORM_EPS, mla_cos_sin, mla_rope_backward, mla_rope_forward
from refpar.model.rope_yarn import softmax_factor
from refpar.parallel.tensor_parallel import (
    Layout,
    column_parallel_linear_backward,
    column_parallel_linear_forward,
    given,
    row_parallel_linear_backward,
    row_parallel_linear_forward,
)


def _t(w):
    """A (out, in) weight as the (in, out) one the linears multiply by: a view, no copy."""
    return array_namespace(w).matrix_transpose(w)


def mla_forward(a, params, layer: int, lay: Layout):
    """a (B, Tl, C) the block's input_layernorm output -> (out (B, Tl, C), cache): this rank's heads
    of mla.mla_forward, in its order, so the trivial layout computes its numbers bit for bit."""
    xp = array_namespace(a)
    cfg, P = lay.config, f"model.layers.{layer}.self_attn."
    dn, dr, rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    nh = lay.heads[1] - lay.heads[0]  # this rank's heads
    cos, sin = mla_cos_sin(as_like(lay.region_pos, a), cfg, a)  # (Ta, dr) each: YaRN's with rope_scaling

    if cfg.q_lora_rank is None:  # q_proj reads the hidden state itself
        q_in, c_qa, c_qn, q_name = a, None, None, "q_proj"
    else:
        cq, c_qa = linear_t_forward(a, params[P + "q_a_proj.weight"])  # (B, Tl, rq), replicated weight
        q_in, c_qn = rmsnorm_forward(cq, params[P + "q_a_layernorm.weight"], LATENT_NORM_EPS)  # (B, Tl, rq)
        q_name = "q_b_proj"
    (q,), c_q = column_parallel_linear_forward(q_in, [(_t(params[P + q_name + ".weight"]), None)], lay,
                                               P + q_name)  # (B, Ta, nh/t dq)
    q = split_heads(q, nh)  # (B, nh/t, Ta, dq)
    q_rope, c_rq = mla_rope_forward(q[..., dn:], cos, sin, cfg.rope_interleave)  # (B, nh/t, Ta, dr)
    q = xp.concat([q[..., :dn], q_rope], axis=-1)  # (B, nh/t, Ta, dq)

    ckv, c_kva = linear_t_forward(a, params[P + "kv_a_proj_with_mqa.weight"])  # (B, Tl, rkv + dr)
    latent, c_kvn = rmsnorm_forward(ckv[..., :rkv], params[P + "kv_a_layernorm.weight"],
                                    LATENT_NORM_EPS)  # (B, Tl, rkv)
    (kv,), c_kvb = column_parallel_linear_forward(latent, [(_t(params[P + "kv_b_proj.weight"]), None)], lay,
                                                  P + "kv_b_proj")  # (B, Ta, nh/t (dn + dv))
    k_rope = lay.pair.enter(ckv[..., rkv:], lay.tp, P + "k_rope:fwd")  # (B, Ta, dr): every head's
    k_rope, c_rk = mla_rope_forward(xp.expand_dims(k_rope, axis=1), cos, sin,
                                    cfg.rope_interleave)  # (B, 1, Ta, dr)
    kv = split_heads(kv, nh)  # (B, nh/t, Ta, dn + dv)
    B, _, Ta, _ = kv.shape
    k = xp.concat([kv[..., :dn], xp.broadcast_to(k_rope, (B, nh, Ta, dr))], axis=-1)  # (B, nh/t, Ta, dq)
    v = kv[..., dn:]  # (B, nh/t, Ta, dv)

    # YaRN's mscale^2 on the scores (1 without rope_scaling), carried by q so every core (local, ring,
    # Ulysses) keeps its own 1/sqrt(dq)
    m = softmax_factor(cfg.rope_scaling)
    q = q * m if m != 1.0 else q  # (B, nh/t, Ta, dq)
    o, c_core = lay.attention.forward(q, k, v, layer, lay, NO_DROPOUT)  # (B, nh/t, Ta, dv)
    out, c_o = row_parallel_linear_forward(merge_heads(o), _t(params[P + "o_proj.weight"]), None, lay,
                                           P + "o_proj")  # (B, Tl, C)
    return out, (P, q_name, c_qa, c_qn, c_q, c_rq, c_kva, c_kvn, c_kvb, c_rk, c_core, c_o)


def mla_backward(dout, cache, lay: Layout):
    """dout (B, Tl, C) -> (da (B, Tl, C), the weight half: the up-projections' and o_proj's linears;
    the down-projections' and their norms' gradients, computed on the way, given)."""
    P, q_name, c_qa, c_qn, c_q, c_rq, c_kva, c_kvn, c_kvb, c_rk, c_core, c_o = cache
    xp = array_namespace(dout)
    cfg = lay.config
    dn, interleave = cfg.qk_nope_head_dim, cfg.rope_interleave

    do, w_o = row_parallel_linear_backward(dout, c_o, lay, (P + "o_proj.weight", None),
                                           transposed=True)  # (B, Ta, nh/t dv)
    nh = lay.heads[1] - lay.heads[0]
    dq, dk, dv = lay.attention.backward(split_heads(do, nh), c_core, lay)  # (B, nh/t, Ta, dq|dq|dv)
    m = softmax_factor(cfg.rope_scaling)
    dq = dq * m if m != 1.0 else dq  # (B, nh/t, Ta, dq): the scores' YaRN factor, as in the forward

    # the shared rotary key gathers its gradient from every head: this rank's here, the others' in f
    dk_rope = xp.sum(dk[..., dn:], axis=1, keepdims=True)  # (B, 1, Ta, dr)
    dk_rope = mla_rope_backward(dk_rope, c_rk, interleave)  # (B, 1, Ta, dr)
    dk_rope = lay.pair.enter_backward(dk_rope[:, 0, ...], lay.tp, P + "k_rope:bwd")  # (B, Tl, dr)
    dkv = merge_heads(xp.concat([dk[..., :dn], dv], axis=-1))  # (B, Ta, nh/t (dn + dv))
    dlatent, w_kvb = column_parallel_linear_backward([dkv], c_kvb, lay, [(P + "kv_b_proj.weight", None)],
                                                     transposed=True)  # (B, Tl, rkv), summed over tp
    dlatent, g_kvn = rmsnorm_backward(dlatent, c_kvn)  # (B, Tl, rkv)
    da, g_kva = linear_t_backward(xp.concat([dlatent, dk_rope], axis=-1), c_kva)  # (B, Tl, C)
    down = (P + "kv_a_layernorm.weight", P + "kv_a_proj_with_mqa.weight")
    work = [w_o, w_kvb, (given, (down, g_kvn, g_kva))]

    dq_rope = mla_rope_backward(dq[..., dn:], c_rq, interleave)  # (B, nh/t, Ta, dr)
    dq = merge_heads(xp.concat([dq[..., :dn], dq_rope], axis=-1))  # (B, Ta, nh/t dq)
    dq_in, w_q = column_parallel_linear_backward([dq], c_q, lay, [(P + q_name + ".weight", None)],
                                                 transposed=True)  # (B, Tl, rq or C), summed over tp
    work.append(w_q)
    if c_qa is None:
        return da + dq_in, work
    dcq, g_qn = rmsnorm_backward(dq_in, c_qn)  # (B, Tl, rq)
    da_q, g_qa = linear_t_backward(dcq, c_qa)  # (B, Tl, C)
    work.append((given, ((P + "q_a_layernorm.weight", P + "q_a_proj.weight"), g_qn, g_qa)))
    return da + da_q, work
