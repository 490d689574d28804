"""`refpar train` with tp, sp and cp: the JSON summary agrees with one device and with the closed
forms, and layouts that cannot work stop every rank with one sentence."""

from __future__ import annotations

import json

from refpar.analysis.intra_layer import expected_calls
from refpar.config import TrainConfig, model_preset
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within


def test_train_json_dp_tp_sp_matches_one_device_and_the_closed_forms():
    s = refpar_json(4, "train", "--mesh", "dp=2,tp=2", "--sp", "--steps", "3", "--seq-len", "15",
                    "--check")
    assert s["mesh"]["dp"] == s["mesh"]["tp"] == 2 and s["world_size"] == 4
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    assert s["comm_bytes"] == s["expected_comm_bytes"]
    assert {(r["axis"], r["op"]) for r in s["comm_bytes"]} == {
        ("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter"), ("dp", "all_reduce")}
    assert s["memory_peak_bytes"] == s["expected_memory_peak_bytes"]


def test_train_json_ring_cp_reports_its_point_to_point_bytes_and_traces_the_last_step(tmp_path):
    trace = tmp_path / "ring.json"
    s = refpar_json(2, "train", "--mesh", "cp=2", "--cp-algo", "ring", "--steps", "2", "--check",
                    "--trace", str(trace))
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    assert s["comm_bytes"] == s["expected_comm_bytes"]
    assert {r["op"] for r in s["comm_bytes"]} == {"isend", "irecv", "all_reduce"}
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    model, train = model_preset("tiny"), TrainConfig(steps=2)
    for rank in (0, 1):
        want = expected_calls(model, train, {"cp": 2}, {"cp": rank}, cp_algo="ring")
        assert len([e for e in events if e["pid"] == rank]) == len(want)


def test_a_layout_that_cannot_work_exits_2_with_its_sentence_and_no_traceback():
    proc = mpiexec(2, "-m", "refpar", "train", "--mesh", "cp=2", "--seq-len", "3", check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "2*cp=4 zig-zag chunks; use --seq-len 4 or more" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
