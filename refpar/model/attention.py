"""Causal scaled dot-product attention as a forward/backward pair.

Legend: B batch, nh heads, Tq query positions, Tk key positions, hs head size.
Causality is by global position (a key is visible when k_pos <= q_pos), not by index, so a
query or key shard (context parallelism) passes its own positions and gets the same numbers.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace

from refpar.model.layers import dropout_backward, dropout_forward


def attention_forward(q, k, v, q_pos, k_pos, keep=None, p=0.0):
    """q (B, nh, Tq, hs), k and v (B, nh, Tk, hs), positions (Tq,) and (Tk,); `keep` is the dropout
    mask of the probabilities, broadcastable to (B, nh, Tq, Tk), or None."""
    xp = array_namespace(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ xp.matrix_transpose(k)) * scale  # (B, nh, Tq, Tk)
    visible = xp.reshape(k_pos, (1, -1)) <= xp.reshape(q_pos, (-1, 1))  # (Tq, Tk)
    scores = xp.where(visible, scores, -math.inf)  # (B, nh, Tq, Tk)
    e = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))  # (B, nh, Tq, Tk)
    att = e / xp.sum(e, axis=-1, keepdims=True)  # (B, nh, Tq, Tk) softmax
    att_drop, drop_cache = dropout_forward(att, keep, p)  # (B, nh, Tq, Tk)
    out = att_drop @ v  # (B, nh, Tq, hs)
    return out, (q, k, v, att, att_drop, drop_cache, scale)


def attention_backward(dout, cache):
    q, k, v, att, att_drop, drop_cache, scale = cache
    xp = array_namespace(dout, q)
    dv = xp.matrix_transpose(att_drop) @ dout  # (B, nh, Tk, hs)
    datt = dropout_backward(dout @ xp.matrix_transpose(v), drop_cache)  # (B, nh, Tq, Tk)
    # softmax backward: dscores = att * (datt - sum(datt * att)); masked entries have att = 0.
    dscores = att * (datt - xp.sum(datt * att, axis=-1, keepdims=True))  # (B, nh, Tq, Tk)
    dscores = dscores * scale
    dq = dscores @ k  # (B, nh, Tq, hs)
    dk = xp.matrix_transpose(dscores) @ q  # (B, nh, Tk, hs)
    return dq, dk, dv
