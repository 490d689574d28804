"""ZeRO-1/2/3 and FSDP for MoE runs (refpar/parallel/zero.py over each unit's replica group): the
dense weights sharded over each stage's dp x ep data ranks, the experts over dp, against the single
device with the same microbatches, refpar/analysis/closed_forms.py's closed forms, and checkpoints that
reshard."""

import json

import pytest

from refpar.commands.verify import MOE_LOSS_TOLERANCES
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from refpar.engine import Plan, validate
from refpar.holdings import units
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    proc = mpiexec(4, "tests/jobs/moe_zero_check.py", str(tmp_path_factory.mktemp("moe_zero")), timeout=300)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(r)
    return out


def test_moe_zero_1_2_3_and_fsdp_match_one_device_with_closed_form_bytes_and_memory(rows):
    """dp=2 x ep=2 under ZeRO-1, 2, 3 and FSDP, pp=2 x ep=2 under FSDP, pp=2 x dp=2 interleaved under
    ZeRO-2, dp=2 x cp=2 (Ulysses) under ZeRO-3, ep=2 x tp=2 with sp under ZeRO-1 and FSDP, dp=2 x
    tp=2 under ZeRO-3 and ZeRO-2, cp=2 x tp=2 with sp (ring) under ZeRO-2 (ZeRO shards the tp
    shards), two microbatches each: losses, parameters (gathered over tp) and
    routing are the single device's; each step's traced bytes per (axis, op) and the
    params/grads/master/optimizer peaks of every rank equal the closed forms; the optimizer state
    is smaller than the unsharded run's on every rank."""
    runs = [r for r in rows if "run" in r and "float64" in r["run"]]
    assert len(runs) == 12
    for r in runs:
        assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
        assert r["routing_same"] and r["bytes_ok"] and r["memory_ok"], r
        assert all(mine < unsharded for mine, unsharded in r["optimizer_peaks"]), r
        assert all(master == 0 for master, _ in r["master_peaks"]), r  # float64 needs no masters
        for axes in r["axes"]:
            # the gradients are reduce-scattered, never all-reduced (data's all-reduce is the loss)
            assert "data:reduce_scatter" in axes, r
            assert not {"dp:all_reduce", "dp_cp:all_reduce"} & set(axes), r
            # experts are sharded over dp (dp x cp with cp) when there is such an axis; else nothing moves
            copies = "dp_cp" if "cp=2" in r["run"] else "dp"
            assert (f"{copies}:reduce_scatter" in axes) == ("dp=2" in r["run"] or "cp=2" in r["run"]), r


def test_moe_zero2_in_fp16_with_fp32_grads_has_the_closed_forms_and_sharded_masters(rows):
    """fp16-mixed, gradients accumulated and reduce-scattered in float32, parameters gathered in 16
    bits, the overflow flag agreed over the data ranks (dp=2 x ep=2; ep=2 x tp=2 --sp over tp too):
    bytes and peaks (fp32 masters and moments of the shards only) equal the closed forms; the loss
    stays within fp16's MoE bound of one device."""
    runs = [r for r in rows if "run" in r and "float16" in r["run"]]
    assert len(runs) == 2
    for r in runs:
        assert r["bytes_ok"] and r["memory_ok"], r
        assert within(r["loss_diff"], MOE_LOSS_TOLERANCES["fp16-mixed"]), r
        assert all(0 < master < unsharded for master, unsharded in r["master_peaks"]), r


def test_moe_zero_checkpoints_resume_exactly_on_their_mesh_and_reshard_to_others(rows):
    """Saved under ZeRO-1 (dp=2,ep=2), FSDP (pp=2,ep=2), ZeRO-2 with cp (ep=2,cp=2) and ZeRO-1 with
    tp (ep=2,tp=2: moments of tp shards as boxes of the global tensors) after 2 of 4 steps, as flat
    ranges of each group's shards cut into boxes. Resumed on the same mesh and stage: bit for bit.
    Resumed without ZeRO on ep=2 and on one process (each rank reassembles exactly its whole
    tensors and moments), and under ZeRO-2 on another mesh: the losses agree to float64's
    rounding."""
    resumes = [r for r in rows if "resume" in r]
    assert [r["resume"] for r in resumes] == [
        "dp=2,ep=2 zero 1 -> dp=2,ep=2 zero 1", "dp=2,ep=2 zero 1 -> ep=2 plain",
        "dp=2,ep=2 zero 1 -> 1 plain", "pp=2,ep=2 fsdp -> pp=2,ep=2 fsdp",
        "pp=2,ep=2 fsdp -> dp=2,ep=2 zero 2", "ep=2,cp=2 zero 2 -> ep=2,cp=2 zero 2",
        "ep=2,cp=2 zero 2 -> ep=2 plain", "ep=2,tp=2 zero 1 -> ep=2,tp=2 zero 1",
        "ep=2,tp=2 zero 1 -> ep=2 plain"]
    for r in resumes:
        assert r["first_step"] == 2 and len(r["losses"]) == 2 and r["reassembled"], r
        a, b = r["resume"].split(" -> ")
        if a == b:
            assert r["exact"] and r["losses"] == r["uninterrupted"], r
        else:  # other meshes sum the gradients in another order: the contract
            worst = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], r["uninterrupted"], strict=True))
            assert within(worst, CONTRACT), r


def test_moe_zero3_cli_without_pp_runs_one_stage_and_reports_the_closed_forms():
    s = refpar_json(4, "train", "--mesh", "dp=2,ep=2", "--moe-experts", "4", "--moe-topk", "2",
                    "--zero", "3", "--microbatches", "2", "--steps", "2", "--check")
    assert s["zero"] == 3 and s["schedule"] is None and s["bubble_fraction"] is None
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    assert s["comm_bytes"] == s["expected_comm_bytes"]
    assert s["memory_peak_bytes"] == s["expected_memory_peak_bytes"]
    axes = {(r["axis"], r["op"]) for r in s["comm_bytes"]}
    assert {("data", "reduce_scatter"), ("data", "all_gather"), ("dp", "reduce_scatter"),
            ("dp", "all_gather"), ("ep", "all_to_all")} <= axes and ("dp", "all_reduce") not in axes


def test_units_never_mix_dense_weights_with_experts():
    names = ["wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.mlp.router.weight",
             "h.0.mlp.experts.1.c_fc.weight", "h.0.mlp.experts.1.c_fc.bias", "h.1.ln_1.weight",
             "h.1.mlp.c_fc.weight", "ln_f.weight"]
    assert units(names) == {
        "wte": ["wte.weight"], "root": ["wpe.weight", "ln_f.weight"],
        "h.0": ["h.0.ln_1.weight", "h.0.mlp.router.weight"],
        "h.0.experts": ["h.0.mlp.experts.1.c_fc.weight", "h.0.mlp.experts.1.c_fc.bias"],
        "h.1": ["h.1.ln_1.weight", "h.1.mlp.c_fc.weight"]}


@pytest.mark.parametrize("sizes, plan, words", [
    ({"pp": 2}, Plan("1f1b", 2, zero=1),
     "--zero 1 shards each stage's weights over its dp x ep x cp ranks; give the mesh dp=2, ep=2 or cp=2 "
     "or more"),
    ({"ep": 2}, Plan(zero=2, fsdp=True), "--fsdp and --zero 2 are two ways to shard"),
    ({"ep": 2}, Plan(zero=4), "--zero 4 is not a ZeRO stage"),
])
def test_bad_moe_zero_setup_is_one_sentence(sizes, plan, words):
    with pytest.raises(ConfigError) as err:
        validate(ModelConfig(moe_experts=4), TrainConfig(), ParallelConfig(sizes).sizes, plan)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
