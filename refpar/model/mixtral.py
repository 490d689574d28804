"""Mixtral's sparse MoE block (Jiang et al. 2024) for refpar's Llama: refpar's router, queues and
buffers (refpar/model/moe.py: `route`, `dispatch`, `combine` and their backwards) with SwiGLU experts
under Hugging Face's Mixtral names.

Legend: B batch, T sequence, C channels, N tokens of this call (B*T), E experts, k experts per
token, R rows of the expert buffer, F an expert's SwiGLU width (intermediate_size).

Names and layouts are those of Mixtral's checkpoint files (what HF's `save_pretrained` writes and
the released Mixtral-8x7B holds), torch.nn.Linear's (out, in):
    model.layers.{i}.block_sparse_moe.gate.weight           (E, C)  the router
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight (F, C)  gate
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight (F, C)  up
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight (C, F)  down: expert(x) = w2(silu(w1 x) * w3 x)
transformers >= 5 holds the experts fused in memory (`mlp.gate.weight`, `mlp.experts.gate_up_proj`
(E, 2F, C), `mlp.experts.down_proj` (E, C, F)); `unfuse_experts` reads that layout too.

Routing is HF's MixtralSparseMoeBlock's when dropless (`moe_dropless`) with k >= 2: softmax over the E
router logits, the top k, their probabilities renormalised to sum to 1. A capacity, when set, drops
assignments as for GPT-2's experts. The router losses are refpar's, per block (moe.py: Switch
load balancing and ST-MoE z-loss); HF's `load_balancing_loss_func` pools the router logits of all
layers into one statistic and is off by default (`output_router_logits=False`), so a comparison
with HF sets moe_aux_loss_weight = moe_z_loss_weight = 0.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.llama_layers import swiglu_mlp_backward, swiglu_mlp_forward
from refpar.model.moe import (
    MoELayer,
    combine,
    combine_backward,
    dispatch,
    dispatch_backward,
    route,
    router_backward,
)

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down


def router_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate.weight"


def expert_prefix(layer: int, expert: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}"


def moe_param_shapes(config, layer: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of block `layer`'s experts and router by full name, in the order of HF's
    MixtralSparseMoeBlock (router first)."""
    C, F = config.n_embd, config.intermediate_size
    shapes = {router_name(layer): (config.moe_experts, C)}
    for e in range(config.moe_experts):
        p = expert_prefix(layer, e)
        shapes.update({f"{p}.w1.weight": (F, C), f"{p}.w3.weight": (F, C), f"{p}.w2.weight": (C, F)})
    return shapes


def unfuse_experts(state_dict: dict, n_layer: int) -> dict:
    """transformers >= 5's in-memory Mixtral keys (`model.layers.{i}.mlp.gate.weight`,
    `mlp.experts.gate_up_proj` (E, 2F, C): gate rows then up rows, `mlp.experts.down_proj`
    (E, C, F)) as the checkpoint's per-expert keys above; every other key passes unchanged."""
    out = dict(state_dict)
    for i in range(n_layer):
        fused = f"model.layers.{i}.mlp."
        if fused + "gate.weight" in out:
            out[router_name(i)] = out.pop(fused + "gate.weight")
        if fused + "experts.gate_up_proj" in out:
            gate_up = out.pop(fused + "experts.gate_up_proj")  # (E, 2F, C)
            F = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                out[f"{expert_prefix(i, e)}.w1.weight"] = gate_up[e, :F]  # (F, C)
                out[f"{expert_prefix(i, e)}.w3.weight"] = gate_up[e, F:]  # (F, C)
        if fused + "experts.down_proj" in out:
            down = out.pop(fused + "experts.down_proj")  # (E, C, F)
            for e in range(down.shape[0]):
                out[f"{expert_prefix(i, e)}.w2.weight"] = down[e]  # (C, F)
    return out


# ------------------------------------------------------------------------------------ experts
def experts_forward(xbuf, rows_per_expert, params, layer: int, experts):
    """xbuf (R, C) grouped by expert, `rows_per_expert` (len(experts),) host ints -> (R, C): each
    expert is a SwiGLU MLP (moe.experts_forward's twin for GPT-2's experts)."""
    xp = array_namespace(xbuf)
    outs, caches, start = [], [], 0
    for e, n in zip(experts, rows_per_expert, strict=True):
        p = expert_prefix(layer, e)
        y, c = swiglu_mlp_forward(xbuf[start:start + n, ...], *(params[f"{p}.{w}.weight"]
                                                                 for w in EXPERT_WEIGHTS))  # (n_e, C)
        outs.append(y)
        caches.append((p, n, c))
        start += n
    return xp.concat(outs, axis=0), caches  # (R, C)


def experts_backward(dybuf, caches):
    """(R, C) -> (dxbuf (R, C), grads by name of the experts in the cache)."""
    xp = array_namespace(dybuf)
    dxs, grads, start = [], {}, 0
    for p, n, c in caches:
        dx, dw1, dw3, dw2 = swiglu_mlp_backward(dybuf[start:start + n, ...], c)  # (n_e, C)
        grads.update({f"{p}.w1.weight": dw1, f"{p}.w3.weight": dw3, f"{p}.w2.weight": dw2})
        dxs.append(dx)
        start += n
    return xp.concat(dxs, axis=0), grads  # (R, C)


# ------------------------------------------------------------------------------ the whole layer
def moe_forward(x, params, layer: int, config, weight: float = 1.0, grad_scale: float = 1.0, bias=None):
    """x (B, T, C) after post_attention_layernorm -> (out (B, T, C), cache), as moe.moe_forward
    with the router stored (E, C) and SwiGLU experts; cache["routing"] holds the losses and
    statistics; `weight`, `grad_scale` and `bias` as in moe.route."""
    xp = array_namespace(x)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, C)
    w_router = xp.matrix_transpose(params[router_name(layer)])  # (C, E), the layout route takes
    routing, rcache = route(x2, w_router, config, weight=weight, grad_scale=grad_scale, bias=bias,
                            seq_len=x.shape[1])
    xbuf = dispatch(x2, routing)  # (R, C)
    counts = [int(c) for c in routing["rows_per_expert"]]
    ybuf, ecache = experts_forward(xbuf, counts, params, layer, range(config.moe_experts))  # (R, C)
    out, pad = combine(ybuf, routing)  # (N, C)
    cache = {"routing": routing, "router": rcache, "experts": ecache, "pad": pad, "layer": layer,
             "shape": x.shape}
    return xp.reshape(out, x.shape), cache


def moe_backward(dout, cache):
    """dout (B, T, C) -> (dx (B, T, C), grads by name), router losses' gradients included."""
    xp = array_namespace(dout)
    routing = cache["routing"]
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
    dybuf, dgates = combine_backward(dout2, cache["pad"], routing)  # (R, C), (N, k)
    dxbuf, grads = experts_backward(dybuf, cache["experts"])  # (R, C)
    dx2 = dispatch_backward(dxbuf, routing)  # (N, C)
    dx_router, dw_router = router_backward(dgates, cache["router"])  # (N, C), (C, E)
    grads[router_name(cache["layer"])] = xp.matrix_transpose(dw_router)  # (E, C)
    return xp.reshape(dx2 + dx_router, cache["shape"]), grads


class MixtralMoELayer(MoELayer):
    """The single-device Mixtral layer as the object `llama.block_forward(..., moe=)` takes, with
    MoELayer's `last_routing`, `weight`, `grad_scale` and `bias`."""

    def forward(self, x, params, layer: int, config):
        out, cache = moe_forward(x, params, layer, config, self.weight, self.grad_scale,
                                 self.bias.get(layer))
        self.last_routing[layer] = cache["routing"]
        return out, cache

    def backward(self, dout, cache):
        return moe_backward(dout, cache)
