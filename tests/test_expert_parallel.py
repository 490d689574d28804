"""Expert parallelism on 2 and 4 ranks, and dp x ep, against the single device; its closed forms."""

import json
import math

import numpy as np
import pytest

from refpar.analysis import moe as moe_analysis
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from refpar.engine import Plan, validate
from refpar.memory import CATEGORIES
from refpar.model.gpt import param_shapes
from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within

CASES = {"top1_drops", "top2_drops", "top1_dropless", "top2_dropless", "deepseek_drops", "group_limited"}


def runs(n, *meshes):
    proc = mpiexec(n, "tests/jobs/ep_check.py", *meshes, timeout=240)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row)
    assert {(r["mesh"], r["case"]) for r in rows} == {(m, c) for m in meshes for c in CASES}
    return rows


def assert_matches_single_device(rows):
    for r in rows:
        assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
        # aux losses from the other mesh's parameters, summed over ranks: the contract, relative
        assert r["same_dropped"] and r["same_tokens_per_expert"] and within(r["same_aux"], CONTRACT), r
        assert r["bytes_match"], r  # traced bytes per (axis, op) and expert memory == closed forms
        assert (min(r["dropped"]) > 0) == r["case"].endswith("_drops"), r
        assert r["same_bias"] and r["group_limited"], r  # aux-free biases equal, bit for bit
        assert r["bias_moved"] == (r["case"] == "deepseek_drops"), r


def test_ep2_matches_single_device_after_3_adamw_steps_for_top1_top2_drops_and_dropless():
    assert_matches_single_device(runs(2, "ep=2"))


def test_ep4_and_dp2_ep2_match_single_device_after_3_adamw_steps_with_closed_form_bytes():
    assert_matches_single_device(runs(4, "ep=4", "dp=2,ep=2"))


def test_balanced_routing_bytes_equal_the_uniform_expectation():
    """When every rank keeps the same number of rows for every expert and each assignment is its own
    pair (a token's experts on different ep ranks), the exact payload bytes from the counts (the
    pairs' records left out: m = 0) are the uniform-routing expectation, with and without a
    capacity that binds."""
    for factor, dropless in [(0.5, False), (2.0, False), (1.0, True)]:
        config = ModelConfig(n_embd=16, moe_experts=8, moe_top_k=2, moe_capacity_factor=factor,
                             moe_dropless=dropless)
        n_data, ep, tokens = 4, 2, 32  # dp=2, ep=2
        share = tokens * n_data * 2 // 8  # assignments per expert
        cap = moe_analysis.capacity(tokens * n_data, config)
        per_rank = (share if cap is None else min(share, cap)) // n_data
        kept = np.full((n_data, 8), per_rank)
        for rank in range(n_data):
            pairs = moe_analysis.pair_counts_upper_bound(kept, ep)
            exact = moe_analysis.all_to_all_bytes(pairs, ep, rank, 16, 8, slots=0)
            expected = moe_analysis.expected_all_to_all_bytes(config, tokens, n_data, ep, 8)
            assert exact.sent == exact.recv == expected


def test_expert_memory_per_rank_adds_up_to_every_expert_parameter():
    config = ModelConfig(moe_experts=6, moe_layers=(1, 3))
    expert_elems = sum(math.prod(s) for n, s in param_shapes(config).items() if ".experts." in n)
    for ep in (1, 2, 4):  # 6 experts on 4 ranks: 2, 2, 1, 1
        per_rank = [moe_analysis.expert_params_per_rank(config, ep, q) for q in range(ep)]
        assert sum(per_rank) == expert_elems
        assert max(per_rank) - min(per_rank) <= 2 * (4 * 32 * 32 * 2 + 4 * 32 + 32)
    assert moe_analysis.expert_param_bytes_per_rank(config, 2, 0) == 8 * expert_elems // 2


@pytest.mark.parametrize(
    "model, sizes, words",
    [(ModelConfig(moe_experts=2), {"ep": 4}, "moe_experts=2 is fewer than ep=4"),
     (ModelConfig(), {"ep": 2}, "add --moe-experts"),
     (ModelConfig(moe_experts=4), {"dp": 4, "ep": 4}, "batch_size=8 is smaller than dp x ep = 16")],
)
def test_bad_expert_parallel_setup_is_one_sentence(model, sizes, words):
    with pytest.raises(ConfigError) as err:
        validate(model, TrainConfig(), ParallelConfig(sizes).sizes, Plan())
    assert words in str(err.value) and "\n" not in str(err.value)


def test_train_cli_reports_routing_per_step_and_matches_one_device_with_closed_form_bytes():
    from tests.mpi import refpar_json

    s = refpar_json(2, "train", "--mesh", "ep=2", "--moe-experts", "4", "--moe-topk", "2",
                    "--capacity-factor", "0.9", "--moe-layers", "1,3", "--steps", "3", "--check")
    print({k: s[k] for k in ("losses", "max_loss_rel_diff", "max_param_rel_diff", "moe")})
    assert s["mesh"]["ep"] == 2 and s["world_size"] == 2
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    moe = s["moe"]
    assert moe["blocks"] == [1, 3] and moe["dropped"] == moe["reference_dropped"]
    assert all(sum(step) > 0 for step in moe["dropped"])
    cap = math.ceil(8 * 16 * 2 * 0.9 / 4)  # tiny: batch 8 x 16 tokens
    for step, dropped in zip(moe["tokens_per_expert"], moe["dropped"], strict=True):
        for kept, lost in zip(step, dropped, strict=True):
            assert max(kept) <= cap and sum(kept) + lost == 8 * 16 * 2
    assert len(moe["aux_loss"]) == 3 and all(a > 0 for a in moe["aux_loss"])
    assert moe["capacity"] == cap and moe["experts_per_ep_rank"] == [[0, 1], [2, 3]]
    for sends, kept in zip(moe["kept_counts"], moe["tokens_per_expert"], strict=True):
        for per_rank, per_expert in zip(sends, kept, strict=True):  # (D, E) rows add up per expert
            assert np.sum(per_rank, axis=0).tolist() == per_expert
    assert s["comm_bytes"] == s["expected_comm_bytes"]
    assert s["memory_peak_bytes"] == s["expected_memory_peak_bytes"]
    assert {r["category"] for r in s["memory_peak_bytes"]} == set(CATEGORIES)  # activations too
    assert {(r["axis"], r["op"]) for r in s["comm_bytes"]} == {
        ("data", "all_gather"), ("ep", "all_to_all"), ("data", "all_reduce")}


@pytest.mark.parametrize("args, sentence", [
    (["--mesh", "ep=4", "--moe-experts", "2"], "moe_experts=2 is fewer than ep=4; use at least 4 experts"),
    (["--mesh", "ep=2"], "ep=2 spreads experts over ranks; add --moe-experts E with E >= 2"),
    (["--moe-experts", "4", "--zero", "1"],
     "--zero 1 shards each stage's weights over its dp x ep x cp ranks; give the mesh dp=2, ep=2 or cp=2 "
     "or more"),
    (["--moe-experts", "4", "--cp-algo", "ulysses"],
     "--cp-algo chooses how cp ranks share attention; give the mesh cp=2 or more"),
    (["--moe-experts", "4", "--sp"],
     "--sp shards along the sequence over tp ranks; give the mesh tp=2 or more"),
])
def test_train_cli_refuses_a_bad_expert_setup_in_one_sentence(args, sentence):
    import subprocess
    import sys

    from tests.mpi import ROOT, mpi_env

    proc = subprocess.run([sys.executable, "-m", "refpar", "train", *args], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"refpar train: error: {sentence}"


def test_routing_figure_draws_the_runs_counts():
    from refpar.viz.moe import routing_figure

    moe = {"blocks": [1, 3], "capacity": 5,
           "tokens_per_expert": [[[5, 3, 4, 2], [1, 1, 1, 1]], [[5, 5, 1, 0], [2, 2, 2, 2]]],
           "dropped": [[2, 0], [6, 0]],
           "kept_counts": [[[[3, 1, 2, 1], [2, 2, 2, 1]], [[0] * 4] * 2],
                           [[[2, 3, 1, 0], [3, 2, 0, 0]], [[1] * 4] * 2]],
           "experts_per_ep_rank": [[0, 1], [2, 3]]}
    fig = routing_figure(moe, block_index=0, step=-1)
    kept, sends = fig.data
    assert [list(r) for r in kept.z] == [[5, 3, 4, 2], [5, 5, 1, 0]]
    assert [list(r) for r in sends.z] == [[2, 3, 1, 0], [3, 2, 0, 0]]
    assert [list(r) for r in kept.customdata] == [[2] * 4, [6] * 4]
    assert [s["x0"] for s in fig.layout.shapes] == [1.5]  # between ep rank 0's and 1's experts
    assert "capacity 5" in fig.layout.annotations[0].text and "step 2" in fig.layout.annotations[1].text


def test_uniform_all_to_all_bytes_agree_with_the_planners_ep_term():
    """refpar.analysis.step_time prices the ep all-to-all of any model; for refpar's own dropless
    MoE GPT-2 its bytes per rank per step equal this file's uniform-routing expectation."""
    from refpar.analysis.hardware import hardware
    from refpar.analysis.presets import ModelSpec
    from refpar.analysis.scale import PRECISIONS
    from refpar.analysis.step_time import step_time

    config = ModelConfig(moe_experts=8, moe_top_k=2, moe_dropless=True)
    spec = ModelSpec("refpar-moe", config.n_layer, config.n_embd, config.n_head,
                     vocab_size=config.vocab_size, seq_len=16, global_batch=8, n_experts=8, top_k=2,
                     moe_d_ff=4 * config.n_embd)
    for dp, ep in [(1, 2), (1, 4), (2, 2)]:
        tokens = 8 * 16 // (dp * ep)
        _, sent, _ = step_time(spec, hardware("h100"), global_batch=8, micro_batch=8 // (dp * ep),
                               seq=16, dp=dp, ep=ep, precision=PRECISIONS["float64"],
                               dtype="float64")
        ours = config.n_layer * moe_analysis.expected_all_to_all_bytes(config, tokens, dp * ep, ep, 8)
        assert ours > 0 and float(sent["ep"]) == pytest.approx(ours, rel=1e-12)


def test_pair_counts_of_a_hand_counted_routing_and_their_closed_form_bytes():
    """4 tokens, top-2 of 4 experts on ep=2 (experts 0, 1 on rank 0; 2, 3 on rank 1), one dropped
    assignment. By hand: token 0 -> {0, 1}: one pair to rank 0 (two assignments); token 1 -> {0, 2}:
    one to each; token 2 -> {3, 2}: one to rank 1; token 3 -> {1, 3} with 3 dropped: one to rank 0.
    Pairs to (rank 0, rank 1) = (3, 2), 5 in all for 7 kept assignments."""
    from refpar.parallel.expert_parallel import pair_layout

    experts = np.array([[0, 1], [0, 2], [3, 2], [1, 3]])
    keep = np.array([[True, True], [True, True], [True, True], [True, False]])
    lay = pair_layout(experts, keep, np.array([0, 0, 1, 1]), np.array([0, 2]), m=2)
    assert lay["sizes"] == [3, 2]
    assert lay["token"].tolist() == [0, 1, 3, 1, 2]  # destination-major, tokens ascending
    # each pair's local experts, slot order, -1 past them: token 2's slots are 3, then 2
    assert lay["local"].tolist() == [[0, 1], [0, -1], [1, -1], [0, -1], [1, 0]]
    assert lay["row"].tolist() == [[0, 5], [1, 3], [5, 4], [2, 5]]  # 5: no pair (the zero row)
    assert lay["gate_at"][3, 1] == 5 * 2  # the dropped slot's dgate is the zero past the records
    # two data ranks (dp=1, ep=2) with these pairs: rank 0 sends its 2 rank-1 pairs, receives rank
    # 1's 4 rank-0 pairs; C = 16, m = 2: dispatch 20 elements a row, combine 16, back 16 and 18
    pairs = np.array([[3, 2], [4, 1]])
    assert moe_analysis.all_to_all_rows(pairs, 2, 0) == (2, 4)
    assert moe_analysis.record_slots(4, 2, 2) == 2
    b = moe_analysis.all_to_all_bytes(pairs, 2, 0, 16, 8, 2)
    assert b.sent == 8 * (2 * 20 + 4 * 16 + 2 * 16 + 4 * 18)
    assert b.recv == 8 * (4 * 20 + 2 * 16 + 4 * 16 + 2 * 18)
    # one per assignment (the old exchange's rows) bounds the pairs from above
    kept = np.array([[3, 2, 1, 1], [2, 2, 1, 0]])
    assert moe_analysis.pair_counts_upper_bound(kept, 2).tolist() == [[5, 2], [4, 1]]
