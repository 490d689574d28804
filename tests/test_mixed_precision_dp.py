"""DP, ZeRO-1/2/3 and FSDP in bf16-mixed and fp16-mixed: the ZeRO paper's 16Ψ, measured to the byte.

The closed forms first (no MPI), then one 3-rank MPI job (tests/jobs/mixed_dp_job.py) that trains every
strategy in bf16-mixed, bf16-mixed with fp32 gradients, fp16-mixed and fp16-mixed with a forced
overflow, and checks measured memory, traced bytes, dtypes on the wire and losses.
"""

import json
from operator import itemgetter

import pytest

from refpar.analysis.comm_volume import paper_step_elems, step_bytes
from refpar.analysis.memory import (
    Options,
    model_state_bytes,
    paper_model_state_bytes,
    peak_bytes,
    precision_options,
    unit_sizes,
)
from refpar.comm import cost
from refpar.config import model_preset
from refpar.sharding import shard_sizes
from tests.mpi import mpiexec, refpar_json

TINY = model_preset("tiny", dtype="bfloat16")
PSI = sum(unit_sizes(TINY).values())
BF16 = precision_options("bfloat16")
STAGES = (("dp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp", 3))


def test_bf16_mixed_dp_holds_2_2_4_8_bytes_per_parameter_the_zero_papers_16_psi():
    state = model_state_bytes(TINY, 1, 0, Options("dp", **BF16))
    assert state == {"params": 2 * PSI, "grads": 2 * PSI, "master": 4 * PSI, "optimizer": 8 * PSI}
    assert sum(state.values()) == paper_model_state_bytes(PSI, 1, 0) == 16 * PSI


def test_fp32_gradients_keep_the_16bit_gradient_beside_the_fp32_one_so_dp_holds_the_playbooks_20_psi():
    """The Ultra-Scale Playbook's fp32 gradient accumulation (DeepSpeed's BF16_Optimizer): 2Ψ bf16
    parameters + 2Ψ bf16 gradients (what backward writes) + 4Ψ fp32 gradients + 4Ψ master + 8Ψ
    moments."""
    state = model_state_bytes(TINY, 1, 0, Options("dp", **precision_options("bfloat16", fp32_grads=True)))
    assert state == {"params": 2 * PSI, "grads": (2 + 4) * PSI, "master": 4 * PSI, "optimizer": 8 * PSI}
    assert sum(state.values()) == 20 * PSI


@pytest.mark.parametrize("n", [3, 5])
def test_fp32_gradient_partitions_keep_both_gradients_whole_until_zero2_shards_the_fp32_one(n):
    """ZeRO-1 keeps BF16_Optimizer's whole 16-bit and fp32 gradients (2Ψ + 6Ψ + 12s); from ZeRO-2
    the 16-bit gradient lives only until its unit's reduce-scatter and the fp32 shard stays
    (2Ψ + 16s, ZeRO-3 and FSDP 18s), with s = Σ_u s_u this rank's uneven share."""
    fp32 = precision_options("bfloat16", fp32_grads=True)
    for r in range(n):
        share = sum(shard_sizes(size, n)[r] for size in unit_sizes(TINY).values())
        want = {"zero1": 8 * PSI + 12 * share, "zero2": 2 * PSI + 16 * share, "zero3": 18 * share,
                "fsdp": 18 * share}
        for strategy, total in want.items():
            state = model_state_bytes(TINY, n, r, Options(strategy, **fp32))
            assert sum(state.values()) == total, strategy
            assert state["grads"] == (6 * PSI if strategy == "zero1" else 4 * share), strategy
    assert any(size % n for size in unit_sizes(TINY).values())  # the shards are uneven


def test_the_fp32_gradient_peak_of_zero2_adds_a_units_16bit_gradient_to_its_fp32_buffer():
    """From a unit's first backward piece to its reduce-scatter ZeRO-2 holds the unit's 16-bit
    gradient and its fp32 accumulator: (2 + 4)Ψ_u more than the 4-byte gradient alone, the ends'
    (wte and the root: filled by the head, reduced after the embedding) plus a block's with its piece."""
    n, sizes = 3, unit_sizes(TINY)
    fp32 = Options("zero2", **precision_options("bfloat16", fp32_grads=True))
    for r in range(n):
        share = sum(shard_sizes(size, n)[r] for size in sizes.values())
        grads = peak_bytes(TINY, n, r, fp32)["grads"]
        assert grads == 4 * share + 6 * (sizes["wte"] + sizes["root"]) + (6 + 2) * sizes["h.0"]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("strategy, stage", STAGES)
def test_bf16_partitions_are_pos_pos_g_pos_g_p_with_uneven_shards_summing_to_the_whole(n, strategy, stage):
    per_rank = [model_state_bytes(TINY, n, r, Options(strategy, **BF16)) for r in range(n)]
    bytes_per_param = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
    sharded_from = {"params": 3, "grads": 2, "master": 1, "optimizer": 1}  # the stage that shards it
    for category, b in bytes_per_param.items():
        replicas = 1 if stage >= sharded_from[category] else n
        assert sum(s[category] for s in per_rank) == b * PSI * replicas, category
    for r in range(n):
        share = sum(shard_sizes(size, n)[r] for size in unit_sizes(TINY).values())  # Σ s_u, uneven
        want = {"dp": 16 * PSI, "zero1": 4 * PSI + 12 * share, "zero2": 2 * PSI + 14 * share,
                "zero3": 16 * share, "fsdp": 16 * share}[strategy]
        assert sum(per_rank[r].values()) == want
        # Σ s_u is within one element per unit of Ψ/N: the paper's form up to the uneven split.
        assert abs(want - paper_model_state_bytes(PSI, n, stage)) <= 16 * len(unit_sizes(TINY))


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_traffic_is_the_papers_volume_at_2_bytes_per_element(n):
    assert all(size % n == 0 for size in unit_sizes(TINY).values())
    for strategy, stage in STAGES[:4]:
        sent = [sum(b.sent for b in step_bytes(TINY, n, r, Options(strategy, **BF16), loss=False).values())
                for r in range(n)]
        assert sent == [2 * paper_step_elems(PSI, n, stage)] * n


def test_fp32_gradients_double_the_gradient_traffic_but_not_the_parameter_gathers():
    n, fp32 = 4, precision_options("bfloat16", fp32_grads=True)
    bf16 = step_bytes(TINY, n, 0, Options("zero1", **BF16), loss=False)
    wide = step_bytes(TINY, n, 0, Options("zero1", **fp32), loss=False)
    assert wide["reduce_scatter"].sent == 2 * bf16["reduce_scatter"].sent
    assert wide["all_gather"] == bf16["all_gather"]


def test_fp16_zero_agrees_on_overflow_with_one_float32_flag_per_step_and_plain_dp_needs_none():
    fp16, n = precision_options("float16"), 3
    for strategy in ("zero1", "zero2", "zero3", "fsdp"):
        flag = [step_bytes(TINY, n, r, Options(strategy, **fp16), loss=False)["all_reduce"] for r in range(n)]
        assert flag == [cost.all_reduce_bytes(1, n, r, 4) for r in range(n)]
        assert sum(f.sent for f in flag) == 2 * (n - 1) * 4  # a ring all-reduce of one float32
        assert "all_reduce" not in step_bytes(TINY, n, 1, Options(strategy, **BF16), loss=False)
    # Plain DP all-reduces the gradients, so every rank checks the same numbers: no flag.
    assert step_bytes(TINY, n, 1, Options("dp", **fp16), loss=False) == \
        step_bytes(TINY, n, 1, Options("dp", **BF16), loss=False)


def test_every_strategy_in_mixed_precision_matches_the_papers_memory_the_traced_bytes_and_one_device():
    """One 3-rank job (every unit splits unevenly), every strategy: measured model states equal the
    paper's forms exactly, measured peaks and traced bytes equal the closed forms, gradients move
    in their dtype and parameters in 16 bits, and losses track the single-device mixed run:

    - bf16-mixed (and with fp32 gradients): every step's loss within 2^-8 (bf16's unit roundoff,
      0.4%) relative. The forward of each sample is the single device's; what differs is where
      gradients are rounded to 16 bits: each rank rounds its partial gradient and the ring adds the
      N partials in bf16 (N-1 more roundings), one device rounds one fp32 sum. Adam divides by
      sqrt(v), so a gradient a few units of roundoff off moves a parameter a few roundoffs of lr, and
      the loss, a mean over 7 x 16 tokens, moves far less than one bf16 rounding (seen: 2e-5 to 2e-4).
    - fp16-mixed: within 2^-11 (fp16's unit roundoff) relative, for the same reason (seen: 2e-5);
      with the loss scale started at 2^20 the first steps overflow, every rank skips exactly the
      single device's steps, and the scale backs off and recovers as it does there.
    These bounds are for a few steps of a stable run: rounding differences are perturbations, and a
    run whose loss is itself unstable amplifies them like any other (benchmarks/precision.py's
    small preset jumps from 7.59 to 8.16 at step 4 in fp64, and there bf16 and fp16 DP sit 0.25%
    and 0.3% from their single-device runs)."""
    proc = mpiexec(3, "tests/jobs/mixed_dp_job.py", timeout=240)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report["max_loss_rel_diff"], indent=1))
    assert report["failures"] == [], "\n".join(report["failures"])
    assert report["checks"] > 1000


def test_refpar_train_runs_zero3_in_bf16_mixed_and_reports_the_master_weights_next_to_the_closed_form():
    s = refpar_json(2, "train", "--mesh", "dp=2", "--zero", "3", "--precision", "bf16-mixed", "--steps", "2",
                    "--check")
    assert s["precision"] == "bf16-mixed" and s["loss_scaling"] is None
    assert s["max_loss_rel_diff"] <= 2.0 ** -8  # bf16's unit roundoff: see the test above
    key = itemgetter("rank", "category")
    assert sorted(s["memory_peak_bytes"], key=key) == sorted(s["expected_memory_peak_bytes"], key=key)
    key = itemgetter("rank", "op")
    assert sorted(s["comm_bytes"], key=key) == sorted(s["expected_comm_bytes"], key=key)
    master = [r["bytes"] for r in s["memory_peak_bytes"] if r["category"] == "master"]
    assert master == [4 * sum(shard_sizes(n_u, 2)[r] for n_u in unit_sizes(TINY).values()) for r in range(2)]
    assert s["data_parallel"]["model_state_bytes"] == [16 * PSI // 2] * 2  # every unit splits evenly


def test_mixed_checkpoints_resume_bit_for_bit_on_the_same_mesh_and_within_tolerance_elsewhere(tmp_path):
    """One 3-rank job (tests/jobs/mixed_resume_job.py): bf16 ZeRO-3, fp16 ZeRO-1 with skipped steps and a
    moving loss scale, bf16 DP with fp32 gradients, each saved after step 2 and resumed on the same
    mesh (bit for bit: losses, scales, skipped steps, parameter bits), under another strategy on 2
    ranks and on one process (losses within 2^-8 for bf16, 2^-11 for fp16, as against the single
    device in the test above: only reduction order and 16-bit rounding points differ)."""
    proc = mpiexec(3, "tests/jobs/mixed_resume_job.py", str(tmp_path), timeout=180)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], "\n".join(report["failures"])
    assert report["checks"] == 3 * 31


def test_refpar_train_saves_a_mixed_zero_run_that_one_process_resumes(tmp_path):
    """The command line end to end: fp16-mixed ZeRO-2 on 2 ranks saves, `refpar train` on one
    process resumes from it with the loss scaler it stored and continues within fp16's roundoff."""
    ckpt = str(tmp_path / "ckpt")
    common = ["train", "--precision", "fp16-mixed", "--steps", "3"]
    two = refpar_json(2, *common, "--mesh", "dp=2", "--zero", "2", "--save", ckpt, "--save-every", "2")
    one = refpar_json(1, *common, "--resume", str(tmp_path / "ckpt" / "step-00000002"))
    assert one["losses"] == pytest.approx(two["losses"][2:], rel=2.0 ** -11)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000002" / "manifest.json").read_text())
    assert manifest["loss_scaler"]["scale"] == 2.0 ** 16 and manifest["optimizer_t"] == 2
    assert manifest["tensors"]["params/wte.weight"]["dtype"] == "float16"
    assert manifest["tensors"]["master/wte.weight"]["dtype"] == "float32"
