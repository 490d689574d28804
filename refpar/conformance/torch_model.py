"""refpar's GPT-2 in torch.nn, with nn.Linear layers so that DTensor's ColwiseParallel and
RowwiseParallel (which accept only nn.Linear and nn.Embedding) can shard it.

Legend: B batch, T sequence, C channels, nh heads, hs head size, V vocab.

Parameter names are GPT-2's (`h.0.attn.c_attn.weight`, ...); GPT-2 stores Conv1D weights as
weight[in, out] and nn.Linear as weight[out, in], so `load_gpt2` and `to_gpt2` transpose the
2-D weights of the linear layers. Dropout is off in every conformance case (p = 0); the dumps
for `refpar check` pass keep masks in (`masks={(layer, site): bool tensor}`, refpar's sites).

Attention takes its number of heads from the width it receives (3C/tp under tensor
parallelism: ColwiseParallel hands each rank its heads as a plain local tensor), and splits q, k,
v as consecutive thirds of that width; `qkv_row_order` gives the row order of c_attn that makes
each rank's contiguous chunk hold its own heads of q, k and v.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def drop(x, keep, p: float):
    """Inverted dropout with a given keep mask (None: no dropout)."""
    return x if keep is None else x * keep.to(x.dtype) / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, C: int, hs: int):
        super().__init__()
        self.hs = hs
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x, keep_att=None, p=0.0):
        B, T, _ = x.shape
        qkv = self.c_attn(x)  # (B, T, 3C/tp)
        nh = qkv.shape[-1] // (3 * self.hs)  # this rank's heads
        q, k, v = (t.reshape(B, T, nh, self.hs).transpose(1, 2) for t in qkv.split(nh * self.hs, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hs)  # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (drop(att, keep_att, p) @ v).transpose(1, 2).reshape(B, T, nh * self.hs)  # (B, T, C/tp)
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, C: int):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C: int, hs: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = Attention(C, hs)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = MLP(C)

    def forward(self, x, masks=None, p=0.0):
        masks = masks or {}
        x = x + drop(self.attn(self.ln_1(x), masks.get("attn"), p), masks.get("attn_resid"), p)
        return x + drop(self.mlp(self.ln_2(x)), masks.get("mlp_resid"), p)


class GPT2(nn.Module):
    """tokens (B, T) -> logits (B, T, V); the head is `wte` (tied)."""

    def __init__(self, config):
        super().__init__()
        C, eps = config.n_embd, config.layer_norm_eps
        self.wte = nn.Embedding(config.vocab_size, C)
        self.wpe = nn.Embedding(config.n_positions, C)
        self.h = nn.ModuleList(Block(C, config.head_size, eps) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(C, eps=eps)

    def forward(self, tokens, masks=None, p=0.0):
        masks = masks or {}
        T = tokens.shape[1]
        x = drop(self.wte(tokens) + self.wpe(torch.arange(T)), masks.get((0, "embd")), p)  # (B, T, C)
        for i, block in enumerate(self.h):
            x = block(x, {s: m for (layer, s), m in masks.items() if layer == i}, p)
        return self.ln_f(x) @ self.wte.weight.t()  # (B, T, V)


def is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{k}." in name for k in LINEARS)


def to_torch_layout(name: str, a: np.ndarray) -> np.ndarray:
    """GPT-2 (Conv1D weight[in, out]) -> nn.Linear weight[out, in]; everything else unchanged."""
    return a.T if is_linear_weight(name) else a


def to_gpt2_layout(name: str, a: np.ndarray) -> np.ndarray:
    return a.T if is_linear_weight(name) else a


def qkv_row_order(C: int, hs: int, tp: int) -> np.ndarray:
    """Rows of c_attn (q, k, v stacked) reordered so that chunk r of tp holds [q, k, v] of rank r's
    heads: the fused-QKV interleaving a tensor-parallel GPT-2 needs (refpar keeps GPT-2's order and
    slices q, k and v separately; refpar.parallel.tensor_parallel.tp_param_slices)."""
    nh = C // hs
    per = nh // tp
    rows = []
    for r in range(tp):
        cols = np.arange(r * per * hs, (r + 1) * per * hs)
        rows += [cols, C + cols, 2 * C + cols]
    return np.concatenate(rows)


def build(config, params: dict, dtype) -> GPT2:
    """The torch model holding refpar's parameters (a GPT-2 state dict), in `dtype`."""
    model = GPT2(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.ascontiguousarray(to_torch_layout(name, params[name]))))
    return model
