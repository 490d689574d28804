"""Each pricing rule of a software stack against a hand-computed or published figure: FlashAttention's
activations without the scores, Megatron's fp32 main gradients and fp32 reduction, selective
recomputation under FlashAttention, overlapped pipeline sends; and the search agreeing with pricing
(every chunk count it accepts, unpriced plans ranked last). Single process, small searches."""

import numpy as np
import pytest

from refpar.analysis.activations import korthikanti_layer_bytes
from refpar.analysis.efficiency import MEGATRON_2022, MEGATRON_CORE_2024, MODERN
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.planner import SCHEDULE_CHOICES, enumerate_plans, plan, price
from refpar.analysis.presets import PRESETS, ModelSpec
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes, memory_per_rank, model_states
from refpar.analysis.step_time import pipeline_time, step_time

# Korthikanti et al. 2022's 22B GPT (Table 3): a = 64, h = 6144, s = 2048; 16-bit activations and
# 1-byte dropout masks, which PRECISIONS["bf16"] is.
GPT_22B = ModelSpec("gpt-22b", 48, 6144, 64, vocab_size=51200, seq_len=2048, global_batch=1)
LLAMA3_8B_PARAMS = 8_030_261_248  # the released Meta-Llama-3-8B checkpoint


@pytest.mark.parametrize("t, sp", [(1, False), (8, False), (8, True)])
def test_flash_attention_keeps_no_scores_only_the_log_sum_exp(t, sp):
    # Korthikanti's eq. 1, 2 or 4 keeps 5 a s^2 b / t bytes of scores (softmax output 2, its dropout
    # mask 1, dropout output 2). FlashAttention keeps none of them but one fp32 log-sum-exp per
    # query and head: 4 a s b / t bytes (Dao et al. 2022, Section 3.1).
    s, b, a, h = 2048, 2, GPT_22B.n_head, GPT_22B.d_model
    expected = korthikanti_layer_bytes(s, b, h, a, t, sp) - 5 * a * s * s * b / t + 4 * a * s * b / t
    got = layer_activation_bytes(GPT_22B, b, s, tp=t, sp=sp, attention="flash")
    assert float(got) == pytest.approx(expected, rel=1e-12)
    # Selective recomputation has nothing left to drop under it.
    selective = layer_activation_bytes(GPT_22B, b, s, tp=t, sp=sp, attention="flash", recompute="selective")
    assert float(selective) == float(got)


def test_a_plan_under_flash_software_needs_the_activation_memory_without_scores():
    # The same plan, one stage, 1 micro-batch: what the modern (flash) software saves is exactly
    # the L layers' scores less their log-sum-exps.
    kw = dict(micro_batch=1, seq=2048, tp=8, sp=True, precision=PRECISIONS["bf16"])
    unfused = memory_per_rank(GPT_22B, software=MEGATRON_2022, **kw)["activations"]
    flash = memory_per_rank(GPT_22B, software=MODERN, **kw)["activations"]
    s, a, t, L = 2048, 64, 8, 48
    assert float(unfused - flash) == pytest.approx(L * (5 * a * s * s / t - 4 * a * s / t), rel=1e-12)


@pytest.mark.parametrize("d", [1, 8, 64])
def test_megatron_fp32_main_grads_are_its_published_bytes_per_parameter(d):
    # Megatron-LM README, "Distributed Optimizer": "bf16 param, fp32 grads": 18 bytes per parameter,
    # 6 + 12/d with the distributed optimizer (fp32 main gradients accumulated by the fused
    # weight-gradient GEMM, no 16-bit gradient beside them).
    psi, precision = 1_000_000, PRECISIONS["bf16-fp32-accum"]
    plain = sum(model_states(psi, 0, d, precision, fused_grad_accumulation=True).values())
    distributed = sum(model_states(psi, 1, d, precision, fused_grad_accumulation=True).values())
    assert plain / psi == 18
    assert distributed / psi == pytest.approx(6 + 12 / d, rel=1e-12)
    # Unfused, the 16-bit gradient is kept beside the buffer: 2 + 2 + 4 + 4 + 8 = 20 bytes.
    assert sum(model_states(psi, 0, d, precision).values()) / psi == 20


def test_fp32_gradient_reduction_moves_four_bytes_per_parameter():
    # One stage, no tensor parallelism, 8 replicas: a ring all-reduce sends 2 (d-1)/d of the fp32
    # gradients of all 8,030,261,248 parameters of Llama 3 8B.
    spec, hw, d = PRESETS["llama3-8b"], HARDWARE["h100"], 8
    kw = dict(global_batch=8, micro_batch=1, seq=8192, dp=d, precision=PRECISIONS["bf16-fp32-accum"])
    _, fp32, _ = step_time(spec, hw, software=MEGATRON_CORE_2024, **kw)
    _, bf16, _ = step_time(spec, hw, software=MODERN, **kw)
    assert float(fp32["dp"]) == pytest.approx(2 * (d - 1) / d * 4 * LLAMA3_8B_PARAMS, rel=1e-12)
    assert float(bf16["dp"]) == pytest.approx(2 * (d - 1) / d * 2 * LLAMA3_8B_PARAMS, rel=1e-12)


def test_selective_recomputation_costs_nothing_under_flash_and_one_core_forward_unfused():
    spec, hw = GPT_22B, HARDWARE["a100"]
    kw = dict(global_batch=4, micro_batch=4, seq=2048, tp=8, sp=True, precision=PRECISIONS["bf16"])
    for software in (MODERN, MEGATRON_2022):
        none, _, _ = step_time(spec, hw, recompute="none", software=software, **kw)
        selective, _, _ = step_time(spec, hw, recompute="selective", software=software, **kw)
        extra = float(selective["compute"] - none["compute"])
        if software.attention == "flash":
            assert extra == 0.0
        else:
            from refpar.analysis.efficiency import block_seconds
            core_f = block_seconds(spec, hw, micro_batch=4, seq=2048, tp=8, sp=True,
                                   precision=PRECISIONS["bf16"], software=software)["core_f"]
            assert extra == pytest.approx(spec.n_layer * float(core_f), rel=1e-12)


def test_overlapped_pipeline_sends_expose_only_the_fill_and_the_drain():
    # Blocking: every micro-batch and chunk sends both ways, 2 (m v + p - 1) transfers on the
    # critical path; overlapped, only the 2 (p - 1) of the fill and drain.
    p, m, v, send = 8, 64, 3, 1e-3
    assert pipeline_time("interleaved-1f1b", p, m, 1.0, 1.0, 1.0, send, v)[2] == pytest.approx(
        2 * (m * v + p - 1) * send)
    assert pipeline_time("interleaved-1f1b", p, m, 1.0, 1.0, 1.0, send, v, overlap=True)[2] == pytest.approx(
        2 * (p - 1) * send)


def test_the_search_tries_every_chunk_count_price_accepts_and_agrees_with_it():
    # megatron-1.7b has 24 blocks: on 4 stages 6 each, so interleaving accepts v in {2, 3, 6}.
    spec, hw = PRESETS["megatron-1.7b"], HARDWARE["a100"]
    c = enumerate_plans(spec, hw, 32, 512, 2048, budget=hw.memory_bytes)
    interleaved = (c.schedule == SCHEDULE_CHOICES.index("interleaved-1f1b")) & (c.columns["pp"] == 4)
    assert set(c.chunks[interleaved].tolist()) == {2, 3, 6}
    # Pricing the searched plan with v = 3 gives the search's own time.
    i = int(np.nonzero(interleaved & (c.chunks == 3))[0][0])
    mesh = {k: int(c.columns[k][i]) for k in ("dp", "tp", "pp", "cp", "ep")}
    priced = price(spec, hw, 32, mesh, zero=int(c.columns["zero"][i]), schedule="interleaved-1f1b", chunks=3,
                   micro_batch=int(c.columns["micro_batch"][i]), recompute=("none", "selective", "full")[
                       c.recompute[i]], sp=bool(c.columns["tp"][i] > 1), global_batch=512, seq=2048)
    assert priced["step_time_s"] == pytest.approx(float(c.times["total"][i]), rel=1e-12)


def test_plans_relying_on_unpriced_costs_never_rank_above_a_priced_plan():
    # Llama 3 8B on 16 H100s at 32K tokens: the fastest candidate by the model's own times uses
    # ring context parallelism, whose per-hop launches are not priced. The search lists every
    # priced plan first, each unpriced one after them saying what is not priced.
    spec, hw, seq = PRESETS["llama3-8b"], HARDWARE["h100"], 32768
    c = enumerate_plans(spec, hw, 16, 16, seq, budget=hw.memory_bytes)
    assert c.columns["cp"][int(np.argmin(c.times["total"]))] > 1
    n_priced = int(np.sum(c.columns["cp"] == 1) - np.sum((c.columns["cp"] == 1) & np.isin(
        c.schedule, [SCHEDULE_CHOICES.index("zb-h1"), SCHEDULE_CHOICES.index("zb-h2")])))
    result = plan(spec, hw, 16, global_batch=16, seq=seq, top=n_priced + 3)
    flags = [bool(p["unpriced"]) for p in result["plans"]]
    assert flags == [False] * n_priced + [True] * 3
    for p in result["plans"]:
        assert (p["schedule"] in ("zb-h1", "zb-h2") or p["mesh"]["cp"] > 1) == bool(p["unpriced"])
