"""The engine's sharded combinations (refpar/engine, refpar/parallel/zero.py and fsdp.py): ZeRO-1/2/3
over the dp x cp group, ZeRO-2 with tp and pp, sp with ZeRO-2/3, sp inside cp, FSDP's prefetch and
no-reshard with pp and tp. Each MPI job trains 3 AdamW steps in float64 with dropout and several
microbatches, and is checked at once against the single device (<= 1e-10) and against the closed
forms of refpar/analysis/closed_forms.py (bytes per rank, axis and op, and peak memory per rank and
category, exactly)."""

from __future__ import annotations

import pytest

from refpar.analysis.closed_forms import rank_coords, rank_units
from refpar.comm import cost
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan
from refpar.trainer import train_single_device
from tests.mesh_view import assert_mesh_view_matches_the_run
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within


def _by_key(rows, key):
    return {tuple(r[k] for k in key): r for r in rows}


def run_and_check(n: int, *args: str) -> dict:
    s = refpar_json(n, "train", *args, "--steps", "3", "--check", timeout=300)
    print(args, {k: s[k] for k in ("max_loss_rel_diff", "max_param_rel_diff")})
    assert s["model"]["dropout"] > 0 and s["model"]["dtype"] == "float64"
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    comm_key, mem_key = ("rank", "axis", "op"), ("rank", "category")
    assert _by_key(s["comm_bytes"], comm_key) == _by_key(s["expected_comm_bytes"], comm_key)
    assert _by_key(s["memory_peak_bytes"], mem_key) == _by_key(s["expected_memory_peak_bytes"], mem_key)
    return s


def _sent(s, axis, op):
    return {r["rank"]: r["bytes_sent"] for r in s["comm_bytes"] if (r["axis"], r["op"]) == (axis, op)}


def test_zero3_over_dp_x_cp_with_a_pipeline_matches_one_device_and_the_closed_forms(tmp_path):
    trace = tmp_path / "run.json"
    s = run_and_check(8, "--mesh", "dp=2,cp=2,pp=2", "--zero", "3", "--microbatches", "2",
                      "--trace", str(trace))
    # the Whole mesh page's holdings and step (ZeRO-3's gathers over dp x cp), rank by rank, are
    # what this run measured and traced
    assert_mesh_view_matches_the_run(s, model_preset("tiny"), TrainConfig(steps=3),
                                     Plan(zero=3, microbatches=2), trace)
    # gathered and reduced over the 4 ranks of dp x cp, which the loss is summed over too (3 steps x
    # one float64); cp itself carries only ring attention, no gradient or loss all-reduce
    assert set(_sent(s, "dp_cp", "all_gather")) == set(_sent(s, "dp_cp", "reduce_scatter")) == set(range(8))
    sizes = s["mesh"]
    for rank, sent in _sent(s, "dp_cp", "all_reduce").items():
        co = rank_coords(sizes, rank)
        assert sent == 3 * cost.all_reduce_bytes(1, 4, co["dp"] * 2 + co["cp"], 8).sent
    assert not _sent(s, "cp", "all_reduce")
    assert not _sent(s, "dp", "reduce_scatter") and not _sent(s, "dp", "all_gather")


def test_zero2_with_tp_sp_and_a_pipeline_reduces_every_microbatch_and_gathers_once():
    m = 3
    s = run_and_check(8, "--mesh", "dp=2,tp=2,pp=2", "--zero", "2", "--sp", "--microbatches", str(m),
                      "--batch-size", "6")
    # per step, each unit (wte, the root, a block) reduce-scattered in each of the m microbatches,
    # gathered once after the update: with dp=2 each is (d-1)/d of the unit, a factor m apart
    rs, ag = _sent(s, "dp", "reduce_scatter"), _sent(s, "dp", "all_gather")
    assert set(rs) == set(range(8))
    for rank in rs:
        # a unit of odd length splits 1 element unevenly: 3 steps x m x 4 units (at most) x 8 bytes
        assert abs(rs[rank] - m * ag[rank]) <= 3 * m * 4 * 8
    assert _sent(s, "tp", "reduce_scatter")  # sp's pair


def test_sp_inside_cp_with_zero3_over_cp_alone_matches_one_device_and_the_closed_forms():
    s = run_and_check(4, "--mesh", "cp=2,tp=2", "--sp", "--zero", "3", "--cp-algo", "ulysses",
                      "--microbatches", "2")
    assert _sent(s, "cp", "all_to_all") and _sent(s, "tp", "all_gather") and _sent(s, "dp_cp", "all_gather")


def test_sp_inside_ring_cp_with_a_pipeline_and_zero1_over_cp_matches_one_device():
    s = run_and_check(8, "--mesh", "cp=2,tp=2,pp=2", "--sp", "--zero", "1", "--microbatches", "2",
                      "--seq-len", "12")
    assert _sent(s, "cp", "isend") and _sent(s, "dp_cp", "reduce_scatter")


def test_zero3_checkpoint_resumes_under_zero2_over_dp_x_cp_and_on_one_process(tmp_path):
    """Saved by ZeRO-3 with tp, sp and a pipeline (parameters and AdamW moments as flat ranges of
    each unit's shard, cut across the tp shards' boxes) after 2 of 3 steps; resumed by ZeRO-2 over
    dp x cp (4 ranks) and by one process."""
    common = ("train", "--steps", "3", "--batch-size", "4", "--seq-len", "8", "--microbatches", "2")
    full = refpar_json(8, *common, "--mesh", "dp=2,tp=2,pp=2", "--zero", "3", "--sp", "--save",
                       str(tmp_path), "--save-every", "2")["losses"]
    step2 = str(tmp_path / "step-00000002")
    zero2 = refpar_json(4, *common, "--mesh", "dp=2,cp=2", "--zero", "2", "--resume", step2)["losses"]
    one = train_single_device(model_preset("tiny"), TrainConfig(steps=3, batch_size=4, seq_len=8),
                              resume=step2).losses
    # Not exact: the meshes split the batch and the row-parallel sums differently, so roundings
    # differ by a few ulps: the float64 contract (tests/test_checkpoint.py says more)
    for other in (zero2, one):
        worst = max(abs(a - b) / abs(b) for a, b in zip(other, full[2:], strict=True))
        assert within(worst, CONTRACT)


def test_fsdp_with_tp_and_a_pipeline_gathers_block_by_block_and_its_checkpoint_resumes(tmp_path):
    s = run_and_check(8, "--mesh", "dp=2,tp=2,pp=2", "--fsdp", "--microbatches", "2", "--batch-size", "4",
                      "--seq-len", "8", "--save", str(tmp_path), "--save-every", "2")
    # one block (or the ends) gathered at a time: every rank's parameter peak is below its shards
    # plus its whole stage gathered at once
    sizes = s["mesh"]
    peak = {r["rank"]: r["bytes"] for r in s["memory_peak_bytes"] if r["category"] == "params"}
    for rank, held in peak.items():
        units = rank_units(model_preset("tiny"), sizes, rank_coords(sizes, rank), Plan(microbatches=2)).units
        assert held < 8 * sum(u.shard + u.size for u in units.values()), rank
    one = train_single_device(model_preset("tiny"), TrainConfig(steps=3, batch_size=4, seq_len=8),
                              resume=str(tmp_path / "step-00000002")).losses
    assert within(abs(one[0] - s["losses"][2]) / abs(s["losses"][2]), CONTRACT)


def test_fsdp_prefetch_and_no_reshard_work_in_a_pipeline_and_with_tp():
    # prefetch: each next block's all-gather written out as a ring on every rank that has one
    s = run_and_check(4, "--mesh", "dp=2,pp=2", "--fsdp", "--prefetch", "--microbatches", "2")
    assert set(_sent(s, "dp", "isend")) == set(range(4))
    # no reshard after forward: a block stays gathered from its forward to its backward, so it
    # gathers less than with resharding
    kept = run_and_check(4, "--mesh", "dp=2,tp=2", "--fsdp", "--no-reshard-after-forward",
                         "--microbatches", "2")
    resharded = run_and_check(4, "--mesh", "dp=2,tp=2", "--fsdp", "--microbatches", "2")
    for rank, sent in _sent(kept, "dp", "all_gather").items():
        assert sent < _sent(resharded, "dp", "all_gather")[rank], rank


@pytest.mark.parametrize(
    ("n", "args", "words"),
    [
        (4, ["--mesh", "cp=2,tp=2", "--sp", "--cp-algo", "ulysses", "--seq-len", "3"],
         "fewer than tp=2 to shard them over with --sp; use --seq-len 4 or more"),
        (4, ["--mesh", "dp=2,tp=2", "--fsdp", "--zero", "1"], "are two ways to shard"),
    ],
)
def test_what_the_engine_still_refuses_fails_on_every_rank_with_one_sentence(n, args, words):
    proc = mpiexec(n, "-m", "refpar", "train", *args, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
