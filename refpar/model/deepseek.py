"""DeepSeek-V3 (Liu et al. 2024) on one device, exactly Hugging Face's DeepseekV3ForCausalLM: the third
model family every strategy must reproduce.

    python -m refpar train --model deepseek-tiny

Legend: B batch, T sequence, C channels, V vocab, F the dense SwiGLU width (intermediate_size), H an
expert's (moe_intermediate_size), E routed experts, S shared experts.
Llama's block (refpar/model/llama.py: pre-RMSNorm, SwiGLU, no biases, no dropout, untied head unless
`tie_embeddings`) with two changes: multi-head latent attention (refpar/model/mla.py) instead of
grouped-query attention, and after the first `first_k_dense_replace` blocks, which keep a dense MLP,
DeepSeekMoE's fine-grained experts (Dai et al. 2024): refpar/model/moe.py's layer with `MOE`, routed
by refpar/model/routing.py (sigmoid scores, aux-free bias, group-limited choice, norm_topk_prob,
routed_scaling_factor: the ModelConfig moe_* fields), plus S shared experts every token passes through.

Parameters are a flat dict under Hugging Face's checkpoint names, weight[out, in]:
model.embed_tokens.weight; model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight (q_proj.weight without q_lora_rank);
model.layers.{i}.mlp.{gate,up,down}_proj.weight in a dense block; in a MoE block
model.layers.{i}.mlp.gate.weight (E, C) the router, mlp.experts.{e}.{gate,up,down}_proj.weight
(H, C), (H, C), (C, H), and mlp.shared_experts.{gate,up,down}_proj.weight, one MLP of width S*H standing
for the S shared experts (as HF's DeepseekV3MoE holds them); model.layers.{i}.{input,
post_attention}_layernorm.weight, model.norm.weight, lm_head.weight. The router's aux-free bias
(HF's buffer mlp.gate.e_score_correction_bias) is no parameter: it is the run's `MoELayer(bias=)`
(`expert_biases` reads it from an HF state dict).

The pieces are public and named as llama.py's, which they reuse where the families agree (the
embedding, the head, the router losses):

    x, ce = embed_forward(tokens, params)
    x, cb = block_forward(x, params, layer, config)            # for each layer
    loss, ch = head_forward(x, params, targets, config, normalizer)
    dx, grads = head_backward(ch); dx, g = block_backward(dx, cb); g = embed_backward(dx, ce)
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import rng
from refpar.config import ModelConfig
from refpar.model.layers import add_grads, as_like
from refpar.model.llama import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    _positions,
    add_embedding_grads,
    block_router_loss,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
    head_name,
    logits_forward,
    params_from_hf,
)
from refpar.model.llama_layers import (
    rmsnorm_backward,
    rmsnorm_forward,
    swiglu_mlp_backward,
    swiglu_mlp_forward,
)
from refpar.model.mla import latent_cache, mla_backward, mla_forward, mla_param_shapes
from refpar.model.moe import MoELayer, MoESpec, SwiGLUMLP
from refpar.model.mtp import mtp_backward, mtp_forward, mtp_layer, mtp_param_shapes
from refpar.precision import dtype_of

# DeepSeekMoE under HF's DeepseekV3 checkpoint names: the router (E, C), each routed expert a SwiGLU
# of width moe_intermediate_size, and the S shared experts one SwiGLU of S times that width (no
# {expert} in its template).
MOE = MoESpec(router="model.layers.{layer}.mlp.gate.weight",
              experts="model.layers.{layer}.mlp.experts.{expert}",
              shared="model.layers.{layer}.mlp.shared_experts", router_out_in=True,
              mlp=SwiGLUMLP("gate_proj", "up_proj", "down_proj", width="moe_intermediate_size"))
EXPERT_BIAS = "model.layers.{layer}.mlp.gate.e_score_correction_bias"  # HF's buffer, not a parameter


# ------------------------------------------------------------------------------------ parameters
def is_moe(layer: int, config: ModelConfig) -> bool:
    """Whether block `layer` has experts: those of config.moe_blocks, and the multi-token prediction
    modules' blocks (indices n_layer and up) when the model has experts, as DeepSeek-V3's has."""
    return config.moe_experts > 0 and layer >= config.first_k_dense_replace


def block_param_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Block `layer`'s parameters by full name: attention, MLP (dense or MoE), the two norms."""
    C, F, p = config.n_embd, config.intermediate_size, f"model.layers.{layer}."
    shapes = mla_param_shapes(config, p + "self_attn.")
    if is_moe(layer, config):
        shapes.update(MOE.param_shapes(config, layer))
    else:
        shapes.update({p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                       p + "mlp.down_proj.weight": (C, F)})
    shapes.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,)})
    return shapes


kv_cache_shape = latent_cache  # what a KV cache keeps per token per layer: MLA's latent and rotary key


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and full shape, in the order of DeepseekV3ForCausalLM's checkpoint, then
    the multi-token prediction modules' (refpar/model/mtp.py), which that class has not."""
    V, C = config.vocab_size, config.n_embd
    shapes: dict[str, tuple[int, ...]] = {EMBED: (V, C)}
    for i in range(config.n_layer):
        shapes.update(block_param_shapes(config, i))
    shapes[FINAL_NORM] = (C,)
    if not config.tie_embeddings:
        shapes[LM_HEAD] = (V, C)
    for k in range(1, config.num_nextn_predict_layers + 1):
        shapes.update(mtp_param_shapes(config, k) | block_param_shapes(config, mtp_layer(config, k)))
    return shapes


def init_params(config: ModelConfig, seed: int) -> dict:
    """HF's DeepseekV3 init, as llama.init_params draws it: every matrix normal(0, init_std), every
    RMSNorm gain (the latent and MTP ones too) 1; one RNG key per parameter name, so a shard is a slice."""
    dtype = dtype_of(config.dtype)
    params = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, dtype)
        else:
            draw = rng.normal(seed, "init", rng.name_id(name), shape=shape)
            params[name] = (draw * config.init_std).astype(dtype)
    return params


# ----------------------------------------------------------------------------------------- block
def block_forward(x, params, layer: int, config: ModelConfig, drop=None, positions=None, moe=None,
                  attention=mla_forward):
    """x (B, T, C) -> y (B, T, C): x + mla(input_layernorm(x)), then + mlp(post_attention_layernorm(.)),
    the MLP dense in the first first_k_dense_replace blocks and `moe.forward` (default the
    single-device `MoELayer` of `MOE`) after. `positions` (T,) as in llama.block_forward; `drop` is
    accepted for a pipeline stage's sake (no dropout). `attention` takes mla_forward's arguments:
    serving's cached, absorbed MLA (refpar/serving/latent_attention.py), forward only."""
    p = f"model.layers.{layer}."
    P = params
    positions = _positions(x, x.shape[1], positions)  # (T,)
    eps = config.norm_eps

    a, c_ln1 = rmsnorm_forward(x, P[p + "input_layernorm.weight"], eps)  # (B, T, C)
    o, c_attn = attention(a, P, p + "self_attn.", config, positions)  # (B, T, C)
    x1 = x + o  # (B, T, C)

    m, c_ln2 = rmsnorm_forward(x1, P[p + "post_attention_layernorm.weight"], eps)  # (B, T, C)
    if is_moe(layer, config):
        moe = MoELayer(MOE) if moe is None else moe
        m, c_mlp = moe.forward(m, P, layer, config)  # (B, T, C)
    else:
        moe = None  # a dense block
        m, c_mlp = swiglu_mlp_forward(m, P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                                      P[p + "mlp.down_proj.weight"])  # (B, T, C)
    y = x1 + m  # (B, T, C)
    return y, (layer, c_ln1, c_attn, c_ln2, moe, c_mlp)  # moe, c_mlp last: llama.block_router_loss


def block_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), {name: grad} for this block's parameters)."""
    layer, c_ln1, c_attn, c_ln2, moe, c_mlp = cache
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

    da, g_attn = mla_backward(dx1, c_attn)  # (B, T, C)
    g.update(g_attn)
    da, g[p + "input_layernorm.weight"] = rmsnorm_backward(da, c_ln1)  # (B, T, C)
    return dx1 + da, g


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
    """Mean cross-entropy over the batch (sum / normalizer, default B*T), plus the MoE blocks' router
    losses (`moe`: their layer object, default the single-device one), plus with
    num_nextn_predict_layers D the multi-token prediction losses (mtp_loss_weight / D each, every depth
    over its B (T - k) positions: normalizer (T - k) / T), and every parameter's gradient; the options
    as llama.loss_and_grads takes them (no dropout, so `seed`, `step`, `sample_ids` and `training`
    change nothing)."""
    emb = params[EMBED]
    tokens, targets = as_like(tokens, emb), as_like(targets, emb)
    B, T = tokens.shape
    normalizer = B * T if normalizer is None else normalizer
    if moe is None and dloss != 1.0 and config.moe_experts:
        moe = MoELayer(MOE, grad_scale=dloss)  # the router losses' gradients scale too

    x, c_embed = embed_forward(tokens, params)  # (B, T, C)
    c_blocks = []
    for layer in range(config.n_layer):
        x, c = block_forward(x, params, layer, config, moe=moe)  # (B, T, C)
        c_blocks.append(c)
    loss, c_head = head_forward(x, params, targets, config, normalizer)
    D, c_mtp = config.num_nextn_predict_layers, []
    h = c_head[0][1][0]  # (B, T, C): model.norm's output, the head's input (its linear cache's x)
    for k in range(1, D + 1):
        loss_k, h, c = mtp_forward(h, targets, params, k, config, head_name(config),
                                   lambda z, P, layer: block_forward(z, P, layer, config, moe=moe),
                                   normalizer * (T - k) / T)  # (B, T - k, C)
        loss = loss + config.mtp_loss_weight / D * loss_k
        c_mtp.append(c)
    c_blocks += [c[6] for c in c_mtp]  # the MTP blocks' caches
    loss = loss + sum(block_router_loss(c) for c in c_blocks)  # MoE blocks' router losses

    grads, dh = {}, None
    for c in reversed(c_mtp):  # depth D first: each gives the one before its gradient of h
        dh, g = mtp_backward(dloss * config.mtp_loss_weight / D, dh, c, block_backward)  # (B, T-k+1, C)
        add_grads(grads, g)  # the shared embedding and head take a share from each depth
    dx, g = head_backward(c_head, dloss)  # (B, T, C)
    if dh is not None:  # model.norm's output feeds the first MTP depth too
        dx_mtp, dnorm = rmsnorm_backward(dh, c_head[0][0])  # (B, T, C)
        dx, g[FINAL_NORM] = dx + dx_mtp, g[FINAL_NORM] + dnorm
    add_grads(grads, g)
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
    """The dict under DeepseekV3's checkpoint keys: refpar's own (a new dict, the same arrays)."""
    return dict(params_or_grads)


def from_hf_state_dict(state_dict, config: ModelConfig) -> dict:
    """Parameters from a DeepseekV3ForCausalLM state dict (arrays or CPU torch tensors): the
    checkpoint's keys or a model's `state_dict()` (fused experts). The routers' bias buffers are left
    out (`expert_biases` reads them), and so are the rotary `inv_freq` buffers. Missing names, unknown
    names and wrong shapes raise ValueError naming the first one."""
    return params_from_hf(state_dict, config, param_shapes(config), MOE,
                          config.n_layer + config.num_nextn_predict_layers,
                          ("rotary_emb.inv_freq", "mlp.gate.e_score_correction_bias"), "DeepSeek")


def expert_biases(state_dict, config: ModelConfig) -> dict:
    """The aux-free routing biases of an HF state dict, layer -> (E,) in config.dtype, for `MoELayer(bias=)`
    (refpar/model/routing.py's `bias`), the multi-token prediction modules' blocks included; the MoE
    blocks whose buffer is absent are left out."""
    layers = [i for i in range(config.n_layer + config.num_nextn_predict_layers) if is_moe(i, config)]
    keys = {layer: EXPERT_BIAS.format(layer=layer) for layer in layers}
    return {layer: np.asarray(state_dict[key], dtype=dtype_of(config.dtype)) for layer, key in keys.items()
            if key in state_dict}
