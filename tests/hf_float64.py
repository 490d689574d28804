"""Hugging Face's Llama and Mixtral computed in the model's own dtype throughout, for float64 oracles.

transformers computes four things in float32 whatever the model's dtype, on purpose (it serves
bf16 and fp16 models): RMSNorm's statistics (LlamaRMSNorm casts its input to float32), the rotary
angles (LlamaRotaryEmbedding computes inv_freq and the angles in float32), the softmax of eager
attention (`softmax(..., dtype=torch.float32)`) and Mixtral's router softmax
(`softmax(router_logits.float())`). In a float64 model each of these rounds to float32's 6e-8, far
above the 1e-10 of the float64 contract. `compute_in_input_dtype` replaces exactly these four with
transformers' own code less the cast, for the duration of a test (pytest's monkeypatch);
tests/test_llama_hf.py shows that each replacement gives transformers' result bit for bit on
float32 inputs, where the cast does nothing, so nothing else about them differs.
"""

from __future__ import annotations

import torch
from torch import nn


def rmsnorm_forward(self, hidden_states):
    """LlamaRMSNorm.forward without `.to(torch.float32)` and back."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states


def rotary_forward(self, x, position_ids):
    """LlamaRotaryEmbedding's default rope (compute_default_rope_parameters and forward) in x's
    dtype instead of float32."""
    base = self.config.rope_parameters["rope_theta"]
    dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def eager_attention(modeling):
    """`modeling`'s eager_attention_forward with the softmax in the query's dtype; repeat_kv (the
    grouped-query expansion) is the module's own."""
    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = modeling.repeat_kv(key, module.num_key_value_groups)
        value_states = modeling.repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        return attn_output, attn_weights
    return forward


def router_forward(self, hidden_states):
    """MixtralTopKRouter.forward without `router_logits.float()`."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = nn.functional.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def compute_in_input_dtype(monkeypatch, modeling, family: str) -> None:
    """Patches transformers' `modeling` module (modeling_llama or modeling_mixtral; `family` is its
    class prefix, "Llama" or "Mixtral") for the rest of the test."""
    monkeypatch.setattr(getattr(modeling, f"{family}RMSNorm"), "forward", rmsnorm_forward)
    monkeypatch.setattr(getattr(modeling, f"{family}RotaryEmbedding"), "forward", rotary_forward)
    monkeypatch.setattr(modeling, "eager_attention_forward", eager_attention(modeling))
    if hasattr(modeling, f"{family}TopKRouter"):
        monkeypatch.setattr(getattr(modeling, f"{family}TopKRouter"), "forward", router_forward)
