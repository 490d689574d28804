"""SGD and AdamW as pure elementwise functions, the learning-rate schedule, and the pieces of
gradient clipping by the global norm that every mesh shares.

Elementwise is the point: the update of one element depends only on that element's parameter,
gradient and moments, so ZeRO and FSDP run these functions unchanged on a flat shard of any
partition and get the single device's numbers. `cfg` is anything with beta1, beta2, eps,
weight_decay and decay_all (a `TrainConfig`); `lr` is the step's, `learning_rate(cfg, step)`.

Weight decay is decoupled (Loshchilov & Hutter 2019) and applies to matrices and embeddings only,
not to biases or LayerNorm/RMSNorm gains: the convention of GPT-2, nanoGPT (`configure_optimizers`:
every parameter of two or more dimensions decays) and Megatron-LM (no decay for biases and
one-dimensional parameters). `decay_all` decays every tensor. On a flat shard, pass `decay` as a
per-element mask built from the parameters the shard covers (`decays` of each one's full shape).

`grad_factor` multiplies a gradient before the update: 1/loss scale under fp16, times the clipping
coefficient (`clip_coefficient`); 1.0 leaves the gradient as backward wrote it.

Mixed precision (refpar/precision.py): for 16-bit parameters the state also holds `master`, an fp32
copy of the parameters (exact at init, since every 16-bit value is an fp32 value), and `m`, `v` in
fp32. `mixed_adamw_update` / `mixed_sgd_update` upcast the 16-bit gradient, undo the loss scale,
update master (and moments) in fp32 and return the parameters as master rounded to 16 bits once.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace, device

from refpar.precision import is_16bit

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s (and Megatron-LM's clip_grad_by_total_norm_fp32's)


def learning_rate(cfg, step: int) -> float:
    """The learning rate of 0-based step `step` of a run of N = cfg.steps steps, W = warmup_steps,
    peak lr, floor min_lr, schedule lr_schedule:

        s < W       lr (s + 1) / (W + 1)            linear warmup, nanoGPT's train.py get_lr (it
                                                    never trains a step at 0, as Megatron's first,
                                                    init_lr + (lr - init_lr) s / W, does)
        s >= W      min_lr + coeff(r) (lr - min_lr), r = (s - W) / (N - 1 - W) from 0 to 1
          constant  coeff 1: lr (Megatron: max_lr after the warmup)
          linear    coeff 1 - r
          cosine    coeff (1 + cos(pi r)) / 2
          wsd       warmup-stable-decay: coeff 1 up to s = N - 1 - K, then 1 - (s - (N - 1 - K)) / K
                    over the last K = wsd_decay_steps steps (Megatron's WSD with
                    lr_wsd_decay_style "linear"; K defaults to a fifth of the steps after the
                    warmup, the cooldown of Hagele et al. 2024, "Scaling Laws and Compute-Optimal
                    Training Beyond Fixed Training Durations")

    The decay ends at the last step, s = N - 1, which trains at min_lr: nanoGPT with
    lr_decay_iters = max_iters; Megatron-LM's megatron/core/optimizer_param_scheduler.py get_lr
    has the same decays with its num_steps in place of s. The schedule follows the step index, so
    a step fp16 skips still moves it (as nanoGPT's; Megatron holds it) and a resumed run continues it."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    ratio = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "linear":
        coeff = 1.0 - ratio
    elif cfg.lr_schedule == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    else:  # wsd
        k = wsd_decay_steps(cfg)
        start = cfg.steps - 1 - k
        coeff = 1.0 if step <= start else 1.0 - (step - start) / k
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def wsd_decay_steps(cfg) -> int:
    """K, the steps of WSD's decay: cfg.wsd_decay_steps, else a fifth of those after the warmup."""
    if cfg.wsd_decay_steps is not None:
        return cfg.wsd_decay_steps
    return max(1, math.ceil((cfg.steps - cfg.warmup_steps) / 5))


def decays(shape, cfg) -> bool:
    """Whether weight decay applies to a parameter of (full) `shape`: matrices and embeddings yes,
    biases and norm gains no (module docstring); every tensor with cfg.decay_all."""
    return cfg.decay_all or len(shape) >= 2


def decay_rule(cfg) -> str:
    """The weight-decay rule in words, for the run's start-up summary."""
    where = "every tensor" if cfg.decay_all else "matrices and embeddings, not biases or norm gains"
    return f"weight decay {cfg.weight_decay:g} on {where}"


def sum_of_squares(arrays):
    """Σ over `arrays` of Σ a², as a (1,) array of the optimizer's dtype: fp32 for 16-bit arrays
    (mixed precision: the norm is fp32, as Megatron's and DeepSpeed's), else the arrays' own."""
    arrays = list(arrays)
    xp = array_namespace(*arrays)
    total = None
    for a in arrays:
        a = fp32(a) if is_16bit(a.dtype) else a
        part = xp.reshape(xp.sum(a * a), (1,))  # (1,)
        total = part if total is None else total + part
    return total


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What clipping by the global norm multiplies every gradient by: min(1, max_norm / (norm +
    1e-6)), torch.nn.utils.clip_grad_norm_'s formula (clip_coef = max_norm / (total_norm + 1e-6),
    clamped to 1.0) and eps; Megatron-LM's clip_grad_by_total_norm_fp32 takes the same eps."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def clipped_steps(norms, max_norm: float) -> int:
    """How many of the global `norms` clipping to `max_norm` scales down (clip_coefficient < 1)."""
    return sum(n + CLIP_EPS > max_norm for n in norms)


def _decay_factor(p, cfg, decay, lr: float):
    """1 - lr * wd where decay applies, 1 elsewhere; a Python float or an array of p's dtype."""
    if isinstance(decay, bool):
        return 1.0 - lr * cfg.weight_decay if decay else 1.0
    xp = array_namespace(p)
    return 1.0 - (lr * cfg.weight_decay) * xp.astype(decay, p.dtype)


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


ADAMW_CHUNK = 1 << 16  # elements a pass of `adamw_update` takes: its temporaries stay in the cache


def adamw_update(p, g, m, v, t: int, cfg, decay, lr: float, grad_factor: float = 1.0):
    """One AdamW step of one array (t counts from 1) at learning rate `lr`; returns new (p, m, v),
    in torch.optim.AdamW's order of operations: decay, moments, then
    p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).

    An array of more than ADAMW_CHUNK elements is updated a chunk at a time (every element's update
    is its own, so the numbers are the same): the update's ten passes then run over temporaries
    the cache holds, where whole-array temporaries (each 0.5 GB at GPT-2's 124M parameters) would
    be allocated, faulted in and streamed through memory once a pass."""
    n = math.prod(p.shape)
    if n <= ADAMW_CHUNK:
        return _adamw_elements(p, g, m, v, t, cfg, decay, lr, grad_factor)
    xp = array_namespace(p, g)
    flat = [xp.reshape(a, (n,)) for a in (p, g, m, v)]  # (n,) each
    masks = None if isinstance(decay, bool) else xp.reshape(decay, (n,))  # (n,)
    out = [xp.empty((n,), dtype=a.dtype, device=device(a)) for a in (p, m, v)]  # new p, m, v
    for start in range(0, n, ADAMW_CHUNK):
        part = slice(start, start + ADAMW_CHUNK)
        chunk_decay = decay if masks is None else masks[part]
        out[0][part], out[1][part], out[2][part] = _adamw_elements(
            *(a[part] for a in flat), t, cfg, chunk_decay, lr, grad_factor)
    return tuple(xp.reshape(a, p.shape) for a in out)


def _adamw_elements(p, g, m, v, t: int, cfg, decay, lr: float, grad_factor: float):
    """`adamw_update` of one piece, by whole-array operations. Each operation rounds as in the
    one-expression form; the in-place ones only reuse arrays this call has just made."""
    xp = array_namespace(p, g)
    g = g if grad_factor == 1.0 else g * grad_factor
    p = p * _decay_factor(p, cfg, decay, lr)  # a new array: updated in place below
    m = cfg.beta1 * m
    m += (1.0 - cfg.beta1) * g  # m = beta1 m + (1 - beta1) g
    g2 = g * g
    g2 *= 1.0 - cfg.beta2
    v = cfg.beta2 * v
    v += g2  # v = beta2 v + (1 - beta2) g^2
    bc1 = 1.0 - cfg.beta1 ** t
    bc2 = 1.0 - cfg.beta2 ** t
    denom = xp.sqrt(v)
    denom /= bc2 ** 0.5
    denom += cfg.eps
    update = m / denom
    update *= lr / bc1
    p -= update
    return p, m, v


def sgd_update(p, g, cfg, decay, lr: float, grad_factor: float = 1.0):
    """One plain SGD step of one array with decoupled weight decay; returns the new p."""
    g = g if grad_factor == 1.0 else g * grad_factor
    return p * _decay_factor(p, cfg, decay, lr) - lr * g


def _unscaled_fp32(g, grad_factor: float):
    """The gradient in fp32 times `grad_factor` (1/loss scale, times the clipping coefficient)."""
    g = fp32(g)
    return g if grad_factor == 1.0 else g * grad_factor


def mixed_adamw_update(p16, g, master, m, v, t: int, cfg, decay, lr: float, grad_factor: float = 1.0):
    """One AdamW step of a 16-bit array with fp32 master weights; returns new (p16, master, m, v):
    g (16-bit or fp32) is upcast and multiplied by `grad_factor`, master/m/v update in fp32
    exactly as `adamw_update`, and p16 = master rounded to p16's dtype."""
    xp = array_namespace(master)
    master, m, v = adamw_update(master, _unscaled_fp32(g, grad_factor), m, v, t, cfg, decay, lr)
    return xp.astype(master, p16.dtype), master, m, v


def mixed_sgd_update(p16, g, master, cfg, decay, lr: float, grad_factor: float = 1.0):
    """The SGD twin of `mixed_adamw_update`; returns new (p16, master)."""
    xp = array_namespace(master)
    master = sgd_update(master, _unscaled_fp32(g, grad_factor), cfg, decay, lr)
    return xp.astype(master, p16.dtype), master


def optimizer_init(params: dict, cfg) -> dict:
    """The state `optimizer_step` expects for `cfg.optimizer` (with `master` for 16-bit params)."""
    return adamw_init(params) if cfg.optimizer == "adamw" else _with_master({"t": 0}, params)


def optimizer_step(params: dict, grads: dict, state: dict, cfg, *, lr: float, grad_factor: float = 1.0,
                   skip: bool = False) -> tuple[dict, dict]:
    """One step at learning rate `lr` over a dict of arrays; returns new (params, state), the
    inputs untouched. `grad_factor` multiplies the gradients (module docstring); `skip` (the
    gradients overflowed) returns params and state as they are, the step counter t not advanced."""
    if skip:
        return params, state
    t = state["t"] + 1
    master = state.get("master")
    f = grad_factor
    if cfg.optimizer == "sgd":
        if master is None:
            new = {n: sgd_update(p, grads[n], cfg, decays(p.shape, cfg), lr, f) for n, p in params.items()}
            return new, {"t": t}
        new, new_master = {}, {}
        for n, p in params.items():
            new[n], new_master[n] = mixed_sgd_update(p, grads[n], master[n], cfg, decays(p.shape, cfg), lr, f)
        return new, {"t": t, "master": new_master}
    new, m, v = {}, {}, {}
    if master is None:
        for n, p in params.items():
            new[n], m[n], v[n] = adamw_update(p, grads[n], state["m"][n], state["v"][n], t, cfg,
                                              decays(p.shape, cfg), lr, f)
        return new, {"t": t, "m": m, "v": v}
    new_master = {}
    for n, p in params.items():
        new[n], new_master[n], m[n], v[n] = mixed_adamw_update(
            p, grads[n], master[n], state["m"][n], state["v"][n], t, cfg, decays(p.shape, cfg), lr, f)
    return new, {"t": t, "m": m, "v": v, "master": new_master}
