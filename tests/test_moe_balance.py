"""Aux-loss-free balancing (DeepSeek-V3 §2.1.2) over a 30-step tiny run on one device (float64)."""

import numpy as np
import pytest

from refpar.analysis.moe import load_imbalance
from refpar.config import TrainConfig, model_preset
from refpar.trainer import train_single_device
from refpar.viz.moe import expert_load_figure

STEPS, GAMMA = 30, 0.01


def run(balance: str):
    # dropless, so each step's kept tokens per expert are its load; no router loss of any kind, so
    # the bias is the only thing that differs between the two runs
    model = model_preset("tiny", moe_experts=8, moe_top_k=2, moe_dropless=True, moe_gate="sigmoid",
                         moe_balance=balance, moe_bias_rate=GAMMA, moe_z_loss_weight=0.0)
    return model, train_single_device(model, TrainConfig(steps=STEPS)).moe_steps


@pytest.fixture(scope="module")
def runs():
    """(model, the aux-free run's MoE steps, the unbalanced run's): both tests read the same runs."""
    model, free = run("aux-free")
    return model, free, run("none")[1]


def imbalance(steps, model) -> np.ndarray:
    """(steps,) max/mean load, averaged over the MoE blocks."""
    return np.array([np.mean([load_imbalance(s.tokens_per_expert[i]) for i in model.moe_blocks])
                     for s in steps])


def test_aux_free_bias_evens_expert_load_over_30_tiny_steps_and_follows_the_sign_update(runs):
    model, free, none = runs
    balanced, unbalanced = imbalance(free, model), imbalance(none, model)
    print(f"max/mean load, first 10 steps then last 10: aux-free {balanced[:10].mean():.3f} -> "
          f"{balanced[-10:].mean():.3f}, no balancing {unbalanced[:10].mean():.3f} -> "
          f"{unbalanced[-10:].mean():.3f}")
    # same start (the bias is zero at step 0), then the bias makes the difference
    assert balanced[0] == unbalanced[0]
    assert balanced[-10:].mean() < balanced[:10].mean()
    assert balanced[-10:].mean() < unbalanced[-10:].mean() - 0.1
    # the bias each step routed with is gamma * the sum of sign(mean load - load) of the steps
    # before it, from the recorded loads (dropless: kept = selected)
    for i in model.moe_blocks:
        expected = np.zeros(model.moe_experts)
        for s in free:
            assert s.expert_bias.get(i, [0.0] * model.moe_experts) == list(expected), (s.step, i)
            load = np.array(s.tokens_per_expert[i], dtype=float)
            expected = expected + GAMMA * np.sign(load.mean() - load)
    assert all(s.expert_bias == {} for s in none)


def test_expert_load_figure_draws_each_experts_load_and_the_imbalance_of_both_runs(runs):
    """The app's figure from two runs' --json "moe" objects (steps x blocks x E loads, here built
    from the runs' records): one line per expert and run, and each run's max/mean per step."""
    model, free, none = runs
    blocks = list(model.moe_blocks)
    as_json = {label: {"blocks": blocks, "tokens_per_expert": [[s.tokens_per_expert[i] for i in blocks]
                                                               for s in steps]}
               for label, steps in (("aux-free", free), ("none", none))}
    fig = expert_load_figure(as_json, block_index=1)
    lines = [t for t in fig.data if t.xaxis == "x"]
    assert len(lines) == 2 * model.moe_experts
    assert list(lines[3].y) == [s.tokens_per_expert[blocks[1]][3] for s in free]
    for label, steps in (("aux-free", free), ("none", none)):
        (ratio,) = [t for t in fig.data if t.name == label]
        loads = np.array([s.tokens_per_expert[blocks[1]] for s in steps], dtype=float)
        np.testing.assert_array_equal(ratio.y, loads.max(axis=1) / loads.mean(axis=1))
