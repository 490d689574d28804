"""Mixture of Experts feed-forward as a forward/backward pair: router, top-k gates, capacity,
experts, and the two router losses with hand-written gradients.

Legend: B batch, T sequence, C channels, N tokens of this call (B*T), E experts, k experts per
token, R rows of the expert buffer (assignments kept), H = 4C, an expert's hidden width.

The conventions, so that the numbers can be reproduced elsewhere:
- Router (Switch Transformer, Fedus et al. 2021): logits = x @ router.weight, weight (C, E) with
  no bias; probs = softmax(logits).
- Top-k: the k largest probabilities, ties to the lower expert index. Gates: with k = 1 the gate is
  the probability itself (Switch; renormalising a single gate would make it 1 and cut the router
  off from the task loss); with k >= 2 the k selected probabilities are renormalised to sum to 1
  (Mixtral, Jiang et al. 2024: the same as a softmax over the selected logits).
- Capacity: an expert takes at most ceil(N_global * k * capacity_factor / E) assignments, where
  an assignment is one (token, slot) pair and N_global the tokens of the whole global batch.
  An expert's queue is ordered by slot first, then by global token index b * T + t: every first
  choice is served before any second choice (GShard, Lepikhin et al. 2020), earlier tokens of the
  batch before later ones. Assignments past the capacity are dropped: they add nothing, so a token
  that loses all its experts leaves the block through the residual unchanged. Gates are not
  renormalised after a drop. With `moe_dropless` there is no capacity.
- Load-balancing loss (Switch eq. 4, for any k): alpha * E * sum_i f_i * P_i with f_i the share
  of the N_global * k selections (before dropping) that chose expert i and P_i the mean of
  probs[:, i] over the global batch; uniform routing gives alpha. f is piecewise constant, so
  the gradient flows through P only.
- Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): beta * mean over tokens of logsumexp(logits)^2.
- Both losses enter the training loss with weight 1 (alpha and beta are their weights), and
  `moe_backward` includes their gradients.
- Microbatches (Megatron-Core's convention): a step of M microbatches routes each microbatch on
  its own tokens: N_global above is the microbatch's token count (capacity, queue order, f and P
  are the microbatch's), and each microbatch's aux and z losses enter with weight 1/M
  (`loss_scale`), so the step's router losses are the mean over microbatches. M = 1 is the
  global-batch routing above.

Mixed precision: the router (softmax, gates, losses), `combine` and the backward scatter-adds run
under `fp32_compute` (refpar/precision.py), the experts through the fp32-computing layer pairs.

Everything that depends on the rest of the global batch comes from the selection counts alone:
`route` takes an `exchange(counts) -> every part's counts`, the identity here on one device and an
all-gather under expert parallelism (refpar/parallel/expert_parallel.py), which also reuses
`dispatch`, `experts_forward` and `combine`. A part is a run of consecutive global token indices:
a data rank's rows (T tokens each, rows consecutive) are one, a context-parallel rank's positions
of its rows are several (`Parts`), and a run's place in each expert's queue comes from the runs
before it in global order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace, device

from refpar.model.layers import (
    as_like,
    gelu_backward,
    gelu_forward,
    linear_backward,
    linear_forward,
    one_hot,
)
from refpar.precision import fp32_compute


def router_name(layer: int) -> str:
    return f"h.{layer}.mlp.router.weight"


def expert_prefix(layer: int, expert: int) -> str:
    return f"h.{layer}.mlp.experts.{expert}"


def expert_param_shapes(config) -> dict[str, tuple[int, ...]]:
    """One expert's parameters by suffix: GPT-2's MLP, (C, 4C) up and (4C, C) down."""
    C = config.n_embd
    return {
        "c_fc.weight": (C, 4 * C), "c_fc.bias": (4 * C,),
        "c_proj.weight": (4 * C, C), "c_proj.bias": (C,),
    }


def moe_param_shapes(config, layer: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of block `layer`'s MoE by full name."""
    shapes = {router_name(layer): (config.n_embd, config.moe_experts)}
    for e in range(config.moe_experts):
        for suffix, shape in expert_param_shapes(config).items():
            shapes[f"{expert_prefix(layer, e)}.{suffix}"] = shape
    return shapes


def capacity(n_tokens: int, config) -> int | None:
    """Assignments one expert takes from a batch of n_tokens (None: dropless)."""
    if config.moe_dropless:
        return None
    return math.ceil(n_tokens * config.moe_top_k * config.moe_capacity_factor / config.moe_experts)


# -------------------------------------------------------------------------------------- router
def router_forward(x2, w, k: int):
    """x2 (N, C), w (C, E) -> probs (N, E), the k chosen experts (N, k) and their gates (N, k)."""
    xp = array_namespace(x2, w)
    logits, lin_cache = linear_forward(x2, w, None)  # (N, E)
    m = xp.max(logits, axis=-1, keepdims=True)  # (N, 1): exp cannot overflow
    e = xp.exp(logits - m)  # (N, E)
    s = xp.sum(e, axis=-1, keepdims=True)  # (N, 1)
    probs = e / s  # (N, E)
    lse = xp.reshape(m + xp.log(s), (-1,))  # (N,) logsumexp of the logits
    experts = xp.argsort(-probs, axis=-1, stable=True)[:, :k]  # (N, k): ties to the lower index
    chosen = xp.take_along_axis(probs, experts, axis=-1)  # (N, k)
    gates = chosen if k == 1 else chosen / xp.sum(chosen, axis=-1, keepdims=True)  # (N, k)
    return probs, lse, experts, chosen, gates, lin_cache


def selection_counts(experts, n_experts: int):
    """(N, k) chosen experts -> (k, E): how many tokens chose expert e in slot j."""
    xp = array_namespace(experts)
    hot = one_hot(experts, n_experts, xp.int64)  # (N, k, E)
    return xp.sum(hot, axis=0)  # (k, E)


@dataclass(frozen=True)
class Parts:
    """Where one call's tokens lie in the global (micro)batch. The call's N tokens, in its order, are
    runs of `sizes` tokens, each a run of consecutive global token indices b*T + t; `index[i]` is
    run i's place among the runs of every part in global order (the order of `exchange`'s result).
    `owners[p]`: the exchange rank holding run p (None: run p is rank p's), so that `kept_counts`
    can add up what each rank sends."""

    sizes: tuple[int, ...]
    index: tuple[int, ...]
    owners: tuple[int, ...] | None = None


def queue_offsets(all_counts, rank: int):
    """(parts, k, E) counts of every part of the global batch (in batch order) -> (k, E): the
    assignments queued ahead of part `rank`'s first slot-j choice of expert e, namely all earlier
    slots' and the earlier parts' slot-j ones."""
    xp = array_namespace(all_counts)
    total = xp.sum(all_counts, axis=0)  # (k, E)
    earlier_slots = xp.cumulative_sum(total, axis=0) - total  # (k, E)
    earlier_ranks = xp.sum(all_counts[:rank, ...], axis=0)  # (k, E)
    return earlier_slots + earlier_ranks


def kept_counts(all_counts, cap, owners=None):
    """(parts, k, E) selection counts -> (parts, E) assignments each part keeps per expert: part p's
    slot-j choices of e hold queue places [offset, offset + count), and those below `cap` stay.
    With `owners` (parts,) the parts are added up per owner: (ranks, E), ranks = max(owners) + 1."""
    xp = array_namespace(all_counts)
    if cap is None:
        kept = xp.sum(all_counts, axis=1)  # (parts, E)
    else:
        parts = all_counts.shape[0]
        start = xp.stack([queue_offsets(all_counts, r) for r in range(parts)])  # (parts, k, E)
        room = xp.clip(cap - start, min=0)  # (parts, k, E)
        kept = xp.sum(xp.minimum(room, all_counts), axis=1)  # (parts, E)
    if owners is None:
        return kept
    owners = np.asarray(owners)
    return xp.stack([xp.sum(xp.take(kept, as_like(np.flatnonzero(owners == r), kept), axis=0), axis=0)
                     for r in range(int(owners.max()) + 1)])  # (ranks, E)


@fp32_compute
def route(x2, w, config, exchange=None, rank: int = 0, weight: float = 1.0, grad_scale: float = 1.0,
          parts: Parts | None = None):
    """Router forward and the routing decision for this call's tokens.

    `exchange(counts (runs, k, E)) -> (P, k, E)` gathers the selection counts of the runs of every
    part of the global batch in global order; `parts` says which runs this call's tokens are (by
    default one run, the `rank`-th: a data rank's rows without context parallelism); by default
    this call is the whole batch. `weight` weighs both router losses (1/M for one of M
    microbatches); `grad_scale` is the fp16 loss scale the backward will start from: the router
    losses' gradients are scaled by it like the task loss's, their reported values are not.
    Returns (routing, cache): routing is a dict with the chosen `experts` (N, k), `gates` (N, k),
    `keep` (N, k), the buffer layout (`token_of_row` (R,), `gate_of_row` (R,), `row` (N, k),
    `rows_per_expert` (E,) of this call), the losses `aux_loss`, `z_loss` (this call's share of the
    global ones), the global `tokens_per_expert` (E,) kept and `dropped` assignments, `capacity`,
    `selections`, every run's counts (P, k, E), and `owners`, `parts.owners`.
    """
    xp = array_namespace(x2, w)
    N, E, k = x2.shape[0], config.moe_experts, config.moe_top_k
    probs, lse, experts, chosen, gates, lin_cache = router_forward(x2, w, k)
    parts = Parts((N,), (rank,)) if parts is None else parts
    hot = one_hot(experts, E, xp.int64)  # (N, k, E)
    # Earlier selections of this call: cum[n] counts tokens 0..n-1, so a run's counts are the
    # difference of cum at its ends, and a token's place within its run cum[n] - cum[run start].
    cum = xp.cumulative_sum(hot, axis=0, include_initial=True)  # (N+1, k, E)
    ends = np.cumsum(parts.sizes)  # (runs,) host
    starts = as_like(ends - np.asarray(parts.sizes), hot)  # (runs,)
    at_start = xp.take(cum, starts, axis=0)  # (runs, k, E)
    counts = xp.take(cum, as_like(ends, hot), axis=0) - at_start  # (runs, k, E)
    all_counts = counts if exchange is None else exchange(counts)  # (P, k, E)
    selected = xp.sum(all_counts, axis=(0, 1))  # (E,) global selections per expert
    n_global = int(xp.sum(selected)) // k
    cap = capacity(n_global, config)

    offsets = xp.stack([queue_offsets(all_counts, p) for p in parts.index])  # (runs, k, E)
    run_of = as_like(np.repeat(np.arange(len(parts.sizes)), parts.sizes), hot)  # (N,)
    ahead = cum[:-1, ...] + xp.take(offsets - at_start, run_of, axis=0)  # (N, k, E)
    position = xp.sum(ahead * hot, axis=-1)  # (N, k): place in the expert's global queue
    keep = position >= 0 if cap is None else position < cap  # (N, k)

    # Buffer rows: kept assignments sorted by expert, then by queue position. Listing assignments
    # slot-major, (j, n) -> j * N + n, is queue order, so a stable sort by expert gives it.
    key = xp.reshape(xp.where(keep, experts, E).T, (-1,))  # (k*N,): dropped ones sort last
    perm = xp.argsort(key, stable=True)  # (k*N,)
    R = int(xp.sum(xp.astype(keep, xp.int64)))
    order = perm[:R]  # (R,) flat slot-major index of each row's assignment
    gate_flat = xp.reshape(gates.T, (-1,))  # (k*N,)
    row = xp.reshape(xp.argsort(perm, stable=True), (k, N)).T  # (N, k): inverse permutation
    kept_hot = hot * xp.astype(keep, xp.int64)[..., None]  # (N, k, E)

    n_dev = xp.asarray(N, dtype=xp.int64, device=device(x2))
    aux_coef = (weight * config.moe_aux_loss_weight * E / n_global) * (
        xp.astype(selected, x2.dtype) / (n_global * k)
    )  # (E,): alpha * E * f_i / N_global, d aux / d probs[n, i]
    z_coef = weight * config.moe_z_loss_weight / n_global
    kept_global = selected if cap is None else xp.minimum(selected, xp.asarray(cap, dtype=xp.int64))
    routing = {
        "experts": experts, "gates": gates, "keep": keep,
        "token_of_row": xp.remainder(order, n_dev),  # (R,)
        "gate_of_row": xp.take(gate_flat, order, axis=0),  # (R,)
        "row": xp.minimum(row, xp.asarray(R, dtype=row.dtype)),  # (N, k): R is the zero row
        "rows_per_expert": xp.sum(kept_hot, axis=(0, 1)),  # (E,) this call's
        "aux_loss": xp.sum(probs * aux_coef),
        "z_loss": z_coef * xp.sum(lse * lse),
        "tokens_per_expert": kept_global,  # (E,) global
        "dropped": int(xp.sum(selected - kept_global)),
        "capacity": cap,
        "selections": all_counts,  # (P, k, E) of every run of the global batch
        "owners": parts.owners,  # (P,) the exchange rank of each run, or None: run p is rank p's
    }
    if grad_scale != 1.0:  # the losses above stay unscaled; their gradients, like the rest, scale
        aux_coef, z_coef = aux_coef * grad_scale, z_coef * grad_scale
    cache = (probs, lse, experts, chosen, gates, keep, aux_coef, z_coef, lin_cache)
    return routing, cache


@fp32_compute
def router_backward(dgates, cache):
    """dgates (N, k) of the kept assignments -> (dx2 (N, C), dw (C, E)), aux and z-loss included."""
    probs, lse, experts, chosen, gates, keep, aux_coef, z_coef, lin_cache = cache
    xp = array_namespace(probs)
    E, k = probs.shape[-1], experts.shape[-1]
    dgates = dgates * xp.astype(keep, dgates.dtype)  # (N, k): a dropped gate changes nothing
    if k == 1:
        dchosen = dgates  # (N, 1)
    else:  # g_j = p_j / S with S = sum of the chosen p: dp_j = (dg_j - sum_l dg_l g_l) / S
        S = xp.sum(chosen, axis=-1, keepdims=True)  # (N, 1)
        dchosen = (dgates - xp.sum(dgates * gates, axis=-1, keepdims=True)) / S  # (N, k)
    dprobs = xp.sum(one_hot(experts, E, probs.dtype) * dchosen[..., None], axis=1)  # (N, E)
    dprobs = dprobs + aux_coef  # (N, E)
    dlogits = probs * (dprobs - xp.sum(probs * dprobs, axis=-1, keepdims=True))  # (N, E)
    dlogits = dlogits + (2.0 * z_coef) * lse[:, None] * probs  # d lse^2 = 2 lse softmax
    dx2, dw, _ = linear_backward(dlogits, lin_cache)
    return dx2, dw


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
def experts_forward(xbuf, rows_per_expert, params, layer: int, experts):
    """xbuf (R, C) grouped by expert, `rows_per_expert` (len(experts),) host ints -> (R, C).
    Each expert is GPT-2's MLP: c_fc, tanh-GELU, c_proj."""
    xp = array_namespace(xbuf)
    outs, caches, start = [], [], 0
    for e, n in zip(experts, rows_per_expert, strict=True):
        p = expert_prefix(layer, e)
        xe = xbuf[start:start + n, ...]  # (n_e, C)
        h, c1 = linear_forward(xe, params[f"{p}.c_fc.weight"], params[f"{p}.c_fc.bias"])  # (n_e, H)
        a, c2 = gelu_forward(h)  # (n_e, H)
        y, c3 = linear_forward(a, params[f"{p}.c_proj.weight"], params[f"{p}.c_proj.bias"])
        outs.append(y)  # (n_e, C)
        caches.append((p, c1, c2, c3))
        start += n
    return xp.concat(outs, axis=0), caches  # (R, C)


def experts_backward(dybuf, caches):
    """(R, C) -> (dxbuf (R, C), grads by name of the experts in the cache)."""
    xp = array_namespace(dybuf)
    dxs, grads, start = [], {}, 0
    for p, c1, c2, c3 in caches:
        n = c1[0].shape[0]
        da, grads[f"{p}.c_proj.weight"], grads[f"{p}.c_proj.bias"] = linear_backward(
            dybuf[start:start + n, ...], c3)  # (n_e, H)
        dh = gelu_backward(da, c2)  # (n_e, H)
        dx, grads[f"{p}.c_fc.weight"], grads[f"{p}.c_fc.bias"] = linear_backward(dh, c1)
        dxs.append(dx)  # (n_e, C)
        start += n
    return xp.concat(dxs, axis=0), grads  # (R, C)


# ------------------------------------------------------------------------------ the whole layer
def moe_forward(x, params, layer: int, config, weight: float = 1.0, grad_scale: float = 1.0):
    """x (B, T, C) after ln_2 -> (out (B, T, C), cache). This call is the whole global batch (or
    one microbatch: `weight` 1/M). cache["routing"] holds the losses and statistics (`aux_loss`,
    `z_loss`, `tokens_per_expert`, `dropped`); `weight` and `grad_scale` as in `route`."""
    xp = array_namespace(x)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, C)
    routing, rcache = route(x2, params[router_name(layer)], config, weight=weight, grad_scale=grad_scale)
    xbuf = dispatch(x2, routing)  # (R, C)
    counts = [int(c) for c in routing["rows_per_expert"]]
    ybuf, ecache = experts_forward(xbuf, counts, params, layer, range(config.moe_experts))  # (R, C)
    out, pad = combine(ybuf, routing)  # (N, C)
    cache = {"routing": routing, "router": rcache, "experts": ecache, "pad": pad, "layer": layer,
             "shape": x.shape}
    return xp.reshape(out, x.shape), cache


def moe_backward(dout, cache):
    """dout (B, T, C) -> (dx (B, T, C), grads by name), aux and z-loss gradients included."""
    xp = array_namespace(dout)
    routing = cache["routing"]
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
    dybuf, dgates = combine_backward(dout2, cache["pad"], routing)  # (R, C), (N, k)
    dxbuf, grads = experts_backward(dybuf, cache["experts"])  # (R, C)
    dx2 = dispatch_backward(dxbuf, routing)  # (N, C)
    dx_router, grads[router_name(cache["layer"])] = router_backward(dgates, cache["router"])
    return xp.reshape(dx2 + dx_router, cache["shape"]), grads


def router_loss(cache):
    """The load-balancing plus z-loss of one forward (this call's share of the global ones)."""
    return cache["routing"]["aux_loss"] + cache["routing"]["z_loss"]


class MoELayer:
    """The single-device layer as the object `gpt.block_forward(..., moe=)` takes; expert
    parallelism passes its own with the same two methods. `last_routing[layer]` keeps the routing
    of each layer's latest forward, for reports. `weight`: 1/M when the step has M microbatches;
    `grad_scale`: the fp16 loss scale of the backward that will follow (`route`)."""

    def __init__(self, weight: float = 1.0, grad_scale: float = 1.0):
        self.last_routing: dict[int, dict] = {}
        self.weight, self.grad_scale = weight, grad_scale

    def forward(self, x, params, layer: int, config):
        out, cache = moe_forward(x, params, layer, config, self.weight, self.grad_scale)
        self.last_routing[layer] = cache["routing"]
        return out, cache

    def backward(self, dout, cache):
        return moe_backward(dout, cache)
