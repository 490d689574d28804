"""The closed forms of refpar.analysis reproduce published tables; each test names its source."""

from fractions import Fraction

import numpy as np
import pytest

from refpar.analysis.flops import param_counts, step_flops
from refpar.analysis.memory import paper_model_state_bytes
from refpar.analysis.presets import PRESETS, ModelSpec
from refpar.analysis.scale import (
    PRECISIONS,
    Precision,
    layer_activation_bytes,
    memory_per_rank,
    model_states,
)

MEGATRON = [name for name in PRESETS if name.startswith("megatron-")]
# Narayanan et al. 2021, Table 1, "Number of parameters (billion)".
MEGATRON_TABLE1_BILLIONS = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]


def test_megatron_2021_table1_parameter_counts_from_their_shapes():
    for name, published in zip(MEGATRON, MEGATRON_TABLE1_BILLIONS, strict=True):
        spec = PRESETS[name]
        l, h, V, s = spec.n_layer, spec.d_model, spec.vocab_size, spec.seq_len
        # Narayanan et al. 2021, eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)); refpar also
        # counts the final LayerNorm (2h), which eq. 2 leaves out.
        eq2 = 12 * l * h * h + 13 * l * h + (V + s) * h
        assert param_counts(spec).total == eq2 + 2 * h
        assert round(param_counts(spec).total / 1e9, 1) == published, name


@pytest.mark.parametrize(
    "name, released",
    [
        # Parameter counts of the released checkpoints (the sum of their tensors' sizes).
        ("gpt2", 124_439_808),
        ("gpt2-xl", 1_557_611_200),
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("mixtral-8x7b", 46_702_792_704),
    ],
)
def test_parameter_counts_equal_released_checkpoints(name, released):
    assert param_counts(PRESETS[name]).total == released


def test_moe_active_parameters_match_the_papers():
    # Jiang et al. 2024, Section 1: Mixtral has 47B parameters, 13B active per token.
    mixtral = param_counts(PRESETS["mixtral-8x7b"])
    assert round(mixtral.total / 1e9) == 47 and round(mixtral.active / 1e9) == 13
    # Dai et al. 2024, Table 1 / Section 5: DeepSeekMoE 16B has 16.4B total, 2.8B activated.
    deepseek = param_counts(PRESETS["deepseek-moe-16b"])
    assert round(deepseek.total / 1e9, 1) == 16.4 and round(deepseek.active / 1e9, 1) == 2.8
    # DeepSeek-AI 2024, DeepSeek-V3 report, abstract and Table 1: 671B total, 37B activated (the
    # main model, without its 14B multi-token-prediction module)
    v3 = param_counts(PRESETS["deepseek-v3"])
    assert round(v3.total / 1e9) == 671 and int(v3.active / 1e9) == 37


# One MLA block of DeepSeek-V3 from its config.json shapes: q_a (7168, 1536), its norm, q_b
# (1536, 128 * (128 + 64)), kv_a (7168, 512 + 64), its norm, kv_b (512, 128 * (128 + 128)),
# o (128 * 128, 7168).
V3_MLA = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168


def test_deepseek_v3_published_mesh_memory_per_gpu_from_the_closed_forms():
    """PP16 x EP64 with ZeRO-1 and no TP on 2,048 H800s (DeepSeek-V3 report §3.2), dp = 2048 /
    (16 x 64) = 2: the heaviest stage is the first, the embedding and the 3 dense blocks (stage_layers
    gives it 3 of 61), so bf16 weights and gradients of those, and ZeRO-1's fp32 master and two
    moments sharded over all 128 ranks that hold them."""
    from refpar.analysis.flops import attention_params

    spec = PRESETS["deepseek-v3"]
    assert sum(attention_params(spec)) == V3_MLA == 187_107_328
    h = spec.d_model
    first = spec.vocab_size * h + 3 * (V3_MLA + 2 * h + 3 * h * 18432)  # embedding + 3 dense blocks
    mem = memory_per_rank(spec, micro_batch=1, seq=4096, pp=16, dp=2, ep=64, zero=1,
                          microbatches=120, recompute="full")
    assert float(mem["params"]) == float(mem["grads"]) == 2 * first
    assert float(mem["master"]) == 4 * first / 128 and float(mem["optimizer"]) == 8 * first / 128
    print({k: round(float(v) / 1e9, 2) for k, v in mem.items()}, "GB per GPU")


@pytest.mark.parametrize("name", MEGATRON + ["gpt3-175b"])
@pytest.mark.parametrize("batch, seq", [(1, 2048), (1536, 2048), (8, 1024)])
def test_step_flops_are_narayanan_eq3_with_and_without_recomputation(name, batch, seq):
    spec = PRESETS[name]
    B, s, l, h, V = batch, seq, spec.n_layer, spec.d_model, spec.vocab_size
    # Narayanan et al. 2021, eq. 3 (with recomputation) and its derivation in Section 5.1 (three
    # passes instead of four for the blocks: 72 and 1/12).
    eq3 = 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * l * h))
    without = 72 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * l * h))
    assert step_flops(spec, B, s, "full") == eq3
    assert step_flops(spec, B, s, "none") == without


@pytest.mark.parametrize(
    "name, tokens, gpus, tflops, days",
    # Narayanan et al. 2021, Section 5.1, eq. 4 (time ~ 8TP / nX) and its two worked examples.
    [("gpt3-175b", 300e9, 1024, 140e12, 34), ("megatron-1t", 450e9, 3072, 163e12, 84)],
)
def test_training_time_examples_of_narayanan_eq4(name, tokens, gpus, tflops, days):
    spec = PRESETS[name]
    per_token = step_flops(spec, 1, spec.seq_len, "full") / spec.seq_len
    predicted = per_token * tokens / (gpus * tflops) / 86400
    # eq. 4 approximates eq. 3 by 8P per token; the exact count is within 3% of it.
    assert abs(predicted - days) / days < 0.03


def _zero_gb(psi, nd, stage):
    states = sum(model_states(psi, stage, nd, PRECISIONS["bf16"]).values())
    # The ZeRO engineer's transcription (refpar/analysis/memory.py) of the same Section 5 forms.
    assert states == pytest.approx(paper_model_state_bytes(psi, nd, stage), rel=1e-12)
    return states / 1e9


def test_zero_figure1_example():
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N_d = 64, K = 12.
    shown = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in shown.items():
        assert round(_zero_gb(7.5e9, 64, stage), 1) == gb


# Rajbhandari et al. 2020, Table 1: per-device memory (GB) for P_os, P_os+g, P_os+g+p.
ZERO_TABLE1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
            64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
            64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


@pytest.mark.parametrize("psi", list(ZERO_TABLE1))
def test_zero_table1_per_device_memory(psi):
    for nd, row in ZERO_TABLE1[psi].items():
        for stage, printed in zip((1, 2, 3), row, strict=True):
            # The table prints 2-4 significant digits, truncating or rounding: within one unit
            # of the last digit printed.
            text = repr(printed)
            unit = 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)
            assert abs(_zero_gb(psi, nd, stage) - printed) < unit, (psi, nd, stage)


def test_playbook_model_state_memory_table():
    # HF Ultra-Scale Playbook, "Memory usage in Transformers": weights + gradients + Adam state
    # for 1B/7B/70B/405B models, bf16 mixed precision without and with fp32 gradient accumulation.
    table = {1e9: (16, 20), 7e9: (112, 140), 70e9: (1120, 1400), 405e9: (6480, 8100)}
    for n, (plain, accum) in table.items():
        assert sum(model_states(n, 0, 1, PRECISIONS["bf16"]).values()) / 1e9 == pytest.approx(plain)
        got = sum(model_states(n, 0, 1, PRECISIONS["bf16-fp32-accum"]).values()) / 1e9
        assert got == pytest.approx(accum)


def test_planner_memory_of_one_rank_is_zero_formula_with_the_model_psi():
    # With dp only, the planner's weights + gradients + optimizer are ZeRO's formulas with
    # psi = the parameter count from the shapes (Rajbhandari et al. 2020, Section 5).
    spec = PRESETS["gpt3-175b"]
    psi = param_counts(spec).total
    for stage in range(4):
        memory = memory_per_rank(spec, micro_batch=1, seq=2048, dp=64, zero=stage)
        states = memory["params"] + memory["grads"] + memory["master"] + memory["optimizer"]
        assert states == pytest.approx(_zero_gb(psi, 64, stage) * 1e9, rel=1e-12)


# Korthikanti et al. 2022, Table 3 models (heads, hidden, layers), fp16 activations, 1-byte masks.
KORTHIKANTI_MODELS = [(64, 6144, 48), (96, 12288, 96), (128, 20480, 105), (160, 25600, 128)]
FP16 = Precision(activation=2, mask=1)


def _gpt(a, h, L):
    return ModelSpec("gpt", L, h, a, vocab_size=51200, seq_len=2048, global_batch=1)


@pytest.mark.parametrize("a, h, L", KORTHIKANTI_MODELS)
@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table2_activation_memory_per_layer(a, h, L, t):
    spec, s, b = _gpt(a, h, L), 2048, 1

    def act(**kw):
        return layer_activation_bytes(spec, b, s, tp=t, precision=FP16, **kw)

    sbh = s * b * h
    # Korthikanti et al. 2022, Table 2, row by row (and refpar/analysis/activations.py's
    # transcription of the same rows).
    from refpar.analysis.activations import korthikanti_layer_bytes

    if t == 1:
        assert act() == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act(sp=False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    for sp in (False, True):
        assert act(sp=sp) == pytest.approx(korthikanti_layer_bytes(s, b, h, a, t, sp))
    assert act(sp=False, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert act(sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert act(sp=False, recompute="full") == pytest.approx(2 * sbh)


@pytest.mark.parametrize("a, h, L", KORTHIKANTI_MODELS)
def test_korthikanti_first_stage_holds_all_layers_of_one_microbatch(a, h, L):
    # Korthikanti et al. 2022, Section 4.2.3 and eq. 5: with 1F1B the first stage holds p
    # micro-batches of L/p layers, s b h L / t (34 + 5 a s / h), plus the embedding's dropout mask
    # for each of them (Section 4.3, s b h p / t); interleaving multiplies the layers' part by
    # 1 + (p - 1) / (p v).
    spec, s, b, t, p = _gpt(a, h, L), 2048, 1, 8, 8
    if L % p:
        p = 7 if L % 7 == 0 else 1
    common = dict(micro_batch=b, seq=s, tp=t, pp=p, microbatches=4 * p, precision=FP16)
    one_f_one_b = memory_per_rank(spec, schedule="1f1b", **common)["activations"]
    layers = s * b * h * L / t * (34 + 5 * a * s / h)
    assert one_f_one_b == pytest.approx(layers + s * b * h * p / t)
    if L % (2 * p) == 0:
        v = 2
        interleaved = memory_per_rank(spec, schedule="interleaved-1f1b", chunks=v, **common)
        factor = 1 + (p - 1) / (p * v)
        assert interleaved["activations"] == pytest.approx((layers + s * b * h * p / t) * factor)


def test_arrays_price_many_meshes_at_once_as_one_at_a_time():
    spec = PRESETS["llama3-70b"]
    tp, zero = np.array([1, 2, 4, 8]), np.array([0, 1, 2, 3])
    many = memory_per_rank(spec, micro_batch=2, seq=4096, tp=tp, pp=4, dp=8, zero=zero,
                           microbatches=8, recompute="selective")
    for i in range(4):
        one = memory_per_rank(spec, micro_batch=2, seq=4096, tp=int(tp[i]), pp=4, dp=8,
                              zero=int(zero[i]), microbatches=8, recompute="selective")
        for key, value in one.items():
            assert many[key][i] == pytest.approx(value, rel=1e-12)


# Narayanan et al. 2021, Table 1: (model, t, p, GPUs, batch, achieved teraFLOP/s per GPU).
MEGATRON_TABLE1_RUNS = [
    ("megatron-1.7b", 1, 1, 32, 512, 137), ("megatron-3.6b", 2, 1, 64, 512, 138),
    ("megatron-7.5b", 4, 1, 128, 512, 142), ("megatron-18.4b", 8, 1, 256, 1024, 135),
    ("megatron-39.1b", 8, 2, 512, 1536, 138), ("megatron-76.1b", 8, 4, 1024, 1792, 140),
    ("megatron-145.6b", 8, 8, 1536, 2304, 148), ("megatron-310.1b", 8, 16, 1920, 2160, 155),
    ("megatron-529.6b", 8, 35, 2520, 2520, 163), ("megatron-1t", 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("overrides", [{}, {"moe_experts": 4, "moe_top_k": 2},
                                       {"moe_experts": 4, "moe_top_k": 1, "moe_layers": (2, 3)},
                                       {"tie_embeddings": True, "moe_experts": 3, "moe_top_k": 2,
                                        "moe_layers": (3,)}])
def test_refpar_models_are_counted_as_their_parameter_table(overrides):
    # The model's own parameter table (refpar.model.param_shapes, GPT-2's or Llama's; docs/internals.md),
    # dense and with MoE blocks (experts and routers), against the planner's count from the shapes
    # alone. Each preset takes the overrides its family has (Llama: a tied head; Mixtral's top-2).
    import math

    from refpar.analysis.presets import from_model_config
    from refpar.config import MODEL_PRESETS, ConfigError, model_preset
    from refpar.model import param_shapes

    counted = 0
    for name in MODEL_PRESETS:
        try:
            config = model_preset(name, **overrides)
        except ConfigError:
            continue
        table = sum(math.prod(shape) for shape in param_shapes(config).values())
        assert param_counts(from_model_config(config)).total == table, name
        counted += 1
    assert counted >= 2  # a family of presets at least


def test_gpt2_preset_has_hugging_faces_gpt2_small_parameter_count():
    # refpar train --model gpt2 is Hugging Face's "gpt2": GPT2LMHeadModel's num_parameters() with the
    # head tied to wte is 124,439,808 (the released checkpoint); shapes only, nothing allocated.
    import math

    from refpar.config import model_preset
    from refpar.model import param_shapes

    assert sum(math.prod(shape) for shape in param_shapes(model_preset("gpt2")).values()) == 124_439_808


@pytest.mark.parametrize("name, released", [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248),
                                            ("llama3-70b", 70_553_706_496),
                                            ("mixtral-8x7b", 46_702_792_704)])
def test_refpar_llama_built_as_a_released_model_has_its_parameter_count(name, released):
    # refpar's Llama (refpar.model.llama.param_shapes: shapes only, nothing allocated) in the
    # released model's shape has the released checkpoint's parameter count, as the planner's preset.
    import math

    from refpar.config import ModelConfig
    from refpar.model import param_shapes

    spec = PRESETS[name]
    config = ModelConfig(arch="llama", vocab_size=spec.vocab_size, n_positions=spec.seq_len,
                         n_embd=spec.d_model, n_head=spec.n_head, n_kv_head=spec.n_kv_head,
                         n_layer=spec.n_layer, intermediate_size=spec.d_ff, dropout=0.0,
                         moe_experts=spec.n_experts, moe_top_k=spec.top_k or 1)
    table = sum(math.prod(shape) for shape in param_shapes(config).values())
    assert table == released == param_counts(spec).total


@pytest.mark.parametrize("name, t, p, gpus, batch, published", MEGATRON_TABLE1_RUNS)
def test_megatron_table1_meshes_are_enumerated_and_fit_an_80gb_a100(name, t, p, gpus, batch,
                                                                   published):
    # Narayanan et al. 2021 trained every Table 1 row on 80 GB A100s (Section 5) with full
    # recomputation and fp32 gradient accumulation: the planner must offer each mesh and must not
    # reject it for memory.
    from refpar.analysis.hardware import HARDWARE
    from refpar.analysis.planner import meshes

    spec, d = PRESETS[name], gpus // (t * p)
    offered = {tuple(row) for row in meshes(spec, gpus, HARDWARE["a100"], batch, 2048)}
    assert (d, t, p, 1, 1) in offered
    memory = memory_per_rank(spec, micro_batch=1, seq=2048, tp=t, pp=p, dp=d, schedule="1f1b",
                             microbatches=batch // d, recompute="full",
                             precision=PRECISIONS["bf16-fp32-accum"])
    assert sum(memory.values()) <= HARDWARE["a100"].memory_bytes
