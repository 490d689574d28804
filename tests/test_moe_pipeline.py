"""MoE inside pipeline stages (pp x dp x ep, refpar/engine), MoE microbatches (routing per
microbatch) and MoE checkpoints, against the single device with the same microbatches."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from refpar.analysis.moe import moe_cache_bytes
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from refpar.engine import Plan, validate
from refpar.holdings import microbatch_samples
from refpar.model import moe
from refpar.model.gpt import MOE, dtype_of, init_params
from refpar.parallel.pipeline.executor import held_bytes
from refpar.trainer import train_single_device
from tests.mpi import MPIEXEC, ROOT, mpi_env, mpiexec, refpar_json
from tests.numerics import CONTRACT, rel_diff, within

BF16_MOE_TOLERANCE = 5e-3  # relative loss, bf16-mixed with experts (refpar/commands/verify.py)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    proc = mpiexec(4, "tests/jobs/moe_pipeline_check.py", str(tmp_path_factory.mktemp("moe_ckpt")),
                   timeout=300)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(r)
    return out


def test_moe_pipelines_and_dp_ep_microbatches_match_one_device_with_closed_form_bytes_and_memory(rows):
    """pp=2 x ep=2 under 1f1b, gpipe (top-1) and interleaved (dropless), pp=2 x dp=2 under zb-h1,
    pp=4 with MoE in the last two blocks only, dp x ep without a pipeline (dropping by position
    and by score: Megatron-Core's "probs", the scores all-gathered), each with 2 or 4 microbatches,
    pp=2 x ep=2 under 1f1b with DeepSeek-V3's routing (shared expert, sigmoid gates, aux-free bias,
    sequence-wise loss, group limit), and pp=2 x ep=2 under zb-h1 in bf16 (its loss
    within bf16's MoE bound, the rest as follows): losses, parameters, aux losses and the routing
    of every block are the single device's with the same microbatches (the aux-free biases too);
    each step's traced bytes per (axis, op) and every memory peak equal the closed forms from the
    routing counts, and so does every rank's activation peak, to the byte: the MoE blocks'
    routing, router, expert buffers and caches from the counts of each microbatch, replayed over
    the schedule."""
    runs = [r for r in rows if "run" in r]
    assert len(runs) == 9
    # dropping by score ranks other assignments first than the queue: another run than by position
    by_position, by_score = [r for r in runs if r["run"].startswith("dp=2,ep=2")]
    assert "'probs'" in by_score["run"] and by_score["loss_diff"] < 1e-10, by_score
    assert by_score["all_to_all_bytes"] != by_position["all_to_all_bytes"], (by_score, by_position)
    # the scores' ring all-gather over the 4 data ranks: each holds 1 row of 8 tokens of each of the
    # 2 microbatches, k = 2 float64 scores a token, and sends and receives the 3 pieces not its own
    # (or its neighbour's: all pieces are alike) per MoE layer (3), microbatch (2) and step (3)
    assert by_score["scores_bytes"] == [[3 * 2 * 3 * 3 * 8 * 2 * 8] * 2] * 4, by_score
    assert all(r["scores_bytes"] == [[0, 0]] * 4 for r in runs if r is not by_score), runs
    for r in runs:
        if "bfloat16" in r["run"]:  # routing may flip once the parameters differ in the last bit
            assert within(r["loss_diff"], BF16_MOE_TOLERANCE), r
        else:
            assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
            # the router losses of parameters that differ in their last bits, summed over other
            # ranks: the float64 contract, as for the loss
            assert within(r["aux_diff"], CONTRACT) and r["routing_same"], r
        assert r["bytes_ok"] and r["memory_ok"], r
        assert (min(r["dropped"]) > 0) != ("moe_dropless" in r["run"]), r  # capacities that bite
        assert (r["all_to_all_bytes"] > 0) == ("ep=2" in r["run"]), r
        measured, closed = zip(*r["activation_peaks"], strict=True)  # one pair per rank
        assert measured == closed and min(measured) > 0, r


def test_moe_checkpoints_resume_exactly_on_their_mesh_and_reshard_to_others(rows):
    """Saved by a dp x ep mesh (no pipeline) and by a pp x ep pipeline after 2 of 4 steps. Resumed on the
    same mesh: losses and parameters bit for bit the uninterrupted run's. Resumed on another mesh
    (pipeline <-> no pipeline, ep=2 -> ep=4, one process): every rank reassembles exactly its
    tensors and moments from the other layout, and the losses agree to float64's rounding."""
    resumes = [r for r in rows if "resume" in r]
    assert [r["resume"] for r in resumes] == ["dp=2,ep=2 -> dp=2,ep=2", "dp=2,ep=2 -> pp=2,ep=2",
                                              "pp=2,ep=2 -> pp=2,ep=2", "pp=2,ep=2 -> ep=4",
                                              "pp=2,ep=2 -> 1"]
    for r in resumes:
        assert r["first_step"] == 2 and len(r["losses"]) == 2 and r["reassembled"], r
        a, b = r["resume"].split(" -> ")
        if a == b:
            # Exact: the same ranks run the same operations in the same order on the same state.
            assert r["exact"] and r["losses"] == r["uninterrupted"], r
        else:
            # Not exact: the other mesh sums the gradients in another order (expert gradients over
            # all-to-all rows vs dp copies, microbatches in the pipeline's order): the float64 contract.
            worst = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], r["uninterrupted"], strict=True))
            assert within(worst, CONTRACT), r


def test_pp_dp_ep_cli_with_1f1b_matches_one_device_and_reports_every_blocks_routing():
    s = refpar_json(8, "train", "--mesh", "pp=2,dp=2,ep=2", "--moe-experts", "4", "--moe-topk", "2",
                    "--capacity-factor", "0.9", "--moe-layers", "1,3", "--microbatches", "2",
                    "--schedule", "1f1b", "--steps", "3", "--check")
    print({k: s[k] for k in ("losses", "max_loss_rel_diff", "max_param_rel_diff", "bubble_fraction")})
    assert s["schedule"] == "1f1b" and s["microbatches"] == 2 and s["world_size"] == 8
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    moe = s["moe"]
    assert moe["dropped"] == moe["reference_dropped"] and all(min(step) > 0 for step in moe["dropped"])
    cap = int(np.ceil(4 * 16 * 2 * 0.9 / 4))  # a microbatch of tiny's batch: 4 x 16 tokens, top-2
    assert moe["capacity"] == cap
    for step, dropped in zip(moe["tokens_per_expert"], moe["dropped"], strict=True):
        for kept, lost in zip(step, dropped, strict=True):  # two microbatches of 64 tokens x 2 slots
            assert max(kept) <= 2 * cap and sum(kept) + lost == 2 * 64 * 2
    assert s["comm_bytes"] == s["expected_comm_bytes"]
    assert s["memory_peak_bytes"] == s["expected_memory_peak_bytes"]
    activations = [r["bytes"] for r in s["memory_peak_bytes"] if r["category"] == "activations"]
    assert len(activations) == 8 and min(activations) > 0  # every rank's, next to its closed form
    axes = {(r["axis"], r["op"]) for r in s["comm_bytes"]}
    assert {("pp", "isend"), ("pp", "irecv"), ("ep", "all_to_all"), ("dp", "all_reduce")} <= axes
    assert 0 < s["bubble_fraction"]["simulated_unit_costs"] < 1


@pytest.mark.parametrize("dtype, k, dropless", [("float64", 2, False), ("float64", 1, True),
                                               ("bfloat16", 2, False), ("float16", 1, False)])
def test_held_bytes_of_an_moe_cache_is_the_closed_form_and_never_parameters_or_gradients(dtype, k,
                                                                                       dropless):
    """One device's MoE layer keeps what an expert-parallel rank keeps, without the ep counts and
    with its experts taking the R dispatched rows themselves (Q = R), plus its input, which in a
    block is ln_2's output: held_bytes of its cache is that closed form to the byte, 16-bit too.
    The parameters' dict and the gradients' dict beside it (what the engine's stages carry in their
    caches and hand from B to W) add nothing, nor do the weights inside the linear layers' caches."""
    model = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=2, dtype=dtype,
                        moe_experts=4, moe_top_k=k, moe_capacity_factor=0.8, moe_dropless=dropless)
    params = init_params(model, seed=5)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(dtype_of(dtype))  # (B, T, C)
    out, cache = moe.moe_forward(x, params, 0, model, MOE)
    _, grads = moe.moe_backward(np.ones_like(out), cache)
    routing, N, C, e = cache["routing"], 16, 16, x.itemsize
    R = int(np.sum(routing["rows_per_expert"]))
    assert (0 < R < N * k) != dropless  # the capacity drops some assignments
    parts = moe_cache_bytes(N, k, 4, C, R, R, 1, e)  # no pairs: one device's experts take its rows
    want = sum(parts.values()) + N * C * e
    assert held_bytes((cache, params), params) == want
    assert held_bytes((cache, params, grads), params) == want
    assert held_bytes((params, grads), params) == 0


def test_one_microbatch_is_the_global_batch_and_dropless_unweighted_microbatches_only_accumulate():
    """Global microbatch j is the same contiguous slice on any mesh, cut over the data ranks in
    batch order. Without capacity and router losses, routing per microbatch changes nothing but the
    order of sums: M = 2 gives the M = 1 run to rounding; with a capacity and the Switch losses it
    does not (each microbatch is routed, dropped and balanced on its own tokens)."""
    moe_model = ModelConfig(moe_experts=4)
    for n_data in (1, 2, 3):
        for m in (1, 2, 4):
            parts = [list(microbatch_samples(moe_model, 12, m, {"dp": n_data, "ep": 1}, {"dp": d, "ep": 0},
                                             j)) for j in range(m) for d in range(n_data)]
            assert sum(parts, []) == list(range(12))  # microbatch-major, data ranks in batch order
    model = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=2, dropout=0.1,
                        moe_experts=4, moe_top_k=2, moe_dropless=True, moe_aux_loss_weight=0.0,
                        moe_z_loss_weight=0.0)
    train = TrainConfig(steps=2, batch_size=4, seq_len=8, lr=1e-2, seed=3)
    one, two = train_single_device(model, train), train_single_device(model, train, microbatches=2)
    # the two microbatches' gradients are summed where one batch sums in one GEMM: the contract
    assert within(max(abs(a - b) / b for a, b in zip(one.losses, two.losses, strict=True)), CONTRACT)
    assert within(max(rel_diff(one.params[n], p) for n, p in two.params.items()), CONTRACT)
    capped = replace(model, moe_dropless=False, moe_capacity_factor=0.8, moe_aux_loss_weight=0.01)
    one, two = train_single_device(capped, train), train_single_device(capped, train, microbatches=2)
    assert abs(one.losses[0] - two.losses[0]) > 1e-6  # 10^4 times the contract's rounding
    assert [len(s.microbatch_kept_counts) for s in two.moe_steps] == [2, 2]


@pytest.mark.parametrize("sizes, plan, changes, words", [
    ({"pp": 4}, Plan("1f1b", 4), {"n_layer": 2},
     "4 pipeline stages need at least 4 blocks, the model has n_layer=2"),
    ({"pp": 2, "ep": 2}, Plan("1f1b", 3), {},
     "--microbatches 3 does not divide --batch-size 8"),
    ({"pp": 2, "dp": 2, "ep": 2}, Plan("1f1b", 4), {},
     "--batch-size 8 in 4 microbatches leaves 2 sequences per microbatch for dp x ep = 4 ranks"),
    ({"pp": 2, "tp": 3}, Plan(), {}, "tp=3 does not divide n_head=4"),
    ({"pp": 2, "ep": 8}, Plan(), {}, "moe_experts=4 is fewer than ep=8"),
    ({"pp": 2}, Plan("1f1b", 1, 2), {}, "chunks"),
])
def test_bad_moe_pipeline_setup_is_one_sentence(sizes, plan, changes, words):
    model = ModelConfig(moe_experts=4, **changes)
    with pytest.raises(ConfigError) as err:
        validate(model, TrainConfig(), ParallelConfig(sizes).sizes, plan)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_moe_microbatches_that_do_not_divide_the_batch_are_refused():
    with pytest.raises(ConfigError, match="--microbatches 3 does not divide --batch-size 8"):
        validate(ModelConfig(moe_experts=4), TrainConfig(), ParallelConfig({"ep": 2}).sizes,
                 Plan(microbatches=3))


def test_a_bad_moe_pipeline_fails_on_every_rank_before_communication_with_one_line():
    cmd = [sys.executable, "-m", "refpar", "train", "--mesh", "pp=4", "--n-layer", "2", "--moe-experts", "4"]
    proc = subprocess.run([str(MPIEXEC), "-n", "4", *cmd], cwd=ROOT, env=mpi_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("refpar train: error: 4 pipeline stages need at least 4 blocks, the "
                                   "model has n_layer=2; use fewer stages (or chunks) or more layers")


def test_resuming_a_moe_checkpoint_with_other_microbatches_is_refused_in_one_sentence(tmp_path):
    """Capacity and router losses are per microbatch: another M would silently change the run."""
    common = ["-m", "refpar", "train", "--mesh", "ep=2", "--moe-experts", "4", "--batch-size", "4"]
    mpiexec(2, *common, "--microbatches", "2", "--steps", "1", "--save", str(tmp_path))
    proc = mpiexec(2, *common, "--microbatches", "1", "--steps", "2", "--resume", str(tmp_path),
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("routed its tokens in 2 microbatches per step and this run in 1; "
                                        "resume with --microbatches 2 (capacity and router losses are "
                                        "per microbatch)"), proc.stderr
    resumed = mpiexec(2, *common, "--microbatches", "2", "--steps", "2", "--resume", str(tmp_path))
    assert resumed.returncode == 0
