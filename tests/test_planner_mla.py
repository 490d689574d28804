"""The planner prices DeepSeek-V3 with its own shapes (refpar/analysis/efficiency.py, step_time.py,
scale.py): multi-head latent attention's GEMMs, attention core, rotary and latent norms, context-parallel
K/V and FLOPs, and the middle pipeline stages' experts in the optimizer's time and memory; each against
a closed form written here from DeepSeek-V3's config.json."""

from __future__ import annotations

import pytest

from refpar.analysis.efficiency import (
    CALIBRATED,
    MEGATRON_2021,
    MODERN,
    _attention_linears,
    _elementwise_bytes,
    block_seconds,
    gemm_seconds,
    memory_seconds,
    op_checkpoint_gemms,
)
from refpar.analysis.flops import forward_flops
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.presets import PRESETS
from refpar.analysis.scale import PRECISIONS, memory_per_rank
from refpar.analysis.step_time import step_time

V3, H100 = PRESETS["deepseek-v3"], HARDWARE["h100"]
# DeepSeek-V3's config.json: hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, a head's
# query and key 128 + 64 (rotary) channels, its value 128; 61 blocks, the first 3 dense; 256 routed
# experts of width 2048, 8 per token, 1 shared; vocabulary 129,280.
H, A, RQ, RKV, DN, DR, DV, L, E, F = 7168, 128, 1536, 512, 128, 64, 128, 61, 256, 2048


def _floats(gemms):
    return [tuple(float(x) for x in g) for g in gemms]


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_latent_attentions_gemms_are_its_down_and_up_projections_not_multi_head_qkv(tp, sp):
    # q_a (h -> rq) and kv_a (h -> rkv + dr) whole on each rank (on its n / t tokens under sp),
    # q_b (rq -> a (dn + dr) / t), kv_b (rkv -> a (dn + dv) / t), o (a dv / t -> h): Megatron-Core's MLA.
    n = 4096
    down = n / tp if sp else n
    expected = [(down, 1536, 7168, 1), (n, 128 * 192 / tp, 1536, 1), (down, 576, 7168, 1),
                (n, 128 * 256 / tp, 512, 1), (n, 7168, 128 * 128 / tp, 1)]
    assert _floats(_attention_linears(V3, n, tp, sp)) == expected
    # torchtitan's per-op checkpointing recomputes every second mm: q_b, kv_b, then the MoE MLP whole
    recomputed = _floats(op_checkpoint_gemms(V3, n, tp, True, sp))
    assert recomputed[:2] == [(n, 128 * 192 / tp, 1536), (n, 128 * 256 / tp, 512)]
    assert recomputed[2] == (n, 256, 7168)  # the router, first of the MLP


@pytest.mark.parametrize("tp, cp", [(1, 1), (8, 2)])
def test_flash_attention_core_reads_dn_plus_dr_channels_for_qk_and_dv_for_v(tp, cp):
    b, s = 1, 4096
    parts = block_seconds(V3, H100, micro_batch=b, seq=s, tp=tp, cp=cp, moe=True,
                          precision=PRECISIONS["bf16"], software=MODERN)
    # the causal half of QK^T (2 (dn + dr) FLOPs a score) and P V (2 dv) over the rank's heads
    flops = (2 * (128 + 64) + 2 * 128) * b * (s / cp) * s * (128 / tp) / 2
    assert parts["core_f"] == pytest.approx(flops / (H100.flops("bfloat16") * H100.flash_fraction), rel=1e-12)
    mha = 4 * b * (s / cp) * s * (7168 / 128) * (128 / tp) / 2  # what a head of h / a = 56 channels would be
    assert parts["core_f"] > 1.4 * mha / (H100.flops("bfloat16") * H100.flash_fraction)


def test_unfused_attention_core_batches_gemms_of_mlas_widths():
    b, s, tp = 1, 2048, 8
    parts = block_seconds(V3, H100, micro_batch=b, seq=s, tp=tp, moe=True, precision=PRECISIONS["bf16"],
                          software=MEGATRON_2021)
    heads = 128 // tp
    per_byte = memory_seconds(H100, b * heads * s * s)  # one byte per score through HBM

    def bmm(M, N, K):  # a batched GEMM over the scores, or writing / reading their 2 bytes
        return max(gemm_seconds(H100, M, N, K, batch=b * heads), 2 * per_byte)

    # QK^T over dn + dr, softmax reads and writes the scores (no dropout in DeepSeek-V3), P V over dv
    forward = bmm(s, s, 192) + 4 * per_byte + bmm(s, 128, s)
    assert parts["core_f"] == pytest.approx(forward, rel=1e-12)


@pytest.mark.parametrize("tp, sp", [(8, False), (8, True)])
def test_memory_bound_kernels_rotate_the_rope_channels_and_normalise_the_latents(tp, sp):
    n, e = 4096, 2
    stream = n * H / (tp if sp else 1)
    expected = (2 * 2 * e * stream  # the two RMSNorms of the residual stream, read and write
                + 2 * 3 * e * stream  # two residual adds: read the branch and the stream, write
                + 3 * e * n * (8 + 1) * F / tp  # SwiGLU of 8 routed and 1 shared experts' columns
                + 2 * 2 * e * n * (A * DR / tp + DR)  # RoPE on the heads' dr query channels, the shared key
                + 2 * e * n / (tp if sp else 1) * (RQ + RKV))  # q_a_layernorm and kv_a_layernorm
    assert _elementwise_bytes(V3, n, tp, sp, PRECISIONS["bf16"]) == pytest.approx(expected, rel=1e-12)


def test_forward_flops_count_mlas_attention_core_widths():
    b, s = 2, 4096
    _, core, _ = forward_flops(V3, b, s)
    assert core == 2 * b * s * s * A * (DN + DR + DV) * L


def test_ring_context_parallelism_passes_the_ranks_heads_keys_and_values():
    tp, cp, b, s = 8, 2, 1, 4096
    _, _, calls = step_time(V3, H100, global_batch=1024, micro_batch=b, seq=s, tp=tp, cp=cp, pp=16, dp=4,
                            ep=8, precision=PRECISIONS["bf16"])
    # 2 bytes x the rank's s / cp tokens x its a / t heads' k (dn + dr) and v (dv)
    assert float(calls["cp.send"][2]) == 2 * (s / cp) * (A / tp) * (DN + DR + DV)


# One MoE block's weights on a tensor-parallel rank (t = 8), by hand: the up-projections, o_proj and
# the shared expert split by t; q_a, kv_a, their norms, the block's two norms and the router whole.
TP, EP, DP, PP = 8, 8, 4, 16
MOE_SHARED = ((RQ * A * (DN + DR) + RKV * A * (DN + DV) + A * DV * H + 3 * H * F) / TP
              + H * RQ + RQ + H * (RKV + DR) + RKV + 2 * H + H * E)
MOE_EXPERTS = E * 3 * H * F / (EP * TP)  # this rank's E / ep experts' t-th


def test_the_middle_stages_experts_set_the_optimizers_time_and_memory():
    # 61 blocks over p = 16 stages: 4 each, the first and last 3 (Llama 3's split); the first holds the
    # 3 dense blocks, so a middle stage holds 4 MoE blocks, more experts than the last's 3.
    seq, micro = 4096, 1
    kw = dict(micro_batch=micro, seq=seq, tp=TP, pp=PP, dp=DP, ep=EP, zero=1, precision=PRECISIONS["bf16"])
    shared, experts = 4 * MOE_SHARED, 4 * MOE_EXPERTS
    # ZeRO-1: the shared weights' optimizer state over dp x ep ranks, the experts' over dp
    local = shared / (DP * EP) + experts / DP
    memory = memory_per_rank(V3, microbatches=15360 // (DP * EP * micro), **kw)
    assert float(memory["optimizer"]) == pytest.approx(8 * local, rel=1e-12)
    assert float(memory["master"]) == pytest.approx(4 * local, rel=1e-12)
    assert float(memory["params"]) == pytest.approx(2 * (shared + experts), rel=1e-12)
    times, _, _ = step_time(V3, H100, global_batch=15360, **kw)
    # Adam on the rank's shard: zero and read the bf16 gradient (3 x 2 bytes), read and write the fp32
    # master and moments (2 x 12), read the master again and write the bf16 weights (4 + 2)
    touched = local * (3 * 2 + 2 * (4 + 8) + 4 + 2)
    assert float(times["optimizer"]) == pytest.approx(touched / (H100.hbm_bandwidth * CALIBRATED.memory),
                                                      rel=1e-12)
    last = 3 * MOE_SHARED + 3 * MOE_EXPERTS  # what the last stage's blocks would have set it to
    assert experts + shared > last + V3.vocab_size * H / TP + H
