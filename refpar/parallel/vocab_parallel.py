"""The vocabulary split over `tp` (Megatron-LM's VocabParallelEmbedding and vocab-parallel
cross-entropy): tp rank r holds rows shard_range(V, t, r) of the tied wte, (V/t, C).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check

Legend: B batch, Ta tokens inside a tensor-parallel region, Tl tokens of the residual stream on this
rank, C channels, V vocab, t tp size (refpar/parallel/tensor_parallel.py's `Layout`).

One embedding lookup (`vocab_rows_*`: GPT-2's wte, Llama's embed_tokens) and one head (`logits_*`:
logits of this rank's rows of the (V, C) head matrix, then cross-entropy) serve both families;
refpar/parallel/pieces.py adds each family's position table, dropout and final norm.

The vocabulary is split unevenly with shard_range rather than padded: every logit a rank computes is
a real vocabulary entry, so the max, the sum of exponentials and the target logit reduce over exactly
the single device's V entries and there is nothing to mask. The embedding leaves its region through
g (each rank's lookups are a partial sum); the head enters through f (the column-parallel linear of
tensor_parallel.py, on wte.T), and its cross-entropy's three all-reduces of (B, Ta) move float32
statistics whatever the activation dtype.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.layers import as_like, compute, one_hot, rounded, scatter_add_rows
from refpar.parallel.tensor_parallel import (
    Layout,
    column_parallel_linear_backward,
    column_parallel_linear_forward,
)


def tp_all_reduce(x, lay: Layout, tag: str, op: str = "sum"):
    return x if lay.tp is None else lay.tp.all_reduce(x, op=op, tag=tag)


def _mine(ids, lay: Layout):
    """(B, Ta) global ids -> this rank's rows of them (0 where not its own) and whether it owns them."""
    xp, v0, v1 = array_namespace(ids), *lay.vocab
    mine = (ids >= v0) & (ids < v1)  # (B, Ta)
    return xp.where(mine, ids - v0, xp.zeros_like(ids)), mine


# Vocab-parallel embedding: each rank looks up only the tokens in its rows; g sums the lookups.
def vocab_rows_forward(tokens, w, lay: Layout, tag: str):
    """tokens (B, Ta) global ids -> the lookups in this rank's rows of `w` (V/t, C), summed over tp
    (g): x (B, Tl, C), and the cache: the tokens (the backward finds its rows again)."""
    xp = array_namespace(w)
    tokens = as_like(tokens, w)
    B, Ta = tokens.shape
    rows, mine = _mine(tokens, lay)  # (B, Ta) each
    partial = xp.reshape(xp.take(w, xp.reshape(rows, (-1,)), axis=0), (B, Ta, w.shape[1]))
    partial = partial * xp.expand_dims(xp.astype(mine, w.dtype), axis=-1)  # (B, Ta, C), 0 if not mine
    return lay.pair.leave(partial, lay.tp, f"{tag}:fwd"), tokens  # (B, Tl, C)


def vocab_rows_backward(dx, tokens, lay: Layout, tag: str):
    """dx (B, Tl, C) -> the weight half's work: the gradient of this rank's rows (V/t, C). Its input
    half is g's backward (an all-gather under sp), so that every collective stays in B."""
    dpartial = lay.pair.leave_backward(dx, lay.tp, f"{tag}:bwd")  # (B, Ta, C)
    return vocab_rows_weight, (dpartial, tokens, lay, tag)


def vocab_rows_weight(dpartial, tokens, lay: Layout, tag: str) -> dict:
    """{tag.weight: (V/t, C)}, in dpartial's dtype: a scatter-add of dpartial (B, Ta, C) by row."""
    xp = array_namespace(dpartial)
    rows, mine = _mine(tokens, lay)  # (B, Ta) each
    dc = compute(xp.reshape(dpartial, (-1, dpartial.shape[-1])))  # (B*Ta, C)
    # Other ranks' tokens add zero rows (to row 0), so the sums are made in the one device's order.
    dc = dc * xp.reshape(xp.astype(mine, dc.dtype), (-1, 1))  # 0 where not mine
    n = lay.vocab[1] - lay.vocab[0]
    return {f"{tag}.weight": rounded(scatter_add_rows(xp.reshape(rows, (-1,)), dc, n), dpartial.dtype)}


# Vocab-parallel cross-entropy: the (B, Ta, V) logits are never gathered; three all-reduces of (B, Ta)
# (max, sum of exponentials, target logit) give every rank the exact loss (Megatron-LM).
def vocab_parallel_cross_entropy_forward(logits, targets, lay: Layout, normalizer):
    """logits (B, Ta, V/t), targets (B, Ta) global ids -> the sum of token losses / normalizer, and
    the cache: the probabilities (B, Ta, V/t) in the activation dtype and the targets."""
    xp, dt = array_namespace(logits), logits.dtype
    targets = as_like(targets, logits)
    logits = compute(logits)  # (B, Ta, V/t): the softmax and its all-reduces run in float32
    m = tp_all_reduce(xp.max(logits, axis=-1), lay, "lm_head.ce.max:fwd", op="max")  # (B, Ta)
    e = xp.exp(logits - xp.expand_dims(m, axis=-1))  # (B, Ta, V/t)
    s = tp_all_reduce(xp.sum(e, axis=-1), lay, "lm_head.ce.sumexp:fwd")  # (B, Ta)
    z = tp_all_reduce(xp.sum(logits * _hot(targets, lay, logits), axis=-1), lay,
                      "lm_head.ce.target:fwd")  # (B, Ta) target logit
    loss = xp.sum(xp.log(s) - (z - m)) / normalizer  # () as layers.cross_entropy_forward's
    return loss, (rounded(e / xp.expand_dims(s, axis=-1), dt), targets, normalizer)


def _hot(targets, lay: Layout, like):
    """(B, Ta) global ids -> (B, Ta, V/t) their one-hot rows among this rank's, 0 where not its own."""
    xp = array_namespace(like)
    rows, mine = _mine(targets, lay)  # (B, Ta) each
    hot = one_hot(rows, like.shape[-1], like.dtype)  # (B, Ta, V/t)
    return hot * xp.expand_dims(xp.astype(mine, like.dtype), axis=-1)


def vocab_parallel_cross_entropy_backward(dloss, cache, lay: Layout):
    """dloss: 1, or the loss scale of an fp16 run (its gradients are scaled by it)."""
    probs, targets, normalizer = cache
    dlogits = compute(probs) - _hot(targets, lay, compute(probs))  # (B, Ta, V/t)
    dlogits *= dloss / normalizer
    return rounded(dlogits, probs.dtype)


def logits_forward(h, w, targets, lay: Layout, normalizer):
    """h (B, Tl, C), the final norm's output; w (V/t, C) this rank's rows of the head matrix (GPT-2's
    wte, Llama's lm_head or tied embedding) -> the loss: logits of its rows, cross-entropy."""
    xp = array_namespace(w)
    (logits,), lm = column_parallel_linear_forward(h, [(xp.matrix_transpose(w), None)], lay, "lm_head")
    loss, ce = vocab_parallel_cross_entropy_forward(logits, targets, lay, normalizer)  # (B, Ta, V/t) in
    return loss, (lm, ce)


def logits_backward(cache, lay: Layout, name: str, dloss: float = 1.0):
    """-> (dh (B, Tl, C), the weight half: `name`'s gradient (V/t, C)). dloss: where backward starts,
    1 or an fp16 run's loss scale."""
    lm, ce = cache
    dlogits = vocab_parallel_cross_entropy_backward(dloss, ce, lay)  # (B, Ta, V/t)
    return column_parallel_linear_backward([dlogits], lm, lay, [(name, None)], transposed=True)
