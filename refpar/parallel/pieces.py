"""The pieces a pipeline stage runs, one table per model family: the only place in refpar/parallel/
that asks which family a model is (outside expert parallelism).

    mpiexec -n 2 python -m refpar train --model llama-tiny --mesh tp=2 --check

Legend: B batch, Ta tokens inside a tensor-parallel region, Tl the residual stream's, C channels, V
vocab, t tp size (refpar/parallel/tensor_parallel.py's `Layout`).

Every piece runs on a tensor_parallel.Layout, the trivial one (`tp_layout` without a tp group: no
communicator, NO_PAIR's identities) where nothing is split, and has a forward and a backward whose
input half returns its weight half's work, [(function, arguments)], which
tensor_parallel.weight_grads runs:

    x, cache = pieces.embed(tokens, params, lay, drop)               # (B, Tl, C)
    x, cache = pieces.block(x, params, layer, lay, drop, moe, kv)     # (B, Tl, C), for each layer
    loss, cache = head_forward(x, params, targets, lay, normalizer)  # a 0-d array
    dx, work = head_backward(cache, lay, dloss)
    dx, work = pieces.block_backward(dx, cache, layer, lay)
    work = pieces.embed_backward(dx, cache, lay)                     # its input is tokens
    grads = weight_grads(work)                                         # in W, or right away

GPT-2's are refpar/parallel/gpt2_pieces.py's, Llama's refpar/parallel/llama_pieces.py's, DeepSeek-V3's
refpar/parallel/deepseek_pieces.py's (its latent attention split by mla_tensor_parallel.py); the head
(final norm, then vocab_parallel's logits and cross-entropy) is one for both. `attend` is the family's
attention over whole heads, which LocalAttention and context_parallel's Ulysses call: GPT-2's
multi-head attention with its dropout, Llama's grouped-query attention, DeepSeek-V3's multi-head
attention without dropout on its own query-key and value widths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refpar.config import ModelConfig
from refpar.model.attention import attention_backward, attention_forward
from refpar.model.layers import as_like
from refpar.model.llama_layers import gqa_attention_backward, gqa_attention_forward
from refpar.parallel import deepseek_pieces, gpt2_pieces, llama_pieces
from refpar.parallel.tensor_parallel import NO_PAIR, TP_PAIR, Layout, check_tp
from refpar.parallel.vocab_parallel import logits_backward, logits_forward
from refpar.sharding import shard_range


def _gqa_forward(q, k, v, q_pos, k_pos, keep=None, p=0.0):
    """Llama's core: no dropout, so `keep` is None (NO_DROPOUT's)."""
    return gqa_attention_forward(q, k, v, q_pos, k_pos)


@dataclass(frozen=True)
class Family:
    """One model family's pieces (module docstring)."""

    embed: Callable  # (tokens (B, Ta), params, lay, drop) -> (x (B, Tl, C), cache)
    embed_backward: Callable  # (dx, cache, lay) -> weight half's work
    block: Callable  # (x, params, layer, lay, drop, moe, kv) -> (y, cache)
    block_backward: Callable  # (dy, cache, layer, lay) -> (dx, weight half's work)
    norm: Callable  # the final norm: (x, params, lay) -> (h, cache)
    norm_backward: Callable  # (dh, cache) -> (dx, weight half's work)
    head: Callable  # config -> the name of the (V, C) head matrix
    attend: Callable  # (q, k, v, q_pos, k_pos, keep, p) -> (y, cache): attention over whole heads
    attend_backward: Callable  # (dy, cache) -> (dq, dk, dv)
    experts_over_tp: bool  # whether refpar/parallel/expert_tensor_parallel.py splits its experts
    grouped_kv: bool  # whether its attention may read fewer kv heads than query heads (GQA)
    splits_attention: bool = True  # whether its pieces split heads (tp) and positions (cp)


GPT2 = Family(gpt2_pieces.embed_forward, gpt2_pieces.embed_backward, gpt2_pieces.block_forward,
              gpt2_pieces.block_backward, gpt2_pieces.norm_forward, gpt2_pieces.norm_backward,
              lambda config: "wte.weight", attention_forward, attention_backward, True, False)
LLAMA = Family(llama_pieces.embed_forward, llama_pieces.embed_backward, llama_pieces.block_forward,
               llama_pieces.block_backward, llama_pieces.norm_forward, llama_pieces.norm_backward,
               lambda config: llama_pieces.EMBED if config.tie_embeddings else "lm_head.weight",
               _gqa_forward, gqa_attention_backward, False, True)
DEEPSEEK = Family(deepseek_pieces.embed_forward, deepseek_pieces.embed_backward,
                  deepseek_pieces.block_forward, deepseek_pieces.block_backward,
                  deepseek_pieces.norm_forward, deepseek_pieces.norm_backward,
                  LLAMA.head, attention_forward, attention_backward,  # MLA: multi-head, dv its own
                  True, False)
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "deepseek-v3": DEEPSEEK}


def family(config: ModelConfig) -> Family:
    return FAMILIES[config.arch]


def head_forward(x, params, targets, lay: Layout, normalizer):
    """x (B, Tl, C), targets (B, Ta) global ids at lay.region_pos -> the loss (0-d): the final norm,
    logits of this rank's vocabulary rows, cross-entropy (refpar/parallel/vocab_parallel.py)."""
    fam = family(lay.config)
    h, c_norm = fam.norm(x, params, lay)  # (B, Tl, C)
    loss, c_logits = logits_forward(h, params[fam.head(lay.config)], targets, lay, normalizer)
    return loss, (c_norm, c_logits)


def head_backward(cache, lay: Layout, dloss: float = 1.0):
    """-> (dx (B, Tl, C), the weight half's work: the head matrix's rows and the norm's gain)."""
    fam = family(lay.config)
    c_norm, c_logits = cache
    dh, w_head = logits_backward(c_logits, lay, fam.head(lay.config), dloss)  # (B, Tl, C)
    dx, w_norm = fam.norm_backward(dh, c_norm)  # (B, Tl, C)
    return dx, [w_head, w_norm]


class LocalAttention:
    """The whole sequence is on this rank: the family's causal attention on this rank's heads
    (Llama's grouped-query attention reads k and v of its kv heads and has no dropout)."""

    def forward(self, q, k, v, layer, lay: Layout, drop):  # (B, nh/t, Ta, hs); Llama's k, v nkv heads
        cfg, pos = lay.config, lay.region_pos
        at = lay.region_index  # the whole sequence: a slice, so the mask is viewed, not copied
        heads = slice(*lay.heads)
        index = (heads, at, at) if isinstance(at, slice) else np.ix_(np.arange(*lay.heads), pos, pos)
        keep = drop.keep(layer, "attn", (cfg.n_head, lay.seq_len, lay.seq_len), q, index)  # (B, nh/t, Ta, Ta)
        return family(cfg).attend(q, k, v, as_like(pos, q), as_like(pos, q), keep, drop.p)

    def backward(self, dy, cache, lay: Layout):
        return family(lay.config).attend_backward(dy, cache)


def tp_layout(config: ModelConfig, seq_len: int, tp_comm) -> Layout:
    """Plain TP: every rank holds the whole sequence, its heads, its vocabulary rows. Without a tp
    group (`tp_comm` None) the trivial layout: the whole model, nothing moves."""
    t, r = (1, 0) if tp_comm is None else (tp_comm.size, tp_comm.rank)
    check_tp(config, t)
    pos = np.arange(seq_len)
    return Layout(config, seq_len, tp_comm, TP_PAIR if t > 1 else NO_PAIR,
                  shard_range(config.n_head, t, r), shard_range(config.vocab_size, t, r),
                  pos, pos, LocalAttention())
