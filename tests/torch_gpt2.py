"""An independent GPT-2 in PyTorch, written the way Hugging Face's GPT2LMHeadModel is (Conv1D
layers with weight[in, out], a registered causal-mask buffer `attn.bias`, `transformer.` prefix,
`lm_head.weight` tied to `wte.weight`), used as the autograd oracle and as a state-dict source.

Dropout takes explicit keep masks (or none), so that the oracle applies exactly refpar's masks.
"""

import math

import torch
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's linear layer: y = x @ weight + bias, weight (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.02)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(
            *x.shape[:-1], self.weight.shape[1])


def drop(x, keep, p):
    return x if keep is None else x * keep.to(x.dtype) / (1.0 - p)


class Attention(nn.Module):
    def __init__(self, C, nh, P):
        super().__init__()
        self.nh = nh
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)
        self.register_buffer("bias", torch.tril(torch.ones(P, P, dtype=torch.bool)).view(1, 1, P, P))

    def forward(self, x, keep_att, keep_resid, p):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.nh)
        att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf")).softmax(dim=-1)
        y = (drop(att, keep_att, p) @ v).transpose(1, 2).reshape(B, T, C)
        return drop(self.c_proj(y), keep_resid, p)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)

    def forward(self, x, keep, p):
        return drop(self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh")), keep, p)


class Block(nn.Module):
    def __init__(self, C, nh, P):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = Attention(C, nh, P)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x, masks, p):
        x = x + self.attn(self.ln_1(x), masks.get("attn"), masks.get("attn_resid"), p)
        return x + self.mlp(self.ln_2(x), masks.get("mlp_resid"), p)


class Transformer(nn.Module):
    def __init__(self, V, P, C, nh, L):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(P, C)
        self.h = nn.ModuleList(Block(C, nh, P) for _ in range(L))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)


class GPT2LMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config
        self.transformer = Transformer(c.vocab_size, c.n_positions, c.n_embd, c.n_head, c.n_layer)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.p = c.dropout

    def forward(self, tokens, masks=None):
        """masks: {(layer, site): bool tensor} for the sites in refpar.model.dropout, or None."""
        masks = masks or {}
        tr = self.transformer
        T = tokens.shape[1]
        x = drop(tr.wte(tokens) + tr.wpe(torch.arange(T)), masks.get((0, "embd")), self.p)
        for i, block in enumerate(tr.h):
            site = {s: masks.get((i, s)) for s in ("attn", "attn_resid", "mlp_resid")}
            x = block(x, {s: m for s, m in site.items() if m is not None}, self.p)
        return self.lm_head(tr.ln_f(x))
