"""SGD and AdamW as pure elementwise functions.

Elementwise is the point: the update of one element depends only on that element's parameter,
gradient and moments, so ZeRO and FSDP run these functions unchanged on a flat shard of any
partition and get the single device's numbers. `cfg` is anything with lr, beta1, beta2, eps and
weight_decay (a `TrainConfig`).

Weight decay is decoupled (Loshchilov & Hutter 2019) and applies to weights with two or more
dimensions only (nanoGPT's convention: not to biases or LayerNorm gains). On a flat shard, pass
`decay` as a per-element mask built from the parameters the shard covers.
"""

from __future__ import annotations

from array_api_compat import array_namespace


def decays(name: str, p) -> bool:
    """Whether weight decay applies to parameter `name`: matrices yes, vectors no."""
    return p.ndim >= 2


def _decay_factor(p, cfg, decay):
    """1 - lr * wd where decay applies, 1 elsewhere; a Python float or an array of p's dtype."""
    if isinstance(decay, bool):
        return 1.0 - cfg.lr * cfg.weight_decay if decay else 1.0
    xp = array_namespace(p)
    return 1.0 - (cfg.lr * cfg.weight_decay) * xp.astype(decay, p.dtype)


def adamw_init(params: dict) -> dict:
    """{"t": 0, "m": zeros like each param, "v": zeros like each param}."""
    def zeros(p):
        return array_namespace(p).zeros_like(p)

    return {"t": 0, "m": {n: zeros(p) for n, p in params.items()},
            "v": {n: zeros(p) for n, p in params.items()}}


def adamw_update(p, g, m, v, t: int, cfg, decay):
    """One AdamW step of one array (t counts from 1); returns new (p, m, v), in torch.optim.AdamW's
    order of operations: decay, moments, then p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)."""
    xp = array_namespace(p, g)
    p = p * _decay_factor(p, cfg, decay)
    m = cfg.beta1 * m + (1.0 - cfg.beta1) * g
    v = cfg.beta2 * v + (1.0 - cfg.beta2) * (g * g)
    bc1 = 1.0 - cfg.beta1 ** t
    bc2 = 1.0 - cfg.beta2 ** t
    p = p - (cfg.lr / bc1) * (m / (xp.sqrt(v) / bc2 ** 0.5 + cfg.eps))
    return p, m, v


def sgd_update(p, g, cfg, decay):
    """One plain SGD step of one array with decoupled weight decay; returns the new p."""
    return p * _decay_factor(p, cfg, decay) - cfg.lr * g


def optimizer_init(params: dict, cfg) -> dict:
    """The state `optimizer_step` expects for `cfg.optimizer`."""
    return adamw_init(params) if cfg.optimizer == "adamw" else {"t": 0}


def optimizer_step(params: dict, grads: dict, state: dict, cfg) -> tuple[dict, dict]:
    """One step over a dict of arrays; returns new (params, state), the inputs untouched."""
    t = state["t"] + 1
    if cfg.optimizer == "sgd":
        new = {n: sgd_update(p, grads[n], cfg, decays(n, p)) for n, p in params.items()}
        return new, {"t": t}
    new, m, v = {}, {}, {}
    for n, p in params.items():
        new[n], m[n], v[n] = adamw_update(p, grads[n], state["m"][n], state["v"][n], t, cfg, decays(n, p))
    return new, {"t": t, "m": m, "v": v}
