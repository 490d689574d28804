"""SGD and AdamW as pure elementwise functions.

Elementwise is the point: the update of one element depends only on that element's parameter,
gradient and moments, so ZeRO and FSDP run these functions unchanged on a flat shard of any
partition and get the single device's numbers. `cfg` is anything with lr, beta1, beta2, eps and
weight_decay (a `TrainConfig`).

Weight decay is decoupled (Loshchilov & Hutter 2019) and applies to weights with two or more
dimensions only (nanoGPT's convention: not to biases or LayerNorm gains). On a flat shard, pass
`decay` as a per-element mask built from the parameters the shard covers.

Mixed precision (refpar/precision.py): for 16-bit parameters the state also holds `master`, an fp32
copy of the parameters (exact at init, since every 16-bit value is an fp32 value), and `m`, `v` in
fp32. `mixed_adamw_update` / `mixed_sgd_update` upcast the 16-bit gradient, undo the loss scale,
update master (and moments) in fp32 and return the parameters as master rounded to 16 bits once.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.precision import is_16bit


def decays(name: str, p) -> bool:
    """Whether weight decay applies to parameter `name`: matrices yes, vectors no."""
    return p.ndim >= 2


def _decay_factor(p, cfg, decay):
    """1 - lr * wd where decay applies, 1 elsewhere; a Python float or an array of p's dtype."""
    if isinstance(decay, bool):
        return 1.0 - cfg.lr * cfg.weight_decay if decay else 1.0
    xp = array_namespace(p)
    return 1.0 - (cfg.lr * cfg.weight_decay) * xp.astype(decay, p.dtype)


def fp32(a):
    """`a` as float32 in its own namespace: the master copy of a 16-bit array (an exact upcast)."""
    xp = array_namespace(a)
    return xp.astype(a, xp.float32)


def adamw_init(params: dict) -> dict:
    """{"t": 0, "m": zeros like each param, "v": zeros like each param}; fp32 moments (and the fp32
    `master` copies) for 16-bit params."""
    def zeros(p):
        xp = array_namespace(p)
        return xp.zeros(p.shape, dtype=xp.float32) if is_16bit(p.dtype) else xp.zeros_like(p)

    state = {"t": 0, "m": {n: zeros(p) for n, p in params.items()},
             "v": {n: zeros(p) for n, p in params.items()}}
    return _with_master(state, params)


def _with_master(state: dict, params: dict) -> dict:
    if any(is_16bit(p.dtype) for p in params.values()):
        state["master"] = {n: fp32(p) for n, p in params.items()}
    return state


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


def _unscaled_fp32(g, inv_scale: float):
    """The gradient in fp32 with the loss scale divided out (fp16 loss scaling; 1.0 otherwise)."""
    g = fp32(g)
    return g if inv_scale == 1.0 else g * inv_scale


def mixed_adamw_update(p16, g, master, m, v, t: int, cfg, decay, inv_scale: float = 1.0):
    """One AdamW step of a 16-bit array with fp32 master weights; returns new (p16, master, m, v):
    g (16-bit or fp32) is upcast and multiplied by `inv_scale`, master/m/v update in fp32 exactly
    as `adamw_update`, and p16 = master rounded to p16's dtype."""
    xp = array_namespace(master)
    master, m, v = adamw_update(master, _unscaled_fp32(g, inv_scale), m, v, t, cfg, decay)
    return xp.astype(master, p16.dtype), master, m, v


def mixed_sgd_update(p16, g, master, cfg, decay, inv_scale: float = 1.0):
    """The SGD twin of `mixed_adamw_update`; returns new (p16, master)."""
    xp = array_namespace(master)
    master = sgd_update(master, _unscaled_fp32(g, inv_scale), cfg, decay)
    return xp.astype(master, p16.dtype), master


def optimizer_init(params: dict, cfg) -> dict:
    """The state `optimizer_step` expects for `cfg.optimizer` (with `master` for 16-bit params)."""
    return adamw_init(params) if cfg.optimizer == "adamw" else _with_master({"t": 0}, params)


def optimizer_step(params: dict, grads: dict, state: dict, cfg, *, inv_scale: float = 1.0,
                   skip: bool = False) -> tuple[dict, dict]:
    """One step over a dict of arrays; returns new (params, state), the inputs untouched.
    `inv_scale` is 1/loss scale (fp16); `skip` (the gradients overflowed) returns params and state
    as they are, the step counter t not advanced."""
    if skip:
        return params, state
    t = state["t"] + 1
    master = state.get("master")
    if cfg.optimizer == "sgd":
        if master is None:
            new = {n: sgd_update(p, grads[n], cfg, decays(n, p)) for n, p in params.items()}
            return new, {"t": t}
        new, new_master = {}, {}
        for n, p in params.items():
            new[n], new_master[n] = mixed_sgd_update(p, grads[n], master[n], cfg, decays(n, p), inv_scale)
        return new, {"t": t, "master": new_master}
    new, m, v = {}, {}, {}
    if master is None:
        for n, p in params.items():
            new[n], m[n], v[n] = adamw_update(p, grads[n], state["m"][n], state["v"][n], t, cfg,
                                              decays(n, p))
        return new, {"t": t, "m": m, "v": v}
    new_master = {}
    for n, p in params.items():
        new[n], new_master[n], m[n], v[n] = mixed_adamw_update(
            p, grads[n], master[n], state["m"][n], state["v"][n], t, cfg, decays(n, p), inv_scale)
    return new, {"t": t, "m": m, "v": v, "master": new_master}
