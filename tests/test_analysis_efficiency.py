"""The efficiency model's ingredients, each against its closed form: GEMM waves and the roofline,
the shapes' FLOPs against the parameter count, the attention core, gradient accumulation, the
uneven pipeline layout against refpar's schedule simulator, and what overlaps what."""

import math

import numpy as np
import pytest

from refpar.analysis.efficiency import (
    CALIBRATED,
    MEGATRON_2021,
    MODERN,
    TILE,
    Software,
    _linears,
    block_seconds,
    gemm_seconds,
)
from refpar.analysis.flops import forward_flops, layer_params
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.presets import PRESETS
from refpar.analysis.scale import PRECISIONS, stage_layers
from refpar.analysis.step_time import collective_choice, link, pipeline_time, step_time
from refpar.config import ConfigError
from refpar.schedules.builders import build
from refpar.schedules.simulate import simulate

A100, H100 = HARDWARE["a100"], HARDWARE["h100"]


def test_a_gemm_takes_its_whole_waves_of_tiles_plus_half_a_wave():
    # NVIDIA's Matrix Multiplication Background guide, Section 3.2: tiles run in waves of one per
    # SM. With exactly k waves of 256 x 128 tiles the model charges k + 1/2 of them.
    rate = A100.matmul_rate("bfloat16") * CALIBRATED.matmul
    K = 8192
    wave = 2 * TILE[0] * TILE[1] * K / (rate / A100.sm_count)
    for k in (1, 3, 10):
        M, N = TILE[0] * 12 * k, TILE[1] * 9  # 108 k tiles: k waves on 108 SMs
        assert gemm_seconds(A100, M, N, K) == pytest.approx((k + 0.5) * wave, rel=1e-12)
    # Far from a wave boundary a big GEMM runs at the sustained rate, and never faster.
    M = N = K = 16384
    ideal = 2 * M * N * K / rate
    assert ideal < gemm_seconds(A100, M, N, K) < 1.01 * ideal


def test_a_thin_gemm_is_bound_by_moving_its_operands():
    # The roofline: (8192, 16) @ (16, 8192) does 2 GFLOP but moves 2 x (2 x 8192 x 16 + 8192^2)
    # bytes, far longer at the HBM rate the model gives memory-bound kernels.
    moved = 2 * (8192 * 16 * 2 + 8192 * 8192)
    assert gemm_seconds(H100, 8192, 8192, 16) == pytest.approx(
        moved / (H100.hbm_bandwidth * CALIBRATED.memory), rel=1e-12)


@pytest.mark.parametrize("name, tp", [("megatron-1t", 8), ("llama3-70b", 4), ("gpt2", 1)])
def test_a_dense_blocks_gemms_do_the_flops_of_its_parameter_count(name, tp):
    # flops.forward_flops counts 2 x tokens x the weights a token multiplies by; one rank's GEMMs
    # of a block, over the tensor-parallel ranks and the blocks, do the same.
    spec, n = PRESETS[name], 4096
    rank = sum(2 * M * N * K * batch for M, N, K, batch in _linears(spec, n, tp, 1, False))
    layers, _, _ = forward_flops(spec, 1, n)
    assert rank * tp * spec.n_layer == pytest.approx(layers, rel=1e-12)


@pytest.mark.parametrize("name, tp, ep", [("mixtral-8x7b", 2, 4), ("deepseek-moe-16b", 1, 8)])
def test_a_moe_blocks_gemms_do_k_experts_per_token_when_routing_is_balanced(name, tp, ep):
    # Attention and the k routed plus the shared experts' MLPs split by t; the (h, E) router whole
    # on every rank. Each of this rank's E / ep experts takes k n ep / E tokens.
    spec, n = PRESETS[name], 4096
    h, f = spec.d_model, spec.moe_d_ff
    width = 3 if spec.mlp == "swiglu" else 2
    attention = 2 * h * h + 2 * h * spec.kv_dim
    experts = (spec.top_k + spec.n_shared_experts) * width * h * f
    rank = sum(2 * M * N * K * batch for M, N, K, batch in _linears(spec, n, tp, ep, True))
    assert rank == pytest.approx(2 * n * ((attention + experts) / tp + h * spec.n_experts), rel=1e-12)


def test_fused_attention_is_the_causal_half_at_flashattention_2s_rate_and_backward_2_5x():
    spec, b, s, tp, cp = PRESETS["llama3-405b"], 1, 8192, 8, 2
    parts = block_seconds(spec, H100, micro_batch=b, seq=s, tp=tp, cp=cp, sp=True,
                          precision=PRECISIONS["bf16"], software=MODERN)
    causal_half = 4 * b * (s / cp) * s * spec.d_model / tp / 2
    assert parts["core_f"] == pytest.approx(causal_half / (H100.flops("bfloat16") * 0.35), rel=1e-12)
    assert parts["core_b"] == pytest.approx(2.5 * parts["core_f"], rel=1e-12)


def test_unfused_gradient_accumulation_reads_and_writes_the_fp32_buffer_each_micro_batch():
    spec, tp = PRESETS["megatron-1t"], 8
    kw = dict(micro_batch=1, seq=2048, tp=tp, sp=False, precision=PRECISIONS["bf16-fp32-accum"])
    unfused = block_seconds(spec, A100, software=MEGATRON_2021, **kw)["accumulate"]
    fused = block_seconds(spec, A100, software=MODERN, **kw)["accumulate"]
    params = layer_params(spec, False)
    local = params.split / tp + params.replicated
    # Read the 2-byte gradient and the 4-byte buffer, write the buffer.
    assert unfused == pytest.approx(local * (2 + 4 + 4) / (A100.hbm_bandwidth * CALIBRATED.memory),
                                    rel=1e-12)
    assert fused == 0


def test_unknown_software_choices_are_refused_in_one_sentence():
    for kw in ({"attention": "paged"}, {"cp": "ulysses"}):
        with pytest.raises(ConfigError) as err:
            Software(**kw)
        assert "\n" not in str(err.value) and "choose one of" in str(err.value)


@pytest.mark.parametrize("layers, pp, expected", [(126, 16, (7, 8, 7)), (96, 8, (12, 12, 12)),
                                                  (10, 4, (2, 3, 2)), (9, 4, (2, 3, 2)), (7, 1, (7, 7, 7))])
def test_uneven_stages_take_a_block_from_the_last_then_the_first(layers, pp, expected):
    # Llama 3, Section 3.3.2: one Transformer layer less on the first and on the last stage.
    assert tuple(int(x) for x in stage_layers(layers, pp)) == expected


def test_uneven_stages_priced_at_the_heaviest_bound_the_simulated_pipeline():
    # 10 blocks on 4 stages (2, 3, 3, 2) with the head on the last: the closed form prices every
    # stage as the heaviest, an upper bound on refpar's simulator run with each stage's own cost.
    blocks = [2, 3, 3, 2]
    F, B, head = 1.0, 2.0, 0.7
    cost = {r: (n * F + (head if r == 3 else 0), n * B + (head if r == 3 else 0))
            for r, n in enumerate(blocks)}
    heavy_f, heavy_b = max(cost.values(), key=sum)
    for kind, m in (("1f1b", 8), ("gpipe", 6)):
        schedule = build(kind, 4, m)
        durations = {(r, t): cost[r][0] if a.kind == "F" else cost[r][1]
                     for r, row in schedule.items() for t, a in enumerate(row) if a is not None}
        makespan = simulate(schedule, durations=durations).makespan
        work, bubble, _ = pipeline_time(kind, 4, m, heavy_f, heavy_b, 0.0)
        assert makespan <= work + bubble
        assert makespan >= m * sum(cost[3])  # the last stage's own work


def test_a_data_parallel_reduction_not_overlapped_adds_the_whole_all_reduce():
    spec = PRESETS["megatron-7.5b"]
    kw = dict(global_batch=128, micro_batch=4, seq=2048, tp=4, dp=32, recompute="full",
              precision=PRECISIONS["bf16"])
    exposed, _, _ = step_time(spec, A100, software=MEGATRON_2021, **kw)
    # Rajbhandari et al. 2020: data parallelism all-reduces the 2-byte gradients of the rank's
    # weights, here over 32 ranks on 16 nodes (InfiniBand).
    from refpar.analysis.scale import stage_params

    (shared, _), _ = stage_params(spec, 4, 1, 1)
    bw, lat = link(A100, {"tp": 4, "dp": 32}, "dp")
    want = collective_choice("all_reduce", 2 * shared, 32, bw * CALIBRATED.network, lat,
                             A100.call_latency)[0]
    assert exposed["dp"] == pytest.approx(want, rel=1e-12)
    hidden, _, _ = step_time(spec, A100, software=MODERN, **kw)
    assert hidden["dp"] < exposed["dp"]


def test_overlapping_the_backwards_tensor_parallel_collectives_never_slows_a_step():
    spec = PRESETS["megatron-18.4b"]
    for sp in (False, True):
        kw = dict(global_batch=64, micro_batch=2, seq=2048, tp=8, sp=sp, precision=PRECISIONS["bf16"])
        plain, _, _ = step_time(spec, A100, software=Software(tp_overlap=False), **kw)
        overlapped, _, _ = step_time(spec, A100, software=Software(tp_overlap=True), **kw)
        assert overlapped["total"] < plain["total"]
        # Sequence parallelism's gathers of the incoming gradient stay exposed: two per block.
        assert overlapped["tp"] > 0


def test_step_time_by_cause_adds_up_to_the_total():
    for name, mesh in (("llama3-70b", dict(tp=8, pp=4, dp=2, cp=2)),
                       ("mixtral-8x7b", dict(tp=2, pp=2, ep=4))):
        times, _, _ = step_time(PRESETS[name], H100, global_batch=64, micro_batch=1, seq=4096,
                                schedule="interleaved-1f1b", chunks=2, recompute="selective", **mesh)
        parts = sum(v for k, v in times.items() if k not in ("total", "stage", "block"))
        assert parts == pytest.approx(times["total"], rel=1e-12)
        assert all(np.all(np.asarray(v) >= 0) for k, v in times.items() if k not in ("stage", "block"))
    assert math.isclose(CALIBRATED.matmul, 1.0)
