"""GPT-2 with Mixture-of-Experts blocks: whole-model gradients against finite differences."""

import numpy as np
import pytest

from refpar.config import ModelConfig
from refpar.model import moe
from refpar.model.gpt import MOE, init_params, loss_and_grads
from tests.numerics import sum_error, within

# Central differences with eps = 1e-6 on a loss of ~3: truncation ~eps^2 = 1e-12, rounding
# ~u |loss| / eps ~ 1e-9; 1e-7 leaves a factor 100 (as tests/test_moe.py)
FD_TOL = 1e-7


def moe_model(**kw):
    base = dict(vocab_size=24, n_positions=8, n_embd=16, n_head=2, n_layer=2, dropout=0.1,
                moe_experts=4, moe_aux_loss_weight=0.05, moe_z_loss_weight=0.01)
    base.update(kw)
    return ModelConfig(**base)


def test_init_draws_experts_and_router_by_name_in_place_of_the_mlp():
    config = moe_model(moe_layers=(1,))
    params = init_params(config, seed=5)
    assert "h.0.mlp.c_fc.weight" in params and "h.1.mlp.c_fc.weight" not in params
    assert params["h.1.mlp.router.weight"].shape == (16, 4)
    assert params["h.1.mlp.experts.3.c_proj.weight"].shape == (64, 16)
    # Experts are drawn by name: four different experts, each what its own key gives.
    fc = [params[f"h.1.mlp.experts.{e}.c_fc.weight"] for e in range(4)]
    assert not np.array_equal(fc[0], fc[1])
    again = init_params(moe_model(moe_layers=(0, 1)), seed=5)
    np.testing.assert_array_equal(again["h.1.mlp.experts.2.c_fc.weight"], fc[2])


@pytest.mark.parametrize("kw", [dict(moe_top_k=1, moe_capacity_factor=1.0, moe_layers=(1,)),
                                dict(moe_top_k=2, moe_capacity_factor=0.8)])
def test_whole_model_gradients_with_moe_match_central_differences(kw):
    config = moe_model(**kw)
    params = init_params(config, seed=3)
    for layer in config.moe_blocks:  # a decisive router keeps every top-k choice far from a tie
        params[MOE.router_name(layer)] *= 40.0
    gen = np.random.default_rng(4)
    tokens = gen.integers(0, 24, (2, 8))
    targets = gen.integers(0, 24, (2, 8))

    def f():
        recorder = moe.MoELayer(MOE)
        loss, grads = loss_and_grads(params, tokens, targets, config, seed=1, step=2, moe=recorder)
        return loss, grads, recorder.last_routing

    loss, grads, routing = f()
    assert sum(r["dropped"] for r in routing.values()) > 0
    no_router_loss = moe_model(**kw, moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0)
    ce, _ = loss_and_grads(params, tokens, targets, no_router_loss, seed=1, step=2)
    router = sum(float(r["aux_loss"] + r["z_loss"]) for r in routing.values())
    # the loss includes the router losses: the forward of the cross-entropy is the same ops in both
    # runs, so only the adding of ce and 2 losses per MoE block rounds differently
    terms = 1 + 2 * len(routing)
    assert within(abs(loss - (ce + router)), 2 * sum_error(terms, abs(ce) + abs(router)))
    eps, worst = 1e-6, 0.0
    pick = np.random.default_rng(6)
    for name, p in params.items():
        flat = p.reshape(-1)
        for i in pick.choice(flat.size, size=min(flat.size, 3), replace=False):
            old = flat[i]
            flat[i] = old + eps
            up, _, r_up = f()
            flat[i] = old - eps
            down, _, r_down = f()
            flat[i] = old
            for layer, r in routing.items():
                assert np.array_equal(r_up[layer]["keep"], r["keep"])
                assert np.array_equal(r_down[layer]["experts"], r["experts"])
            numeric = (up - down) / (2 * eps)
            worst = max(worst, abs(numeric - grads[name].reshape(-1)[i]) / max(1.0, abs(numeric)))
    assert within(worst, FD_TOL), f"max relative gradient error {worst:.2e}"
