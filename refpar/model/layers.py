"""GPT-2's layers as forward/backward pairs, written by hand (no autograd).

Legend: B batch, T sequence, C channels (n_embd), V vocab, N = B*T tokens, `...` any leading dims.
`x_forward(...) -> (out, cache)`; `x_backward(dout, cache) -> (dinputs..., dparams...)`.
Every function takes its array namespace from its inputs (array-api-compat), so the same code runs
on NumPy, array-api-strict, torch and CuPy arrays.

Mixed precision: every pair is wrapped in `fp32_compute` (refpar/precision.py): given bf16/fp16
arrays it computes in fp32 and rounds outputs and caches to 16 bits once; for float64/float32 it is
a no-op. So softmax, LayerNorm statistics and cross-entropy always run in fp32.
"""

from __future__ import annotations

import math

import numpy as np
from array_api_compat import array_namespace, device, is_numpy_array, is_torch_array

from refpar.backend import as_like
from refpar.model.gemm import matmul
from refpar.precision import fp32_compute, is_16bit

GELU_C = math.sqrt(2.0 / math.pi)  # tanh-GELU (Hendrycks & Gimpel 2016), as GPT-2 uses it


def compute(x):
    """x in float32 when it is 16-bit (an op reads 16-bit inputs and computes in float32, as a
    tensor-core GEMM accumulates), else x itself: `fp32_compute` by hand, for the strategies' pieces
    that communicate between their ops."""
    if x is None or not is_16bit(x.dtype):
        return x
    xp = array_namespace(x)
    return xp.astype(x, xp.float32)


def rounded(x, dtype):
    """An op's float32 result rounded once to the activation dtype (x itself when it has it)."""
    return x if x.dtype == dtype else array_namespace(x).astype(x, dtype)


def one_hot(idx, n: int, dtype):
    """(...) integer ids -> (..., n) one-hot rows of `dtype`: the array-API way to gather and
    scatter-add by index (the standard has `take` but no scatter-add)."""
    xp = array_namespace(idx)
    columns = xp.arange(n, dtype=idx.dtype, device=device(idx))  # (n,)
    return xp.astype(xp.expand_dims(idx, axis=-1) == columns, dtype)  # (..., n)


def scatter_add_rows(idx, rows, n: int):
    """(N,) integer ids, (N, C) rows -> (n, C) sums: out[i] is the sum of the rows whose id is i,
    added one row after the other in row order, as torch's CPU embedding backward adds them
    (index_add_). NumPy's np.add.at and torch's index_add_ do that in N row additions; a namespace
    without a scatter-add (array-api-strict, CuPy) takes the one-hot product, n N C multiply-adds
    (at GPT-2's V = 50257 and 2048 tokens, 2 s of one core where np.add.at takes 20 ms)."""
    if not (is_numpy_array(rows) or is_torch_array(rows)):
        return one_hot(idx, n, rows.dtype).T @ rows  # (n, C)
    xp = array_namespace(rows)
    out = xp.zeros((n, rows.shape[1]), dtype=rows.dtype, device=device(rows))  # (n, C)
    if is_numpy_array(rows):
        np.add.at(out, idx, rows)
    else:
        out.index_add_(0, idx, rows)
    return out


def add_grads(grads: dict, g: dict) -> dict:
    """Adds the gradients `g` into `grads` name by name (a parameter two parts of the model read,
    such as a tied embedding, sums their shares); a name `grads` lacks is taken as it is."""
    for name, grad in g.items():
        grads[name] = grads[name] + grad if name in grads else grad
    return grads


# ---------------------------------------------------------------------------------------- linear
@fp32_compute
def linear_forward(x, w, b):
    """Conv1D layout: out = x @ w + b with w (in, out). b may be None."""
    xp = array_namespace(x, w)
    lead = x.shape[:-1]
    out = matmul(xp.reshape(x, (-1, x.shape[-1])), w)  # (N, out): one GEMM over all tokens
    if b is not None:
        out += b
    return xp.reshape(out, (*lead, w.shape[1])), (x, w, b is not None)


@fp32_compute
def linear_backward(dout, cache):
    x, w, has_bias = cache
    dx = linear_backward_input(dout, w)  # (..., in)
    dw, db = linear_backward_weight(x, dout, has_bias)  # (in, out), (out,)
    return dx, dw, db


@fp32_compute
def linear_backward_input(dout, w):
    """The input half of `linear_backward`, dx = dout @ w.T (..., in): what the layer before waits
    for. A pipeline's zero-bubble schedules run it in B and the weight half later, in W."""
    xp = array_namespace(dout, w)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, out)
    return xp.reshape(matmul(dout2, w.T), (*dout.shape[:-1], w.shape[0]))  # (..., in)


@fp32_compute
def linear_backward_weight(x, dout, has_bias):
    """The weight half of `linear_backward`: dw = x.T @ dout (in, out), db the sum of dout (out,)."""
    xp = array_namespace(dout, x)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, in)
    dw = matmul(x2.T, xp.reshape(dout, (-1, dout.shape[-1])))  # (in, out)
    return dw, (bias_backward(dout) if has_bias else None)


@fp32_compute
def bias_backward(dout):
    """A bias's gradient: dout (..., out) summed over its tokens (out,)."""
    xp = array_namespace(dout)
    return xp.sum(xp.reshape(dout, (-1, dout.shape[-1])), axis=0)  # (out,)


# ------------------------------------------------------------------------------------- layernorm
@fp32_compute
def layernorm_forward(x, w, b, eps=1e-5):
    """Over the last axis, biased variance, as torch.nn.LayerNorm."""
    xp = array_namespace(x, w)
    mean = xp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    xc = x - mean  # (..., C)
    var = xp.mean(xc * xc, axis=-1, keepdims=True)  # (..., 1)
    rstd = 1.0 / xp.sqrt(var + eps)  # (..., 1)
    xhat = xc  # (..., C): x - mean, scaled in place (the same roundings as xc * rstd, one array fewer)
    xhat *= rstd
    out = xhat * w  # (..., C)
    out += b
    return out, (xhat, rstd, w)


@fp32_compute
def layernorm_backward(dout, cache):
    xhat, rstd, w = cache
    xp = array_namespace(dout, w)
    lead = tuple(range(dout.ndim - 1))
    dw = xp.sum(dout * xhat, axis=lead)  # (C,)
    db = xp.sum(dout, axis=lead)  # (C,)
    dxhat = dout * w  # (..., C)
    # d/dx of (x - mean) * rstd: remove the mean of dxhat and its projection on xhat, in place on
    # the first difference (the roundings of the one expression, two arrays fewer).
    dx = dxhat - xp.mean(dxhat, axis=-1, keepdims=True)  # (..., C)
    dx -= xhat * xp.mean(dxhat * xhat, axis=-1, keepdims=True)
    dx *= rstd
    return dx, dw, db


# ------------------------------------------------------------------------------------------ gelu
@fp32_compute
def gelu_forward(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), built in place on fresh arrays: the MLP's
    (B, T, 4C) activations make this one of the model's largest elementwise costs."""
    xp = array_namespace(x)
    a = x * x  # (...)
    a *= 0.044715
    a += 1.0
    a *= x
    a *= GELU_C  # the tanh argument
    t = xp.tanh(a)  # (...)
    out = t + 1.0
    out *= x
    out *= 0.5
    return out, (x, t)


@fp32_compute
def gelu_backward(dout, cache):
    """d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    x, t = cache
    g = x * x  # (...)
    g *= 3.0 * 0.044715
    g += 1.0
    g *= GELU_C  # d(tanh argument)/dx
    g *= x
    sech2 = t * t  # (...): 1 - t^2 in place, -(t^2) + 1 being the same rounding
    sech2 *= -1.0
    sech2 += 1.0
    g *= sech2
    g += 1.0 + t
    g *= 0.5
    g *= dout
    return g


# --------------------------------------------------------------------------------------- dropout
@fp32_compute
def dropout_forward(x, keep, p):
    """Inverted dropout: kept values scaled by 1/(1-p). `keep` is None (no dropout) or a boolean
    array broadcastable to x, of x's namespace (`as_like` moves a NumPy mask)."""
    if keep is None or p == 0.0:
        return x, None
    xp = array_namespace(x)
    scale = xp.astype(keep, x.dtype)  # (..., like x)
    scale *= 1.0 / (1.0 - p)  # 0 or 1/(1-p)
    return x * scale, scale


@fp32_compute
def dropout_backward(dout, cache):
    return dout if cache is None else dout * cache


# ------------------------------------------------------------------------------------- embedding
@fp32_compute
def embedding_forward(tokens, wte, wpe, positions):
    """out[b, t] = wte[tokens[b, t]] + wpe[positions[t]]; positions are global, so a sequence
    shard passes its own slice of them."""
    xp = array_namespace(wte)
    # Token ids come from the host (the data loader): move them next to the table.
    tokens, positions = as_like(tokens, wte), as_like(positions, wte)
    B, T = tokens.shape
    tok = xp.take(wte, xp.reshape(tokens, (-1,)), axis=0)  # (N, C)
    pos = xp.take(wpe, positions, axis=0)  # (T, C)
    out = xp.reshape(tok, (B, T, wte.shape[1])) + pos  # (B, T, C)
    return out, (tokens, positions, wte.shape[0], wpe.shape[0])


@fp32_compute
def embedding_backward(dout, cache):
    tokens, positions, V, P = cache
    xp = array_namespace(dout)
    C = dout.shape[-1]
    dout2 = xp.reshape(dout, (-1, C))  # (N, C)
    dwte = scatter_add_rows(xp.reshape(tokens, (-1,)), dout2, V)  # (V, C): repeated tokens accumulate
    dwpe = one_hot(positions, P, dout.dtype).T @ xp.sum(dout, axis=0)  # (P, C)
    return dwte, dwpe


# ----------------------------------------------------------------------------- cross-entropy
@fp32_compute
def cross_entropy_forward(logits, targets, normalizer):
    """loss = sum over tokens of -log softmax(logits)[target] / normalizer. The normalizer is the
    global token count, so losses computed on shards of the batch add up to the global mean."""
    xp = array_namespace(logits)
    targets = as_like(targets, logits)  # from the host (the data loader)
    V = logits.shape[-1]
    logits2 = xp.reshape(logits, (-1, V))  # (N, V)
    z = logits2 - xp.max(logits2, axis=-1, keepdims=True)  # (N, V), max 0: exp cannot overflow
    e = xp.exp(z)  # (N, V)
    s = xp.sum(e, axis=-1, keepdims=True)  # (N, 1)
    t = xp.reshape(targets, (-1, 1))  # (N, 1)
    z_target = xp.take_along_axis(z, t, axis=-1)  # (N, 1)
    loss = xp.sum(xp.log(s) - z_target) / normalizer  # ()
    e /= s  # (N, V) probabilities
    return loss, (e, t, normalizer, logits.shape)


@fp32_compute
def cross_entropy_backward(dloss, cache):
    probs, t, normalizer, shape = cache
    xp = array_namespace(probs)
    dlogits = probs - one_hot(xp.reshape(t, (-1,)), probs.shape[-1], probs.dtype)  # (N, V)
    dlogits *= dloss / normalizer
    return xp.reshape(dlogits, shape)
