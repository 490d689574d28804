"""Llama's hand-written backwards against central finite differences and against torch autograd, in
float64, layer by layer; RoPE's rotation by global position; the whole model against finite
differences along a direction per tensor.

Finite differences: ||analytic - numeric|| / ||numeric|| over every input entry, with the
fourth-order quotient (8 (f(+h) - f(-h)) - (f(+2h) - f(-2h))) / 12h, h = 1e-4: truncation (~h^4)
and rounding (~1e-16 |f| / h) both stay near 1e-12, far below the 1e-6 checked.
torch autograd: an independent implementation of each layer (torch's own rms_norm, silu, embedding,
scaled_dot_product_attention with enable_gqa), the same quantities summed in other orders: the
float64 contract.
"""

import numpy as np
import pytest

import refpar.model as M
from refpar.config import ModelConfig
from refpar.model import llama
from refpar.model.llama_layers import (
    gqa_attention_backward,
    gqa_attention_forward,
    linear_t_backward,
    linear_t_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    rope_cos_sin,
    rope_forward,
    swiglu_backward,
    swiglu_forward,
    swiglu_mlp_backward,
    swiglu_mlp_forward,
    token_embedding_backward,
    token_embedding_forward,
)
from tests.numerics import CONTRACT, U64, rel_diff, within

H = 1e-4
FD_TOL = 1e-6


def derivative(f, move):
    """d/ds f at s = 0, where move(s) shifts the input by s along a direction."""
    values = {}
    for s in (-2, -1, 1, 2):
        move(s * H)
        values[s] = f()
        move(-s * H)
    return (8 * (values[1] - values[-1]) - (values[2] - values[-2])) / (12 * H)


def check_fd(name, analytic, f, x):
    """analytic == d f() / d x by finite differences, x perturbed in place entry by entry."""
    numeric = np.zeros_like(x)
    flat, nflat = x.reshape(-1), numeric.reshape(-1)
    for i in range(flat.size):
        def move(s, i=i):
            flat[i] += s
        nflat[i] = derivative(f, move)
    err = np.linalg.norm(analytic - numeric) / np.linalg.norm(numeric)
    assert within(err, FD_TOL), f"{name}: relative error {err:.2e} against finite differences"


torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")


def check_torch(forward_np, grads_np, torch_fn, inputs, R):
    """refpar's output and input gradients (of sum(out * R)) against torch autograd on the same
    float64 inputs."""
    tensors = [torch.tensor(x, requires_grad=True) for x in inputs]
    out = torch_fn(*tensors)
    (out * torch.from_numpy(R)).sum().backward()
    assert within(rel_diff(forward_np, out.detach().numpy()), CONTRACT), "forward"
    for i, (mine, t) in enumerate(zip(grads_np, tensors, strict=True)):
        assert within(rel_diff(mine, t.grad.numpy()), CONTRACT), f"gradient of input {i}"


@pytest.fixture
def r():
    return np.random.default_rng(0)


def test_linear_t_is_torch_linear_and_its_weight_gradient_keeps_the_out_in_layout(r):
    x, w, R = r.normal(size=(2, 3, 4)), r.normal(size=(5, 4)), r.normal(size=(2, 3, 5))
    out, cache = linear_t_forward(x, w)
    dx, dw = linear_t_backward(R, cache)
    assert dw.shape == w.shape
    check_fd("dx", dx, lambda: np.sum(linear_t_forward(x, w)[0] * R), x)
    check_fd("dw", dw, lambda: np.sum(linear_t_forward(x, w)[0] * R), w)
    check_torch(out, (dx, dw), torch.nn.functional.linear, (x, w), R)


def test_rmsnorm_backward_matches_finite_differences_and_torch_rms_norm(r):
    x, w, R = r.normal(size=(2, 3, 6)) * 3 + 1, r.normal(size=6), r.normal(size=(2, 3, 6))
    out, cache = rmsnorm_forward(x, w, 1e-5)
    dx, dw = rmsnorm_backward(R, cache)
    check_fd("dx", dx, lambda: np.sum(rmsnorm_forward(x, w, 1e-5)[0] * R), x)
    check_fd("dw", dw, lambda: np.sum(rmsnorm_forward(x, w, 1e-5)[0] * R), w)
    check_torch(out, (dx, dw), lambda x, w: torch.nn.functional.rms_norm(x, (6,), w, 1e-5), (x, w), R)


def torch_rope(x, cos, sin):
    """HF's apply_rotary_pos_emb, restated in torch: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_rope_backward_matches_finite_differences_and_torch_autograd(r):
    positions = np.arange(5, 9)  # a shard's global positions
    cos, sin = rope_cos_sin(positions, 6, 10000.0, np.zeros(1))
    x, R = r.normal(size=(2, 3, 4, 6)), r.normal(size=(2, 3, 4, 6))
    out, cache = rope_forward(x, cos, sin)
    dx = rope_backward(R, cache)
    check_fd("dx", dx, lambda: np.sum(rope_forward(x, cos, sin)[0] * R), x)
    check_torch(out, (dx,), lambda x: torch_rope(x, torch.from_numpy(cos), torch.from_numpy(sin)), (x,), R)


def test_rope_rotates_by_global_position_so_scores_depend_on_the_offset_only(r):
    hs, theta = 8, 500000.0
    full_cos, full_sin = rope_cos_sin(np.arange(12), hs, theta, np.zeros(1))
    part_cos, part_sin = rope_cos_sin(np.arange(7, 12), hs, theta, np.zeros(1))
    # a shard's positions give the full sequence's rows: the same elementwise ops on the same numbers
    assert np.array_equal(part_cos, full_cos[7:]) and np.array_equal(part_sin, full_sin[7:])
    assert np.array_equal(rope_cos_sin(np.arange(1), hs, theta, np.zeros(1))[0], np.ones((1, hs)))
    q, k = r.normal(size=hs), r.normal(size=hs)

    def score(m, n):  # <R_m q, R_n k> for a query at position m and a key at position n
        (cm, cn), (sm, sn) = rope_cos_sin(np.array([m, n]), hs, theta, q)
        return float(np.dot(rope_forward(q, cm, sm)[0], rope_forward(k, cn, sn)[0]))

    # A rotation by position: the score sees m - n only. An angle p * theta^(-2i/hs) is computed to
    # ~5 u relative (power, division, product), so angles up to 107 rad to 600 u absolute, and cos
    # and sin to 600 u; each rotated vector then moves by at most 2 * 600 u of its norm, and the
    # dot product of the two by 2 * 2 * 600 u |q||k|; twice that, for the two scores compared.
    bound = 8 * 600 * U64 * np.linalg.norm(q) * np.linalg.norm(k)
    assert within(abs(score(7, 3) - score(107, 103)), bound)
    assert abs(score(7, 3) - score(7, 4)) > 1e3 * bound  # and does see the offset


def test_swiglu_backward_matches_finite_differences_and_torch_silu(r):
    gate, up, R = r.normal(size=(3, 7)) * 3, r.normal(size=(3, 7)), r.normal(size=(3, 7))
    gate[0, 0] = -800.0  # far out, where exp(-a) would overflow: the tanh form of the sigmoid does not
    with np.errstate(all="raise"):
        out, cache = swiglu_forward(gate, up)
        dgate, dup = swiglu_backward(R, cache)
    assert out[0, 0] == 0.0 and dgate[0, 0] == 0.0
    check_fd("dgate", dgate, lambda: np.sum(swiglu_forward(gate, up)[0] * R), gate)
    check_fd("dup", dup, lambda: np.sum(swiglu_forward(gate, up)[0] * R), up)
    check_torch(out, (dgate, dup), lambda g, u: torch.nn.functional.silu(g) * u, (gate, up), R)


def test_swiglu_mlp_backward_matches_finite_differences_and_torch_autograd(r):
    C, F = 4, 6
    x, R = r.normal(size=(2, 3, C)), r.normal(size=(2, 3, C))
    wg, wu, wd = r.normal(size=(F, C)), r.normal(size=(F, C)), r.normal(size=(C, F))
    out, cache = swiglu_mlp_forward(x, wg, wu, wd)
    grads = swiglu_mlp_backward(R, cache)

    def f():
        return np.sum(swiglu_mlp_forward(x, wg, wu, wd)[0] * R)

    for name, g, a in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, (x, wg, wu, wd), strict=True):
        check_fd(name, g, f, a)
    F_ = torch.nn.functional
    check_torch(out, grads, lambda x, wg, wu, wd: F_.linear(F_.silu(F_.linear(x, wg)) * F_.linear(x, wu), wd),
                (x, wg, wu, wd), R)


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_attention_backward_matches_finite_differences_and_torch_sdpa_with_enable_gqa(r, n_kv_head):
    B, nh, T, hs = 2, 4, 5, 3
    q_pos, k_pos = np.arange(3, 5), np.arange(T)  # queries of a shard, keys of the whole sequence
    q, R = r.normal(size=(B, nh, 2, hs)), r.normal(size=(B, nh, 2, hs))
    k, v = r.normal(size=(B, n_kv_head, T, hs)), r.normal(size=(B, n_kv_head, T, hs))
    out, cache = gqa_attention_forward(q, k, v, q_pos, k_pos)
    dq, dk, dv = gqa_attention_backward(R, cache)

    def f():
        return np.sum(gqa_attention_forward(q, k, v, q_pos, k_pos)[0] * R)

    check_fd("dq", dq, f, q)
    check_fd("dk", dk, f, k)
    check_fd("dv", dv, f, v)
    visible = torch.from_numpy(k_pos[None, :] <= q_pos[:, None])  # (Tq, Tk): causal by global position
    check_torch(out, (dq, dk, dv), lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, enable_gqa=True), (q, k, v), R)


def test_token_embedding_backward_accumulates_repeated_tokens_as_torch_embedding(r):
    w, R = r.normal(size=(7, 4)), r.normal(size=(2, 3, 4))
    tokens = np.array([[1, 3, 1], [6, 1, 0]])  # token 1 three times
    out, cache = token_embedding_forward(tokens, w)
    dw = token_embedding_backward(R, cache)
    check_fd("dw", dw, lambda: np.sum(token_embedding_forward(tokens, w)[0] * R), w)
    check_torch(out, (dw,), lambda w: torch.nn.functional.embedding(torch.from_numpy(tokens), w), (w,), R)


# ------------------------------------------------------------------------------------ whole model
@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="dense-untied"),
    pytest.param({"tie_embeddings": True, "moe_experts": 3, "moe_top_k": 2, "moe_capacity_factor": 0.8,
                  "moe_layers": (1,)}, id="mixtral-capacity-tied"),
])
def test_whole_llama_gradients_match_finite_differences(overrides):
    config = ModelConfig(**{**dict(arch="llama", vocab_size=24, n_positions=8, n_embd=16, n_head=4,
                                   n_kv_head=2, n_layer=2, intermediate_size=24, dropout=0.0,
                                   moe_aux_loss_weight=0.05, moe_z_loss_weight=0.01), **overrides})
    params = M.init_params(config, seed=5)
    gen = np.random.default_rng(1)
    for name in params:  # random gains (not Llama's ones), so their gradients are not special
        if name.endswith("norm.weight"):
            params[name] = params[name] + 0.1 * gen.normal(size=params[name].shape)
    for layer in config.moe_blocks:  # a decisive router keeps every top-k choice far from a tie
        params[llama.MOE.router_name(layer)] *= 40.0
    tokens, targets = gen.integers(0, 24, (2, 8)), gen.integers(0, 24, (2, 8))
    recorder = M.moe_layer(config)
    loss, grads = M.loss_and_grads(params, tokens, targets, config, moe=recorder)
    if config.moe_blocks:
        assert recorder.last_routing[1]["dropped"] > 0  # capacity drops some assignments

    def f():
        return M.loss_and_grads(params, tokens, targets, config)[0]

    worst = 0.0
    for name, p in params.items():
        d = gen.normal(size=p.shape)

        def along(s, p=p, d=d):
            p += s * d

        numeric = derivative(f, along)
        err = abs(float(np.sum(grads[name] * d)) - numeric) / abs(numeric)
        worst = max(worst, err)
        assert within(err, FD_TOL), f"{name}: directional derivative relative error {err:.2e}"
    print(f"worst directional relative error {worst:.2e}")
