"""Production training options on one device (refpar/model/optim.py, refpar/trainer.py): the
learning-rate schedules against their definitions' values at named steps, clipping against
torch.nn.utils.clip_grad_norm_ and against the norm of the gradients backward returns, the
weight-decay rule, and the sentences bad values get. The meshes reproduce all of it:
tests/test_engine.py (every combination of the quick matrix) and tests/test_clipping.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import init_params, loss_and_grads
from refpar.model.optim import (
    ADAMW_CHUNK,
    adamw_update,
    clip_coefficient,
    learning_rate,
    optimizer_init,
    optimizer_step,
    sum_of_squares,
)
from refpar.trainer import train_single_device
from tests.numerics import CONTRACT, U64, rel_diff, within

LR, MIN = 1e-2, 1e-3


def lrs(schedule: str, steps: int = 11, warmup: int = 2, **kw) -> list[float]:
    cfg = TrainConfig(steps=steps, lr=LR, lr_schedule=schedule, warmup_steps=warmup,
                      min_lr=0.0 if schedule == "constant" else MIN, **kw)
    return [learning_rate(cfg, s) for s in range(steps)]


# The definitions with N = 11 steps, W = 2 warmup steps: warmup lr (s + 1) / (W + 1) at s = 0, 1
# (nanoGPT's get_lr); the decay over s = W .. N - 1 = 2 .. 10, r = (s - 2) / 8, so its midpoint is
# s = 6 (r = 1/2) and its end s = 10 (r = 1), where Megatron-LM's cosine and linear both give
# (lr + min_lr) / 2 and min_lr.
@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_warmup_rises_linearly_to_the_peak_at_its_end(schedule):
    got = lrs(schedule)
    assert got[:3] == pytest.approx([LR / 3, 2 * LR / 3, LR], rel=4 * U64)


def test_cosine_halves_at_the_decay_midpoint_and_ends_at_min_lr():
    got = lrs("cosine")
    assert got[6] == pytest.approx((LR + MIN) / 2, rel=8 * U64)
    assert got[4] == pytest.approx(MIN + (LR - MIN) * (1 + math.sqrt(0.5)) / 2, rel=8 * U64)  # r = 1/4
    assert got[10] == MIN and all(a > b for a, b in zip(got[2:], got[3:], strict=False))


def test_linear_falls_by_equal_steps_to_min_lr():
    got = lrs("linear")
    assert got[6] == pytest.approx((LR + MIN) / 2, rel=8 * U64) and got[10] == MIN
    assert np.diff(got[2:]) == pytest.approx([-(LR - MIN) / 8] * 8, rel=1e-12)


def test_constant_stays_at_the_peak_after_warmup():
    assert lrs("constant")[2:] == [LR] * 9 and lrs("constant", warmup=0) == [LR] * 11


def test_wsd_holds_the_peak_then_decays_over_its_last_steps():
    # K = 4 decay steps: stable up to s = N - 1 - K = 6, then min_lr + (1 - (s - 6) / 4) (lr - min_lr)
    got = lrs("wsd", wsd_decay_steps=4)
    assert got[2:7] == pytest.approx([LR] * 5, rel=4 * U64)  # min_lr + 1 (lr - min_lr): one rounding
    assert got[7:] == pytest.approx([MIN + f * (LR - MIN) for f in (0.75, 0.5, 0.25, 0.0)], rel=8 * U64)
    # default K: a fifth of the N - W = 9 steps after the warmup, rounded up: 2
    assert lrs("wsd")[8:] == pytest.approx([LR, (LR + MIN) / 2, MIN], rel=8 * U64)


def test_clip_coefficient_and_norm_are_torch_clip_grad_norm_s():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s) for s in ((5, 3), (7,), (2, 4, 3))]
    for max_norm in (0.5, 100.0):  # clipped, and left as it is
        tensors = [torch.tensor(g, requires_grad=True) for g in grads]
        for t, g in zip(tensors, grads, strict=True):
            t.grad = torch.tensor(g)
        total = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm))
        norm = float(sum_of_squares(grads)[0]) ** 0.5
        coef = clip_coefficient(norm, max_norm)
        assert within(abs(norm - total) / total, CONTRACT)
        for t, g in zip(tensors, grads, strict=True):
            assert within(rel_diff(g * coef, t.grad.numpy()), CONTRACT)


def test_the_trainer_clips_by_the_norm_of_the_gradients_backward_returns():
    model, X = model_preset("tiny"), 0.05
    cfg = TrainConfig(steps=3, clip_grad_norm=X, lr_schedule="cosine", warmup_steps=1, min_lr=1e-3)
    run = train_single_device(model, cfg)
    # step 0's gradients do not depend on clipping: the norm of them all, each element once
    tokens, targets = MarkovCorpus(model.vocab_size, cfg.seed).batch(0, range(cfg.batch_size), cfg.seq_len)
    _, grads = loss_and_grads(init_params(model, cfg.seed), tokens, targets, model, seed=cfg.seed, step=0,
                              sample_ids=range(cfg.batch_size), normalizer=cfg.batch_size * cfg.seq_len)
    norm = float(np.linalg.norm(np.concatenate([g.ravel() for g in grads.values()])))
    assert within(abs(run.grad_norms[0] - norm) / norm, CONTRACT) and min(run.grad_norms) > 10 * X
    assert run.lrs == [learning_rate(cfg, s) for s in range(3)] and run.lrs[-1] == 1e-3
    # clipping to a norm no step reaches multiplies by 1: bitwise the unclipped run (same operations)
    loose = train_single_device(model, TrainConfig(steps=3, clip_grad_norm=1e9, lr_schedule="cosine",
                                                   warmup_steps=1, min_lr=1e-3))
    plain = train_single_device(model, TrainConfig(steps=3, lr_schedule="cosine", warmup_steps=1,
                                                   min_lr=1e-3))
    assert loose.losses == plain.losses and plain.grad_norms == [] and run.losses[1] != plain.losses[1]


@pytest.mark.parametrize("decay_all", [False, True])
def test_weight_decay_scales_matrices_and_embeddings_only_unless_decay_all(decay_all):
    cfg = TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.5, decay_all=decay_all)
    params = init_params(model_preset("tiny"), 0)
    zero = {n: np.zeros_like(p) for n, p in params.items()}  # the update is the decay alone
    new, _ = optimizer_step(params, zero, optimizer_init(params, cfg), cfg, lr=cfg.lr)
    for n, p in params.items():
        decayed = decay_all or p.ndim >= 2  # wte, wpe and every weight matrix; no bias, no LN gain
        assert np.array_equal(new[n], p * (1 - 0.1 * 0.5) if decayed else p), n
    vectors = {n for n, p in params.items() if p.ndim < 2}
    assert vectors >= {"h.0.ln_1.weight", "h.0.attn.c_attn.bias", "ln_f.bias"}


@pytest.mark.parametrize("namespace", ["numpy", "torch"])
def test_adamw_on_an_array_of_several_chunks_is_the_formula_element_by_element_bit_for_bit(namespace):
    """Past ADAMW_CHUNK elements the update runs a chunk at a time: every element must still get
    AdamW's formula (decoupled decay, moments, bias corrections, in torch.optim.AdamW's order),
    written out here one expression a line as the update rounds it, so the bits agree; a
    per-element decay mask (a flat shard's) is sliced with its chunk. On torch m and v agree bit
    for bit too; p within the sqrt, which torch rounds within one ulp (2u) where NumPy rounds it
    correctly (tests/test_mixed_precision_torch.py): the update's six roundings then differ by at
    most 11u of the update, and p - update rounds on each side, half an ulp of p each."""
    cfg = TrainConfig(weight_decay=0.1)
    rng = np.random.default_rng(5)
    shape = (3, ADAMW_CHUNK // 2 + 7)  # 1.5 chunks and a bit: the last chunk is short
    p, g, m = (rng.standard_normal(shape) for _ in range(3))
    v = rng.standard_normal(shape) ** 2
    decay = rng.random(shape) < 0.5
    lr, t, factor = 3e-3, 4, 0.5
    g1 = g * factor
    want_p = p * (1.0 - (lr * cfg.weight_decay) * decay.astype(float))
    want_m = cfg.beta1 * m + (1.0 - cfg.beta1) * g1
    want_v = cfg.beta2 * v + (g1 * g1) * (1.0 - cfg.beta2)
    denom = np.sqrt(want_v) / (1.0 - cfg.beta2 ** t) ** 0.5 + cfg.eps
    update = (want_m / denom) * (lr / (1.0 - cfg.beta1 ** t))
    want_p = want_p - update
    if namespace == "torch":
        torch = pytest.importorskip("torch")
        p, g, m, v, decay = map(torch.from_numpy, (p, g, m, v, decay))
    got = [np.asarray(a) for a in adamw_update(p, g, m, v, t, cfg, decay, lr, grad_factor=factor)]
    assert all(a.shape == shape for a in got)
    assert np.array_equal(got[1], want_m) and np.array_equal(got[2], want_v)
    if namespace == "numpy":
        assert np.array_equal(got[0], want_p)
    else:
        assert np.all(np.abs(got[0] - want_p) <= 11 * U64 * np.abs(update) + np.spacing(np.abs(want_p)))


@pytest.mark.parametrize(("fields", "words"), [
    ({"clip_grad_norm": -1.0}, "must be 0 (no clipping) or a positive finite norm"),
    ({"clip_grad_norm": math.nan}, "must be 0 (no clipping) or a positive finite norm"),
    ({"lr_schedule": "step"}, "choose one of constant, cosine, linear, wsd"),
    ({"warmup_steps": -1}, "must be a whole number >= 0"),
    ({"lr_schedule": "cosine", "min_lr": 1.0}, "must lie between 0 and lr=0.01"),
    ({"min_lr": 1e-3}, "add --lr-schedule cosine, linear or wsd, or drop --min-lr"),
    ({"wsd_decay_steps": 3}, "add --lr-schedule wsd or drop it"),
    ({"lr_schedule": "wsd", "wsd_decay_steps": 0}, "must be a whole number from 1 to --steps 30"),
])
def test_bad_schedule_and_clipping_values_get_one_sentence(fields, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields)
