"""The model's numeric code runs on any array-API namespace and gives the NumPy numbers.

array-api-strict refuses anything outside the standard (NumPy-only functions, integer-array
indexing, ...), so passing here keeps the GPU backends honest; torch CPU tensors stand in for the
torch CUDA backend. Float64 throughout: only summation order may differ, hence the float64
contract (tests/numerics.py).
"""

import numpy as np
import pytest

import refpar.model as M
from refpar.config import TrainConfig, model_preset
from refpar.model.data import MarkovCorpus
from refpar.model.optim import optimizer_init, optimizer_step
from tests.numerics import CONTRACT, rel_diff, within


def namespaces():
    out = []
    try:
        import array_api_strict

        out.append(pytest.param(array_api_strict, id="array-api-strict"))
    except ImportError:
        out.append(pytest.param(None, id="array-api-strict",
                                marks=pytest.mark.skip(reason="array-api-strict is not installed")))
    try:
        import torch

        out.append(pytest.param(torch, id="torch-cpu"))
    except ImportError:
        out.append(pytest.param(None, id="torch-cpu",
                                marks=pytest.mark.skip(reason="torch is not installed")))
    return out


def to_numpy(a):
    return np.asarray(a.numpy() if hasattr(a, "numpy") else np.from_dlpack(a))


MODELS = {
    "gpt2": model_preset("tiny", dropout=0.1),
    "llama": model_preset("llama-tiny"),
    # Mixtral's experts with a capacity that drops some assignments, and a tied head
    "mixtral": model_preset("llama-tiny", moe_experts=4, moe_top_k=2, moe_capacity_factor=0.8,
                            tie_embeddings=True),
    # DeepSeek-V3's latent attention, shared experts, group-limited routing and one MTP depth
    "deepseek-v3": model_preset("deepseek-tiny", n_layer=2, num_nextn_predict_layers=1),
}


@pytest.mark.parametrize("xp", namespaces())
@pytest.mark.parametrize("model, optimizer", [("gpt2", "adamw"), ("gpt2", "sgd"), ("llama", "adamw"),
                                              ("mixtral", "adamw"), ("deepseek-v3", "adamw")])
def test_forward_backward_and_optimizer_step_give_the_numpy_numbers(xp, model, optimizer):
    config = MODELS[model]
    train = TrainConfig(optimizer=optimizer)
    params = M.init_params(config, seed=0)
    tokens, targets = MarkovCorpus(config.vocab_size, 0).batch(2, range(3), 10)
    kw = dict(seed=4, step=2, sample_ids=[0, 1, 2])
    loss, grads = M.loss_and_grads(params, tokens, targets, config, **kw)
    new, _ = optimizer_step(params, grads, optimizer_init(params, train), train, lr=train.lr)
    logits = M.forward(params, tokens, config)

    other = {n: xp.asarray(p) for n, p in params.items()}
    other_loss, other_grads = M.loss_and_grads(other, xp.asarray(tokens), xp.asarray(targets), config, **kw)
    # The optimizer from the same gradients: Adam's first step is ~sign(g), which would magnify
    # the 1e-16 differences of near-zero gradients and say nothing about the optimizer code.
    same_grads = {n: xp.asarray(g) for n, g in grads.items()}
    other_new, _ = optimizer_step(other, same_grads, optimizer_init(other, train), train, lr=train.lr)
    other_logits = M.forward(other, xp.asarray(tokens), config)

    assert within(rel_diff(other_loss, loss), CONTRACT)
    assert within(rel_diff(to_numpy(other_logits), logits), CONTRACT)
    for name in params:
        assert type(other_grads[name]) is type(other[name])
        assert within(rel_diff(to_numpy(other_grads[name]), grads[name]), CONTRACT), name
        assert within(rel_diff(to_numpy(other_new[name]), new[name]), CONTRACT), name
