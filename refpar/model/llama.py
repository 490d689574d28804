"""Llama (Touvron et al. 2023) on one device, exactly Hugging Face's LlamaForCausalLM: the second
model family every strategy must reproduce.

Legend: B batch, T sequence, C channels, nh query heads, nkv key/value heads, hs head size (C // nh),
F the SwiGLU width (intermediate_size), V vocab, L layers.
Pre-RMSNorm blocks, rotary positions (no position table), SwiGLU MLP, grouped-query attention, no
biases, no dropout; the head `lm_head` is its own (V, C) matrix unless `tie_embeddings`. In the
blocks of `config.moe_blocks` Mixtral's experts (Jiang et al. 2024) replace the MLP: refpar/model/moe.py's
layer with `MOE`, Hugging Face's MixtralSparseMoeBlock under its names (below).

Parameters are a flat dict keyed by Hugging Face's own state-dict names, in its layout (every
matrix (out, in), torch.nn.Linear's): model.embed_tokens.weight, model.layers.{i}.self_attn.
{q,k,v,o}_proj.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.
{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight. They are the names a
Llama user knows from the checkpoint files, so loading and saving copies no tensor and renames
none, and every tag a strategy prints ("model.layers.3.self_attn.k_proj") is one HF, torchtitan
and Megatron users recognise. (GPT-2 keeps GPT2Model's names, which refpar has always used.)

The pieces are public, as gpt.py's, so that strategies and pipeline stages reuse them:

    x, ce = embed_forward(tokens, params)
    x, cb = block_forward(x, params, layer, config)            # for each layer
    loss, ch = head_forward(x, params, targets, config, normalizer)
    dx, grads = head_backward(ch); dx, g = block_backward(dx, cb); g = embed_backward(dx, ce)
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, device

from refpar import rng
from refpar.config import ModelConfig
from refpar.model.attention import CacheShape, multi_head_cache
from refpar.model.gpt import merge_heads, split_heads
from refpar.model.layers import add_grads, as_like, cross_entropy_backward, cross_entropy_forward
from refpar.model.llama_layers import (
    gqa_attention_backward,
    gqa_attention_forward,
    linear_t_backward,
    linear_t_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    rope_cos_sin,
    rope_forward,
    swiglu_mlp_backward,
    swiglu_mlp_forward,
    token_embedding_backward,
    token_embedding_forward,
)
from refpar.model.moe import MoELayer, MoESpec, SwiGLUMLP, router_loss, unfuse_experts
from refpar.precision import dtype_of

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# Mixtral's sparse MoE block under the names of its checkpoint files (what HF's `save_pretrained`
# writes and the released Mixtral-8x7B holds), torch.nn.Linear's (out, in):
#   model.layers.{i}.block_sparse_moe.gate.weight           (E, C)  the router
#   model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight (F, C)  gate
#   model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight (F, C)  up
#   model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight (C, F)  down: expert(x) = w2(silu(w1 x) * w3 x)
# Its routing is HF's MixtralSparseMoeBlock's when dropless with k >= 2; a capacity, when set, drops as
# for GPT-2's experts. The router losses are refpar's, per block (refpar/model/routing.py); HF's
# `load_balancing_loss_func` pools all layers' router logits and is off by default
# (`output_router_logits=False`), so a comparison with HF sets both loss weights to 0.
# Shared experts (refpar's names; MixtralForCausalLM has none): SwiGLU MLPs of the experts' shape,
#   model.layers.{i}.block_sparse_moe.shared_experts.{s}.w1/w3/w2.weight
MOE = MoESpec(router="model.layers.{layer}.block_sparse_moe.gate.weight",
              experts="model.layers.{layer}.block_sparse_moe.experts.{expert}",
              shared="model.layers.{layer}.block_sparse_moe.shared_experts.{expert}",
              router_out_in=True, mlp=SwiGLUMLP())


# ------------------------------------------------------------------------------------ parameters
def head_name(config: ModelConfig) -> str:
    """The (V, C) matrix the head multiplies by: lm_head.weight, or the embedding when tied."""
    return EMBED if config.tie_embeddings else LM_HEAD


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and full shape, in the order of LlamaForCausalLM's state dict."""
    V, C, F = config.vocab_size, config.n_embd, config.intermediate_size
    kv = config.n_kv_head * config.head_size  # K and V are (kv, C): grouped-query attention
    shapes: dict[str, tuple[int, ...]] = {EMBED: (V, C)}
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (C, C), p + "self_attn.k_proj.weight": (kv, C),
            p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, C),
        })
        if i in config.moe_blocks:
            shapes.update(MOE.param_shapes(config, i))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                           p + "mlp.down_proj.weight": (C, F)})
        shapes.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,)})
    shapes[FINAL_NORM] = (C,)
    if not config.tie_embeddings:
        shapes[LM_HEAD] = (V, C)
    return shapes


def kv_cache_shape(config: ModelConfig) -> CacheShape:
    """What a KV cache keeps per token per layer: K and V of every kv head (grouped-query attention)."""
    return multi_head_cache(config.n_kv_head, config.head_size, config.n_head)


def init_params(config: ModelConfig, seed: int) -> dict:
    """HF's Llama init: every matrix normal(0, init_std) (its initializer_range, 0.02), the RMSNorm
    gains 1. Drawn as gpt.init_params draws: the full tensor from one RNG key per parameter name, so
    a shard is a slice of this; in float64, rounded once to config.dtype. (GPT-2 also scales its
    residual projections by 1/sqrt(2L); HF's Llama does not.)"""
    dtype = dtype_of(config.dtype)
    params = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("layernorm.weight") or name == FINAL_NORM:
            params[name] = np.ones(shape, dtype)
        else:
            draw = rng.normal(seed, "init", rng.name_id(name), shape=shape)
            params[name] = (draw * config.init_std).astype(dtype)
    return params


# ----------------------------------------------------------------------------------------- embed
def embed_forward(tokens, params, drop=None):
    """tokens (B, T) -> x (B, T, C). `drop`, GPT-2's dropout context, is accepted so that a pipeline
    stage calls either family's pieces alike; Llama has no dropout."""
    return token_embedding_forward(tokens, params[EMBED])


def embed_backward(dx, cache) -> dict:
    """-> {"model.embed_tokens.weight": (V, C)}; a tied head adds its share (`add_embedding_grads`)."""
    return {EMBED: token_embedding_backward(dx, cache)}


def add_embedding_grads(grads: dict, g: dict) -> dict:
    """Folds the embedding's gradient `g` into `grads`, added to the tied head's share when `grads`
    already holds one."""
    return add_grads(grads, {EMBED: g[EMBED]})


# ----------------------------------------------------------------------------------------- block
def _positions(x, T, positions):
    """The rows' global positions: 0..T-1 unless given (a sequence or context shard's own)."""
    if positions is None:
        return array_namespace(x).arange(T, device=device(x))  # (T,)
    return positions


def block_forward(x, params, layer: int, config: ModelConfig, drop=None, positions=None, moe=None):
    """x (B, T, C) -> y (B, T, C): x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)).
    `positions` (T,) are the global positions of x's rows (default 0..T-1): they set both RoPE's
    angles and the causal mask. In the blocks of `config.moe_blocks` the MLP is `moe.forward`
    (default the single-device `MoELayer` of `MOE`). `drop` as in `embed_forward`."""
    p = f"model.layers.{layer}."
    P = params
    T = x.shape[1]
    positions = _positions(x, T, positions)  # (T,)
    eps = config.norm_eps
    cos, sin = rope_cos_sin(positions, config.head_size, config.rope_theta, x)  # (T, hs) each

    a, c_ln1 = rmsnorm_forward(x, P[p + "input_layernorm.weight"], eps)  # (B, T, C)
    q, c_q = linear_t_forward(a, P[p + "self_attn.q_proj.weight"])  # (B, T, C)
    k, c_k = linear_t_forward(a, P[p + "self_attn.k_proj.weight"])  # (B, T, nkv * hs)
    v, c_v = linear_t_forward(a, P[p + "self_attn.v_proj.weight"])  # (B, T, nkv * hs)
    q, c_rq = rope_forward(split_heads(q, config.n_head), cos, sin)  # (B, nh, T, hs)
    k, c_rk = rope_forward(split_heads(k, config.n_kv_head), cos, sin)  # (B, nkv, T, hs)
    v = split_heads(v, config.n_kv_head)  # (B, nkv, T, hs)
    o, c_sdpa = gqa_attention_forward(q, k, v, positions, positions)  # (B, nh, T, hs)
    o, c_o = linear_t_forward(merge_heads(o), P[p + "self_attn.o_proj.weight"])  # (B, T, C)
    x1 = x + o  # (B, T, C)

    m, c_ln2 = rmsnorm_forward(x1, P[p + "post_attention_layernorm.weight"], eps)  # (B, T, C)
    if layer in config.moe_blocks:
        moe = MoELayer(MOE) if moe is None else moe
        m, c_mlp = moe.forward(m, P, layer, config)  # (B, T, C)
    else:
        moe = None  # a dense block
        m, c_mlp = swiglu_mlp_forward(m, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                                      P[p + "mlp.down_proj.weight"])  # (B, T, C)
    y = x1 + m  # (B, T, C)
    cache = (layer, config.n_head, c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, moe, c_mlp)
    return y, cache


def block_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), {name: grad} for this block's parameters)."""
    layer, n_head, c_ln1, c_q, c_k, c_v, c_rq, c_rk, c_sdpa, c_o, c_ln2, moe, c_mlp = cache
    p = f"model.layers.{layer}."
    g = {}

    if moe is not None:  # a MoE block
        dm, g_moe = moe.backward(dy, c_mlp)  # (B, T, C)
        g.update(g_moe)
    else:
        dm, g[p + "mlp.gate_proj.weight"], g[p + "mlp.up_proj.weight"], g[p + "mlp.down_proj.weight"] = (
            swiglu_mlp_backward(dy, c_mlp))  # (B, T, C)
    dm, g[p + "post_attention_layernorm.weight"] = rmsnorm_backward(dm, c_ln2)  # (B, T, C)
    dx1 = dy + dm  # (B, T, C)

    do, g[p + "self_attn.o_proj.weight"] = linear_t_backward(dx1, c_o)  # (B, T, C)
    dq, dk, dv = gqa_attention_backward(split_heads(do, n_head), c_sdpa)  # (B, nh|nkv, T, hs)
    dq = merge_heads(rope_backward(dq, c_rq))  # (B, T, C)
    dk = merge_heads(rope_backward(dk, c_rk))  # (B, T, nkv * hs)
    da, g[p + "self_attn.q_proj.weight"] = linear_t_backward(dq, c_q)  # (B, T, C)
    da_k, g[p + "self_attn.k_proj.weight"] = linear_t_backward(dk, c_k)  # (B, T, C)
    da_v, g[p + "self_attn.v_proj.weight"] = linear_t_backward(merge_heads(dv), c_v)  # (B, T, C)
    da, g[p + "input_layernorm.weight"] = rmsnorm_backward(da + da_k + da_v, c_ln1)  # (B, T, C)
    dx = dx1 + da  # (B, T, C)
    return dx, g


def block_router_loss(cache):
    """The MoE router losses of a block's forward (0.0 for a dense block); `block_backward`
    includes their gradients."""
    moe, c_mlp = cache[-2:]
    return 0.0 if moe is None else router_loss(c_mlp)


# ------------------------------------------------------------------------------------------ head
def logits_forward(x, params, config: ModelConfig):
    """x (B, T, C) -> logits (B, T, V) and the cache: model.norm, then x @ head.T."""
    xf, c_norm = rmsnorm_forward(x, params[FINAL_NORM], config.norm_eps)  # (B, T, C)
    logits, c_head = linear_t_forward(xf, params[head_name(config)])  # (B, T, V)
    return logits, (c_norm, c_head, head_name(config))


def head_forward(x, params, targets, config: ModelConfig, normalizer):
    """x (B, T, C), targets (B, T) -> loss = sum of token losses / normalizer (a 0-d array)."""
    logits, c_logits = logits_forward(x, params, config)  # (B, T, V)
    loss, c_ce = cross_entropy_forward(logits, targets, normalizer)  # ()
    return loss, (c_logits, c_ce)


def head_backward(cache, dloss=1.0):
    """-> (dx (B, T, C), {"model.norm.weight", the head matrix's name: (V, C)})."""
    (c_norm, c_head, head), c_ce = cache
    dlogits = cross_entropy_backward(dloss, c_ce)  # (B, T, V)
    dxf, dhead = linear_t_backward(dlogits, c_head)  # (B, T, C), (V, C)
    dx, dnorm = rmsnorm_backward(dxf, c_norm)  # (B, T, C)
    return dx, {FINAL_NORM: dnorm, head: dhead}


# ----------------------------------------------------------------------------------- whole model
def forward(params, tokens, config: ModelConfig):
    """tokens (B, T) -> logits (B, T, V)."""
    tokens = as_like(tokens, params[EMBED])
    x, _ = embed_forward(tokens, params)  # (B, T, C)
    for layer in range(config.n_layer):
        x, _ = block_forward(x, params, layer, config)  # (B, T, C)
    logits, _ = logits_forward(x, params, config)  # (B, T, V)
    return logits


def loss_and_grads(params, tokens, targets, config: ModelConfig, *, normalizer=None, moe=None, dloss=1.0,
                   grad_dtype=None, seed=0, step=0, sample_ids=None, training=True):
    """Mean cross-entropy over the batch (sum / normalizer, default B*T), plus the router losses of
    the MoE blocks (`moe`: their layer object, default the single-device one), and every parameter's
    gradient. `dloss` and `grad_dtype` as in gpt.loss_and_grads (fp16 loss scale; fp32 gradient
    sums). `seed`, `step`, `sample_ids` and `training` key GPT-2's dropout masks; Llama has no
    dropout, so they change nothing here: they are accepted so that `refpar.model.loss_and_grads` is
    one call for both families."""
    emb = params[EMBED]
    tokens, targets = as_like(tokens, emb), as_like(targets, emb)
    B, T = tokens.shape
    normalizer = B * T if normalizer is None else normalizer
    if moe is None and dloss != 1.0 and config.moe_blocks:
        moe = MoELayer(MOE, grad_scale=dloss)  # the router losses' gradients scale too

    x, c_embed = embed_forward(tokens, params)  # (B, T, C)
    c_blocks = []
    for layer in range(config.n_layer):
        x, c = block_forward(x, params, layer, config, moe=moe)  # (B, T, C)
        c_blocks.append(c)
    loss, c_head = head_forward(x, params, targets, config, normalizer)
    loss = loss + sum(block_router_loss(c) for c in c_blocks)  # MoE blocks' router losses

    dx, grads = head_backward(c_head, dloss)  # (B, T, C)
    for layer in reversed(range(config.n_layer)):
        dx, g = block_backward(dx, c_blocks[layer])  # (B, T, C)
        grads.update(g)
    g = embed_backward(dx, c_embed)
    if grad_dtype is not None:
        xp = array_namespace(emb)
        grads, g = ({n: xp.astype(a, grad_dtype) for n, a in d.items()} for d in (grads, g))
    add_embedding_grads(grads, g)  # tied: head and embedding add
    return float(loss), {name: grads[name] for name in params}


# ------------------------------------------------------------------------ Hugging Face state dict
def to_hf_state_dict(params_or_grads, config: ModelConfig) -> dict:
    """The dict under Hugging Face's checkpoint keys: refpar's own (a new dict, the same arrays). A
    tied head has no lm_head.weight, as HF's own checkpoint files have none."""
    return dict(params_or_grads)


def from_hf_state_dict(state_dict, config: ModelConfig) -> dict:
    """Parameters from a LlamaForCausalLM or MixtralForCausalLM state dict (arrays or anything
    `np.asarray` takes, e.g. CPU torch tensors): the checkpoint's keys, or a model's `state_dict()`
    (transformers >= 5 fuses Mixtral's experts there; a tied lm_head.weight must equal the
    embedding). Rotary `inv_freq` buffers, which older checkpoints saved, are ignored. Missing
    names, unknown names and wrong shapes raise ValueError naming the first one."""
    return params_from_hf(state_dict, config, param_shapes(config), MOE, config.n_layer,
                          ("rotary_emb.inv_freq",), "Llama")


def params_from_hf(state_dict, config: ModelConfig, shapes: dict, spec: MoESpec, n_layer: int,
                   buffers: tuple[str, ...], family: str) -> dict:
    """The parameters `shapes` (name -> shape), in config.dtype, from the HF state dict of a family
    with Llama's names outside its blocks (Llama, Mixtral, DeepSeek-V3): the fused experts of its
    `n_layer` blocks unfused as `spec` names them (moe.unfuse_experts), the keys ending in `buffers`
    skipped; `family` names the family in the ValueError."""
    dtype = dtype_of(config.dtype)
    state_dict = unfuse_experts(state_dict, spec, n_layer)
    params, extra = {}, []
    tied_head = None
    for key, value in state_dict.items():
        if key == LM_HEAD and config.tie_embeddings:
            tied_head = value
        elif key.endswith(buffers):
            continue
        elif key in shapes:
            array = np.asarray(value, dtype=dtype)
            if array.shape != shapes[key]:
                raise ValueError(f"{key} has shape {array.shape}, expected {shapes[key]} for this config")
            params[key] = array
        else:
            extra.append(key)
    missing = [name for name in shapes if name not in params]
    if missing:
        raise ValueError(f"the state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    if extra:
        raise ValueError(f"the state dict has {extra[0]}, which this {family} config does not")
    if tied_head is not None and not np.array_equal(np.asarray(tied_head, dtype=dtype), params[EMBED]):
        raise ValueError(f"lm_head.weight differs from {EMBED}, but this config ties them")
    return {name: params[name] for name in shapes}
