"""The single-device reference model, one API for every family, chosen by `ModelConfig.arch`:
GPT-2 (refpar/model/gpt.py), Llama (refpar/model/llama.py, with Mixtral's experts) and DeepSeek-V3
(refpar/model/deepseek.py), each with its Mixture of Experts (refpar/model/moe.py) described by the
family's `MOE`.

    params = init_params(config, seed)                     # or from_hf_state_dict(hf_state, config)
    logits = forward(params, tokens, config)                # (B, T, V)
    loss, grads = loss_and_grads(params, tokens, targets, config)
    hf_state = to_hf_state_dict(params_or_grads, config)    # Hugging Face's own keys

The Hugging Face keys are those of the family's checkpoint files: GPT2LMHeadModel's
(`transformer.wte.weight`, ..., GPT-2's Conv1D layout weight[in, out]; no lm_head.weight, which is
tied to wte) and LlamaForCausalLM's, MixtralForCausalLM's or DeepseekV3ForCausalLM's
(`model.embed_tokens.weight`, ..., weight[out, in]). `from_hf_state_dict` also takes what an HF
model's `state_dict()` returns.
"""

from __future__ import annotations

from refpar.config import ModelConfig
from refpar.model import deepseek, gpt, llama, moe

FAMILIES = {"gpt2": gpt, "llama": llama, "deepseek-v3": deepseek}


def family(config: ModelConfig):
    """The module that implements `config.arch`."""
    return FAMILIES[config.arch]


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and full shape, in the family's state-dict order."""
    return family(config).param_shapes(config)


def init_params(config: ModelConfig, seed: int) -> dict:
    """Every weight drawn full from one RNG key per parameter name (a shard is a slice of this)."""
    return family(config).init_params(config, seed)


def forward(params, tokens, config: ModelConfig):
    """tokens (B, T) -> logits (B, T, V), evaluation mode."""
    return family(config).forward(params, tokens, config)


def loss_and_grads(params, tokens, targets, config: ModelConfig, **options):
    """(mean loss, {name: gradient}); `options` as gpt.loss_and_grads takes them (seed, step,
    sample_ids, normalizer, training, moe, dloss, grad_dtype)."""
    return family(config).loss_and_grads(params, tokens, targets, config, **options)


def kv_cache_shape(config: ModelConfig):
    """What a KV cache keeps per token per layer (model/attention.py's CacheShape): K and V of every kv
    head (GPT-2, Llama), or MLA's one latent entry (DeepSeek-V3)."""
    return family(config).kv_cache_shape(config)


def moe_spec(config: ModelConfig) -> moe.MoESpec:
    """The family's MoE: its parameters' names, its router's layout and its expert MLP."""
    return family(config).MOE


def moe_layer(config: ModelConfig, weight: float = 1.0, grad_scale: float = 1.0, bias: dict | None = None):
    """The single-device MoE layer `loss_and_grads(..., moe=)` takes, for the family's `moe_spec`;
    `weight`, `grad_scale` and `bias` (the run's aux-free expert biases, layer -> (E,)) as in
    routing.route."""
    return moe.MoELayer(moe_spec(config), weight=weight, grad_scale=grad_scale, bias=bias)


def to_hf_state_dict(params_or_grads, config: ModelConfig) -> dict:
    """Parameters (or gradients) under Hugging Face's checkpoint keys, the same arrays."""
    return family(config).to_hf_state_dict(params_or_grads, config)


def from_hf_state_dict(state_dict, config: ModelConfig) -> dict:
    """refpar's parameters, in config.dtype, from an HF checkpoint's or model's state dict."""
    return family(config).from_hf_state_dict(state_dict, config)
