"""The MoE layer against finite differences, a brute-force router and GPT-2's MLP (float64)."""

import math
from dataclasses import replace

import numpy as np
import pytest

from refpar.config import ConfigError, ModelConfig
from refpar.model import moe
from refpar.model.gpt import MOE
from refpar.model.layers import gelu_forward, linear_forward
from refpar.model.routing import Parts, kept_counts, route, routing_kept
from tests.numerics import CONTRACT, U64, rel_diff, sum_error, within

C, B, T = 8, 2, 6
# Central differences with eps = 1e-6: truncation error eps^2 |f^(3)| / 6 ~ 1e-12, rounding error
# about u |f| / eps ~ 1e-9 for objectives of size ~10; 1e-7 leaves a factor 100 above both.
FD_TOL = 1e-7


def make_params(config, seed, router_std=1.0):
    """Random weights, the router's large enough that the top-k choice is far from a tie."""
    gen = np.random.default_rng(seed)
    params = {}
    for name, shape in MOE.param_shapes(config, 0).items():
        std = router_std if name.endswith("router.weight") else 0.3
        params[name] = gen.standard_normal(shape) * std
    return params


def objective(x, params, config, G, bias=None):
    out, cache = moe.moe_forward(x, params, 0, config, MOE, bias=bias)
    r = cache["routing"]
    return float(np.sum(out * G) + r["aux_loss"] + r["z_loss"]), cache


def cfg(**kw):
    base = dict(n_embd=C, n_head=2, n_layer=1, moe_experts=4, moe_aux_loss_weight=0.3,
                moe_z_loss_weight=0.2)
    base.update(kw)
    return ModelConfig(**base)


CASES = {
    "switch_top1_drops": cfg(moe_top_k=1, moe_capacity_factor=1.0),
    "top2_drops": cfg(moe_top_k=2, moe_capacity_factor=0.75),
    "top2_dropless": cfg(moe_experts=3, moe_top_k=2, moe_dropless=True),
    # DeepSeek-V3's router: sigmoid gates normalised over the top-k, a bias that only picks, the
    # sequence-wise balance loss (no Switch loss: aux-free), 2 groups of 2 experts with 1 per token,
    # and a shared expert; capacity drops by score (Megatron-Core's "probs")
    "deepseek_probs_drops": cfg(moe_top_k=2, moe_capacity_factor=0.75, moe_gate="sigmoid",
                                moe_balance="aux-free", moe_seq_aux_weight=0.3, moe_groups=2,
                                moe_group_limit=1, moe_shared_experts=1, moe_drop_policy="probs"),
    "softmax_seq_aux": cfg(moe_top_k=2, moe_capacity_factor=0.75, moe_seq_aux_weight=0.3),
}
BIASES = {"deepseek_probs_drops": np.array([0.05, -0.02, 0.0, 0.03])}


@pytest.mark.parametrize("name", CASES)
def test_moe_backward_matches_central_differences_with_aux_and_z_loss(name):
    config = CASES[name]
    gen = np.random.default_rng(1)
    x = gen.standard_normal((B, T, C))
    G = gen.standard_normal((B, T, C))
    params = make_params(config, 2)
    bias = BIASES.get(name)
    _, cache = objective(x, params, config, G, bias)
    r = cache["routing"]
    assert (r["dropped"] > 0) == (not config.moe_dropless)
    # Top-k is piecewise constant: the check is valid only away from ties between the k-th and
    # the next probability, where an eps-sized step cannot change the choice (with a bias or groups
    # the choice is not the plain top-k: the unchanged choices below are the check).
    probs = np.sort(cache["router"][0], axis=-1)[:, ::-1]
    k = config.moe_top_k
    assert bias is not None or np.min(probs[:, k - 1] - probs[:, k]) > 1e-4

    dx, grads = moe.moe_backward(G, cache)
    assert r["aux_loss"] > 0 and r["z_loss"] > 0
    eps = 1e-6
    worst = 0.0
    pick = np.random.default_rng(3)
    for key, analytic in [("x", dx), *grads.items()]:
        target = x if key == "x" else params[key]
        flat = target.reshape(-1)
        for i in pick.choice(flat.size, size=min(flat.size, 12), replace=False):
            old = flat[i]
            flat[i] = old + eps
            up, c_up = objective(x, params, config, G, bias)
            flat[i] = old - eps
            down, c_down = objective(x, params, config, G, bias)
            flat[i] = old
            assert np.array_equal(c_up["routing"]["keep"], r["keep"])
            assert np.array_equal(c_down["routing"]["experts"], r["experts"])
            numeric = (up - down) / (2 * eps)
            err = abs(numeric - analytic.reshape(-1)[i]) / max(1.0, abs(numeric))
            worst = max(worst, err)
    assert within(worst, FD_TOL), f"max relative gradient error {worst:.2e}"


def brute_force_routing(probs, k, cap):
    """The documented order as a plain loop: slot by slot, token by token, first come first
    served until an expert holds `cap` assignments."""
    N, E = probs.shape
    choice = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    keep = np.zeros((N, k), bool)
    filled = [0] * E
    for j in range(k):
        for n in range(N):
            e = choice[n, j]
            if cap is None or filled[e] < cap:
                keep[n, j] = True
                filled[e] += 1
    return choice, keep


@pytest.mark.parametrize("k, factor", [(1, 0.5), (2, 0.6), (2, 1.0), (3, 0.9)])
def test_capacity_drops_assignments_in_documented_order(k, factor):
    config = cfg(moe_top_k=k, moe_capacity_factor=factor)
    x = np.random.default_rng(4).standard_normal((B * T, C))
    w = np.random.default_rng(5).standard_normal((C, 4))
    routing, cache = route(x, w, config)
    cap = math.ceil(B * T * k * factor / 4)
    assert routing["capacity"] == cap
    choice, keep = brute_force_routing(cache[0], k, cap)
    np.testing.assert_array_equal(routing["experts"], choice)
    np.testing.assert_array_equal(routing["keep"], keep)
    assert routing["dropped"] == int((~keep).sum())
    kept = np.bincount(choice[keep], minlength=4)
    np.testing.assert_array_equal(routing["tokens_per_expert"], kept)


def test_token_that_loses_all_experts_passes_through_as_zero():
    config = cfg(moe_top_k=1, moe_capacity_factor=0.25)
    gen = np.random.default_rng(6)
    x = gen.standard_normal((B, T, C))
    params = make_params(config, 7)
    out, cache = moe.moe_forward(x, params, 0, config, MOE)
    dropped = ~cache["routing"]["keep"][:, 0]
    assert dropped.any()
    assert np.all(out.reshape(-1, C)[dropped] == 0.0)
    assert np.all(np.abs(out.reshape(-1, C)[~dropped]).sum(axis=-1) > 0)


def test_one_expert_top1_is_gpt2_mlp_and_uniform_router_aux_loss_is_alpha():
    config = cfg(moe_experts=1, moe_top_k=1, moe_dropless=True, moe_aux_loss_weight=0.3)
    gen = np.random.default_rng(8)
    x = gen.standard_normal((B, T, C))
    params = make_params(config, 9)
    out, cache = moe.moe_forward(x, params, 0, config, MOE)
    p = "h.0.mlp.experts.0"
    h, _ = linear_forward(x, params[f"{p}.c_fc.weight"], params[f"{p}.c_fc.bias"])
    mlp, _ = linear_forward(gelu_forward(h)[0], params[f"{p}.c_proj.weight"],
                            params[f"{p}.c_proj.bias"])
    # the expert runs on the gathered rows, the MLP on (B, T, C): GEMMs of other shapes sum in
    # another order
    assert within(rel_diff(out, mlp), CONTRACT), rel_diff(out, mlp)
    # One expert: probs are 1, f = P = 1, so alpha * E * f * P = alpha. The layer sums N copies of
    # alpha / N, itself rounded once: within u alpha + sum_error(N, alpha) of alpha.
    N = B * T
    aux_err = abs(float(cache["routing"]["aux_loss"]) - 0.3)
    assert within(aux_err, U64 * 0.3 + sum_error(N, 0.3 * (1 + U64))), aux_err
    # logsumexp of one logit is the logit, so the z-loss is beta * mean(logit^2); the test's logits
    # come from a GEMM of another shape than the router's, so the contract, not a derived bound
    logit = x.reshape(-1, C) @ params["h.0.mlp.router.weight"]
    z_diff = rel_diff(float(cache["routing"]["z_loss"]), 0.2 * np.mean(logit**2))
    assert within(z_diff, CONTRACT), z_diff


@pytest.mark.parametrize("backend", ["array_api_strict", "torch"])
def test_moe_runs_on_other_array_namespaces_with_numpys_numbers(backend):
    lib = pytest.importorskip(backend)
    config = CASES["top2_drops"]
    gen = np.random.default_rng(10)
    x = gen.standard_normal((B, T, C))
    params = make_params(config, 11)
    out, cache = moe.moe_forward(x, params, 0, config, MOE)
    dx, grads = moe.moe_backward(x, cache)
    sx = lib.asarray(x)
    sparams = {k: lib.asarray(v) for k, v in params.items()}
    sout, scache = moe.moe_forward(sx, sparams, 0, config, MOE)
    sdx, sgrads = moe.moe_backward(sx, scache)
    # another namespace, another BLAS and other sum orders: the float64 contract
    assert within(rel_diff(np.asarray(sout), out), CONTRACT)
    assert within(rel_diff(np.asarray(sdx), dx), CONTRACT)
    for name, g in grads.items():
        assert within(rel_diff(np.asarray(sgrads[name]), g), CONTRACT), name


@pytest.mark.parametrize(
    "kwargs, words",
    [({"moe_experts": -1}, "moe_experts=-1"), ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k=5"),
     ({"moe_experts": 4, "moe_capacity_factor": 0.0}, "moe_capacity_factor=0.0"),
     ({"moe_experts": 4, "moe_layers": (0, 7)}, "moe_layers=(0, 7)"),
     ({"moe_experts": 4, "moe_z_loss_weight": -1.0}, "must be 0 or positive")],
)
def test_bad_moe_config_is_one_sentence(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def _losses_are_the_whole_batch_resummed(aux, z, whole, N):
    """The parts' router losses, added, against the whole batch's. Every term is positive, so a sum
    is its own sum of |terms|: aux sums N * E products probs * coef (coef is the same array in every
    part, from the same global counts), z sums N squares and scales each part's sum by z_coef, one
    rounding more. Two orders of a sum differ by at most 2 sum_error (tests/numerics.py)."""
    E = len(whole["tokens_per_expert"])
    aux_bound = 2 * sum_error(N * E, float(whole["aux_loss"]))
    z_bound = 2 * sum_error(N + 1, float(whole["z_loss"]))
    return within(abs(aux - whole["aux_loss"]), aux_bound) and within(abs(z - whole["z_loss"]), z_bound)


@pytest.mark.parametrize("k, dropless", [(1, False), (2, False), (2, True)])
def test_routing_a_batch_in_parts_keeps_what_one_device_keeps(k, dropless):
    """Each part routes its own tokens, seeing only every part's (k, E) counts: the drops, kept
    counts and losses add up to the whole batch's."""
    config = cfg(moe_top_k=k, moe_capacity_factor=0.7, moe_dropless=dropless)
    x = np.random.default_rng(12).standard_normal((B * T, C))
    w = np.random.default_rng(13).standard_normal((C, 4))
    whole, _ = route(x, w, config)
    parts = [x[:5], x[5:7], x[7:]]
    counts = np.stack([route(p, w, config)[0]["selections"][0] for p in parts])  # (3, k, E)
    kept = kept_counts(counts, whole["capacity"])
    keep, aux, z = [], 0.0, 0.0
    for r, p in enumerate(parts):
        part, _ = route(p, w, config, exchange=lambda c: counts, rank=r)
        np.testing.assert_array_equal(part["rows_per_expert"], kept[r])
        keep.append(part["keep"])
        aux, z = aux + part["aux_loss"], z + part["z_loss"]
        assert part["dropped"] == whole["dropped"]
    np.testing.assert_array_equal(np.concatenate(keep), whole["keep"])
    assert (whole["dropped"] > 0) == (not dropless)
    assert _losses_are_the_whole_batch_resummed(aux, z, whole, len(x))


@pytest.mark.parametrize("k, dropless, policy", [(1, False, "position"), (2, False, "position"),
                                                 (2, True, "position"), (1, False, "probs"),
                                                 (2, False, "probs")])
def test_routing_interleaved_runs_across_parts_keeps_what_one_device_keeps(k, dropless, policy):
    """Three parts hold, of each of 4 rows of 6 tokens, runs of positions in zig-zag fashion (part
    0 positions 0 and 5, part 1 positions 1-2, part 2 positions 3-4; part 0's run 5 of row b and
    run 0 of row b+1 are one run), as context-parallel ranks do. Each routes only its own tokens,
    seeing every run's counts in global order: every token's kept slots, each part's rows per
    expert (kept_counts folded by owner), the drops and the losses are the single call's.
    Dropping by score ("probs"), each part also sees every part's scores as the all-gather
    assembles them (part by part, each in its queue order): its kept slots are still the single
    call's, and its rows per expert (routing_kept) those of the single call's keep mask."""
    config = cfg(moe_top_k=k, moe_capacity_factor=0.7, moe_dropless=dropless, moe_drop_policy=policy)
    rows, seq = 4, 6
    x = np.random.default_rng(14).standard_normal((rows * seq, C))
    w = np.random.default_rng(15).standard_normal((C, 4))
    whole, _ = route(x, w, config)
    held = [[0, 5], [1, 2], [3, 4]]  # positions of each part in every row
    runs = []  # (global start, length, part) of maximal runs of consecutive global token indices
    for part, positions in enumerate(held):
        tokens = [b * seq + t for b in range(rows) for t in positions]
        for g in tokens:
            if runs and runs[-1][2] == part and runs[-1][0] + runs[-1][1] == g:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, part)
            else:
                runs.append((g, 1, part))
    order = sorted(range(len(runs)), key=lambda i: runs[i][0])  # global order of the runs
    place = {i: p for p, i in enumerate(order)}
    owners = tuple(runs[i][2] for i in order)
    assert sum(1 for r in runs if r[2] == 0) == rows + 1  # merged across rows: not per row
    calls = []
    for part in range(3):
        mine = [i for i, r in enumerate(runs) if r[2] == part]
        ids = np.concatenate([np.arange(runs[i][0], runs[i][0] + runs[i][1]) for i in mine])
        parts = Parts(tuple(runs[i][1] for i in mine), tuple(place[i] for i in mine), owners)
        # this part's runs' counts, which the drop policy does not change
        counts, _ = route(x[ids], w, replace(config, moe_drop_policy="position"), parts=parts)
        calls.append((ids, parts, counts["selections"]))
    every = np.zeros((len(runs), k, 4), dtype=np.int64)  # (P, k, E) what the all-gather assembles
    for _, parts, counts in calls:
        every[list(parts.index)] = counts
    if policy == "position":
        kept = kept_counts(every, whole["capacity"], owners)  # (3, E)
    else:  # what the single call keeps of each part's tokens, per expert
        hot = np.eye(4, dtype=np.int64)[whole["experts"]] * whole["keep"][..., None]  # (N, k, E)
        kept = np.stack([hot[ids].sum(axis=(0, 1)) for ids, _, _ in calls])  # (3, E)
    sent = {}  # part -> its scores in queue order, as it hands them to the all-gather

    def record(part):
        def gather(scores, counts):
            sent[part] = scores
            return np.zeros(sum(counts))
        return gather
    for part, (ids, parts, _) in enumerate(calls):
        route(x[ids], w, config, exchange=lambda c, every=every: every, parts=parts,
              gather_scores=record(part))
    keep, aux, z = np.zeros_like(whole["keep"]), 0.0, 0.0
    for part, (ids, parts, _) in enumerate(calls):
        routing, _ = route(x[ids], w, config, exchange=lambda c, every=every: every, parts=parts,
                           gather_scores=lambda s, counts: np.concatenate([sent[p] for p in range(3)]))
        keep[ids] = routing["keep"]
        np.testing.assert_array_equal(routing["rows_per_expert"], kept[part])
        np.testing.assert_array_equal(routing_kept(routing), kept)
        aux, z = aux + routing["aux_loss"], z + routing["z_loss"]
        assert routing["dropped"] == whole["dropped"]
    np.testing.assert_array_equal(keep, whole["keep"])
    assert (whole["dropped"] > 0) == (not dropless)
    assert _losses_are_the_whole_batch_resummed(aux, z, whole, len(x))
    if policy == "probs":  # the score decides: some slot kept by score is one the queue would drop
        by_position, _ = route(x, w, replace(config, moe_drop_policy="position"))
        assert not np.array_equal(by_position["keep"], whole["keep"])


def test_deepseek_routing_matches_brute_force_groups_bias_sigmoid_gates_probs_drops_and_seq_loss():
    """Group-limited choice with a bias, sigmoid gates normalised over the k, drops by score and the
    sequence-wise loss, each written out as a plain loop from the papers' definitions."""
    E, k, G, M, cap_factor, alpha = 12, 3, 4, 2, 0.6, 0.3  # groups of 3: their best 2 score them
    config = cfg(moe_experts=E, moe_top_k=k, moe_capacity_factor=cap_factor, moe_gate="sigmoid",
                 moe_balance="aux-free", moe_seq_aux_weight=alpha, moe_groups=G, moe_group_limit=M,
                 moe_drop_policy="probs")
    x = np.random.default_rng(12).standard_normal((B * T, C))
    w = np.random.default_rng(13).standard_normal((C, E))
    bias = np.random.default_rng(14).standard_normal(E) * 0.1
    routing, _ = route(x, w, config, bias=bias, seq_len=T)
    s = 1 / (1 + np.exp(-(x @ w)))  # (N, E) sigmoid affinities
    cap = math.ceil(B * T * k * cap_factor / E)
    chosen = []
    for n in range(B * T):  # DeepSeek-V3 §2.1.2: the M groups with the best top-ceil(k/M) sums
        biased = s[n] + bias
        group_score = [sum(sorted(biased[g * 3:g * 3 + 3])[::-1][:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-group_score[g], g))[:M]
        allowed = [e for e in range(E) if e // 3 in groups]
        chosen.append(sorted(allowed, key=lambda e: (-biased[e], e))[:k])
    chosen = np.array(chosen)  # (N, k)
    np.testing.assert_array_equal(routing["experts"], chosen)
    assert all(len({e // 3 for e in row}) <= M for row in chosen)
    picked = np.take_along_axis(s, chosen, axis=1)  # gates from the unbiased scores
    np.testing.assert_allclose(routing["gates"], picked / picked.sum(axis=1, keepdims=True), rtol=1e-14)
    # drops by score: each expert keeps its cap highest scores, ties in queue order (slot, token)
    keep = np.zeros((B * T, k), bool)
    for e in range(E):
        queue = [(j, n) for j in range(k) for n in range(B * T) if chosen[n, j] == e]
        for j, n in sorted(queue, key=lambda a: -picked[a[1], a[0]])[:cap]:
            keep[n, j] = True
    np.testing.assert_array_equal(routing["keep"], keep)
    assert routing["dropped"] == int((~keep).sum()) > 0
    # DeepSeek-V3 eq. 17-20 per sequence, averaged over the B sequences (no Switch loss: aux-free)
    share = s / s.sum(axis=1, keepdims=True)  # (N, E)
    seq = 0.0
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        f = E / (k * T) * np.array([(chosen[rows] == i).sum() for i in range(E)])
        seq += alpha * np.sum(f * share[rows].mean(axis=0)) / B
    assert rel_diff(float(routing["aux_loss"]), seq) < 1e-14


@pytest.mark.parametrize("fields, says", [
    (dict(moe_gate="relu"), "unknown moe_gate"),
    (dict(moe_gate="sigmoid", moe_top_k=1), "moe_top_k >= 2"),
    (dict(moe_balance="loss"), "unknown moe_balance"),
    (dict(moe_balance="aux-free", moe_bias_rate=0.0), "moe_bias_rate=0.0 must be positive"),
    (dict(moe_seq_aux_weight=-1.0), "moe_seq_aux_weight=-1.0"),
    (dict(moe_groups=3), "moe_groups=3 must divide moe_experts=4"),
    (dict(moe_groups=2, moe_group_limit=3), "moe_group_limit=3 must be between 1 and moe_groups=2"),
    (dict(moe_top_k=3, moe_groups=2, moe_group_limit=1), "allow at least 2 groups"),
    (dict(moe_drop_policy="random"), "unknown moe_drop_policy"),
    (dict(moe_shared_experts=-1), "moe_shared_experts=-1"),
])
def test_routing_options_refuse_bad_values_in_one_sentence(fields, says):
    with pytest.raises(ConfigError, match=says):
        cfg(**fields)
