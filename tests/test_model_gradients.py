"""Every hand-written backward against central finite differences in float64.

Each layer is checked on every input entry; the whole GPT-2 (tiny preset, dropout on: masks are
fixed by their key, so the loss is a smooth function of the parameters) is checked along a random
direction per parameter tensor and on its largest-gradient entry. Relative error is
||analytic - numeric|| / ||numeric||. The difference quotient is the fourth-order central one,
(8 (f(+h) - f(-h)) - (f(+2h) - f(-2h))) / 12h with h = 1e-4: its truncation error (~h^4) and its
rounding error (~1e-16 * loss / h) both stay near 1e-12, far below the 1e-6 being checked.
"""

import numpy as np
import pytest

from refpar.config import model_preset
from refpar.model import gpt
from refpar.model.attention import attention_backward, attention_forward
from refpar.model.data import MarkovCorpus
from refpar.model.dropout import keep_mask
from refpar.model.layers import (
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
from tests.numerics import CONTRACT, U64, rel_diff, within

H = 1e-4
TOL = 1e-6


def derivative(f, move):
    """d/ds f at s = 0, where move(s) shifts the input to offset s (absolute) along a direction."""
    values = {}
    for s in (-2, -1, 1, 2):
        move(s * H)
        values[s] = f()
        move(-s * H)
    return (8 * (values[1] - values[-1]) - (values[2] - values[-2])) / (12 * H)


def rel_err(analytic, numeric):
    return np.linalg.norm(np.ravel(analytic - numeric)) / max(np.linalg.norm(np.ravel(numeric)), 1e-300)


def numeric_grad(f, x):
    """d f() / d x by central differences, perturbing x in place entry by entry."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        def move(s, i=i):
            flat[i] += s
        gflat[i] = derivative(f, move)
    return grad


def check(name, analytic, f, x):
    err = rel_err(analytic, numeric_grad(f, x))
    assert within(err, TOL), f"{name}: relative error {err:.2e} >= {TOL}"


@pytest.fixture
def r():
    return np.random.default_rng(0)


def test_linear_backward_matches_finite_differences(r):
    x, w, b = r.normal(size=(2, 3, 4)), r.normal(size=(4, 5)), r.normal(size=5)
    R = r.normal(size=(2, 3, 5))  # a random linear functional of the output: loss = sum(out * R)

    def f():
        return np.sum(linear_forward(x, w, b)[0] * R)

    dx, dw, db = linear_backward(R, linear_forward(x, w, b)[1])
    check("dx", dx, f, x)
    check("dw", dw, f, w)
    check("db", db, f, b)
    dx0, dw0, db0 = linear_backward(R, linear_forward(x, w, None)[1])
    assert db0 is None and np.array_equal(dw0, dw)  # the same GEMM x^T R on the same arrays


def test_layernorm_backward_matches_finite_differences(r):
    x, w, b = r.normal(size=(2, 3, 6)) * 3 + 1, r.normal(size=6), r.normal(size=6)
    R = r.normal(size=(2, 3, 6))

    def f():
        return np.sum(layernorm_forward(x, w, b, 1e-5)[0] * R)

    dx, dw, db = layernorm_backward(R, layernorm_forward(x, w, b, 1e-5)[1])
    check("dx", dx, f, x)
    check("dw", dw, f, w)
    check("db", db, f, b)


def test_gelu_backward_matches_finite_differences(r):
    x = r.normal(size=(3, 7)) * 2
    R = r.normal(size=(3, 7))
    check("dx", gelu_backward(R, gelu_forward(x)[1]), lambda: np.sum(gelu_forward(x)[0] * R), x)


def test_dropout_scales_kept_values_and_backward_matches_finite_differences(r):
    x = r.normal(size=(4, 5))
    keep = r.random((4, 5)) > 0.3
    R = r.normal(size=(4, 5))
    out, cache = dropout_forward(x, keep, 0.3)
    # elementwise, 6 roundings at most: the layer's x * (1 / (1 - p)) rounds p = 0.3, 1 - p, the
    # quotient and the product; the test's x / 0.7 rounds 0.7 and the quotient
    want = np.where(keep, x / 0.7, 0.0)
    assert within(float(np.max(np.abs(out - want) / np.maximum(np.abs(want), 1e-300))), 6 * U64)
    check("dx", dropout_backward(R, cache), lambda: np.sum(dropout_forward(x, keep, 0.3)[0] * R), x)


def test_embedding_backward_accumulates_repeated_tokens(r):
    wte, wpe = r.normal(size=(7, 4)), r.normal(size=(9, 4))
    tokens = np.array([[1, 3, 1], [6, 1, 0]])  # token 1 three times
    positions = np.array([4, 5, 6])  # a shard's global positions
    R = r.normal(size=(2, 3, 4))

    def f():
        return np.sum(embedding_forward(tokens, wte, wpe, positions)[0] * R)

    dwte, dwpe = embedding_backward(R, embedding_forward(tokens, wte, wpe, positions)[1])
    check("dwte", dwte, f, wte)
    check("dwpe", dwpe, f, wpe)


def test_cross_entropy_is_mean_negative_log_likelihood_and_backward_matches(r):
    logits = r.normal(size=(2, 3, 5)) * 3
    targets = r.integers(0, 5, size=(2, 3))
    loss, cache = cross_entropy_forward(logits, targets, 6)
    logp = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
    expected = -np.mean(np.take_along_axis(logp, targets[..., None], axis=-1))
    assert within(rel_diff(float(loss), expected), CONTRACT)  # another formula, another order
    check("dlogits", cross_entropy_backward(1.0, cache),
          lambda: float(cross_entropy_forward(logits, targets, 6)[0]), logits)


@pytest.mark.parametrize("shard", [False, True])
def test_attention_backward_matches_finite_differences(r, shard):
    B, nh, T, hs = 2, 2, 5, 3
    # shard: queries are positions 3..4 of a sequence whose keys 0..4 are all present (as in
    # context parallelism), so the mask must be by position, not by index.
    q_pos = np.arange(3, 5) if shard else np.arange(T)
    k_pos = np.arange(T)
    q = r.normal(size=(B, nh, len(q_pos), hs))
    k, v = r.normal(size=(B, nh, T, hs)), r.normal(size=(B, nh, T, hs))
    keep = r.random((B, nh, len(q_pos), T)) > 0.2
    R = r.normal(size=(B, nh, len(q_pos), hs))

    def f():
        return np.sum(attention_forward(q, k, v, q_pos, k_pos, keep, 0.2)[0] * R)

    out, cache = attention_forward(q, k, v, q_pos, k_pos, keep, 0.2)
    if shard:
        full, _ = attention_forward(np.concatenate([r.normal(size=(B, nh, 3, hs)), q], axis=2),
                                    k, v, k_pos, k_pos, np.concatenate([keep[:, :, :1]] * 3 + [keep], 2), 0.2)
        # queries of another length: GEMMs of other shapes, sums in another order
        assert within(rel_diff(out, full[:, :, 3:]), CONTRACT)
    dq, dk, dv = attention_backward(R, cache)
    check("dq", dq, f, q)
    check("dk", dk, f, k)
    check("dv", dv, f, v)


def test_dropout_mask_of_a_shard_is_the_slice_of_the_full_mask():
    full = keep_mask(3, 7, 2, "attn", [5, 9], (4, 6, 6), 0.25)
    part = keep_mask(3, 7, 2, "attn", [9], (4, 6, 6), 0.25, index=(slice(1, 3), slice(2, 6)))
    assert np.array_equal(part[0], full[1, 1:3, 2:6])
    assert 0.6 < full.mean() < 0.9


@pytest.mark.parametrize("shape", [(4, 6, 6), (3, 5, 7), (1,), (2, 64)])  # odd sizes: a half word left
@pytest.mark.parametrize("p", [0.1, 0.25, 1 / 3, 0.5, 1e-9, 0.9999999, np.float64(0.1), np.float32(0.1)])
def test_dropout_mask_is_the_float32_uniforms_compared_with_p(shape, p):
    """keep_mask decides on the uniforms' 32-bit words (dropout._uniform_words); the mask must be
    what NumPy's own float32 uniforms of the same key give, `random(shape, float32) >= p`, whole
    and sliced, whatever p's type (a float64 scalar compares in float64, a float or float32 one
    in float32) and at p near 0 and near 1."""
    from refpar import rng
    from refpar.model.dropout import SITES

    ids = [5, 9, 0]
    want = np.stack([rng.generator(3, "dropout", 7, 2, SITES["attn"], s).random(shape, dtype=np.float32) >= p
                     for s in ids])  # (3, *shape)
    assert np.array_equal(keep_mask(3, 7, 2, "attn", ids, shape, p), want)
    index = (slice(None), slice(0, 1)) if len(shape) > 1 else (slice(1, None),)
    assert np.array_equal(keep_mask(3, 7, 2, "attn", ids, shape, p, index), want[(slice(None), *index)])


# ------------------------------------------------------------------------------------ whole model
def tiny_batch(B=2, T=8):
    config = model_preset("tiny", dropout=0.1)
    params = gpt.init_params(config, seed=5)
    # Random (not GPT-2-init) LayerNorm gains and biases, so their gradients are not special.
    r = np.random.default_rng(1)
    for name in params:
        if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f"):
            params[name] = params[name] + 0.1 * r.normal(size=params[name].shape)
    tokens, targets = MarkovCorpus(config.vocab_size, 2).batch(0, range(B), T)
    return config, params, tokens, targets


def test_whole_model_gradients_match_finite_differences_with_dropout_on():
    config, params, tokens, targets = tiny_batch()
    kw = dict(seed=11, step=3, sample_ids=[4, 9])
    loss, grads = gpt.loss_and_grads(params, tokens, targets, config, **kw)

    def f():
        return gpt.loss_and_grads(params, tokens, targets, config, **kw)[0]

    r = np.random.default_rng(2)
    worst = 0.0
    for name, p in params.items():
        d = r.normal(size=p.shape)

        def along(s, p=p, d=d):
            p += s * d

        numeric = derivative(f, along)
        analytic = float(np.sum(grads[name] * d))
        err = abs(analytic - numeric) / abs(numeric)
        worst = max(worst, err)
        assert within(err, TOL), f"{name}: directional derivative relative error {err:.2e}"
        # and one single entry per tensor, the largest-gradient one, so no entry hides in a sum
        i = np.unravel_index(np.argmax(np.abs(grads[name])), p.shape)

        def entry(s, p=p, i=i):
            p[i] += s

        numeric = derivative(f, entry)
        assert within(abs(grads[name][i] - numeric) / abs(numeric), TOL), f"{name}{i}"
    print(f"worst directional relative error {worst:.2e}")


def test_loss_sums_over_shards_to_the_global_mean_and_dropout_depends_on_sample_id():
    config, params, tokens, targets = tiny_batch(B=4)
    full, g_full = gpt.loss_and_grads(params, tokens, targets, config, seed=1)
    a, g_a = gpt.loss_and_grads(params, tokens[:1], targets[:1], config, seed=1, sample_ids=[0],
                                normalizer=tokens.size)
    b, g_b = gpt.loss_and_grads(params, tokens[1:], targets[1:], config, seed=1, sample_ids=[1, 2, 3],
                                normalizer=tokens.size)
    # two shards' sums added against one sum over the batch: the float64 contract
    assert within(rel_diff(a + b, full), CONTRACT)
    for name in params:
        assert within(rel_diff(g_a[name] + g_b[name], g_full[name]), CONTRACT), name
    other, _ = gpt.loss_and_grads(params, tokens[1:], targets[1:], config, seed=1, sample_ids=[7, 2, 3],
                                  normalizer=tokens.size)
    assert other != b
    no_drop, _ = gpt.loss_and_grads(params, tokens, targets, config, training=False)
    logits = gpt.forward(params, tokens, config)
    expected, _ = cross_entropy_forward(logits, targets, tokens.size)
    # bitwise: loss_and_grads without dropout runs forward's ops in forward's order (head_forward is
    # logits_forward then cross_entropy_forward) and adds an empty sum of router losses, 0
    assert no_drop == float(expected)


def test_explicit_positions_with_dropout_on_are_refused_rather_than_drawn_wrong():
    config, params, tokens, _ = tiny_batch()
    drop = gpt.DropoutContext(1, 0, (0, 1), 0.1, True)
    with pytest.raises(ValueError, match="explicit positions need dropout off"):
        gpt.embed_forward(tokens, params, drop, positions=np.arange(4, 12))
    x, _ = gpt.embed_forward(tokens, params, gpt.NO_DROPOUT, positions=np.arange(8))
    y, _ = gpt.embed_forward(tokens, params)
    assert np.array_equal(x, y)  # the default positions are arange(8): the same gather
