"""Mixture of Experts feed-forward as a forward/backward pair, one layer for both families: the
tokens go to their experts by the routing of refpar/model/routing.py (`dispatch`), each expert runs
its rows (`experts_forward`), and each token's output is the gate-weighted sum of its experts'
(`combine`), plus that of the shared experts every token passes through (DeepSeekMoE, Dai et al.
2024, eq. 9: ungated, dense weights every data rank holds).

Legend: B batch, T sequence, C channels, N tokens of this call (B*T), E experts, k experts per
token, R rows of the expert buffer (assignments kept), H an expert's hidden width (4C for GPT-2's,
intermediate_size for Mixtral's).

A family's MoE differs from another's in three things only, held by its `MoESpec` (gpt.MOE,
llama.MOE): its parameters' names, the router's layout ((C, E), or (E, C) as torch.nn.Linear stores
Mixtral's), and the expert MLP, which the shared experts share: GPT-2's (`GeluMLP`) or Mixtral's
SwiGLU (`SwiGLUMLP`, Jiang et al. 2024; DeepSeek-V3's under its own names and width).

Mixed precision: `combine` and the backward scatter-adds run under `fp32_compute`
(refpar/precision.py), the experts through the fp32-computing layer pairs.

Expert parallelism (refpar/parallel/expert_parallel.py) reuses `dispatch`, `experts_forward`,
`combine`, their backwards and the shared experts, with the same MoESpec.
"""

from __future__ import annotations

from dataclasses import dataclass

from array_api_compat import array_namespace, device

from refpar.model.layers import gelu_backward, gelu_forward, linear_backward, linear_forward
from refpar.model.llama_layers import swiglu_mlp_backward, swiglu_mlp_forward
from refpar.model.routing import route, router_backward
from refpar.precision import fp32_compute


# -------------------------------------------------------------------------------- expert MLPs
class GeluMLP:
    """GPT-2's MLP as an expert, in GPT-2's Conv1D layout weight[in, out] with biases:
    c_fc (C, H), tanh-GELU, c_proj (H, C), H = 4C."""

    down_bias = "c_proj.bias"  # what tensor parallelism adds once, after the sum over tp

    def hidden(self, config) -> int:
        """H, one expert's hidden width: 4C."""
        return 4 * config.n_embd

    def shapes(self, config, copies: int = 1) -> dict[str, tuple[int, ...]]:
        """One expert's parameters by suffix; `copies` experts as one MLP of their widths side by side."""
        C, H = config.n_embd, self.hidden(config) * copies
        return {"c_fc.weight": (C, H), "c_fc.bias": (H,), "c_proj.weight": (H, C), "c_proj.bias": (C,)}

    def forward(self, x2, params, prefix: str, down_bias: bool = True):
        """(n, C) -> (n, C). Without `down_bias` c_proj's bias is left out of the output (expert
        tensor parallelism adds it after summing the partial outputs), its gradient still computed."""
        h, c1 = linear_forward(x2, params[f"{prefix}.c_fc.weight"], params[f"{prefix}.c_fc.bias"])  # (n, H)
        a, c2 = gelu_forward(h)  # (n, H)
        b = params[f"{prefix}.c_proj.bias"] if down_bias else None
        y, c3 = linear_forward(a, params[f"{prefix}.c_proj.weight"], b)  # (n, C)
        return y, (prefix, c1, c2, (*c3[:2], True))  # c_proj's bias gradient either way

    def backward(self, dy, cache):
        """(n, C) -> (dx (n, C), the expert's gradients by name)."""
        p, c1, c2, c3 = cache
        grads = {}
        da, grads[f"{p}.c_proj.weight"], grads[f"{p}.c_proj.bias"] = linear_backward(dy, c3)  # (n, H)
        dh = gelu_backward(da, c2)  # (n, H)
        dx, grads[f"{p}.c_fc.weight"], grads[f"{p}.c_fc.bias"] = linear_backward(dh, c1)  # (n, C)
        return dx, grads


@dataclass(frozen=True)
class SwiGLUMLP:
    """Llama's MLP as an expert, without biases, in torch.nn.Linear's layout weight[out, in]:
    expert(x) = down(silu(gate x) * up x), gate and up (H, C), down (C, H). `gate`, `up`, `down`:
    the projections' names (Mixtral's w1, w3, w2 by default; DeepSeek-V3's gate_proj, up_proj,
    down_proj); `width`: the ModelConfig field holding H (intermediate_size for Mixtral's,
    DeepSeek-V3's routed experts have their own)."""

    gate: str = "w1"
    up: str = "w3"
    down: str = "w2"
    width: str = "intermediate_size"
    down_bias = None  # a class attribute, not a field: there is no bias

    def hidden(self, config) -> int:
        """H, one expert's hidden width: the config's field `width`."""
        return getattr(config, self.width)

    def shapes(self, config, copies: int = 1) -> dict[str, tuple[int, ...]]:
        """One expert's parameters by suffix; `copies` experts as one MLP of their widths side by side."""
        C, H = config.n_embd, self.hidden(config) * copies
        return {f"{self.gate}.weight": (H, C), f"{self.up}.weight": (H, C), f"{self.down}.weight": (C, H)}

    def forward(self, x2, params, prefix: str, down_bias: bool = True):
        """(n, C) -> (n, C); there is no bias to leave out."""
        w = [params[f"{prefix}.{name}.weight"] for name in (self.gate, self.up, self.down)]
        y, c = swiglu_mlp_forward(x2, *w)  # (n, C)
        return y, (prefix, c)

    def backward(self, dy, cache):
        """(n, C) -> (dx (n, C), the expert's gradients by name)."""
        p, c = cache
        dx, dgate, dup, ddown = swiglu_mlp_backward(dy, c)  # (n, C)
        return dx, {f"{p}.{self.gate}.weight": dgate, f"{p}.{self.up}.weight": dup,
                    f"{p}.{self.down}.weight": ddown}


@dataclass(frozen=True)
class MoESpec:
    """What a family's MoE layer is made of. `router`, `experts` and `shared` are name templates
    with {layer} and {expert}; the shared experts' lie outside `.experts.`, so they are dense
    (holdings.is_expert). `router_out_in`: the router is stored (E, C), torch.nn.Linear's layout,
    rather than (C, E); `route` takes (C, E) either way. `shared_mlp`: the shared experts' MLP
    (None: `mlp`'s kind). A `shared` template with {expert} names S separate MLPs (GPT-2's, Llama's);
    without it, one MLP of S times the width stands for all S (DeepSeek-V3's `mlp.shared_experts`,
    Hugging Face's DeepseekV3MoE): the same function, as an MLP over concatenated hidden units is the
    sum of the parts."""

    router: str
    experts: str
    shared: str | None
    router_out_in: bool
    mlp: GeluMLP | SwiGLUMLP
    shared_mlp: GeluMLP | SwiGLUMLP | None = None

    def router_name(self, layer: int) -> str:
        return self.router.format(layer=layer)

    def expert_prefix(self, layer: int, expert: int) -> str:
        return self.experts.format(layer=layer, expert=expert)

    def shared_prefix(self, layer: int, expert: int) -> str:
        return self.shared.format(layer=layer, expert=expert)

    @property
    def shared_kind(self) -> GeluMLP | SwiGLUMLP:
        """The shared experts' MLP."""
        return self.mlp if self.shared_mlp is None else self.shared_mlp

    def shared_parts(self, layer: int, n_shared: int) -> list[tuple[str, int]]:
        """Block `layer`'s S shared experts as stored: (prefix, experts it holds) per MLP, S of one
        or one of S (0 shared experts: none)."""
        if n_shared == 0:
            return []
        if "{expert}" not in self.shared:
            return [(self.shared.format(layer=layer), n_shared)]
        return [(self.shared_prefix(layer, s), 1) for s in range(n_shared)]

    def param_shapes(self, config, layer: int) -> dict[str, tuple[int, ...]]:
        """Every parameter of block `layer`'s MoE by full name: router, routed experts, shared
        experts (the order of the family's state dict)."""
        C, E = config.n_embd, config.moe_experts
        shapes = {self.router_name(layer): (E, C) if self.router_out_in else (C, E)}
        for e in range(E):
            p = self.expert_prefix(layer, e)
            shapes.update({f"{p}.{suffix}": shape for suffix, shape in self.mlp.shapes(config).items()})
        for p, copies in self.shared_parts(layer, config.moe_shared_experts):
            shapes.update({f"{p}.{suffix}": shape
                           for suffix, shape in self.shared_kind.shapes(config, copies).items()})
        return shapes

    def router_weight(self, params, layer: int):
        """The router as `route` takes it, (C, E) (a view when stored (E, C))."""
        w = params[self.router_name(layer)]
        return array_namespace(w).matrix_transpose(w) if self.router_out_in else w

    def router_grad(self, dw):
        """dw (C, E) -> the router's gradient in its stored layout."""
        return array_namespace(dw).matrix_transpose(dw) if self.router_out_in else dw


def unfuse_experts(state_dict: dict, spec: MoESpec, n_layer: int) -> dict:
    """transformers >= 5's in-memory routed experts, the same for MixtralForCausalLM and
    DeepseekV3ForCausalLM (`model.layers.{i}.mlp.gate.weight`, `mlp.experts.gate_up_proj` (E, 2H, C):
    gate rows then up rows, `mlp.experts.down_proj` (E, C, H)), as the checkpoint files' per-expert
    keys of `spec` (its router and its SwiGLU's gate, up and down names); every other key passes
    unchanged."""
    out = dict(state_dict)
    mlp = spec.mlp
    for i in range(n_layer):
        fused = f"model.layers.{i}.mlp."
        if fused + "gate.weight" in out and spec.router_name(i) != fused + "gate.weight":
            out[spec.router_name(i)] = out.pop(fused + "gate.weight")
        if fused + "experts.gate_up_proj" in out:
            gate_up = out.pop(fused + "experts.gate_up_proj")  # (E, 2H, C)
            H = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                out[f"{spec.expert_prefix(i, e)}.{mlp.gate}.weight"] = gate_up[e, :H]  # (H, C)
                out[f"{spec.expert_prefix(i, e)}.{mlp.up}.weight"] = gate_up[e, H:]  # (H, C)
        if fused + "experts.down_proj" in out:
            down = out.pop(fused + "experts.down_proj")  # (E, C, H)
            for e in range(down.shape[0]):
                out[f"{spec.expert_prefix(i, e)}.{mlp.down}.weight"] = down[e]  # (C, H)
    return out


# ----------------------------------------------------------------------- dispatch and combine
def dispatch(x2, routing):
    """(N, C) tokens -> (R, C) buffer rows, grouped by expert in queue order."""
    xp = array_namespace(x2)
    return xp.take(x2, routing["token_of_row"], axis=0)  # (R, C)


@fp32_compute
def dispatch_backward(dxbuf, routing):
    """(R, C) -> (N, C): each token gathers its rows back (a scatter-add written as gathers)."""
    xp = array_namespace(dxbuf)
    # The zero row is built, not sliced from dxbuf: a rank whose tokens were all dropped has R = 0.
    pad = xp.concat([dxbuf, xp.zeros((1, dxbuf.shape[1]), dtype=dxbuf.dtype, device=device(dxbuf))],
                    axis=0)  # (R+1, C)
    k = routing["row"].shape[1]
    return sum(xp.take(pad, routing["row"][:, j], axis=0) for j in range(k))  # (N, C)


@fp32_compute
def combine(ybuf, routing):
    """(R, C) expert outputs -> (N, C): out[n] = sum over kept slots j of gate[n, j] * y[row]."""
    xp = array_namespace(ybuf)
    pad = xp.concat([ybuf, xp.zeros((1, ybuf.shape[1]), dtype=ybuf.dtype,
                                     device=device(ybuf))], axis=0)  # (R+1, C)
    k = routing["row"].shape[1]
    out = sum(routing["gates"][:, j:j + 1] * xp.take(pad, routing["row"][:, j], axis=0)
              for j in range(k))  # (N, C)
    return out, pad


@fp32_compute
def combine_backward(dout, pad, routing):
    """dout (N, C) -> (dybuf (R, C), dgates (N, k))."""
    xp = array_namespace(dout)
    k = routing["row"].shape[1]
    dgates = xp.stack([xp.sum(dout * xp.take(pad, routing["row"][:, j], axis=0), axis=-1)
                       for j in range(k)], axis=1)  # (N, k)
    dybuf = xp.take(dout, routing["token_of_row"], axis=0) * routing["gate_of_row"][:, None]
    return dybuf, dgates  # (R, C), (N, k)


# ------------------------------------------------------------------------------------ experts
def experts_forward(xbuf, rows_per_expert, params, layer: int, experts, spec: MoESpec,
                    down_bias: bool = True):
    """xbuf (R, C) grouped by expert, `rows_per_expert` (len(experts),) host ints -> (R, C).
    `down_bias` as in GeluMLP.forward."""
    xp = array_namespace(xbuf)
    outs, caches, start = [], [], 0
    for e, n in zip(experts, rows_per_expert, strict=True):
        y, c = spec.mlp.forward(xbuf[start:start + n, ...], params, spec.expert_prefix(layer, e),
                                down_bias)  # (n_e, C)
        outs.append(y)
        caches.append((n, c))
        start += n
    return xp.concat(outs, axis=0), (spec.mlp, caches)  # (R, C)


def experts_backward(dybuf, cache):
    """(R, C) -> (dxbuf (R, C), grads by name of the experts in the cache)."""
    xp = array_namespace(dybuf)
    mlp, caches = cache
    dxs, grads, start = [], {}, 0
    for n, c in caches:
        dx, g = mlp.backward(dybuf[start:start + n, ...], c)  # (n_e, C)
        dxs.append(dx)
        grads.update(g)
        start += n
    return xp.concat(dxs, axis=0), grads  # (R, C)


def shared_experts_forward(x2, params, layer: int, n_shared: int, spec: MoESpec):
    """DeepSeekMoE's shared experts (Dai et al. 2024, eq. 9): every token passes through all S,
    unrouted and ungated; (N, C) -> (their sum (N, C), caches), or (None, []) when S = 0."""
    parts = spec.shared_parts(layer, n_shared)
    if not parts:
        return None, []
    mlp = spec.shared_kind
    outs, caches = zip(*(mlp.forward(x2, params, prefix) for prefix, _ in parts), strict=True)
    return sum(outs), [(mlp, c) for c in caches]  # (N, C)


def shared_experts_backward(dout2, caches):
    """dout2 (N, C) -> (dx2 (N, C) or None when S = 0, the shared experts' gradients)."""
    dx2, grads = None, {}
    for mlp, c in caches:
        dx, g = mlp.backward(dout2, c)  # (N, C)
        dx2 = dx if dx2 is None else dx2 + dx
        grads.update(g)
    return dx2, grads


# ------------------------------------------------------------------------------ the whole layer
def moe_forward(x, params, layer: int, config, spec: MoESpec, weight: float = 1.0, grad_scale: float = 1.0,
                bias=None):
    """x (B, T, C) after the block's second norm -> (out (B, T, C), cache). This call is the whole
    global batch (or one microbatch: `weight` 1/M). cache["routing"] holds the losses and statistics
    (`aux_loss`, `z_loss`, `tokens_per_expert`, `dropped`); `weight`, `grad_scale` and `bias` as in
    routing.route."""
    xp = array_namespace(x)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, C)
    routing, rcache = route(x2, spec.router_weight(params, layer), config, weight=weight,
                            grad_scale=grad_scale, bias=bias, seq_len=x.shape[1])
    xbuf = dispatch(x2, routing)  # (R, C)
    counts = [int(c) for c in routing["rows_per_expert"]]
    ybuf, ecache = experts_forward(xbuf, counts, params, layer, range(config.moe_experts), spec)  # (R, C)
    out, pad = combine(ybuf, routing)  # (N, C)
    shared, scache = shared_experts_forward(x2, params, layer, config.moe_shared_experts, spec)  # (N, C)
    out = out if shared is None else out + shared  # (N, C)
    cache = {"routing": routing, "router": rcache, "experts": ecache, "pad": pad, "layer": layer,
             "shape": x.shape, "shared": scache, "spec": spec}
    return xp.reshape(out, x.shape), cache


def moe_backward(dout, cache):
    """dout (B, T, C) -> (dx (B, T, C), grads by name), the router losses' gradients included."""
    xp = array_namespace(dout)
    routing, spec = cache["routing"], cache["spec"]
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
    dx_shared, shared_grads = shared_experts_backward(dout2, cache["shared"])  # (N, C)
    dybuf, dgates = combine_backward(dout2, cache["pad"], routing)  # (R, C), (N, k)
    dxbuf, grads = experts_backward(dybuf, cache["experts"])  # (R, C)
    dx2 = dispatch_backward(dxbuf, routing)  # (N, C)
    dx_router, dw = router_backward(dgates, cache["router"])  # (N, C), (C, E)
    grads[spec.router_name(cache["layer"])] = spec.router_grad(dw)
    dx2 = dx2 + dx_router if dx_shared is None else dx2 + dx_router + dx_shared  # (N, C)
    return xp.reshape(dx2, cache["shape"]), grads | shared_grads


def router_loss(cache):
    """The load-balancing plus z-loss of one forward (this call's share of the global ones)."""
    return cache["routing"]["aux_loss"] + cache["routing"]["z_loss"]


class MoELayer:
    """The single-device layer as the object `block_forward(..., moe=)` takes (gpt.py's and
    llama.py's), for the family's `spec`; expert parallelism passes its own with the same two
    methods. `last_routing[layer]` keeps the routing of each layer's latest forward, for reports.
    `weight`: 1/M when the step has M microbatches; `grad_scale`: the fp16 loss scale of the backward
    that will follow (routing.route); `bias`: layer -> aux-free balancing's (E,) bias, the run's dict
    that routing.update_expert_bias keeps."""

    def __init__(self, spec: MoESpec, weight: float = 1.0, grad_scale: float = 1.0, bias: dict | None = None):
        self.spec = spec
        self.last_routing: dict[int, dict] = {}
        self.weight, self.grad_scale = weight, grad_scale
        self.bias = {} if bias is None else bias

    def forward(self, x, params, layer: int, config):
        out, cache = moe_forward(x, params, layer, config, self.spec, self.weight, self.grad_scale,
                                 self.bias.get(layer))
        self.last_routing[layer] = cache["routing"]
        return out, cache

    def backward(self, dout, cache):
        return moe_backward(dout, cache)
