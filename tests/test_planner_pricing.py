"""Each pricing rule of a software stack against a hand-computed or published figure: FlashAttention's
activations without the scores, Megatron's fp32 main gradients and fp32 reduction, selective
recomputation under FlashAttention, overlapped pipeline sends, groups spanning nodes through every
member's adapter, torchtitan's per-op checkpointing and eager kernels; and the search agreeing with
pricing (every chunk count it accepts, unpriced plans ranked last). Single process, small searches."""

import numpy as np
import pytest

from refpar.analysis import calibration
from refpar.analysis.activations import korthikanti_layer_bytes
from refpar.analysis.efficiency import (
    CALIBRATED,
    MEGATRON_2022,
    MEGATRON_CORE_2024,
    MODERN,
    TORCHTITAN_FSDP2,
    _elementwise_bytes,
    op_checkpoint_gemms,
)
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.held_out_runs import HELD_OUT
from refpar.analysis.planner import SCHEDULE_CHOICES, enumerate_plans, plan, price
from refpar.analysis.presets import PRESETS, ModelSpec
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes, memory_per_rank, model_states
from refpar.analysis.step_time import link, pipeline_time, step_time

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


@pytest.mark.parametrize("hw_name, sizes, group, bandwidth", [
    ("a100", {"dp": 8}, ("dp",), 300e9),  # one node: NVLink
    ("a100", {"dp": 64}, ("dp",), 200e9),  # 8 members a node: min(8 x 25, 8/7 x 300) GB/s
    ("h100", {"dp": 64}, ("dp",), 400e9),  # min(8 x 50, 8/7 x 450)
    ("a100", {"dp": 32, "tp": 2}, ("dp",), 100e9),  # 4 members a node: min(4 x 25, 4/3 x 300)
    ("a100", {"dp": 8, "tp": 8}, ("dp",), 25e9),  # tensor parallelism fills the node: one adapter
    ("a100", {"dp": 16, "ep": 4, "tp": 2}, ("dp", "ep"), 100e9),  # dp x ep together, 4 a node
    ("a100", {"dp": 16, "ep": 8}, ("dp",), 25e9),  # the expert-replica group: one member a node
    ("a100", {"pp": 4, "dp": 2, "tp": 4}, ("pp",), 25e9),  # a stage per node: one adapter
])
def test_a_group_spanning_nodes_leaves_each_node_through_its_members_adapters(hw_name, sizes, group,
                                                                            bandwidth):
    # NCCL runs one ring per member of a node, each leaving through its own GPU's adapter: each
    # adapter carries a g-th of a rank's bytes, NVLink the (g - 1)/g that stays inside.
    bw, _ = link(HARDWARE[hw_name], sizes, group[0], group)
    assert float(bw) == pytest.approx(bandwidth, rel=1e-12)


def test_fsdp_over_eight_a100_nodes_reduce_scatters_at_eight_adapters():
    # Llama 3 8B under ZeRO-3 over 64 A100s (torchtitan's table): each micro-batch's fp32 gradients,
    # S = 4 x 8,030,261,248 bytes, reduce-scattered by a ring of 64: 63 steps of NCCL's network
    # latency and 63/64 S at 200 GB/s times the fitted network fraction, plus NCCL's call latency.
    spec, hw, n = PRESETS["llama3-8b"], HARDWARE["a100"], 64
    _, _, calls = step_time(spec, hw, global_batch=n, micro_batch=1, seq=8192, dp=n, zero=3,
                            software=TORCHTITAN_FSDP2, precision=PRECISIONS["bf16"])
    size, seconds = calls["dp.reduce_scatter"][2], calls["dp.reduce_scatter"][5]
    assert float(size) == 4 * LLAMA3_8B_PARAMS
    expected = hw.call_latency + (n - 1) * hw.ib_latency + (n - 1) / n * size / (200e9 * CALIBRATED.network)
    assert float(seconds) == pytest.approx(expected, rel=1e-9)


def test_per_op_checkpointing_reruns_k_o_and_w3_of_each_block():
    # torchtitan's "op" policy saves every matmul's output except every second one in forward order
    # (q, k, v, o, w1, w3, w2): k, o and w3 run again, (kv + h + f) / (2 h + 2 kv + 3 f) of the
    # block's forward matmul FLOPs, 19,456 / 53,248 for Llama 3 8B.
    spec, n = PRESETS["llama3-8b"], 8192
    shapes = op_checkpoint_gemms(spec, n, 1, False)
    assert [(int(M), int(N), int(K)) for M, N, K in shapes] == [(n, 1024, 4096), (n, 4096, 4096),
                                                                 (n, 14336, 4096)]
    rerun = sum(2 * M * N * K for M, N, K in shapes)
    forward = 2 * n * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert rerun / forward == pytest.approx(19456 / 53248, rel=1e-12)


def test_per_op_checkpointing_costs_what_torchtitan_published_for_llama2_13b():
    # torchtitan docs/performance.md (commit 0413364), Llama 2 13B on 64 A100, local batch 2: 2,162
    # tokens/s/GPU without checkpointing, 1,904 with "selective op": a 13.55% longer step. The
    # model's ratio of the two steps stays within 2% of it (the recorded accuracy of this rule).
    by_name = {r.name: r for r in HELD_OUT}
    none = calibration.price(by_name["torchtitan llama2-13b b=2 no on 64 A100"])["step_s"]
    per_op = calibration.price(by_name["torchtitan llama2-13b b=2 selective op on 64 A100"])["step_s"]
    assert per_op / none == pytest.approx(2162 / 1904, rel=0.02)


def test_per_op_checkpointing_keeps_the_block_input_and_the_odd_matmuls_outputs():
    # Llama 3 8B, one micro-batch of 8,192 tokens, bf16: the block's input x, q (h), v (kv), w1 (f),
    # w2 (h) and the flash output (h), with its fp32 log-sum-exp per query and head.
    spec, n, e = PRESETS["llama3-8b"], 8192, 2
    got = layer_activation_bytes(spec, 1, n, recompute="selective-op", attention="flash")
    assert float(got) == e * n * (4096 + 4096 + 1024 + 14336 + 4096 + 4096) + 4 * 32 * n


def test_eager_kernels_move_the_bytes_of_torchtitans_module_code():
    # Per element, with e = 2 bytes: RMSNorm's six kernels 4e + 28 = 36 against one kernel's 2e = 4
    # (two norms on the (n, h) stream); SwiGLU's two kernels 5e = 10 against 3e = 6 on (n, f);
    # rotary through complex fp32 2e + 16 = 20 against 4e = 8 on Q and K (n, h + kv); the
    # attention output made contiguous (2e on (n, h)) and repeat_kv's copies (2e on (n, h)).
    spec, n = PRESETS["llama3-8b"], 8192
    h, kv, f = 4096, 1024, 14336
    precision = PRECISIONS["bf16"]
    eager = _elementwise_bytes(spec, n, 1, False, precision, fused=False)
    fused = _elementwise_bytes(spec, n, 1, False, precision, fused=True)
    assert float(eager - fused) == 2 * 32 * n * h + 4 * n * f + 12 * n * (h + kv) + 8 * n * h


H100_SPEC = "memory=80,flops=989.5,hbm=3350,nvlink=450,ib=50,gpus_per_node=8"


def test_a_hardware_spec_of_the_h100_datasheet_prices_as_the_h100_preset():
    # The same figures as the preset (its MAMF, flash fraction and SMs are the spec's defaults):
    # the same plan costs the same, to the last digit.
    from refpar.analysis.hardware import parse_hardware_spec
    from refpar.analysis.planner import price

    spec, mesh = PRESETS["llama3-8b"], {"dp": 8, "tp": 2, "pp": 2, "cp": 1, "ep": 1}
    kw = dict(zero=1, schedule="1f1b", micro_batch=1, recompute="none", sp=True, global_batch=64, seq=8192)
    custom = price(spec, parse_hardware_spec(H100_SPEC), 32, mesh, **kw)
    preset = price(spec, HARDWARE["h100"], 32, mesh, **kw)
    assert custom["step_time_s"] == preset["step_time_s"] and custom["memory_bytes"] == preset["memory_bytes"]
    # Half the memory and a tenth of the network, as a user would give them: refused, then slower.
    small = parse_hardware_spec(H100_SPEC.replace("memory=80", "memory=8"))
    with pytest.raises(Exception, match="does not fit"):
        price(spec, small, 32, mesh, **kw)
    slow = price(spec, parse_hardware_spec(H100_SPEC.replace("ib=50", "ib=5")), 32, mesh, **kw)
    assert slow["time_s"]["pp"] > preset["time_s"]["pp"]


@pytest.mark.parametrize("text, words", [
    ("memory=80,flops=989.5", "needs hbm, nvlink, ib, gpus_per_node too"),
    (H100_SPEC + ",memory=40", "gives memory twice"),
    (H100_SPEC.replace("hbm=3350", "hbm=fast"), "hbm=fast must be a positive number"),
    (H100_SPEC.replace("gpus_per_node=8", "gpus_per_node=2.5"), "gpus_per_node=2.5 must be a whole number"),
    (H100_SPEC + ",mamf=2000", "above flops=989.5"),
    (H100_SPEC + ",clock=2", "has no key 'clock'"),
])
def test_a_bad_hardware_spec_is_refused_in_one_sentence(text, words, capsys):
    from refpar.cli import main

    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--hardware-spec", text]) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_a100_40gb_and_b200_presets_hold_what_their_datasheets_change():
    a100, small, h100, b200 = (HARDWARE[n] for n in ("a100", "a100-40gb", "h100", "b200"))
    # The 40GB A100 is the 80GB one's chip with half the memory and 1,555 GB/s of HBM.
    assert small.flops("bfloat16") == a100.flops("bfloat16") and small.memory_bytes == a100.memory_bytes / 2
    # The B200's matmul rate, not measured here, is the H100's measured fraction of its peak.
    assert b200.matmul_rate("bfloat16") / b200.flops("bfloat16") == pytest.approx(
        h100.matmul_rate("bfloat16") / h100.flops("bfloat16"), rel=1e-12)
    # A plan that fits 80 GB is refused on 40 GB, saying by how much.
    from refpar.analysis.planner import price

    mesh = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    kw = dict(zero=1, schedule="none", micro_batch=1, recompute="full", global_batch=8, seq=8192)
    assert price(PRESETS["llama3-8b"], a100, 8, mesh, **kw)["step_time_s"] > 0
    with pytest.raises(Exception, match="does not fit"):
        price(PRESETS["llama3-8b"], small, 8, mesh, **kw)
