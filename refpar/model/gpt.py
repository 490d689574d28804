"""GPT-2 (Radford et al. 2019) on one device: the reference every parallel strategy must reproduce.

Legend: B batch, T sequence, C channels, nh heads, hs head size (C // nh), V vocab, L layers.
Pre-LayerNorm blocks, learned positions, tanh-GELU, LM head tied to `wte`, LayerNorm eps 1e-5,
biases everywhere, dropout at GPT-2's four sites (embd, attention probabilities, the two residual
branches). Parameters are a flat dict with GPT-2's state-dict names in Conv1D layout (weight[in, out]).

The pieces (embed, block, head) are public so that strategies and pipeline stages reuse them:

    x, ce = embed_forward(tokens, params, drop)
    x, cb = block_forward(x, params, layer, config, drop)      # for each layer
    loss, ch = head_forward(x, params, targets, config, normalizer)
    dx, grads = head_backward(ch); dx, g = block_backward(dx, cb); g = embed_backward(dx, ce)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace, device

from refpar import rng
from refpar.config import ConfigError, ModelConfig
from refpar.model.attention import CacheShape, attention_backward, attention_forward, multi_head_cache
from refpar.model.dropout import keep_mask
from refpar.model.layers import (
    add_grads,
    as_like,
    cross_entropy_backward,
    cross_entropy_forward,
    dropout_backward,
    dropout_forward,
    embedding_backward,
    embedding_forward,
    gelu_backward,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
)
from refpar.model.moe import GeluMLP, MoELayer, MoESpec, router_loss
from refpar.precision import dtype_of

# ------------------------------------------------------------------------------------ parameters
# The Mixture of Experts that replaces the MLP in `config.moe_blocks` (refpar/model/moe.py): a router
# (C, E) and GPT-2 MLPs as experts and shared experts
MOE = MoESpec(router="h.{layer}.mlp.router.weight", experts="h.{layer}.mlp.experts.{expert}",
              shared="h.{layer}.mlp.shared_experts.{expert}", router_out_in=False, mlp=GeluMLP())


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and full shape, in GPT-2's state-dict order. Every GPT-2-only path
    (the strategies, serving) starts here, so a Llama config is refused here."""
    if config.arch != "gpt2":
        raise ConfigError(f"this path runs GPT-2 (refpar/model/gpt.py) but the model is "
                          f"arch={config.arch!r}: use refpar.model's functions, which dispatch by arch, "
                          "or `refpar train`, whose engine runs both families")
    V, P, C = config.vocab_size, config.n_positions, config.n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
        })
        if i in config.moe_blocks:  # a Mixture of Experts replaces the MLP (refpar/model/moe.py)
            shapes.update(MOE.param_shapes(config, i))
        else:
            shapes.update({
                h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
                h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
            })
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def kv_cache_shape(config: ModelConfig) -> CacheShape:
    """What a KV cache keeps per token per layer: K and V of every head."""
    return multi_head_cache(config.n_head, config.head_size, config.n_head)


def init_std(name: str, config: ModelConfig) -> float:
    """GPT-2's init: normal(0, 0.02) for weights and embeddings; the residual projections scaled by
    1/sqrt(2L) because each block adds two of them to the residual stream (GPT-2 paper, sec. 2.3)."""
    if name.endswith("c_proj.weight"):
        return config.init_std / math.sqrt(2 * config.n_layer)
    return config.init_std


def init_params(config: ModelConfig, seed: int) -> dict:
    """Weights drawn full, one RNG key per parameter name: a shard is a slice of this. Drawn in
    float64 and rounded once to config.dtype, so a bf16 run starts from the float64 run's weights
    rounded to bf16 (and its fp32 master weights are exactly those rounded values)."""
    dtype = dtype_of(config.dtype)
    params = {}
    for name, shape in param_shapes(config).items():
        if name.endswith(".bias"):
            params[name] = np.zeros(shape, dtype)
        elif ".ln_" in name or name.startswith("ln_f"):
            params[name] = np.ones(shape, dtype)
        else:
            draw = rng.normal(seed, "init", rng.name_id(name), shape=shape)  # float64, a fresh array
            draw *= init_std(name, config)  # in place: GPT-2's 39M-entry embedding is not copied twice
            params[name] = draw.astype(dtype, copy=False)
    return params


# ---------------------------------------------------------------------------------------- dropout
@dataclass(frozen=True)
class DropoutContext:
    """What keys the dropout masks of one forward pass: (seed, step, global sample ids)."""

    seed: int = 0
    step: int = 0
    sample_ids: tuple[int, ...] = ()
    p: float = 0.0
    training: bool = True

    @property
    def active(self) -> bool:
        return self.training and self.p > 0.0

    def keep(self, layer: int, site: str, shape, like, index=None):
        """The mask of `site` for this batch in `like`'s namespace, or None when dropout is off."""
        if not self.active:
            return None
        return as_like(keep_mask(self.seed, self.step, layer, site, self.sample_ids, shape, self.p,
                                 index), like)


NO_DROPOUT = DropoutContext()


def _positions(x, T, positions, drop: DropoutContext):
    """The rows' global positions: 0..T-1 unless given. Given positions (a sequence shard) with
    dropout on are refused: the masks here are drawn for this (T, ...) shape, which is right only
    for whole sequences; a shard draws its slice with `drop.keep(..., index)`."""
    if positions is None:
        xp = array_namespace(x)
        return xp.arange(T, device=device(x))  # (T,)
    if drop.active:
        raise ValueError("explicit positions need dropout off here; a sequence shard draws its "
                         "masks with drop.keep(layer, site, full_shape, like, index)")
    return positions


# ----------------------------------------------------------------------------------------- embed
def embed_forward(tokens, params, drop: DropoutContext = NO_DROPOUT, positions=None):
    """tokens (B, T) -> x (B, T, C): token plus position embedding, then embd dropout."""
    wte, wpe = params["wte.weight"], params["wpe.weight"]
    positions = _positions(tokens, tokens.shape[1], positions, drop)  # (T,)
    x, c_emb = embedding_forward(tokens, wte, wpe, positions)  # (B, T, C)
    x, c_drop = dropout_forward(x, drop.keep(0, "embd", x.shape[1:], x), drop.p)  # (B, T, C)
    return x, (c_emb, c_drop)


def embed_backward(dx, cache) -> dict:
    """-> {"wte.weight": (V, C), "wpe.weight": (P, C)}; the head adds its share of wte's gradient."""
    c_emb, c_drop = cache
    dwte, dwpe = embedding_backward(dropout_backward(dx, c_drop), c_emb)
    return {"wte.weight": dwte, "wpe.weight": dwpe}


def add_embedding_grads(grads: dict, g: dict) -> dict:
    """Folds the embedding's gradients `g` (`embed_backward`'s or a sharded twin's) into `grads`:
    wpe's, and wte's added to the tied head's share when `grads` already holds it."""
    add_grads(grads, {"wte.weight": g["wte.weight"]})
    grads["wpe.weight"] = g["wpe.weight"]
    return grads


# ----------------------------------------------------------------------------------------- block
def split_heads(t, n_head):
    """(B, T, C) -> (B, nh, T, hs)"""
    xp = array_namespace(t)
    B, T, C = t.shape
    return xp.permute_dims(xp.reshape(t, (B, T, n_head, C // n_head)), (0, 2, 1, 3))


def merge_heads(t):
    """(B, nh, T, hs) -> (B, T, C)"""
    xp = array_namespace(t)
    B, nh, T, hs = t.shape
    return xp.reshape(xp.permute_dims(t, (0, 2, 1, 3)), (B, T, nh * hs))


def attention_core(q, k, v, layer: int, n_head: int, drop: DropoutContext = NO_DROPOUT, positions=None):
    """q, k, v (B, nh, T, hs) -> (out (B, nh, T, hs), cache): causal attention with the dropout
    of its probabilities, the piece selective recomputation runs again (refpar/parallel/recompute.py)."""
    T = q.shape[2]
    positions = _positions(q, T, None, drop) if positions is None else positions  # (T,): the caller's
    keep = drop.keep(layer, "attn", (n_head, T, T), q)  # (B, nh, T, T) or None
    return attention_forward(q, k, v, positions, positions, keep, drop.p)


def block_forward(x, params, layer: int, config: ModelConfig, drop: DropoutContext = NO_DROPOUT,
                  positions=None, moe=None):
    """x (B, T, C) -> y (B, T, C): x + attn(ln_1(x)), then + mlp(ln_2(.)). `positions` (T,) are the
    global positions of x's rows (default 0..T-1). In the blocks of `config.moe_blocks` the MLP is
    `moe.forward` (default the single-device `MoELayer`; expert parallelism passes its own)."""
    h = f"h.{layer}."
    P = params
    B, T, C = x.shape
    positions = _positions(x, T, positions, drop)  # (T,)
    eps = config.layer_norm_eps

    a, c_ln1 = layernorm_forward(x, P[h + "ln_1.weight"], P[h + "ln_1.bias"], eps)  # (B, T, C)
    qkv, c_attn = linear_forward(a, P[h + "attn.c_attn.weight"], P[h + "attn.c_attn.bias"])  # (B, T, 3C)
    q = split_heads(qkv[..., :C], config.n_head)  # (B, nh, T, hs)
    k = split_heads(qkv[..., C:2 * C], config.n_head)  # (B, nh, T, hs)
    v = split_heads(qkv[..., 2 * C:], config.n_head)  # (B, nh, T, hs)
    o, c_sdpa = attention_core(q, k, v, layer, config.n_head, drop, positions)  # (B, nh, T, hs)
    o = merge_heads(o)  # (B, T, C)
    o, c_proj = linear_forward(o, P[h + "attn.c_proj.weight"], P[h + "attn.c_proj.bias"])  # (B, T, C)
    o, c_drop1 = dropout_forward(o, drop.keep(layer, "attn_resid", (T, C), x), drop.p)  # (B, T, C)
    x1 = x + o  # (B, T, C)

    m, c_ln2 = layernorm_forward(x1, P[h + "ln_2.weight"], P[h + "ln_2.bias"], eps)  # (B, T, C)
    if layer in config.moe_blocks:
        moe = MoELayer(MOE) if moe is None else moe
        m, c_moe = moe.forward(m, P, layer, config)  # (B, T, C)
        c_fc, c_gelu, c_mproj = (moe, c_moe), None, None
    else:
        m, c_fc = linear_forward(m, P[h + "mlp.c_fc.weight"], P[h + "mlp.c_fc.bias"])  # (B, T, 4C)
        m, c_gelu = gelu_forward(m)  # (B, T, 4C)
        m, c_mproj = linear_forward(m, P[h + "mlp.c_proj.weight"], P[h + "mlp.c_proj.bias"])  # (B, T, C)
    m, c_drop2 = dropout_forward(m, drop.keep(layer, "mlp_resid", (T, C), x), drop.p)  # (B, T, C)
    y = x1 + m  # (B, T, C)
    cache = (layer, config.n_head, c_ln1, c_attn, c_sdpa, c_proj, c_drop1, c_ln2, c_fc, c_gelu,
             c_mproj, c_drop2)
    return y, cache


def block_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), {name: grad} for this block's twelve parameters)."""
    (layer, n_head, c_ln1, c_attn, c_sdpa, c_proj, c_drop1, c_ln2, c_fc, c_gelu, c_mproj,
     c_drop2) = cache
    xp = array_namespace(dy)
    h = f"h.{layer}."
    g = {}

    dm = dropout_backward(dy, c_drop2)  # (B, T, C)
    if c_mproj is None:  # a MoE block: c_fc is (the layer object, its cache)
        dm, g_moe = c_fc[0].backward(dm, c_fc[1])  # (B, T, C)
        g.update(g_moe)
    else:
        dm, g[h + "mlp.c_proj.weight"], g[h + "mlp.c_proj.bias"] = linear_backward(dm, c_mproj)  # (B, T, 4C)
        dm = gelu_backward(dm, c_gelu)  # (B, T, 4C)
        dm, g[h + "mlp.c_fc.weight"], g[h + "mlp.c_fc.bias"] = linear_backward(dm, c_fc)  # (B, T, C)
    dm, g[h + "ln_2.weight"], g[h + "ln_2.bias"] = layernorm_backward(dm, c_ln2)  # (B, T, C)
    dx1 = dy + dm  # (B, T, C)

    do = dropout_backward(dx1, c_drop1)  # (B, T, C)
    do, g[h + "attn.c_proj.weight"], g[h + "attn.c_proj.bias"] = linear_backward(do, c_proj)  # (B, T, C)
    dq, dk, dv = attention_backward(split_heads(do, n_head), c_sdpa)  # (B, nh, T, hs) each
    dqkv = xp.concat([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)  # (B, T, 3C)
    da, g[h + "attn.c_attn.weight"], g[h + "attn.c_attn.bias"] = linear_backward(dqkv, c_attn)  # (B, T, C)
    da, g[h + "ln_1.weight"], g[h + "ln_1.bias"] = layernorm_backward(da, c_ln1)  # (B, T, C)
    dx = dx1 + da  # (B, T, C)
    return dx, g


def block_router_loss(cache):
    """The MoE router losses (load balancing + z-loss) of a block's forward; 0.0 for a dense block.
    They are part of the training loss, and `block_backward` includes their gradients."""
    c_fc, c_mproj = cache[8], cache[10]
    return 0.0 if c_mproj is not None else router_loss(c_fc[1])


# ------------------------------------------------------------------------------------------ head
def logits_forward(x, params, config: ModelConfig):
    """x (B, T, C) -> logits (B, T, V) and the cache: ln_f, then the tied head x @ wte.T."""
    wte = params["wte.weight"]
    xf, c_lnf = layernorm_forward(x, params["ln_f.weight"], params["ln_f.bias"], config.layer_norm_eps)
    logits, c_head = linear_forward(xf, wte.T, None)  # (B, T, V)
    return logits, (c_lnf, c_head)


def head_forward(x, params, targets, config: ModelConfig, normalizer):
    """x (B, T, C), targets (B, T) -> loss = sum of token losses / normalizer (a 0-d array)."""
    logits, c_logits = logits_forward(x, params, config)  # (B, T, V)
    loss, c_ce = cross_entropy_forward(logits, targets, normalizer)  # ()
    return loss, (c_logits, c_ce)


def head_backward(cache, dloss=1.0):
    """-> (dx (B, T, C), {"ln_f.weight", "ln_f.bias", "wte.weight": the head's share (V, C)})."""
    (c_lnf, c_head), c_ce = cache
    dlogits = cross_entropy_backward(dloss, c_ce)  # (B, T, V)
    dxf, dwte_t, _ = linear_backward(dlogits, c_head)  # (B, T, C), (C, V)
    dx, dw, db = layernorm_backward(dxf, c_lnf)  # (B, T, C)
    return dx, {"ln_f.weight": dw, "ln_f.bias": db, "wte.weight": dwte_t.T}


# ----------------------------------------------------------------------------------- whole model
def forward(params, tokens, config: ModelConfig):
    """tokens (B, T) -> logits (B, T, V), evaluation mode (no dropout)."""
    tokens = as_like(tokens, params["wte.weight"])
    x, _ = embed_forward(tokens, params)  # (B, T, C)
    for layer in range(config.n_layer):
        x, _ = block_forward(x, params, layer, config)  # (B, T, C)
    logits, _ = logits_forward(x, params, config)  # (B, T, V)
    return logits


def loss_and_grads(params, tokens, targets, config: ModelConfig, *, seed=0, step=0, sample_ids=None,
                   normalizer=None, training=True, moe=None, dloss=1.0, grad_dtype=None, drop=None):
    """Mean cross-entropy over the batch (sum / normalizer, default B*T), plus the router losses of
    the MoE blocks (`moe`: their layer object, default the single-device one), and every parameter's
    gradient. Dropout masks are keyed by (seed, step, layer, site, sample id): `sample_ids` are the
    batch rows' global ids (default 0..B-1), so a data-parallel shard drops what one device drops;
    `drop` replaces that DropoutContext (refpar check replays the masks a dump applied).
    Mixed precision: backward starts from `dloss` (the fp16 loss scale; the gradients come out
    multiplied by it, the returned loss does not; a `moe` layer given must carry the same
    `grad_scale` for its router losses); gradients leave each op in the parameters' dtype
    and, with `grad_dtype` (float32 for TrainConfig.fp32_grads), are summed in that dtype."""
    wte = params["wte.weight"]
    tokens, targets = as_like(tokens, wte), as_like(targets, wte)
    B, T = tokens.shape
    sample_ids = tuple(range(B)) if sample_ids is None else tuple(int(s) for s in sample_ids)
    normalizer = B * T if normalizer is None else normalizer
    drop = DropoutContext(seed, step, sample_ids, config.dropout, training) if drop is None else drop
    if moe is None and dloss != 1.0 and config.moe_blocks:
        moe = MoELayer(MOE, grad_scale=dloss)  # the router losses' gradients scale with the rest

    x, c_embed = embed_forward(tokens, params, drop)  # (B, T, C)
    c_blocks = []
    for layer in range(config.n_layer):
        x, c = block_forward(x, params, layer, config, drop, moe=moe)  # (B, T, C)
        c_blocks.append(c)
    loss, c_head = head_forward(x, params, targets, config, normalizer)
    loss = loss + sum(block_router_loss(c) for c in c_blocks)  # MoE blocks' router losses

    dx, grads = head_backward(c_head, dloss)  # (B, T, C)
    for layer in reversed(range(config.n_layer)):
        dx, g = block_backward(dx, c_blocks[layer])  # (B, T, C)
        grads.update(g)
    g = embed_backward(dx, c_embed)
    if grad_dtype is not None:
        xp = array_namespace(wte)
        grads, g = ({n: xp.astype(a, grad_dtype) for n, a in d.items()} for d in (grads, g))
    add_embedding_grads(grads, g)  # tied: head and embedding add
    return float(loss), {name: grads[name] for name in params}


# ------------------------------------------------------------------------------ GPT-2 state dict
def to_gpt2_state_dict(params) -> dict:
    """refpar's params are already named and laid out as a GPT-2 (Hugging Face GPT2Model) state
    dict; this returns a new dict with `lm_head.weight` left out (it is `wte.weight`)."""
    return dict(params)


def to_hf_state_dict(params_or_grads, config: ModelConfig) -> dict:
    """GPT2LMHeadModel's checkpoint keys: refpar's, GPT2Model's, under its `transformer.` prefix."""
    return {"transformer." + k: v for k, v in to_gpt2_state_dict(params_or_grads).items()}


def from_hf_state_dict(state_dict, config: ModelConfig) -> dict:
    """Parameters from a GPT2LMHeadModel's or GPT2Model's state dict (`from_gpt2_state_dict`)."""
    return from_gpt2_state_dict(state_dict, config)


def from_gpt2_state_dict(state_dict, config: ModelConfig) -> dict:
    """Parameters from a GPT-2 state dict (arrays or anything `np.asarray` takes, e.g. CPU torch
    tensors). Accepts GPT2Model names (`wte.weight`) and GPT2LMHeadModel names (with the
    `transformer.` prefix); a `lm_head.weight` must equal `wte.weight` (the head is tied); the
    attention-mask buffers (`attn.bias`, `attn.masked_bias`) are ignored. Missing names, unknown
    names and wrong shapes raise ValueError naming the first one."""
    dtype = dtype_of(config.dtype)
    shapes = param_shapes(config)
    params, extra = {}, []
    lm_head = None
    for key, value in state_dict.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            lm_head = value
        elif name.endswith((".attn.bias", ".attn.masked_bias")) and name not in shapes:
            continue
        elif name in shapes:
            array = np.asarray(value, dtype=dtype)
            if array.shape != shapes[name]:
                raise ValueError(f"{key} has shape {array.shape}, expected {shapes[name]} for this config")
            params[name] = array
        else:
            extra.append(key)
    missing = [name for name in shapes if name not in params]
    if missing:
        raise ValueError(f"the state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    if extra:
        raise ValueError(f"the state dict has {extra[0]}, which GPT-2 of this config does not")
    if lm_head is not None and not np.array_equal(np.asarray(lm_head, dtype=dtype), params["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight; refpar's GPT-2 ties them")
    return {name: params[name] for name in shapes}
