"""refpar's Llama in torch.nn, under Hugging Face's state-dict names, with nn.Linear layers so that
DTensor's ColwiseParallel and RowwiseParallel can shard it (refpar/conformance/cases.py, llama_tp).

Legend: B batch, T sequence, C channels, nh query heads, nkv kv heads, hs head size, F the SwiGLU
width, V vocab; a tensor-parallel rank sees nh/t query heads and nkv/t kv heads.

Written from the papers and HF's modeling_llama, not from refpar/model: RMSNorm (Zhang & Sennrich
2019), RoPE with `rotate_half` (Su et al. 2021), grouped-query attention with HF's `repeat_kv`
(Ainslie et al. 2023), SwiGLU (Shazeer 2020). Every weight is nn.Linear's [out, in], as HF and
refpar keep them, so loading is a copy under the same name. Attention takes its head counts from
the widths it receives (ColwiseParallel hands each rank its q rows and its k and v rows as plain
local tensors), so the same module runs whole and sharded. The rotary angles are computed in the
model's dtype (HF computes them in float32, which a float64 comparison cannot afford).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, C: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, C: int, nh: int, nkv: int, theta: float):
        super().__init__()
        self.hs, self.theta = C // nh, theta
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, nkv * self.hs, bias=False)
        self.v_proj = nn.Linear(C, nkv * self.hs, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        hs = self.hs
        q = self.q_proj(x).reshape(B, T, -1, hs).transpose(1, 2)  # (B, nh/t, T, hs)
        k = self.k_proj(x).reshape(B, T, -1, hs).transpose(1, 2)  # (B, nkv/t, T, hs)
        v = self.v_proj(x).reshape(B, T, -1, hs).transpose(1, 2)  # (B, nkv/t, T, hs)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, hs, 2, dtype=x.dtype) / hs)  # (hs/2,)
        angles = torch.arange(T, dtype=x.dtype)[:, None] * inv_freq  # (T, hs/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        q = q * angles.cos() + rotate_half(q) * angles.sin()
        k = k * angles.cos() + rotate_half(k) * angles.sin()
        groups = q.shape[1] // k.shape[1]  # query heads per kv head
        k = k.repeat_interleave(groups, dim=1)  # (B, nh/t, T, hs): HF's repeat_kv
        v = v.repeat_interleave(groups, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, nh/t, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)  # (B, T, C/t)
        return self.o_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, C: int, F: int):
        super().__init__()
        self.gate_proj = nn.Linear(C, F, bias=False)
        self.up_proj = nn.Linear(C, F, bias=False)
        self.down_proj = nn.Linear(F, C, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.input_layernorm = RMSNorm(C, config.norm_eps)
        self.self_attn = Attention(C, config.n_head, config.n_kv_head, config.rope_theta)
        self.post_attention_layernorm = RMSNorm(C, config.norm_eps)
        self.mlp = MLP(C, config.intermediate_size)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class Llama(nn.Module):
    """tokens (B, T) -> logits (B, T, V), an untied `lm_head` (LlamaForCausalLM's layout)."""

    def __init__(self, config):
        super().__init__()
        if config.tie_embeddings or config.moe_experts:
            raise ValueError("the torch Llama of the conformance cases is dense with an untied head")
        self.model = Body(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        for layer in self.model.layers:
            x = layer(x)  # (B, T, C)
        return self.lm_head(self.model.norm(x))  # (B, T, V)


def build(config, params: dict, dtype) -> Llama:
    """The torch model holding refpar's parameters (HF's names and layout), in `dtype`."""
    model = Llama(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.ascontiguousarray(params[name])))
    return model
