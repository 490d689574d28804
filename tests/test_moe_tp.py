"""MoE with expert tensor parallelism (mesh pp x dp x ep x tp, and --sp, with cp too;
refpar/engine, refpar/parallel/expert_tensor_parallel.py) against the single device with
the same microbatches."""

import json
import subprocess
import sys

import numpy as np
import pytest

from refpar.commands.verify import MOE_LOSS_TOLERANCES
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from refpar.engine import Plan, validate
from refpar.holdings import tp_param_slices
from refpar.model.gpt import init_params
from refpar.parallel.tensor_parallel import shard_params_tp
from tests.mpi import ROOT, mpi_env, mpiexec
from tests.numerics import CONTRACT, within


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    proc = mpiexec(4, "tests/jobs/moe_tp_check.py", str(tmp_path_factory.mktemp("moe_tp_ckpt")), timeout=300)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(r)
    return out


def test_moe_with_expert_tp_and_sp_matches_one_device_with_closed_form_bytes_and_memory(rows):
    """ep=2 x tp=2 (one and two microbatches, with and without sp; with sp also with DeepSeek-V3's
    routing, its shared expert replicated over tp), pp=2 x tp=2 with sp (top-1),
    dp=2 x tp=2, cp=2 x tp=2 (ring) and cp=2 x tp=2 with sp (Ulysses, with DeepSeek-V3's
    sequence-wise loss, its counts all-reduced over cp): losses, parameters gathered
    over tp, aux losses, the routing of every block and the aux-free biases are the single
    device's with capacities
    that drop; ep=2 x tp=2 with sp in bf16-mixed: the loss
    within verify's MoE bound of the bf16 single device. Each step's traced bytes per (axis, op)
    and the params/grads/optimizer (bf16: master) and activation peaks equal the closed forms; every rank
    all-reduces its expert buffer once forward and once backward per MoE layer and microbatch, and
    under sp gathers the sequence twice; a rank holds 1/t of its experts' weights (c_proj.bias
    whole)."""
    runs = [r for r in rows if "run" in r]
    assert len(runs) == 8 and sum(r["run"].startswith("cp=2,tp=2") for r in runs) == 2
    C = 16
    whole, half = 2 * C * 4 * C + 4 * C + C, 2 * C * 2 * C + 2 * C + C  # one expert, and its tp shard
    for r in runs:
        if r["dtype"] == "float64":
            assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
            # the router losses of parameters that differ in their last bits, summed over other
            # ranks: the float64 contract, as for the loss
            assert within(r["aux_diff"], CONTRACT) and r["routing_same"], r
        else:  # bf16: partial sums round where one device rounds once, so routing may flip later
            assert within(r["loss_diff"], MOE_LOSS_TOLERANCES["bf16-mixed"]), r
        assert r["bytes_ok"] and r["memory_ok"], r
        assert min(r["dropped"]) > 0, r
        assert r["buffer_all_reduces"] == [[1.0, 1.0]] * 4, r
        assert r["sp_gathers"] == [2.0 if "--sp" in r["run"] else 0.0] * 4, r
        assert r["expert_param_ratio"] == half / whole, r


def test_moe_tp_checkpoints_resume_exactly_and_reshard_to_other_meshes(rows):
    """Saved by ep=2,tp=2 --sp and by cp=2,tp=2 --sp (ring) after 2 of 4 steps. On the same mesh:
    losses and parameters bit for bit the uninterrupted run's. On pp=2,tp=2 (from ep=2,tp=2), ep=2
    (whole experts) and one process: every rank reassembles exactly its tp shards or whole tensors
    and AdamW moments, and the losses agree to float64's rounding (the other mesh sums in another
    order). The shards of either checkpoint hold each element once."""
    resumes = [r for r in rows if "resume" in r]
    assert [r["resume"] for r in resumes] == [
        "ep=2,tp=2 --sp -> ep=2,tp=2 --sp", "ep=2,tp=2 --sp -> pp=2,tp=2", "ep=2,tp=2 --sp -> ep=2",
        "ep=2,tp=2 --sp -> 1", "cp=2,tp=2 --sp -> cp=2,tp=2 --sp", "cp=2,tp=2 --sp -> ep=2",
        "cp=2,tp=2 --sp -> 1"]
    for r in resumes:
        assert r["first_step"] == 2 and len(r["losses"]) == 2 and r["reassembled"], r
        assert r["each_element_written_once"], r  # cp ranks and tp ranks holding copies write nothing
        saved, resumed = r["resume"].split(" -> ")
        if saved == resumed:
            assert r["exact"] and r["losses"] == r["uninterrupted"], r
        else:
            worst = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], r["uninterrupted"], strict=True))
            assert within(worst, CONTRACT), r


def test_expert_tp_slices_split_each_expert_like_the_dense_mlp_and_reassemble_it():
    """c_fc by columns, c_proj.weight by rows, c_proj.bias and the router whole: the t shards of
    every expert put back along their axis are the full initialisation."""
    model = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=4, n_layer=2, moe_experts=3,
                        moe_layers=(1,))
    full = init_params(model, 5)
    for t in (2, 4):
        shards = [shard_params_tp(full, model, t, k) for k in range(t)]
        slices = tp_param_slices(model, t, 0)
        for name in [n for n in full if ".mlp." in n]:
            if name not in slices:
                assert name.endswith(("c_proj.bias", "router.weight")), name
                assert all(np.array_equal(s[name], full[name]) for s in shards)
                continue
            axis = slices[name][0]
            assert axis == (1 if "c_fc.weight" in name else 0), name
            assert np.array_equal(np.concatenate([s[name] for s in shards], axis=axis), full[name])
        assert "h.1.mlp.c_fc.weight" not in slices and "h.0.mlp.c_fc.weight" in slices


@pytest.mark.parametrize("sizes, opts, words", [
    ({"ep": 2, "cp": 8, "tp": 4}, Plan(sp=True), "fewer than tp=4 to shard them over"),
    ({"cp": 2, "tp": 4}, Plan(cp_algo="ulysses"), "use cp <= n_head/tp=1"),
    ({"ep": 2}, Plan(sp=True), "--sp shards along the sequence over tp ranks"),
    ({"ep": 2, "tp": 3}, Plan(), "tp=3 does not divide n_head=4"),
    ({"tp": 2}, Plan(zero=1), "--zero 1 shards each stage's weights over its dp x ep x cp"),
])
def test_bad_moe_tp_setup_is_one_sentence(sizes, opts, words):
    with pytest.raises(ConfigError) as err:
        validate(ModelConfig(moe_experts=4), TrainConfig(), ParallelConfig(sizes).sizes, opts)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_sp_without_tp_in_a_moe_run_is_refused_in_one_sentence_before_any_run():
    proc = subprocess.run([sys.executable, "-m", "refpar", "train", "--moe-experts", "4", "--sp"], cwd=ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("--sp shards along the sequence over tp ranks; give the mesh tp=2 or "
                                        "more")
