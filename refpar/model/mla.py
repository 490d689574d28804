"""Multi-head latent attention (MLA: DeepSeek-V2, DeepSeek-AI 2024, section 2.1; DeepSeek-V3, Liu et
al. 2024, section 2.1.1) as a forward/backward pair written by hand, exactly Hugging Face's
DeepseekV3Attention (transformers/models/deepseek_v3/modeling_deepseek_v3.py, eager attention).

    python -m pytest tests/test_deepseek_hf.py      # against DeepseekV3ForCausalLM, float64

Legend: B batch, T sequence, C channels, nh heads, dn qk_nope_head_dim, dr qk_rope_head_dim,
dq = dn + dr a head's query and key width, dv v_head_dim, rq q_lora_rank, rkv kv_lora_rank.

    cq      = q_a_layernorm(x @ q_a_proj.T)                     (B, T, rq)   (V2 eq. 37)
    q       = cq @ q_b_proj.T, per head [q_nope, q_rope]         (B, nh, T, dn + dr)  (eq. 38-39)
    [ckv, k_rope] = x @ kv_a_proj_with_mqa.T                     (B, T, rkv), (B, T, dr)  (eq. 9, 43)
    [k_nope, v]   = kv_a_layernorm(ckv) @ kv_b_proj.T, per head   (B, nh, T, dn), (B, nh, T, dv)
    q_rope, k_rope rotated by position; the one k_rope is every head's ("decoupled" RoPE, eq. 43-44)
    out     = o_proj(softmax([q_nope, q_rope] . [k_nope, k_rope] / sqrt(dq)) v)   (eq. 45-47)

Without q_lora_rank the query is x @ q_proj.T (DeepSeek-V2-Lite). What a KV cache keeps per token is
ckv and k_rope, rkv + dr numbers, where multi-head attention keeps 2 nh dq.

Conventions, so that the numbers are Hugging Face's (and DeepSeek's reference code's):
- The softmax scale is 1 / sqrt(dn + dr). With `rope_scaling` (YaRN, refpar/model/rope_yarn.py) the
  rotary frequencies are YaRN's, cos and sin are scaled by its attention factor and the softmax scale
  by get_mscale(factor, mscale_all_dim)^2, as HF's DeepseekV3RotaryEmbedding and yarn_apply_mscale do.
- The two latent RMSNorms take epsilon 1e-6 whatever rms_norm_eps is: HF builds them as
  DeepseekV3RMSNorm(rank), whose default that is.
- With `rope_interleave` (HF's default, DeepSeek's checkpoints) the rotary channels pair as (0, 1),
  (2, 3), ...: HF's apply_rotary_pos_emb_interleave, which equals rotating [x[0::2], x[1::2]] in
  rotate_half's pairs (i, i + dr/2), and that is how it is computed here (its output de-interleaved,
  as HF's). Without it, rotate_half's pairs on x as it is, Llama's RoPE.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace

from refpar.model.attention import CacheShape, attention_backward, attention_forward
from refpar.model.gpt import merge_heads, split_heads
from refpar.model.llama_layers import (
    linear_t_backward,
    linear_t_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    rope_cos_sin,
    rope_forward,
)
from refpar.model.rope_yarn import softmax_factor, yarn_cos_sin

LATENT_NORM_EPS = 1e-6  # HF's DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep


def mla_param_shapes(config, prefix: str) -> dict[str, tuple[int, ...]]:
    """The attention's parameters by full name (`prefix` "model.layers.{i}.self_attn."), in the order
    of HF's state dict, torch.nn.Linear's layout (out, in)."""
    C, nh = config.n_embd, config.n_head
    dn, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rkv = config.kv_lora_rank
    if config.q_lora_rank is None:
        shapes = {prefix + "q_proj.weight": (nh * (dn + dr), C)}
    else:
        rq = config.q_lora_rank
        shapes = {prefix + "q_a_proj.weight": (rq, C), prefix + "q_a_layernorm.weight": (rq,),
                  prefix + "q_b_proj.weight": (nh * (dn + dr), rq)}
    shapes.update({prefix + "kv_a_proj_with_mqa.weight": (rkv + dr, C),
                   prefix + "kv_a_layernorm.weight": (rkv,),
                   prefix + "kv_b_proj.weight": (nh * (dn + dv), rkv),
                   prefix + "o_proj.weight": (C, nh * dv)})
    return shapes


def latent_cache(config) -> CacheShape:
    """What MLA's KV cache keeps per token per layer (DeepSeek-V2, section 2.1.2): the latent c_kv after
    kv_a_layernorm and the rotated shared key k_rope, one entry of rkv + dr numbers for all heads,
    whole on every tp rank; the heads' keys and values are absorbed from it (refpar/serving/
    latent_attention.py). Multi-head attention with MLA's head widths would cache every head's key
    (dn + dr) and value (dv): 2 nh dh when the widths are equal (DeepSeek-V2, Table 1)."""
    rkv, dr = config.kv_lora_rank, config.qk_rope_head_dim
    return CacheShape(1, rkv + dr, 0, rkv, split_by_tp=False,
                      multi_head=config.n_head * (config.qk_nope_head_dim + dr + config.v_head_dim))


# ---------------------------------------------------------------------------------------- rope
def mla_cos_sin(positions, config, like):
    """cos and sin (T, dr) of the rotary channels at `positions` (T,): plain RoPE, or YaRN's with
    config.rope_scaling."""
    if config.rope_scaling is None:
        return rope_cos_sin(positions, config.qk_rope_head_dim, config.rope_theta, like)
    return yarn_cos_sin(positions, config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, like)


def mla_softmax_scale(config) -> float:
    """1/sqrt(dn + dr), times YaRN's get_mscale(factor, mscale_all_dim)^2 with rope_scaling."""
    return softmax_factor(config.rope_scaling) / math.sqrt(config.qk_nope_head_dim + config.qk_rope_head_dim)


def mla_rope_forward(x, cos, sin, interleave: bool):
    """x (B, n, T, dr) rotated by position, with cos and sin (T, dr) from rope_cos_sin; `interleave`
    as in the module docstring."""
    if interleave:
        xp = array_namespace(x)
        x = xp.concat([x[..., 0::2], x[..., 1::2]], axis=-1)  # (B, n, T, dr): pairs (i, i + dr/2)
    return rope_forward(x, cos, sin)  # (B, n, T, dr)


def mla_rope_backward(dout, cache, interleave: bool):
    """-> dx (B, n, T, dr): rope's backward, then the channels put back in their interleaved places."""
    dx = rope_backward(dout, cache)  # (B, n, T, dr)
    if not interleave:
        return dx
    xp = array_namespace(dx)
    half = dx.shape[-1] // 2
    return xp.reshape(xp.stack([dx[..., :half], dx[..., half:]], axis=-1), dx.shape)  # (B, n, T, dr)


# --------------------------------------------------------------------------------------- layer
def mla_forward(x, params, prefix: str, config, positions):
    """x (B, T, C) after the block's input_layernorm, positions (T,) global -> (out (B, T, C), cache).
    `positions` set both the rotary angles and the causal mask."""
    xp = array_namespace(x)
    P, nh = params, config.n_head
    dn, dr, rkv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    B, T, _ = x.shape
    cos, sin = mla_cos_sin(positions, config, x)  # (T, dr) each

    if config.q_lora_rank is None:
        q, c_q = linear_t_forward(x, P[prefix + "q_proj.weight"])  # (B, T, nh * dq)
        c_qa = c_qn = None
    else:
        cq, c_qa = linear_t_forward(x, P[prefix + "q_a_proj.weight"])  # (B, T, rq)
        cq, c_qn = rmsnorm_forward(cq, P[prefix + "q_a_layernorm.weight"], LATENT_NORM_EPS)  # (B, T, rq)
        q, c_q = linear_t_forward(cq, P[prefix + "q_b_proj.weight"])  # (B, T, nh * dq)
    q = split_heads(q, nh)  # (B, nh, T, dq)
    q_rope, c_rq = mla_rope_forward(q[..., dn:], cos, sin, config.rope_interleave)  # (B, nh, T, dr)
    q = xp.concat([q[..., :dn], q_rope], axis=-1)  # (B, nh, T, dq)

    ckv, c_kva = linear_t_forward(x, P[prefix + "kv_a_proj_with_mqa.weight"])  # (B, T, rkv + dr)
    k_rope = xp.expand_dims(ckv[..., rkv:], axis=1)  # (B, 1, T, dr): one for all heads
    k_rope, c_rk = mla_rope_forward(k_rope, cos, sin, config.rope_interleave)  # (B, 1, T, dr)
    latent, c_kvn = rmsnorm_forward(ckv[..., :rkv], P[prefix + "kv_a_layernorm.weight"],
                                    LATENT_NORM_EPS)  # (B, T, rkv)
    kv, c_kvb = linear_t_forward(latent, P[prefix + "kv_b_proj.weight"])  # (B, T, nh * (dn + dv))
    kv = split_heads(kv, nh)  # (B, nh, T, dn + dv)
    k = xp.concat([kv[..., :dn], xp.broadcast_to(k_rope, (B, nh, T, dr))], axis=-1)  # (B, nh, T, dq)
    v = kv[..., dn:]  # (B, nh, T, dv)

    o, c_att = attention_forward(q, k, v, positions, positions,
                                 scale=mla_softmax_scale(config))  # (B, nh, T, dv)
    out, c_o = linear_t_forward(merge_heads(o), P[prefix + "o_proj.weight"])  # (B, T, C)
    cache = (prefix, nh, dn, config.rope_interleave, c_qa, c_qn, c_q, c_rq, c_kva, c_rk, c_kvn, c_kvb,
             c_att, c_o)
    return out, cache


def mla_backward(dout, cache):
    """dout (B, T, C) -> (dx (B, T, C), {name: grad} for the attention's parameters)."""
    prefix, nh, dn, interleave, c_qa, c_qn, c_q, c_rq, c_kva, c_rk, c_kvn, c_kvb, c_att, c_o = cache
    xp = array_namespace(dout)
    g = {}

    do, g[prefix + "o_proj.weight"] = linear_t_backward(dout, c_o)  # (B, T, nh * dv)
    dq, dk, dv = attention_backward(split_heads(do, nh), c_att)  # (B, nh, T, dq|dq|dv)

    # the shared rotary key gathers every head's gradient
    dk_rope = xp.sum(dk[..., dn:], axis=1, keepdims=True)  # (B, 1, T, dr)
    dk_rope = mla_rope_backward(dk_rope, c_rk, interleave)  # (B, 1, T, dr)
    dkv = merge_heads(xp.concat([dk[..., :dn], dv], axis=-1))  # (B, T, nh * (dn + dv))
    dlatent, g[prefix + "kv_b_proj.weight"] = linear_t_backward(dkv, c_kvb)  # (B, T, rkv)
    dlatent, g[prefix + "kv_a_layernorm.weight"] = rmsnorm_backward(dlatent, c_kvn)  # (B, T, rkv)
    dckv = xp.concat([dlatent, dk_rope[:, 0, ...]], axis=-1)  # (B, T, rkv + dr)
    dx, g[prefix + "kv_a_proj_with_mqa.weight"] = linear_t_backward(dckv, c_kva)  # (B, T, C)

    dq_rope = mla_rope_backward(dq[..., dn:], c_rq, interleave)  # (B, nh, T, dr)
    dq = merge_heads(xp.concat([dq[..., :dn], dq_rope], axis=-1))  # (B, T, nh * dq)
    if c_qa is None:
        dx_q, g[prefix + "q_proj.weight"] = linear_t_backward(dq, c_q)  # (B, T, C)
    else:
        dcq, g[prefix + "q_b_proj.weight"] = linear_t_backward(dq, c_q)  # (B, T, rq)
        dcq, g[prefix + "q_a_layernorm.weight"] = rmsnorm_backward(dcq, c_qn)  # (B, T, rq)
        dx_q, g[prefix + "q_a_proj.weight"] = linear_t_backward(dcq, c_qa)  # (B, T, C)
    return dx + dx_q, g
