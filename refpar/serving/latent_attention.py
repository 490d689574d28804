"""Multi-head latent attention served from its compressed cache, the up-projections absorbed
(DeepSeek-V2, DeepSeek-AI 2024, section 2.1.2 and appendix C): DeepSeek-V3's attention core in
refpar/serving/batching.py's passes.

    python -m refpar generate --model deepseek-tiny --check
    mpiexec -n 2 python -m refpar generate --model deepseek-tiny --mesh tp=2 --check
    python -m pytest tests/test_serving_mla.py

Legend: N new tokens of a pass (all requests' segments side by side), Tr the positions of a request
this rank holds, nh query heads, dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim,
rkv kv_lora_rank, C channels.

The cache keeps per token per layer one entry e = [c_kv, k_rope] (rkv + dr numbers,
refpar/model/mla.py's `latent_cache`): the latent after kv_a_layernorm and the rotated key every
head shares. Training's MLA (mla.py's mla_forward) expands the latent into every head's key and
value, k_nope = c_kv W_UK^T and v = c_kv W_UV^T, with kv_b_proj's rows per head [W_UK (dn, rkv);
W_UV (dv, rkv)]. Serving never does: by associativity

    q_nope . k_nope = (q_nope W_UK) . c_kv          the key's up-projection absorbed into the query
    sum_j p_j v_j   = (sum_j p_j c_kv,j) W_UV^T     the value's into the output, before o_proj

so a head's query is [q_nope W_UK, q_rope] (rkv + dr), it attends to the cached entries themselves,
and its output (rkv) is taken to dv by W_UV: the cached tokens are read, never expanded, and the
numbers equal mla_forward's up to rounding (the softmax scale stays the heads' 1/sqrt(dn + dr), and
YaRN's rope_scaling applies as in mla_forward: mla_cos_sin, mla_softmax_scale).
Under tp a rank keeps the whole latent (every head reads it) and computes its own heads: its rows
of q_b_proj and kv_b_proj (W_UK and W_UV of its heads), its columns of o_proj, whose partial sums
one g all-reduce adds, as the MLP's (`LatentAttention.block`).
Under cp the partial outputs are merged in the latent space (nh, N, rkv), before W_UV, by
kv_cache.merge_over_cp: W_UV is linear, so merging before or after it is the same.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from refpar.model import deepseek
from refpar.model.gpt import merge_heads, split_heads
from refpar.model.llama_layers import rmsnorm_forward, swiglu_mlp_forward
from refpar.model.mla import LATENT_NORM_EPS, mla_cos_sin, mla_rope_forward, mla_softmax_scale
from refpar.model.moe import MoELayer
from refpar.serving.kv_cache import merge_over_cp, partial_attention


def mla_query(x, P, prefix: str, config, cos, sin, nh=None):
    """x (1, N, C) -> q (nh, N, dn + dr): the heads' queries (the rank's nh of q_b_proj's rows under
    tp), the rotary part rotated (mla_forward's)."""
    nh = config.n_head if nh is None else nh
    if config.q_lora_rank is None:
        q = x @ P[prefix + "q_proj.weight"].T  # (1, N, nh * dq)
    else:
        cq = x @ P[prefix + "q_a_proj.weight"].T  # (1, N, rq)
        cq, _ = rmsnorm_forward(cq, P[prefix + "q_a_layernorm.weight"], LATENT_NORM_EPS)  # (1, N, rq)
        q = cq @ P[prefix + "q_b_proj.weight"].T  # (1, N, nh * dq)
    q = split_heads(q, nh)  # (1, nh, N, dq)
    dn = config.qk_nope_head_dim
    q_rope, _ = mla_rope_forward(q[..., dn:], cos, sin, config.rope_interleave)  # (1, nh, N, dr)
    return np.concatenate([q[0, ..., :dn], q_rope[0]], axis=-1)  # (nh, N, dq)


def latent_entry(x, P, prefix: str, config, cos, sin):
    """x (1, N, C) -> e (1, N, rkv + dr): what the cache keeps of each token, [kv_a_layernorm(c_kv),
    rotated k_rope] (mla_forward's latent and shared key)."""
    rkv = config.kv_lora_rank
    ckv = x @ P[prefix + "kv_a_proj_with_mqa.weight"].T  # (1, N, rkv + dr)
    k_rope, _ = mla_rope_forward(ckv[:, None, :, rkv:], cos, sin, config.rope_interleave)  # (1, 1, N, dr)
    latent, _ = rmsnorm_forward(ckv[..., :rkv], P[prefix + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
    return np.concatenate([latent, k_rope[:, 0]], axis=-1)  # (1, N, rkv + dr)


class LatentAttention:
    """The attention of a decode or prefill pass for DeepSeek-V3 (batching.py's `lay.attention`):
    appends each request segment's entries to the cache (kv_cache.KVCache or paged.PagedKVCache, one
    head of width rkv + dr and no value), then attends the segment's absorbed queries to everything
    the request has cached. `segments` are (rid, start, stop) along N."""

    def __init__(self, cache, segments, cp=None):
        self.cache, self.segments, self.cp = cache, segments, cp

    def block(self, x, params, layer: int, lay):
        """x (1, N, C) -> (1, N, C): DeepSeek-V3's block (model/deepseek.py) with this attention.
        Under tp a rank computes its heads' attention and its columns of the MLP (its t-th of every
        routed expert and, on tp rank 0 alone, the shared experts, which every rank holds whole):
        each a partial sum over the tp group, added by one g all-reduce, o_proj's and the MLP's."""
        def attention(a, P, prefix, config, positions):
            return self.forward(a, P, prefix, config, positions, layer, lay), None

        if lay.tp is None:
            return deepseek.block_forward(x, params, layer, lay.config, positions=lay.region_pos,
                                          attention=attention)[0]
        cfg, p = lay.config, f"model.layers.{layer}."
        a, _ = rmsnorm_forward(x, params[p + "input_layernorm.weight"], cfg.norm_eps)  # (1, N, C)
        x1 = x + attention(a, params, p + "self_attn.", cfg, lay.region_pos)[0]  # (1, N, C)
        m, _ = rmsnorm_forward(x1, params[p + "post_attention_layernorm.weight"], cfg.norm_eps)  # (1, N, C)
        if deepseek.is_moe(layer, cfg):
            own = cfg if lay.tp.rank == 0 else replace(cfg, moe_shared_experts=0)
            d, _ = MoELayer(deepseek.MOE).forward(m, params, layer, own)  # (1, N, C), partial over tp
        else:
            d, _ = swiglu_mlp_forward(m, params[p + "mlp.gate_proj.weight"], params[p + "mlp.up_proj.weight"],
                                      params[p + "mlp.down_proj.weight"])  # (1, N, C), partial over tp
        return x1 + lay.pair.leave(d, lay.tp, p + "mlp:fwd")  # (1, N, C): g

    def forward(self, x, P, prefix: str, config, positions, layer: int, lay=None):
        """x (1, N, C) after input_layernorm, positions (N,) global -> (1, N, C): under tp (`lay.tp`)
        the rank's heads, its rows of kv_b_proj and columns of o_proj, summed by o_proj's g."""
        tp = lay is not None and lay.tp is not None
        nh = lay.heads[1] - lay.heads[0] if tp else config.n_head
        dn, rkv = config.qk_nope_head_dim, config.kv_lora_rank
        cos, sin = mla_cos_sin(positions, config, x)  # (N, dr) each: YaRN's with rope_scaling
        q = mla_query(x, P, prefix, config, cos, sin, nh)  # (nh, N, dn + dr)
        e = latent_entry(x, P, prefix, config, cos, sin)  # (1, N, rkv + dr)
        w_kvb = np.reshape(P[prefix + "kv_b_proj.weight"], (nh, dn + config.v_head_dim, rkv))
        w_uk, w_uv = w_kvb[:, :dn], w_kvb[:, dn:]  # (nh, dn, rkv), (nh, dv, rkv)
        q = np.concatenate([q[..., :dn] @ w_uk, q[..., dn:]], axis=-1)  # (nh, N, rkv + dr): W_UK absorbed
        scale = mla_softmax_scale(config)  # the heads' own 1/sqrt(dn + dr) (YaRN's), not 1/sqrt(rkv + dr)
        outs, lses = [], []
        for rid, a, b in self.segments:
            self.cache.append(rid, layer, e[:, a:b], e[:, a:b, :0], positions[a:b])  # no value: it is c_kv
            E, _, k_pos = self.cache.get(rid, layer, e, e[..., :0])  # (1, Tr, rkv + dr)
            o, lse = partial_attention(q[:, a:b], E, E[..., :rkv], positions[a:b], k_pos, scale)
            outs.append(o)  # (nh, n, rkv): the attended latents
            lses.append(lse)  # (nh, n, 1)
        o = np.concatenate(outs, axis=1)  # (nh, N, rkv)
        if self.cp is not None:
            o = merge_over_cp(self.cp, o, np.concatenate(lses, axis=1), layer)  # (nh, N, rkv)
        o = o @ np.swapaxes(w_uv, 1, 2)  # (nh, N, dv): W_UV absorbed into the output
        out = merge_heads(o[None]) @ P[prefix + "o_proj.weight"].T  # (1, N, C), partial over tp
        return lay.pair.leave(out, lay.tp, prefix + "o_proj:fwd") if tp else out  # g
