"""Llama's layers as forward/backward pairs, written by hand (no autograd): the matmul in the layout
Hugging Face stores Llama's weights in, RMSNorm, rotary position embedding, SwiGLU, grouped-query
attention, and the token embedding without a position table.

Legend: B batch, T sequence, C channels, nh query heads, nkv key/value heads, g = nh // nkv query
heads per kv head, hs head size, F the SwiGLU width (intermediate_size), V vocab, N = B*T tokens,
`...` any leading dims. `x_forward(...) -> (out, cache)`; `x_backward(dout, cache) -> (dinputs...,
dparams...)`, as in refpar/model/layers.py, whose conventions (array-API namespaces, `fp32_compute`
for mixed precision) hold here too.

Each formula is the one of Hugging Face's transformers/models/llama/modeling_llama.py, so that its
numbers can be checked against LlamaForCausalLM: LlamaRMSNorm, LlamaRotaryEmbedding with
rotate_half and apply_rotary_pos_emb, LlamaMLP with silu, repeat_kv's grouping of query heads.
"""

from __future__ import annotations

from array_api_compat import array_namespace, device

from refpar.model.attention import attention_backward, attention_forward
from refpar.model.layers import as_like, linear_backward, linear_forward, scatter_add_rows
from refpar.precision import fp32_compute


# -------------------------------------------------------------------------------------- linear
def linear_t_forward(x, w):
    """out = x @ w.T with w (out, in): torch.nn.Linear's layout without bias, in which Hugging Face
    stores every Llama matrix. The Conv1D pair of layers.py on w's transpose (a view, no copy)."""
    xp = array_namespace(w)
    return linear_forward(x, xp.matrix_transpose(w), None)


def linear_t_backward(dout, cache):
    """-> (dx (..., in), dw (out, in)): the weight's gradient in the weight's own layout."""
    dx, dw_in_out, _ = linear_backward(dout, cache)
    return dx, array_namespace(dw_in_out).matrix_transpose(dw_in_out)


# ------------------------------------------------------------------------------------- rmsnorm
@fp32_compute
def rmsnorm_forward(x, w, eps):
    """x / sqrt(mean(x^2) + eps) * w over the last axis (Zhang & Sennrich 2019): LayerNorm without
    the mean removed and without a bias."""
    xp = array_namespace(x, w)
    rstd = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)  # (..., 1)
    xhat = x * rstd  # (..., C)
    return xhat * w, (xhat, rstd, w)


@fp32_compute
def rmsnorm_backward(dout, cache):
    xhat, rstd, w = cache
    xp = array_namespace(dout, w)
    dw = xp.sum(dout * xhat, axis=tuple(range(dout.ndim - 1)))  # (C,)
    dxhat = dout * w  # (..., C)
    # d/dx of x * rstd(x): rstd falls as |x| grows, which removes dxhat's projection on xhat.
    dx = (dxhat - xhat * xp.mean(dxhat * xhat, axis=-1, keepdims=True)) * rstd  # (..., C)
    return dx, dw


# ---------------------------------------------------------------------------------------- rope
def rope_cos_sin(positions, head_size: int, theta: float, like):
    """cos and sin (T, hs) of the angles positions[t] * theta^(-2i / hs), i < hs/2 (Su et al. 2021),
    each angle twice: [angles, angles], Hugging Face's `cat((freqs, freqs))`, which pairs channel i
    with channel i + hs/2 (`rotate_half`). `positions` (T,) are global, so a sequence or context
    shard passes its own and rotates by where its tokens are in the sequence. The angles are computed
    in float64 (HF computes them in float32) and the results rounded once to `like`'s dtype."""
    xp = array_namespace(like)
    pos = xp.astype(as_like(positions, like), xp.float64)  # (T,)
    exponent = xp.arange(0, head_size, 2, dtype=xp.float64, device=device(like)) / head_size  # (hs/2,)
    inv_freq = 1.0 / theta**exponent  # (hs/2,)
    angles = xp.reshape(pos, (-1, 1)) * xp.reshape(inv_freq, (1, -1))  # (T, hs/2)
    angles = xp.concat([angles, angles], axis=-1)  # (T, hs)
    return xp.astype(xp.cos(angles), like.dtype), xp.astype(xp.sin(angles), like.dtype)


def rotate_half(x):
    """(..., hs) -> (..., hs): [x1, x2] -> [-x2, x1], the quarter turn of each (i, i + hs/2) pair."""
    xp = array_namespace(x)
    half = x.shape[-1] // 2
    return xp.concat([-x[..., half:], x[..., :half]], axis=-1)


@fp32_compute
def rope_forward(x, cos, sin):
    """x (B, n, T, hs) rotated by position: x * cos + rotate_half(x) * sin, with cos and sin (T, hs)
    from `rope_cos_sin` for x's positions (HF's apply_rotary_pos_emb)."""
    return x * cos + rotate_half(x) * sin, (cos, sin)  # (B, n, T, hs)


@fp32_compute
def rope_backward(dout, cache):
    cos, sin = cache
    # rotate_half is the matrix [[0, -I], [I, 0]], whose transpose is -rotate_half.
    return dout * cos - rotate_half(dout * sin)  # (B, n, T, hs)


# -------------------------------------------------------------------------------------- swiglu
def _sigmoid(a):
    """(1 + tanh(a / 2)) / 2: the logistic function in a form that cannot overflow."""
    xp = array_namespace(a)
    s = xp.tanh(a * 0.5)
    s += 1.0
    s *= 0.5
    return s


@fp32_compute
def swiglu_forward(gate, up):
    """silu(gate) * up (Shazeer 2020), silu(a) = a * sigmoid(a). The cache keeps the two inputs only;
    backward recomputes the sigmoid, one elementwise pass."""
    return gate * _sigmoid(gate) * up, (gate, up)  # (..., F)


@fp32_compute
def swiglu_backward(dout, cache):
    """-> (dgate, dup); d silu / da = sigmoid(a) (1 + a (1 - sigmoid(a)))."""
    gate, up = cache
    s = _sigmoid(gate)  # (..., F)
    dup = dout * gate * s  # (..., F)
    dgate = dout * up * s * (1.0 + gate * (1.0 - s))  # (..., F)
    return dgate, dup


def swiglu_mlp_forward(x, w_gate, w_up, w_down):
    """x (..., C) -> (..., C): down(silu(gate(x)) * up(x)), weights (F, C), (F, C), (C, F) in
    torch.nn.Linear's layout: Llama's MLP and each of Mixtral's experts (w1, w3, w2)."""
    g, c_gate = linear_t_forward(x, w_gate)  # (..., F)
    u, c_up = linear_t_forward(x, w_up)  # (..., F)
    h, c_act = swiglu_forward(g, u)  # (..., F)
    out, c_down = linear_t_forward(h, w_down)  # (..., C)
    return out, (c_gate, c_up, c_act, c_down)


def swiglu_mlp_backward(dout, cache):
    """-> (dx (..., C), dw_gate (F, C), dw_up (F, C), dw_down (C, F))."""
    c_gate, c_up, c_act, c_down = cache
    dh, dw_down = linear_t_backward(dout, c_down)  # (..., F)
    dg, du = swiglu_backward(dh, c_act)  # (..., F) each
    dx_gate, dw_gate = linear_t_backward(dg, c_gate)  # (..., C)
    dx_up, dw_up = linear_t_backward(du, c_up)  # (..., C)
    return dx_gate + dx_up, dw_gate, dw_up, dw_down


# ----------------------------------------------------------------------- grouped-query attention
def gqa_attention_forward(q, k, v, q_pos, k_pos):
    """Causal attention of q (B, nh, Tq, hs) over k and v (B, nkv, Tk, hs), nh a multiple of nkv
    (Ainslie et al. 2023): query head h reads kv head h // g, HF's repeat_kv order. The g query heads
    of a kv head are one more batch axis of refpar/model/attention.py's attention, against which the
    kv head broadcasts: no kv head is copied. A tensor-parallel rank passes its own query heads with
    the kv heads they read (one replicated kv head when it holds fewer query heads than g)."""
    xp = array_namespace(q, k, v)
    B, nh, Tq, hs = q.shape
    nkv = k.shape[1]
    qg = xp.reshape(q, (B, nkv, nh // nkv, Tq, hs))  # (B, nkv, g, Tq, hs)
    kg = xp.expand_dims(k, axis=2)  # (B, nkv, 1, Tk, hs)
    vg = xp.expand_dims(v, axis=2)  # (B, nkv, 1, Tk, hs)
    out, c_sdpa = attention_forward(qg, kg, vg, q_pos, k_pos)  # (B, nkv, g, Tq, hs)
    return xp.reshape(out, q.shape), c_sdpa  # (B, nh, Tq, hs)


def gqa_attention_backward(dout, cache):
    """-> (dq (B, nh, Tq, hs), dk, dv (B, nkv, Tk, hs)): a kv head's gradient sums over the g query
    heads that read it."""
    xp = array_namespace(dout)
    B, nh, Tq, hs = dout.shape
    nkv = cache[1].shape[1]  # the cached kg (B, nkv, 1, Tk, hs)
    dqg, dkg, dvg = attention_backward(xp.reshape(dout, (B, nkv, nh // nkv, Tq, hs)), cache)
    dk = xp.sum(dkg, axis=2)  # (B, nkv, Tk, hs)
    dv = xp.sum(dvg, axis=2)  # (B, nkv, Tk, hs)
    return xp.reshape(dqg, dout.shape), dk, dv


# ----------------------------------------------------------------------------- token embedding
@fp32_compute
def token_embedding_forward(tokens, w):
    """tokens (B, T) -> w[tokens] (B, T, C): positions enter later, through RoPE."""
    xp = array_namespace(w)
    tokens = as_like(tokens, w)  # from the host (the data loader)
    B, T = tokens.shape
    out = xp.take(w, xp.reshape(tokens, (-1,)), axis=0)  # (N, C)
    return xp.reshape(out, (B, T, w.shape[1])), (tokens, w.shape[0])


@fp32_compute
def token_embedding_backward(dout, cache):
    """-> dw (V, C): a scatter-add, so repeated tokens accumulate."""
    tokens, V = cache
    xp = array_namespace(dout)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
    return scatter_add_rows(xp.reshape(tokens, (-1,)), dout2, V)  # (V, C)
