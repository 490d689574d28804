"""Tensor parallelism on the `tp` axis (Megatron-LM: Shoeybi et al. 2019; Narayanan et al. 2021 §3.2).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check

Legend: B batch, T sequence, C channels, nh heads, hs head size, V vocab, t tp size;
Ta tokens inside a tensor-parallel region, Tl tokens of the residual stream on this rank (both T
under plain TP; sequence_parallel.py and context_parallel.py change them through a `Layout`).

A block is two tensor-parallel regions, attention and MLP. Each is entered through f and left
through g, Megatron's conjugate pair:

    f = copy_to_tp       identity forward   | all-reduce backward
    g = reduce_from_tp   all-reduce forward | identity backward

so a block does two all-reduces forward (g after attention, g after the MLP) and two backward
(f before each): four, each of (B, T, C). Inside a region nothing moves: the column-parallel linear
(c_attn, c_fc) splits its output columns, the row-parallel linear (c_proj) its input rows, and
attention runs on whole heads (the fused c_attn is split per head, so a head's Q, K, V stay together).
This file holds the pair, the `Layout` and the two linears, each backward in an input and a weight
half; the blocks built of them are refpar/parallel/gpt2_pieces.py's and llama_pieces.py's, chosen
by refpar/parallel/pieces.py, which also makes the layouts (`tp_layout`; tp = 1: NO_PAIR, the
trivial layout every unsplit mesh runs).

Weights a rank holds (GPT-2 Conv1D layout weight[in, out]); all others are replicated:
    wte.weight            rows shard_range(V, t, rank)              (V/t, C), uneven allowed
    h.i.attn.c_attn       columns of heads [h0, h1) of q, k and v   (C, 3C/t), (3C/t,)
    h.i.attn.c_proj.w     rows of heads [h0, h1)                    (C/t, C)
    h.i.mlp.c_fc          columns shard_range(4C, t, rank)          (C, 4C/t), (4C/t,)
    h.i.mlp.c_proj.w      rows shard_range(4C, t, rank)             (4C/t, C)
In MoE blocks each expert is such an MLP (Megatron-LM's expert tensor parallelism, expert tp size
= t): h.i.mlp.experts.e.c_fc by columns, its c_proj.weight by rows, c_proj.bias whole
(refpar/parallel/expert_tensor_parallel.py); the router stays whole. The embedding and the LM head
over the vocabulary rows: refpar/parallel/vocab_parallel.py.

Mixed precision (bf16 / fp16 activations, refpar/precision.py): every piece reads 16-bit arrays,
computes in float32 (`compute`) and rounds its output once (`rounded`), as the model's layers do.
What crosses tp is what Megatron-LM sends: the row-parallel partial sums and the f/g activation
gradients in 16 bits (so a sum over ranks rounds where one device's GEMM does not). For float64 and
float32 models both helpers return their input: the numbers are unchanged, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from array_api_compat import array_namespace

from refpar.config import ConfigError, ModelConfig
from refpar.holdings import tp_param_slices
from refpar.model.layers import (
    bias_backward,
    compute,
    dropout_backward,
    dropout_forward,
    linear_backward_input,
    linear_backward_weight,
    linear_forward,
    rounded,
)


# f and g, each with its backward next to it. `tp` is the tp Communicator.
def copy_to_tp(x, tp, tag):
    """f forward: the region's input is already on every rank."""
    return x


def copy_to_tp_backward(dx, tp, tag):
    """f backward: each rank's heads or columns give part of the input's gradient; sum them."""
    return tp.all_reduce(dx, tag=tag)


def reduce_from_tp(x, tp, tag):
    """g forward: each rank's rows give a partial sum of the output; sum them."""
    return tp.all_reduce(x, tag=tag)


def reduce_from_tp_backward(dx, tp, tag):
    """g backward: the gradient of a replicated output is already on every rank."""
    return dx


def _identity(x, comm, tag):
    return x


@dataclass(frozen=True)
class RegionPair:
    """How activations enter (f) and leave (g) a tensor-parallel region, each with its backward."""

    enter: Callable
    enter_backward: Callable
    leave: Callable
    leave_backward: Callable


TP_PAIR = RegionPair(copy_to_tp, copy_to_tp_backward, reduce_from_tp, reduce_from_tp_backward)
NO_PAIR = RegionPair(_identity, _identity, _identity, _identity)  # tp == 1: nothing to split


@dataclass(frozen=True)
class Layout:
    """What this rank holds of a step's activations and weights, and how regions are entered."""

    config: ModelConfig
    seq_len: int  # T, the global sequence length
    tp: object  # the tp Communicator, None when tp == 1
    pair: RegionPair
    heads: tuple[int, int]  # global heads [h0, h1) of this rank
    vocab: tuple[int, int]  # global vocabulary rows [v0, v1) of this rank
    region_pos: np.ndarray  # (Ta,) global positions inside a region (attention, MLP, LM head)
    resid_pos: np.ndarray  # (Tl,) global positions of the residual stream (LayerNorm, dropout)
    attention: object  # the attention core: forward(q, k, v, layer, lay, drop) / backward(dy, cache, lay)

    @cached_property
    def region_index(self):
        """region_pos as an index of a mask's sequence axis (positions_index), found once per layout."""
        return positions_index(self.region_pos)

    @cached_property
    def resid_index(self):
        return positions_index(self.resid_pos)


def check_tp(config: ModelConfig, tp: int) -> None:
    if config.n_head % tp != 0:
        choices = [d for d in range(1, config.n_head + 1) if config.n_head % d == 0]
        raise ConfigError(f"tp={tp} does not divide n_head={config.n_head}; choose tp in {_braces(choices)}")
    if config.vocab_size < tp:
        raise ConfigError(f"tp={tp} is larger than vocab_size={config.vocab_size}; use tp <= vocab_size")
    kv = config.n_kv_head or config.n_head  # GPT-2's kv heads are its heads, which tp divides
    if kv % tp and tp % kv:
        choices = sorted({d for d in range(1, config.n_head + 1) if config.n_head % d == 0 and (kv % d == 0
                                                                                          or d % kv == 0)})
        raise ConfigError(f"tp={tp} neither divides n_kv_head={kv} nor is a multiple of it, so a rank's "
                          f"query heads would read two kv heads; choose tp in {_braces(choices)}")


def _braces(choices) -> str:
    """{1, 2, 4, 8}: the choices in increasing order (a printed set's order is not)."""
    return "{" + ", ".join(str(c) for c in sorted(choices)) + "}"


def shard_params_tp(full: dict, config: ModelConfig, t: int, rank: int) -> dict:
    """This rank's parameters: a slice of the full initialisation, so any t starts from the same model."""
    slices = tp_param_slices(config, t, rank)
    return {name: (np.take(w, slices[name][1], axis=slices[name][0]) if name in slices else w.copy())
            for name, w in full.items()}


# Dropout keyed by global indices (DropoutContext.keep draws a site's mask whole per sample and then
# slices it): replicated regions get identical masks on every tp rank, shards get their own part.
def positions_index(pos: np.ndarray):
    """Global positions as an index of a mask's sequence axis: a slice where they are consecutive
    (the whole sequence, an sp shard), which views the drawn mask instead of copying it; else the
    positions themselves (a cp rank's zig-zag chunks)."""
    if len(pos) and np.all(np.diff(pos) == 1):
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return pos


def resid_dropout_forward(x, drop, layer: int, site: str, lay: Layout):
    shape = (lay.seq_len, lay.config.n_embd)
    index = (lay.resid_index, slice(None))
    return dropout_forward(x, drop.keep(layer, site, shape, x, index), drop.p)


def resid_dropout_backward(dout, cache):
    return dropout_backward(dout, cache)


# Column- and row-parallel linear (weight [in, out]), each a forward and a backward in two halves:
# the input half (dx, with the communication dx needs) returns the weight half's work, a (function,
# arguments) pair that `weight_grads` runs in W, or right away (Qi et al. 2023, section 2). The GEMMs
# are refpar/model/layers.py's (one 2-D GEMM over all tokens), so that a layout that splits nothing
# computes the single device's numbers bit for bit.
def column_parallel_linear_forward(x, weights: list, lay: Layout, tag: str):
    """x (B, Tl, C) -> [(B, Ta, out/t)], one for each (w (C, out/t), b or None) of `weights`: the
    linears that read one region input, entered once. Keeps x as given, not as entered: the backward
    enters it again, free under TP (f is the identity), an all-gather under SP, which keeps only the
    sequence shard between F and B (Korthikanti et al. 2022 §4.2.2)."""
    xa = lay.pair.enter(x, lay.tp, f"{tag}:fwd")  # (B, Ta, C)
    outs = [linear_forward(xa, w, b)[0] for w, b in weights]  # (B, Ta, out/t) each
    return outs, (x, [w for w, _ in weights], tag)


def column_parallel_linear_backward(douts: list, cache, lay: Layout, names: list, transposed: bool = False):
    """douts [(B, Ta, out/t)] -> (dx (B, Tl, C), the weight half: names[i] (weight, bias or None)
    get dw (C, out/t), or its transpose for a weight kept (out, in), and db). The input half enters
    the input again (":regather") and sums the input's gradients in the linears' order before f's
    backward: every collective stays in B, in the order of a backward that is not split, and W
    only multiplies (it keeps the entered input, (B, Ta, C) under sp)."""
    x, ws, tag = cache
    xa = lay.pair.enter(x, lay.tp, f"{tag}:regather")  # (B, Ta, C)
    dxa = linear_backward_input(douts[0], ws[0])  # (B, Ta, C)
    for dout, w in zip(douts[1:], ws[1:], strict=True):
        dxa = dxa + linear_backward_input(dout, w)
    dx = lay.pair.enter_backward(dxa, lay.tp, f"{tag}:bwd")  # (B, Tl, C)
    return dx, (linears_weight, (xa, [(n, d, transposed) for n, d in zip(names, douts, strict=True)]))


def linears_weight(x, linears) -> dict:
    """The weight half of the linears that read one input x (B, Ta, C): `linears` is (names (weight,
    bias or None), dout, whether the weight is kept (out, in)) each."""
    grads = {}
    for (weight, bias), dout, transposed in linears:
        dw, db = linear_backward_weight(x, dout, bias is not None)  # (in, out), (out,)
        grads[weight] = array_namespace(dw).matrix_transpose(dw) if transposed else dw
        if bias is not None:
            grads[bias] = db
    return grads


def row_parallel_linear_forward(x, w, b, lay: Layout, tag: str):
    """x (B, Ta, in/t) -> (B, Tl, C): each rank's rows give a partial sum; g adds them, then the bias
    is added once."""
    partial, _ = linear_forward(x, w, None)  # (B, Ta, C), partial over t
    out = lay.pair.leave(partial, lay.tp, f"{tag}:fwd")  # (B, Tl, C)
    if b is not None:
        out = rounded(compute(out) + compute(b), x.dtype)
    return out, (x, w, b is not None, tag)


def row_parallel_linear_backward(dout, cache, lay: Layout, names: tuple, transposed: bool = False):
    """dout (B, Tl, C) -> (dx (B, Ta, in/t), the weight half: dw from this rank's rows of the input,
    db over this rank's residual tokens)."""
    x, w, has_bias, tag = cache
    dpartial = lay.pair.leave_backward(dout, lay.tp, f"{tag}:bwd")  # (B, Ta, C)
    dx = linear_backward_input(dpartial, w)  # (B, Ta, in/t)
    return dx, (row_weight, (names, x, dpartial, dout if has_bias else None, transposed))


def row_weight(names, x, dpartial, dout, transposed) -> dict:
    grads = linears_weight(x, [((names[0], None), dpartial, transposed)])
    if dout is not None:
        grads[names[1]] = bias_backward(dout)  # (C,)
    return grads


def given(names: tuple, *grads) -> dict:
    """The weight half of a piece whose gradients its input half computed on the way (a norm's gains,
    two reductions; a MoE layer's, fused)."""
    return dict(zip(names, grads, strict=True))


def weight_grads(work) -> dict:
    """W: the gradients of a piece from its weight half's work, [(function, arguments)]."""
    grads = {}
    for fn, args in work:
        grads |= fn(*args)
    return grads
