"""Causal scaled dot-product attention as a forward/backward pair.

Legend: B batch, nh heads, Tq query positions, Tk key positions, hs head size.
Mixed precision: both run under `fp32_compute` (16-bit q, k, v in; fp32 scores, softmax and
products; 16-bit outputs and cached probabilities out).
Causality is by global position (a key is visible when k_pos <= q_pos), not by index, so a
query or key shard (context parallelism) passes its own positions and gets the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from array_api_compat import array_namespace, device

from refpar.model.gemm import matmul
from refpar.model.layers import dropout_forward
from refpar.precision import fp32_compute


@dataclass(frozen=True)
class CacheShape:
    """What a KV cache keeps of one token in one layer, a family's answer (refpar.model.kv_cache_shape):
    `heads` cached heads, each `key` + `value` numbers. Multi-head and grouped-query attention keep
    each kv head's K and V; multi-head latent attention (refpar/model/mla.py) keeps one entry, the
    latent and the shared rotary key [c_kv, k_rope], that every query head reads its key and its value
    from (value 0: the value is the entry's first `attended` numbers, vLLM's MLA cache layout)."""

    heads: int  # cached heads: GPT-2's n_head, Llama's n_kv_head, MLA's 1
    key: int  # numbers of a cached head's key: hs; MLA kv_lora_rank + qk_rope_head_dim
    value: int  # numbers of its value: hs; MLA 0
    attended: int  # width of a query head's attention output before o_proj: hs; MLA kv_lora_rank
    split_by_tp: bool  # tp splits the cached heads; MLA's entry is whole on every tp rank (replicated)
    multi_head: int  # numbers per token multi-head attention of the same query heads would keep: 2 nh hs

    @property
    def latent(self) -> bool:
        """Keys and values are both read from one cached entry per token (MLA), none is cached apart."""
        return self.value == 0

    @property
    def per_token(self) -> int:
        """Numbers per token per layer, all heads."""
        return self.heads * (self.key + self.value)


def multi_head_cache(kv_heads: int, head_size: int, n_head: int) -> CacheShape:
    """K and V of each of `kv_heads` heads of `head_size`, which tp splits (GPT-2, Llama)."""
    return CacheShape(kv_heads, head_size, head_size, head_size, split_by_tp=True,
                      multi_head=2 * n_head * head_size)


@fp32_compute
def attention_forward(q, k, v, q_pos, k_pos, keep=None, p=0.0, scale=None):
    """q (B, nh, Tq, hs), k and v (B, nh, Tk, hs), positions (Tq,) and (Tk,); `keep` is the dropout
    mask of the probabilities, broadcastable to (B, nh, Tq, Tk), or None; the scores' `scale` is
    1/sqrt(hs) unless given (YaRN's multiplies it: model/rope_yarn.py)."""
    xp = array_namespace(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = xp.reshape(k_pos, (1, -1)) <= xp.reshape(q_pos, (-1, 1))  # (Tq, Tk)
    # In-place updates of fresh arrays: the (B, nh, Tq, Tk) tensors dominate this layer's time.
    scores = matmul(q, xp.matrix_transpose(k))  # (B, nh, Tq, Tk)
    scores *= scale
    # The causal mask added in place (x + 0 is x, x + -inf is -inf): `where` would write a new array.
    mask = xp.where(visible, xp.zeros(visible.shape, dtype=scores.dtype, device=device(scores)), -math.inf)
    scores += mask  # (B, nh, Tq, Tk)
    scores -= xp.max(scores, axis=-1, keepdims=True)  # max 0 per row: exp cannot overflow
    att = xp.exp(scores)  # (B, nh, Tq, Tk)
    att /= xp.sum(att, axis=-1, keepdims=True)  # softmax
    att_drop, drop_cache = dropout_forward(att, keep, p)  # (B, nh, Tq, Tk)
    out = matmul(att_drop, v)  # (B, nh, Tq, hs)
    return out, (q, k, v, att, att_drop, drop_cache, scale)


@fp32_compute
def attention_backward(dout, cache):
    q, k, v, att, att_drop, drop_cache, scale = cache
    xp = array_namespace(dout, q)
    dv = matmul(xp.matrix_transpose(att_drop), dout)  # (B, nh, Tk, hs)
    datt = matmul(dout, xp.matrix_transpose(v))  # (B, nh, Tq, Tk), fresh: updated in place below
    if drop_cache is not None:
        datt *= drop_cache  # dropout backward
    # softmax backward: dscores = att * (datt - sum(datt * att)); masked entries have att = 0.
    datt -= xp.expand_dims(xp.vecdot(datt, att, axis=-1), axis=-1)  # minus (B, nh, Tq, 1)
    datt *= att
    datt *= scale
    dscores = datt  # (B, nh, Tq, Tk)
    dq = matmul(dscores, k)  # (B, nh, Tq, hs)
    dk = matmul(xp.matrix_transpose(dscores), q)  # (B, nh, Tk, hs)
    return dq, dk, dv
