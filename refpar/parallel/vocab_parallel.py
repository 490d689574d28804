"""The vocabulary split over `tp` (Megatron-LM's VocabParallelEmbedding and vocab-parallel
cross-entropy): tp rank r holds rows shard_range(V, t, r) of the tied wte, (V/t, C).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check

Legend: B batch, Ta tokens inside a tensor-parallel region, Tl tokens of the residual stream on this
rank, C channels, V vocab, t tp size (refpar/parallel/tensor_parallel.py's `Layout`).

The vocabulary is split unevenly with shard_range rather than padded: every logit a rank computes is
a real vocabulary entry, so the max, the sum of exponentials and the target logit reduce over exactly
the single device's V entries and there is nothing to mask. The embedding leaves its region through
g (each rank's lookups are a partial sum); the head enters through f (the column-parallel linear of
tensor_parallel.py, on wte.T), and its cross-entropy's three all-reduces of (B, Ta) move float32
statistics whatever the activation dtype.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.layers import (
    as_like,
    compute,
    layernorm_backward,
    layernorm_forward,
    one_hot,
    rounded,
    scatter_add_rows,
)
from refpar.model.llama_layers import rmsnorm_backward, rmsnorm_forward
from refpar.parallel.tensor_parallel import (
    Layout,
    column_parallel_linear_backward,
    column_parallel_linear_forward,
    resid_dropout_backward,
    resid_dropout_forward,
)


def tp_all_reduce(x, lay: Layout, tag: str, op: str = "sum"):
    return x if lay.tp is None else lay.tp.all_reduce(x, op=op, tag=tag)


# Vocab-parallel embedding: each rank looks up only the tokens in its rows; g sums the lookups.
def vocab_rows_forward(tokens, w, lay: Layout, tag: str):
    """tokens (B, Ta) global ids -> the lookups in this rank's rows of `w` (V/t, C), summed over tp
    (g): x (B, Tl, C), and the cache (rows, mine)."""
    xp, v0, v1 = array_namespace(w), *lay.vocab
    tokens = as_like(tokens, w)
    B, Ta = tokens.shape
    mine = (tokens >= v0) & (tokens < v1)  # (B, Ta)
    rows = xp.where(mine, tokens - v0, xp.zeros_like(tokens))  # (B, Ta)
    partial = xp.reshape(xp.take(w, xp.reshape(rows, (-1,)), axis=0), (B, Ta, w.shape[1]))
    partial = partial * xp.expand_dims(xp.astype(mine, w.dtype), axis=-1)  # (B, Ta, C), 0 if not mine
    return lay.pair.leave(partial, lay.tp, f"{tag}:fwd"), (rows, mine)  # (B, Tl, C)


def vocab_rows_backward(dx, cache, lay: Layout, w, tag: str):
    """dx (B, Tl, C) -> the gradient of this rank's rows (V/t, C) (`w` gives their number and dtype)."""
    rows, mine = cache
    xp = array_namespace(dx)
    dpartial = compute(lay.pair.leave_backward(dx, lay.tp, f"{tag}:bwd"))  # (B, Ta, C)
    # Other ranks' tokens add zero rows (to row 0), so the sums are made in the one device's order.
    dpartial = xp.reshape(dpartial, (-1, dpartial.shape[-1]))  # (B*Ta, C)
    dpartial = dpartial * xp.reshape(xp.astype(mine, dpartial.dtype), (-1, 1))  # 0 where not mine
    return rounded(scatter_add_rows(xp.reshape(rows, (-1,)), dpartial, w.shape[0]), w.dtype)  # (V/t, C)


def vocab_parallel_embedding_forward(tokens, params, lay: Layout, drop):
    """tokens (B, Ta) global ids at lay.region_pos -> x (B, Tl, C)."""
    wte, wpe = params["wte.weight"], params["wpe.weight"]
    xp = array_namespace(wte)
    x, (rows, mine) = vocab_rows_forward(tokens, wte, lay, "wte")  # (B, Tl, C)
    x = x + xp.take(wpe, as_like(lay.resid_pos, wpe), axis=0)  # (B, Tl, C)
    x, drop_e = resid_dropout_forward(x, drop, 0, "embd", lay)
    return x, (rows, mine, drop_e)


def vocab_parallel_embedding_backward(dx, cache, lay: Layout, params) -> dict:
    rows, mine, drop_e = cache
    wte, wpe = params["wte.weight"], params["wpe.weight"]
    xp = array_namespace(dx)
    dx = resid_dropout_backward(dx, drop_e)  # (B, Tl, C)
    dc = compute(dx)  # (B, Tl, C)
    dwpe = one_hot(as_like(lay.resid_pos, dx), wpe.shape[0], dc.dtype).T @ xp.sum(dc, axis=0)  # (P, C)
    return {"wte.weight": vocab_rows_backward(dx, (rows, mine), lay, wte, "wte"),
            "wpe.weight": rounded(dwpe, wpe.dtype)}


# Vocab-parallel cross-entropy: the (B, Ta, V) logits are never gathered; three all-reduces of (B, Ta)
# (max, sum of exponentials, target logit) give every rank the exact loss (Megatron-LM).
def vocab_parallel_cross_entropy_forward(logits, targets, lay: Layout, normalizer):
    """logits (B, Ta, V/t), targets (B, Ta) global ids -> the sum of token losses / normalizer."""
    xp, v0, v1, dt = array_namespace(logits), *lay.vocab, logits.dtype
    targets = as_like(targets, logits)
    logits = compute(logits)  # (B, Ta, V/t): the softmax and its all-reduces run in float32
    m = tp_all_reduce(xp.max(logits, axis=-1), lay, "lm_head.ce.max:fwd", op="max")  # (B, Ta)
    e = xp.exp(logits - xp.expand_dims(m, axis=-1))  # (B, Ta, V/t)
    s = tp_all_reduce(xp.sum(e, axis=-1), lay, "lm_head.ce.sumexp:fwd")  # (B, Ta)
    mine = (targets >= v0) & (targets < v1)  # (B, Ta)
    hot = one_hot(xp.where(mine, targets - v0, xp.zeros_like(targets)), logits.shape[-1], logits.dtype)
    hot = hot * xp.expand_dims(xp.astype(mine, logits.dtype), axis=-1)  # (B, Ta, V/t), 0 if not mine
    z = tp_all_reduce(xp.sum(logits * hot, axis=-1), lay, "lm_head.ce.target:fwd")  # (B, Ta) target logit
    loss = float(xp.sum(xp.log(s) + m - z)) / normalizer
    # kept for backward in the activation dtype: probabilities and one-hot targets (B, Ta, V/t)
    return loss, (rounded(e / xp.expand_dims(s, axis=-1), dt), rounded(hot, dt), normalizer)


def vocab_parallel_cross_entropy_backward(dloss, cache):
    """dloss: 1, or the loss scale of an fp16 run (its gradients are scaled by it)."""
    probs, hot, normalizer = cache
    return rounded((compute(probs) - compute(hot)) * (dloss / normalizer), probs.dtype)  # (B, Ta, V/t)


def vocab_parallel_head_forward(x, params, targets, lay: Layout, normalizer):
    """x (B, Tl, C) -> loss: ln_f, logits of this rank's vocabulary rows (tied to wte), cross-entropy."""
    eps = lay.config.layer_norm_eps
    h, ln_f = layernorm_forward(x, params["ln_f.weight"], params["ln_f.bias"], eps)  # (B, Tl, C)
    logits, lm = column_parallel_linear_forward(h, params["wte.weight"].T, None, lay, "lm_head")
    loss, ce = vocab_parallel_cross_entropy_forward(logits, targets, lay, normalizer)  # (B, Ta, V/t) in
    return loss, (ln_f, lm, ce)


def vocab_parallel_head_backward(cache, lay: Layout, dloss: float = 1.0) -> tuple:
    """dloss: where backward starts, 1 or an fp16 run's loss scale."""
    ln_f, lm, ce = cache
    dlogits = vocab_parallel_cross_entropy_backward(dloss, ce)  # (B, Ta, V/t)
    dh, dw, _ = column_parallel_linear_backward(dlogits, lm, lay)  # dw (C, V/t)
    dx, dln_w, dln_b = layernorm_backward(dh, ln_f)
    return dx, {"wte.weight": dw.T, "ln_f.weight": dln_w, "ln_f.bias": dln_b}


# Llama's: no position table and no dropout; the head is RMSNorm and lm_head (or the tied embedding).
LLAMA_EMBED = "model.embed_tokens.weight"


def llama_vocab_parallel_embedding_forward(tokens, params, lay: Layout):
    """tokens (B, Ta) -> x (B, Tl, C)."""
    return vocab_rows_forward(tokens, params[LLAMA_EMBED], lay, "model.embed_tokens")


def llama_vocab_parallel_embedding_backward(dx, cache, lay: Layout, params) -> dict:
    return {LLAMA_EMBED: vocab_rows_backward(dx, cache, lay, params[LLAMA_EMBED], "model.embed_tokens")}


def llama_vocab_parallel_head_forward(x, params, targets, lay: Layout, normalizer):
    """x (B, Tl, C) -> loss: model.norm, logits of this rank's vocabulary rows, cross-entropy."""
    cfg = lay.config
    head = LLAMA_EMBED if cfg.tie_embeddings else "lm_head.weight"
    h, c_norm = rmsnorm_forward(x, params["model.norm.weight"], cfg.norm_eps)  # (B, Tl, C)
    logits, lm = column_parallel_linear_forward(h, params[head].T, None, lay, "lm_head")  # (B, Ta, V/t)
    loss, ce = vocab_parallel_cross_entropy_forward(logits, targets, lay, normalizer)
    return loss, (c_norm, lm, ce, head)


def llama_vocab_parallel_head_backward(cache, lay: Layout, dloss: float = 1.0) -> tuple:
    c_norm, lm, ce, head = cache
    dlogits = vocab_parallel_cross_entropy_backward(dloss, ce)  # (B, Ta, V/t)
    dh, dw, _ = column_parallel_linear_backward(dlogits, lm, lay)  # dw (C, V/t)
    dx, dnorm = rmsnorm_backward(dh, c_norm)  # (B, Tl, C)
    return dx, {head: dw.T, "model.norm.weight": dnorm}
