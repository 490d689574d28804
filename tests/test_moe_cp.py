"""MoE with context parallelism (refpar/engine on pp x dp x ep x cp, ring or Ulysses)
against the single device with the same microbatches, its closed forms, and its checkpoints."""

import json

import pytest

from refpar.analysis.moe import routing_runs
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from refpar.engine import Plan, validate
from refpar.parallel.context_parallel import cp_positions
from refpar.parallel.routing_runs import token_runs
from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    proc = mpiexec(4, "tests/jobs/moe_cp_check.py", str(tmp_path_factory.mktemp("moe_cp_ckpt")), timeout=240)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(r)
    return out


def test_moe_with_ring_and_ulysses_cp_matches_one_device_with_closed_form_bytes_and_memory(rows):
    """ep=2 x cp=2 (ring) with Switch's routing, with DeepSeek-V3's (shared expert, sigmoid gates,
    aux-free bias, sequence-wise loss, group limit, drops by position) and dropping by score
    (Megatron-Core's "probs"), dp=2 x cp=2 (Ulysses, top-1) and pp=2 x cp=2
    (ring, 1f1b), 2 microbatches each, capacities that drop assignments: losses and parameters
    within 1e-10 of one device, aux losses, every block's dropped and kept counts and the expert
    bias the single device's, each step's traced bytes per (axis, op) and the params/grads/
    optimizer peaks equal to the closed forms."""
    runs = [r for r in rows if "run" in r]
    assert [r["run"].split()[0] for r in runs] == ["ep=2,cp=2"] * 3 + ["dp=2,cp=2", "pp=2,cp=2"]
    assert runs[1]["bias_moved"] and "moe_gate': 'sigmoid'" in runs[1]["run"], runs[1]
    # DeepSeek-V3's sequence-wise loss: each rank all-reduces its rows' (rows, E) int64 counts over
    # cp=2 per MoE layer and microbatch, ring: 2 (n - n/2) elements each way, n = rows E; here 2 rows
    # (8 sequences over 2 data ranks and 2 microbatches), E = 4, 3 MoE layers, 2 microbatches, 3 steps
    n = 2 * 4
    assert runs[1]["seq_counts_bytes"] == [[3 * 3 * 2 * 2 * (n - n // 2) * 8] * 2] * 4, runs[1]
    assert all(r["seq_counts_bytes"] == [[0, 0]] * 4 for r in runs if r is not runs[1]), runs
    # dropping by score: the scores' ring all-gather over the 4 data ranks (2 data x 2 cp ranks),
    # each holding 2 rows x 4 positions of each microbatch, k = 2 float64 scores a token: it sends
    # and receives the 3 pieces not its own per MoE layer (3), microbatch (2) and step (3)
    by_score = runs[2]
    assert "'probs'" in by_score["run"], by_score
    assert by_score["all_to_all_bytes"] != runs[0]["all_to_all_bytes"], by_score  # other rows kept
    assert by_score["scores_bytes"] == [[3 * 2 * 3 * 3 * 8 * 2 * 8] * 2] * 4, by_score
    assert all(r["scores_bytes"] == [[0, 0]] * 4 for r in runs if r is not by_score), runs
    for r in runs:
        assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
        # the router losses of parameters that differ in their last bits, summed over other
        # ranks: the float64 contract, as for the loss
        assert within(r["aux_diff"], CONTRACT) and r["routing_same"], r
        assert min(r["dropped"]) > 0, r  # the capacity bites: the queue order decides what stays
        assert r["bytes_ok"] and r["memory_ok"], r
        if r["run"].endswith("ring"):  # Ulysses' own all-to-alls are on cp
            assert (r["all_to_all_bytes"] > 0) == ("ep=2" in r["run"]), r


def test_moe_cp_checkpoint_resumes_exactly_and_reshards_to_a_mesh_without_cp(rows):
    """Saved under ep=2,cp=2 after 2 of 4 steps (cp rank 0 writes): resumed there, bit for bit the
    uninterrupted run; resumed under dp=2,ep=2, every rank reassembles exactly its tensors and
    moments and the losses agree to float64's rounding."""
    resumes = [r for r in rows if "resume" in r]
    assert [r["resume"] for r in resumes] == ["ep=2,cp=2 -> ep=2,cp=2", "ep=2,cp=2 -> dp=2,ep=2"]
    same, other = resumes
    for r in resumes:
        assert r["first_step"] == 2 and len(r["losses"]) == 2 and r["reassembled"], r
    assert same["exact"] and same["losses"] == same["uninterrupted"], same
    worst = max(abs(x - y) / abs(y) for x, y in zip(other["losses"], other["uninterrupted"], strict=True))
    assert within(worst, CONTRACT), other


@pytest.mark.parametrize("algo", ["ring", "ulysses"])
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_routing_runs_closed_form_counts_the_maximal_runs_of_each_cp_rank(algo, c):
    """routing_runs' count (1 without cp, b under Ulysses, b + 1, 2b, ..., b under ring) is the
    number of maximal runs of consecutive global tokens that token_runs finds."""
    T = 11
    for rows in (1, 2, 5):
        for j in range(c):
            found = token_runs(range(3, 3 + rows), cp_positions(T, c, j, algo), T)
            assert len(found) == routing_runs(rows, T, c, j, algo), (rows, j)
            assert sum(n for _, n in found) == rows * len(cp_positions(T, c, j, algo))


@pytest.mark.parametrize("sizes, opts, words", [
    ({"cp": 2, "tp": 2}, Plan(cp_algo="ulysses"), "use cp <= n_head/tp=1"),
    ({"ep": 2}, Plan(cp_algo="ring"), "give the mesh cp=2 or more"),
    ({"cp": 4}, Plan(cp_algo="ulysses"), "use cp <= n_head/tp=2"),
    ({"cp": 8}, Plan(), "use --seq-len 16 or more"),
])
def test_bad_moe_cp_setup_is_one_sentence(sizes, opts, words):
    model = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=2, moe_experts=4)
    with pytest.raises(ConfigError) as err:
        validate(model, TrainConfig(batch_size=8, seq_len=8), ParallelConfig(sizes).sizes, opts)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
