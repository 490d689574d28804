"""The engine (refpar/engine) on an N-D mesh against the single device and its closed forms, its bad
input, and a rank that fails mid-step. Every MPI job is a subprocess with a timeout (tests/mpi.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan
from refpar.schedules.builders import build
from refpar.viz import timeline
from tests.mesh_view import assert_mesh_view_matches_the_run
from tests.mpi import ROOT, mpi_env, mpiexec, refpar_json, run_script
from tests.numerics import CONTRACT, within


def _by_key(rows, key):
    return {tuple(r[k] for k in key): r for r in rows}


def test_dp2_tp2_pp2_1f1b_matches_one_device_with_closed_form_bytes_memory_and_a_trace(tmp_path):
    trace = tmp_path / "run.json"
    s = refpar_json(8, "train", "--mesh", "dp=2,tp=2,pp=2", "--microbatches", "4", "--steps", "3",
                    "--check", "--trace", str(trace), timeout=300)
    print({k: s[k] for k in ("losses", "reference_losses", "max_loss_rel_diff", "max_param_rel_diff")})
    assert s["model"]["dropout"] > 0 and s["model"]["dtype"] == "float64" and s["schedule"] == "1f1b"
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    # every rank, axis and op: traced bytes == the closed form, exactly
    comm_key = ("rank", "axis", "op")
    assert _by_key(s["comm_bytes"], comm_key) == _by_key(s["expected_comm_bytes"], comm_key)
    assert {(r["axis"], r["op"]) for r in s["comm_bytes"]} >= {
        ("tp", "all_reduce"), ("pp", "isend"), ("pp", "irecv"), ("dp", "all_reduce")}
    mem_key = ("rank", "category")
    assert _by_key(s["memory_peak_bytes"], mem_key) == _by_key(s["expected_memory_peak_bytes"], mem_key)
    assert 0 < s["bubble_fraction"]["simulated"] < 1 and 0 < s["bubble_fraction"]["measured"] < 1
    chrome = json.loads(trace.read_text())
    assert {e["pid"] for e in chrome["traceEvents"]} == set(range(8))
    lines = [json.loads(line) for line in trace.with_name(trace.name + ".jsonl").read_text().splitlines()]
    assert {e["axis"] for e in lines} >= {"tp", "pp", "dp"} and {e["rank"] for e in lines} == set(range(8))
    # the Whole mesh page's holdings and step, rank by rank, are what this run measured and traced
    assert_mesh_view_matches_the_run(s, model_preset("tiny"), TrainConfig(steps=3),
                                     Plan(schedule="1f1b", microbatches=4), trace)
    # the executed timeline: the trace's actions are the 1F1B schedule; timed with their measured
    # durations it gives the report's simulated bubble (the same durations, through a x1e6 to
    # microseconds and back: a few ulps each, so 1e-12 relative on a ratio of their sums)
    executed, simulated = timeline.simulated_from_trace(chrome)
    assert executed == build("1f1b", 2, 4)
    assert abs(simulated.bubble_fraction - s["bubble_fraction"]["simulated"]) <= 1e-12
    # the executed bubble is the report's measured one (the same slots; a few ulps through x1e6)
    measured = timeline.measured_from_trace(chrome).bubble_fraction
    assert abs(measured - s["bubble_fraction"]["measured"]) <= 1e-12
    figure = timeline.executed_figure(chrome)
    drawn = [t for t in figure.data if t.type == "bar" and t.name != "idle"]  # not the send-receive lines
    assert sum(len(t.x) for t in drawn) == sum(e["ph"] == "X" for e in chrome["traceEvents"])
    actions = [t for t in drawn if not t.name.endswith(" messages")]  # in the compute lane
    for rank in range(8):  # idle is exactly the time no action of the rank covers
        busy = sorted((b, b + w) for t in actions for y, b, w in zip(t.y, t.base, t.x, strict=True)
                      if y == rank)
        covered, reach = 0.0, 0.0
        for a, b in busy:
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        idle = sum(w for t in figure.data if t.name == "idle"
                   for y, w in zip(t.y, t.x, strict=True) if y == rank)
        assert abs(covered + idle - figure.layout.meta["end"]) <= 1e-9 * figure.layout.meta["end"]


@pytest.mark.timeout(900)  # its own subprocess limit (840 s) is the one meant, not the suite's 300 s
def test_verify_quick_on_text_passes_every_strategy_combination_clipping_every_step_on_a_cosine_schedule():
    # verify launches its own mpiexec jobs, so it runs as a plain process, not under one. Every run
    # clips at every step (the tiny model's norms are 0.5 to 2, far above 0.05) and warms up over
    # two steps, then decays (cosine) to min_lr at step 5: each step its own learning rate, one
    # device's losses, parameters and global norms, and bytes and memory equal to the closed forms.
    # Every run trains on real text (issue 38): a page of docs/ through a 320-token BPE that each rank
    # trains for itself (the trainer is deterministic, so every rank has the same vocabulary).
    proc = subprocess.run([sys.executable, "-m", "refpar", "verify", "--quick", "--steps", "5",
                           "--clip-grad-norm", "0.05", "--lr-schedule", "cosine", "--warmup-steps", "2",
                           "--min-lr", "1e-3", "--data", "docs/internals.md", "--tokenizer", "bpe",
                           "--vocab-size", "320"], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=840)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0 and "FAIL" not in proc.stdout
    lines = proc.stdout.splitlines()
    rows = lines[1:-2]
    assert len(rows) == 11 and all(line.split()[-2] == "5/5" for line in rows)  # clipped every step
    assert lines[-2].startswith("all 11 passed")  # one of them, tp+sp, in bf16-mixed
    assert "fp64: loss, parameters and gradient norms <= 1e-10" in lines[-1]
    assert "bf16-mixed: loss <= 0.002" in lines[-1]


@pytest.mark.parametrize(
    ("n", "args", "words"),
    [
        (4, ["--mesh", "dp=2,tp=2,pp=2"], "has 8 ranks but the job has 4; run mpiexec -n 8"),
        (4, ["--mesh", "tp=3,pp=2"], "tp=3 does not divide n_head=4"),
        (4, ["--mesh", "tp=2,pp=2", "--n-layer", "1"], "2 pipeline stages need at least 2 blocks"),
        (4, ["--mesh", "tp=2,pp=2", "--zero", "2"], "give the mesh dp=2 or more"),
        (4, ["--mesh", "tp=2,pp=2", "--zero", "3"], "give the mesh dp=2 or more"),
        (4, ["--mesh", "cp=2,pp=2", "--sp"], "--sp shards along the sequence over tp ranks"),
    ],
)
def test_bad_engine_mesh_fails_on_every_rank_with_one_sentence_before_any_communication(n, args, words):
    proc = mpiexec(n, "-m", "refpar", "train", *args, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


FAILING_RANK = """
import sys
from refpar.comm.communicator import abort_on_error, world
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan, parallelize, train
from refpar.mesh import DeviceMesh
from refpar.parallel.pipeline.stage import Stage

comm = world()
backward = Stage.backward_input

def broken(self, dout, cache, mb, weight=True):
    if comm.rank == 3:
        raise RuntimeError("injected failure in a backward")
    return backward(self, dout, cache, mb, weight)

Stage.backward_input = broken
with abort_on_error():
    mesh = DeviceMesh(comm, {"pp": 2, "dp": 1, "ep": 1, "cp": 1, "tp": 2})
    train(parallelize(model_preset("tiny"), TrainConfig(steps=3), mesh, Plan(microbatches=2)))
"""


def test_a_rank_that_raises_mid_step_ends_the_job_in_seconds_with_its_rank_and_error():
    start = time.perf_counter()
    with pytest.raises(AssertionError) as failed:  # run_script raises when the job exits non-zero
        run_script(4, FAILING_RANK, timeout=60)
    seconds = time.perf_counter() - start
    message = str(failed.value)
    print(f"{seconds:.1f} s", message[-400:])
    assert "exited 1" in message
    assert "error on rank 3 of 4: RuntimeError: injected failure in a backward" in message
    assert seconds < 45
