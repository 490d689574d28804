"""The GEMM FLOPs refpar runs (refpar/model/gemm.py counts each product's 2 m n k) are the planner's
closed form of a training step (refpar/analysis/flops.step_flops, Narayanan et al. 2021's count);
on real meshes and with recomputation in tests/test_recompute.py."""

import numpy as np
import pytest

from refpar.analysis.flops import step_flops
from refpar.analysis.presets import from_model_config
from refpar.config import model_preset
from refpar.model import gemm, init_params, loss_and_grads


def test_a_product_counts_two_flops_per_multiply_add_of_each_matrix_it_multiplies():
    a, b = np.ones((2, 3, 4, 5)), np.ones((5, 6))  # six (4, 5) matrices, each times the same (5, 6)
    gemm.take()
    gemm.matmul(a, b)
    assert gemm.take() == 6 * 2 * 4 * 6 * 5
    assert gemm.take() == 0  # read once, then counted from 0 again


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_single_device_step_runs_exactly_the_planners_flops(preset):
    # GPT-2's tied head and Llama's untied one, its SwiGLU MLP and grouped K/V projections: forward
    # and backward of one batch are 3 x (blocks + attention core + logits) of the planner's count
    model, B, T = model_preset(preset), 4, 16
    tokens = np.arange(B * T).reshape(B, T) % model.vocab_size  # (B, T)
    params = init_params(model, seed=0)
    gemm.take()
    loss_and_grads(params, tokens, np.roll(tokens, -1, axis=1), model)
    assert gemm.take() == step_flops(from_model_config(model), B, T, "none")
