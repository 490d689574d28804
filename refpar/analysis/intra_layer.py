"""Closed forms for tensor, sequence and context parallelism: what each rank holds and what it sends.

Legend: B batch (this rank's dp share), T sequence, C channels, nh heads, hs head size, V vocab,
L layers, t tp size, c cp size, e bytes per element; Ta tokens inside a tensor-parallel region,
Tl tokens of the residual stream on this rank.

Bytes per rank per step (`expected_calls` lists every call, in order, so a test can compare the
trace call by call; each call's bytes come from refpar.comm.cost):
- TP (Narayanan et al. 2021 §3.2): per block 4 all-reduces of (B, T, C), 2 forward (g) and 2
  backward (f); plus one for the vocab-parallel embedding (g), one before the LM head (f backward)
  and three of (B, T) in the vocab-parallel cross-entropy (max, sum of exponentials, target logit).
- TP+SP (Korthikanti et al. 2022 §4.2.2): each all-reduce becomes a reduce-scatter and an
  all-gather, the same bytes; plus, as in Megatron-LM, an all-gather per column-parallel linear in
  backward that re-gathers the input it kept sharded; plus one all-reduce of the gradients of the
  parameters of the sequence-sharded region.
- Ring attention: per layer c-1 K/V blocks (2, B, nh, Tk, hs) forward, c-1 again backward and c
  blocks of their gradients; each an isend on this rank and an irecv from the previous one.
- Ulysses (Jacobs et al. 2023): per layer one all-to-all of q, k, v and one of the output forward,
  the same two backward.
- dp x cp (the ranks holding the same weights): one all-reduce of every gradient this rank holds
  (DP's one bucket), and one of the loss (1 float64).

Mixed precision (e = 2): activations, their gradients, K/V blocks and all-to-alls move in 16 bits;
what is computed in float32 moves in float32 (4 bytes, `compute_itemsize`): the cross-entropy's
three all-reduces and ring attention's travelling dK/dV accumulators; gradients move in their own
dtype (`grad_itemsize`: 4 with fp32_grads); fp16 adds one all-reduce of a float32 overflow flag over
tp (`found_inf.tp`), the axis whose ranks hold different gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refpar.comm import cost
from refpar.config import ModelConfig, TrainConfig
from refpar.holdings import held_numels, kv_heads_per_rank, names, sequence_parallel_param_names
from refpar.model import param_shapes
from refpar.sharding import shard_range, shard_sizes


@dataclass(frozen=True)
class RankShape:
    """The sizes one rank works with, from the mesh and its coordinates."""

    B: int  # this rank's samples
    T: int
    Ta: int  # tokens inside a tp region
    Tl: int  # tokens of the residual stream
    t: int
    c: int
    nh: int  # heads of this tp rank
    V: int  # vocabulary rows of this tp rank
    e: int  # bytes per element
    cp_tokens: tuple[int, ...]  # tokens on each cp rank
    cp_rank: int


def compute_itemsize(e: int) -> int:
    """Bytes per element of what a 16-bit op computes in (float32); e itself for float32/64."""
    return 4 if e == 2 else e


def grad_itemsize(model: ModelConfig, train: TrainConfig) -> int:
    """Bytes per gradient element: the parameters' dtype, float32 with fp32_grads."""
    return 4 if train.fp32_grads else np.dtype(model.dtype).itemsize


def zigzag_lengths(T: int, c: int) -> list[int]:
    """Tokens of each cp rank when rank r holds chunks r and 2c-1-r of 2c (ring attention)."""
    chunks = shard_sizes(T, 2 * c)
    return [chunks[r] + chunks[2 * c - 1 - r] for r in range(c)]


def cp_tokens(T: int, c: int, cp_algo: str | None) -> list[int]:
    """Tokens of each cp rank: zig-zag chunks under ring attention, contiguous under Ulysses."""
    if c == 1:
        return [T]
    return zigzag_lengths(T, c) if (cp_algo or "ring") == "ring" else shard_sizes(T, c)


def rank_shape(model: ModelConfig, train: TrainConfig, sizes: dict, coords: dict, sp: bool,
               cp_algo: str | None, b: int | None = None) -> RankShape:
    """The sizes of the rank at `coords` (missing axes are 1): `b` rows (default its dp share of the
    batch), its cp rank's tokens, and under sp the residual stream's shard of them."""
    t, k, c, q = sizes.get("tp", 1), coords.get("tp", 0), sizes.get("cp", 1), coords.get("cp", 0)
    if b is None:
        b = len(range(*shard_range(train.batch_size, sizes.get("dp", 1), coords.get("dp", 0))))
    tokens = cp_tokens(train.seq_len, c, cp_algo)
    return RankShape(B=b, T=train.seq_len, Ta=tokens[q], Tl=shard_sizes(tokens[q], t)[k] if sp else tokens[q],
                     t=t, c=c, nh=model.n_head // t, V=shard_sizes(model.vocab_size, t)[k],
                     e=np.dtype(model.dtype).itemsize, cp_tokens=tuple(tokens), cp_rank=q)


@dataclass(frozen=True)
class Call:
    axis: str
    op: str
    tag: str
    bytes_sent: int
    bytes_recv: int


def _tp_calls(model: ModelConfig, s: RankShape, sp: bool, tp_rank: int, grad_e: int | None = None
              ) -> list[Call]:
    t, e, C, L = s.t, s.e, model.n_embd, model.n_layer
    act = s.B * s.Ta * C  # elements of a (B, Ta, C) activation

    def ar(tag, n, size=e):
        b = cost.all_reduce_bytes(n, t, tp_rank, size)
        return Call("tp", "all_reduce", tag, b.sent, b.recv)

    def ag(tag):  # (Tl, B, C) pieces -> (Ta, B, C): the sequence, or this cp rank's tokens
        b = cost.all_gather_bytes(shard_sizes(s.Ta, t), tp_rank, e, s.B * C)
        return Call("tp", "all_gather", tag, b.sent, b.recv)

    def rs(tag):  # (Ta, B, C) -> (Tl, B, C)
        b = cost.reduce_scatter_bytes(s.Ta, t, tp_rank, e, s.B * C)
        return Call("tp", "reduce_scatter", tag, b.sent, b.recv)

    ce = [ar(f"lm_head.ce.{k}:fwd", s.B * s.Ta, compute_itemsize(e)) for k in ("max", "sumexp", "target")]
    # Llama's blocks move what GPT-2's do (llama_pieces.py), under other tags
    embed = names(model).embedding.removesuffix(".weight")  # wte, model.embed_tokens
    if not sp:
        calls = [ar(f"{embed}:fwd", act)]
        for i in range(L):
            calls += [ar(f"h.{i}.attn.c_proj:fwd", act), ar(f"h.{i}.mlp.c_proj:fwd", act)]
        calls += ce + [ar("lm_head:bwd", act)]
        for i in reversed(range(L)):
            calls += [ar(f"h.{i}.mlp.c_fc:bwd", act), ar(f"h.{i}.attn.c_attn:bwd", act)]
        return calls
    calls = [rs(f"{embed}:fwd")]
    for i in range(L):
        calls += [ag(f"h.{i}.attn.c_attn:fwd"), rs(f"h.{i}.attn.c_proj:fwd"),
                  ag(f"h.{i}.mlp.c_fc:fwd"), rs(f"h.{i}.mlp.c_proj:fwd")]
    calls += [ag("lm_head:fwd"), *ce, ag("lm_head:regather"), rs("lm_head:bwd")]
    for i in reversed(range(L)):
        for sub, col in (("mlp", "c_fc"), ("attn", "c_attn")):
            calls += [ag(f"h.{i}.{sub}.c_proj:bwd"), ag(f"h.{i}.{sub}.{col}:regather"),
                      rs(f"h.{i}.{sub}.{col}:bwd")]
    shapes = param_shapes(model)
    sp_numel = sum(math.prod(shapes[n]) for n in sequence_parallel_param_names(model))
    calls += [ag(f"{embed}:bwd"), ar("sp.replicated_grads:bwd", sp_numel, grad_e or e)]
    return calls


def _ring_calls(model: ModelConfig, s: RankShape, kv_width: int | None = None) -> list[Call]:
    """`kv_width`: a K/V block's elements per row and token (default 2 hs times the rank's kv heads;
    DeepSeek-V3's heads times dn + dr + dv, analysis/latent_attention.py)."""
    c, r, hs = s.c, s.cp_rank, model.head_size
    kv = kv_heads_per_rank(model, s.t)  # Llama's K/V blocks carry its kv heads alone
    width = 2 * kv * hs if kv_width is None else kv_width
    block = [s.B * width * n for n in s.cp_tokens]  # elements of each rank's K/V block

    def hop(tag, step, e=s.e):  # the block held at `step` goes to rank+1; rank-1's arrives
        return [Call("cp", "isend", tag, block[(r - step) % c] * e, 0),
                Call("cp", "irecv", tag, 0, block[(r - step - 1) % c] * e)]

    calls = []
    for i in range(model.n_layer):
        for step in range(c - 1):
            calls += hop(f"h.{i}.attn.ring_kv:fwd", step)
    for i in reversed(range(model.n_layer)):
        for step in range(c):
            if step < c - 1:
                calls += hop(f"h.{i}.attn.ring_kv:bwd", step)
            calls += hop(f"h.{i}.attn.ring_dkv:bwd", step, compute_itemsize(s.e))  # float32 sums
    return calls


def _ulysses_calls(model: ModelConfig, s: RankShape, widths: tuple[int, int, int] | None = None
                   ) -> list[Call]:
    """`widths`: q's, k's and v's head widths (default hs each; DeepSeek-V3's dn + dr, dn + dr, dv,
    the output's v's)."""
    c, r = s.c, s.cp_rank
    seqs, kv = list(s.cp_tokens), kv_heads_per_rank(model, s.t)  # Llama's k and v: its kv heads
    wq, wk, wv = (model.head_size,) * 3 if widths is None else widths

    def a2a(tag, arrays, to_heads):  # `arrays`: (head count, width) of q, k, v or of the output
        # of each rank's share, heads times their width
        heads = [sum(shard_sizes(n, c)[d] * w for n, w in arrays) for d in range(c)]
        if to_heads:  # my tokens of each rank's heads out, my heads of each rank's tokens in
            send = [s.B * heads[d] * seqs[r] for d in range(c)]
            recv = [s.B * heads[r] * seqs[q] for q in range(c)]
        else:
            send = [s.B * heads[r] * seqs[d] for d in range(c)]
            recv = [s.B * heads[q] * seqs[r] for q in range(c)]
        b = cost.all_to_all_bytes(send, recv, r, s.e)
        return Call("cp", "all_to_all", tag, b.sent, b.recv)

    qkv, y = ((s.nh, wq), (kv, wk), (kv, wv)), ((s.nh, wv),)
    calls = []
    for i in range(model.n_layer):
        calls += [a2a(f"h.{i}.attn.ulysses_qkv:fwd", qkv, True), a2a(f"h.{i}.attn.ulysses_out:fwd", y, False)]
    for i in reversed(range(model.n_layer)):
        calls += [a2a(f"h.{i}.attn.ulysses_out:bwd", y, True), a2a(f"h.{i}.attn.ulysses_qkv:bwd", qkv, False)]
    return calls


def expected_calls(model: ModelConfig, train: TrainConfig, sizes: dict, coords: dict, sp: bool = False,
                   cp_algo: str | None = None) -> list[Call]:
    """Every communication call of one training step on the rank at `coords`, in program order
    within each axis."""
    s = rank_shape(model, train, sizes, coords, sp, cp_algo)
    ge = grad_itemsize(model, train)
    calls = _tp_calls(model, s, sp, coords.get("tp", 0), ge) if s.t > 1 else []
    if s.c > 1:
        calls += _ring_calls(model, s) if (cp_algo or "ring") == "ring" else _ulysses_calls(model, s)
    grads = sum(held_numels(model, {"pp": 1, "ep": 1, "tp": s.t},  # every parameter, tp-sliced
                            {"pp": 0, "ep": 0, "tp": coords.get("tp", 0)}).values())
    c, d = sizes.get("cp", 1), sizes.get("dp", 1)
    if c * d > 1:  # the ranks holding the same weights: dp x cp (axis dp without cp)
        axis, rank = ("dp" if c == 1 else "dp_cp"), coords.get("dp", 0) * c + coords.get("cp", 0)
        # every gradient in one bucket, then the loss, a float64 whatever the model's dtype
        for tag, n, e in (("bucket.0:grad", grads, ge), ("loss", 1, 8)):
            b = cost.all_reduce_bytes(n, c * d, rank, e)
            calls.append(Call(axis, "all_reduce", tag, b.sent, b.recv))
    if model.dtype == "float16" and s.t > 1:  # the tp ranks agree on an overflow
        b = cost.all_reduce_bytes(1, s.t, coords.get("tp", 0), 4)
        calls.append(Call("tp", "all_reduce", "found_inf.tp", b.sent, b.recv))
    return calls


def paper_bytes_per_layer(kind: str, B: int, T: int, C: int, p: int, e: int) -> float:
    """Bytes one rank sends per transformer layer per step, as the papers write them (sizes that
    divide evenly; p the tp or cp size). `expected_calls` reduces to these (tests check it).

    tp:      4 all-reduces of BTC, 2(p-1)/p each (Narayanan et al. 2021 §3.2)
    sp:      4 (reduce-scatter, all-gather) pairs, (p-1)/p each, the same as tp (Korthikanti et
             al. 2022 §4.2.2), plus the 2 all-gathers that re-gather c_attn's and c_fc's input
    ring:    K and V of BTC/p each: p-1 hops forward, p-1 backward, and their gradients p hops
    ulysses: q, k, v and the output, each BTC/p, forward and backward, (p-1)/p of it leaving the rank
             (Jacobs et al. 2023: 4 all-to-alls of Nh/P per layer, each way)
    """
    n = B * T * C * e
    if kind == "tp":
        return 4 * 2 * (p - 1) / p * n
    if kind == "sp":
        return (4 * 2 + 2) * (p - 1) / p * n
    if kind == "ring":
        return ((p - 1) + (p - 1) + p) * 2 * n / p
    if kind == "ulysses":
        return 2 * 4 * (p - 1) / p * n / p
    raise ValueError(f"unknown kind {kind!r}; use tp, sp, ring or ulysses")
