"""DeepSeek-V3's engine pieces on one process (refpar/parallel/deepseek_pieces.py and
mla_tensor_parallel.py): on the trivial layout they are refpar/model/deepseek.py's block bit for bit;
what their caches hold is refpar/analysis/activations.py's closed form, which the planner's
layer_activation_bytes reproduces without refpar's own extras; bad meshes get one sentence."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refpar.analysis.activations import mla_layer_bytes
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes
from refpar.config import MODEL_PRESETS, ConfigError, Plan, TrainConfig
from refpar.engine import validate
from refpar.model import deepseek
from refpar.model.moe import MoELayer
from refpar.parallel import deepseek_pieces
from refpar.parallel.pieces import tp_layout
from refpar.parallel.pipeline.executor import held_bytes
from refpar.parallel.tensor_parallel import weight_grads

TINY = MODEL_PRESETS["deepseek-tiny"]
B, T = 2, 8


def _block(config, layer):
    params = deepseek.init_params(config, seed=3)
    x = np.random.default_rng(4).standard_normal((B, T, config.n_embd))  # (B, T, C)
    dy = np.random.default_rng(5).standard_normal((B, T, config.n_embd))  # (B, T, C)
    return params, x, dy


@pytest.mark.parametrize("changes, layer", [({}, 0), ({}, 1), ({"q_lora_rank": None}, 0)])
def test_pieces_on_the_trivial_layout_are_the_model_block_bit_for_bit(changes, layer):
    """The same layers in the same order on the same shapes (a layout that splits nothing), so the
    output and every gradient are equal bitwise: a dense block, a MoE block (routed and shared
    experts), and a query without its latent (q_proj)."""
    config = replace(TINY, **changes)
    params, x, dy = _block(config, layer)
    lay = tp_layout(config, T, None)
    y_ref, c_ref = deepseek.block_forward(x, params, layer, config, moe=MoELayer(deepseek.MOE))
    y, c = deepseek_pieces.block_forward(x, params, layer, lay, moe=MoELayer(deepseek.MOE))
    assert np.array_equal(y, y_ref)
    dx_ref, g_ref = deepseek.block_backward(dy, c_ref)
    dx, work = deepseek_pieces.block_backward(dy, c, layer, lay)
    grads = weight_grads(work)
    assert np.array_equal(dx, dx_ref) and grads.keys() == g_ref.keys()
    assert all(np.array_equal(grads[n], g_ref[n]) for n in g_ref), [n for n in g_ref
                                                                    if not np.array_equal(grads[n], g_ref[n])]


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": None}, {"dtype": "float32"}])
def test_a_dense_blocks_cache_holds_the_closed_forms_bytes(changes):
    """held_bytes (what the executor's ledger counts) of a dense block's cache on the trivial layout
    equals mla_layer_bytes, with the latent query and without it, in float64 and float32."""
    config = replace(TINY, **changes)
    params, x, _ = _block(config, 0)
    x = x.astype(config.dtype)
    params = {n: p.astype(config.dtype) for n, p in params.items()}
    _, cache = deepseek_pieces.block_forward(x, params, 0, tp_layout(config, T, None))
    assert held_bytes(cache, params) == mla_layer_bytes(config, B, T)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_planner_prices_latent_attention_with_the_same_terms(tp, sp, recompute):
    """scale.layer_activation_bytes of deepseek-tiny's spec (its MLA widths) equals mla_layer_bytes
    without refpar's extras (1/rms per token, RoPE tables), per tp rank's heads and columns and sp
    shard, in each recomputation mode: the planner and the closed form count the same buffers."""
    planner = layer_activation_bytes(from_model_config(TINY), B, T, tp=tp, sp=sp, recompute=recompute,
                                     precision=PRECISIONS["float64"])
    closed = mla_layer_bytes(TINY, B, T, heads=TINY.n_head // tp, ff=TINY.intermediate_size // tp,
                             Tl=T // tp if sp else T, keep_refpar=False, recompute=recompute)
    assert planner == closed


@pytest.mark.parametrize("model, sizes, cp_algo, sentence", [
    (TINY, {"tp": 3}, None, "tp=3 does not divide n_head=4"),
    # experts split unevenly over ep (shard_range: 8 over 3 ranks is 3, 3, 2); a rank with none is refused
    (TINY, {"ep": 16}, None, "moe_experts=8 is fewer than ep=16; use at least 16 experts"),
    (replace(TINY, moe_intermediate_size=2, n_head=8), {"tp": 4}, None,
     "tp=4 splits moe_intermediate_size=2 into fewer columns than ranks; use tp <= 2"),
    (TINY, {"tp": 2, "cp": 4}, "ulysses", "Ulysses gives each of cp=4 ranks whole heads"),
    (replace(TINY, num_nextn_predict_layers=1), {"tp": 2}, None, "multi-token prediction trains in"),
])
def test_meshes_deepseek_cannot_run_get_one_sentence_before_any_message(model, sizes, cp_algo, sentence):
    mesh = {"pp": 1, "dp": 1, "tp": 1, "cp": 1, "ep": 1} | sizes
    with pytest.raises(ConfigError, match=sentence):
        validate(model, TrainConfig(batch_size=4, seq_len=8), mesh, Plan(cp_algo=cp_algo))


def test_the_pieces_take_yarns_frequencies_and_softmax_factor_as_the_model_does():
    """With rope_scaling (YaRN, mscale_all_dim != mscale so its softmax factor is not 1) the pieces scale
    q by the factor where the model scales the scores: one more rounding, so the float64 contract
    (1e-10 relative) rather than bitwise; without the factor they would differ by its square's 1.2%."""
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
    config = replace(TINY, rope_scaling=yarn)
    params, x, dy = _block(config, 0)
    lay = tp_layout(config, T, None)
    y_ref, c_ref = deepseek.block_forward(x, params, 0, config, moe=MoELayer(deepseek.MOE))
    y, c = deepseek_pieces.block_forward(x, params, 0, lay, moe=MoELayer(deepseek.MOE))
    dx_ref, g_ref = deepseek.block_backward(dy, c_ref)
    dx, work = deepseek_pieces.block_backward(dy, c, 0, lay)
    grads = weight_grads(work)
    for got, want in [(y, y_ref), (dx, dx_ref), *((grads[n], g_ref[n]) for n in g_ref)]:
        assert np.max(np.abs(got - want)) <= 1e-10 * np.max(np.abs(want))
