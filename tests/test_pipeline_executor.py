"""Pipeline training on real MPI ranks: every schedule reproduces the single-device run, the
activation memory each rank measures is the schedule's in-flight count times a microbatch's bytes,
and the executed timeline is the simulated one up to the time its critical path spends outside
actions."""

import json

import pytest

from refpar.cli import main
from refpar.schedules.builders import gpipe, interleaved_1f1b, one_f_one_b
from refpar.schedules.simulate import peak_inflight_microbatches
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within

CASES = {
    2: [["gpipe", 4, 1], ["1f1b", 3, 1], ["interleaved-1f1b", 4, 2], ["zb-h1", 4, 1],
        ["zb-h2", 8, 1]],
    3: [["gpipe", 2, 1], ["1f1b", 4, 1], ["interleaved-1f1b", 3, 2], ["zb-h1", 3, 1],
        ["zb-h2", 5, 1]],
    4: [["gpipe", 4, 1], ["1f1b", 8, 1], ["interleaved-1f1b", 4, 2], ["zb-h1", 4, 1],
        ["zb-h2", 7, 1]],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request):
    p = request.param
    proc = mpiexec(p, "tests/jobs/pipeline_checks.py", json.dumps(CASES[p]), timeout=240)
    return p, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_schedule_matches_single_device_after_3_adamw_steps_with_dropout(results):
    p, rows = results
    assert [r["kind"] for r in rows] == [c[0] for c in CASES[p]]
    for r in rows:
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["reference_losses"],
                                                                strict=True))
        # float64, same weights, same keyed dropout masks: only the order in which microbatch
        # gradients are summed differs from one device.
        assert within(loss_diff, CONTRACT), (p, r["kind"], loss_diff)
        assert within(r["max_param_rel_diff"], CONTRACT), (p, r["kind"], r["max_param_rel_diff"])


def test_traced_bytes_equal_the_closed_form_per_rank_axis_and_op(results):
    # activations and input gradients over pp, wte's gradient in the embedding group, the loss
    # over pp: refpar.analysis.closed_forms's closed forms, exactly, on every rank.
    p, rows = results
    assert all(r["traced_bytes_equal_closed_form"] for r in rows), [r["kind"] for r in rows]


def test_measured_activation_peak_is_the_schedules_in_flight_bytes(results):
    p, rows = results
    for r in rows:
        # Each rank's ledger peak equals the replay of its list with the bytes one microbatch
        # keeps after F (and after B, until W, for split backwards), from the closed forms.
        assert r["activation_peak"] == r["replayed_peak"], (p, r["kind"])
        if r["kind"] in ("gpipe", "1f1b") and 8 % r["m"] == 0:
            # Equal microbatches: peak = in-flight count x one microbatch's activations
            # (GPipe m, 1F1B min(p - rank, m)).
            build = gpipe if r["kind"] == "gpipe" else one_f_one_b
            counts = peak_inflight_microbatches(build(p, r["m"]))
            assert r["activation_peak"] == [counts[rank] * r["bytes_per_microbatch"][rank]
                                            for rank in range(p)], (p, r["kind"])


def test_executed_bubble_is_the_simulated_one_within_the_critical_path_gap(results):
    p, rows = results
    for r in rows:
        # The simulation runs the same lists with the measured action durations and free
        # transfers, so nothing in the run can start earlier than in the simulation; and the run's
        # critical path is those durations plus the time between them (messages in flight,
        # bookkeeping, waiting for one of the 2 shared cores). Hence
        #   0 <= measured - simulated makespan <= gap,  and the bubbles differ by <= gap / measured.
        # 1e-9 s covers rounding of the sums of durations.
        slack = r["measured_makespan"] - r["simulated_makespan"]
        assert -1e-9 <= slack <= r["gap"] + 1e-9, (p, r["kind"], slack, r["gap"])
        assert 0 <= r["measured_bubble"] - r["simulated_bubble"] + 1e-9
        assert r["measured_bubble"] - r["simulated_bubble"] <= r["gap"] / r["measured_makespan"] + 1e-9


def test_train_command_matches_one_device_and_reports_bytes_bubbles_and_trace(tmp_path):
    # each of the dp=2 pipelines takes 4 of the 8 sequences, one per microbatch
    trace = tmp_path / "trace.json"
    out = refpar_json(4, "train", "--mesh", "pp=2,dp=2", "--schedule", "interleaved-1f1b",
                      "--microbatches", "4", "--steps", "2", "--check", "--trace", str(trace))
    assert (out["schedule"], out["microbatches"], out["mesh"]["pp"]) == ("interleaved-1f1b", 4, 2)
    assert within(out["max_loss_rel_diff"], CONTRACT) and within(out["max_param_rel_diff"], CONTRACT)
    rows = {tuple(sorted(r.items())) for r in out["comm_bytes"]}
    assert rows == {tuple(sorted(r.items())) for r in out["expected_comm_bytes"]}
    # parameters, gradients, AdamW moments of each rank's stages; activations: the schedule's
    # in-flight microbatches times what each keeps
    assert out["memory_peak_bytes"] == out["expected_memory_peak_bytes"]
    bubble = out["bubble_fraction"]
    # the simulation of the measured durations is a lower bound of the executed bubble (see
    # test_executed_bubble_is_the_simulated_one_within_the_critical_path_gap); unit costs give
    # Narayanan et al.'s (p-1)/(v*m + p-1) of total time
    assert bubble["simulated"] <= bubble["measured"] + 1e-9
    assert bubble["simulated_unit_costs"] == pytest.approx(1 / 9)
    # the Chrome trace holds every action of the last step on every rank (world rank = pp * 2 + dp)
    events = json.loads(trace.read_text())["traceEvents"]
    schedule = interleaved_1f1b(2, 4, 2)
    assert sorted((e["pid"], e["name"]) for e in events if e.get("cat") == "compute") == sorted(
        (pp * 2 + dp, str(a)) for pp, row in schedule.items() for a in row if a for dp in range(2))
    assert {e["name"].split()[0] for e in events if e.get("cat") == "pp"} >= {"isend", "irecv"}
    # the app's Communication page draws this trace (the file, or every message of the .jsonl beside it as
    # Run for real loads it): the compute actions carry no bytes and are left to the timeline, each
    # message is one bar whose hover names the bytes it sent
    from refpar.comm.trace import chrome_trace, read_trace
    from refpar.viz.comm import WAITING, trace_figure

    messages = [e for e in events if e.get("ph") == "X" and e["cat"] != "compute"]
    for drawn, sent in ((trace_figure(json.loads(trace.read_text())), messages),
                        (trace_figure(chrome_trace(read_trace(f"{trace}.jsonl"))), None)):
        bars = [text for bar in drawn.data if bar.name != WAITING for text in bar.text]
        assert all("bytes sent" in text for text in bars) and "compute" not in {b.name for b in drawn.data}
        if sent is not None:
            told = [f"{e['name']}: {e['args']['bytes_sent']:,} bytes sent" for e in sent]
            assert sorted(bars) == sorted(told)


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "zb-h3"], "unknown schedule 'zb-h3'"),
    (["--mesh", "pp=2,ep=2"], "ep=2 spreads experts over ranks; add --moe-experts E with E >= 2"),
    (["--microbatches", "16"], "fewer sequences per data-parallel rank than --microbatches 16"),
    (["--mesh", "pp=4", "--schedule", "interleaved-1f1b", "--microbatches", "4"],
     "8 pipeline stages need at least 8 blocks"),
    (["--mesh", "dp=2", "--schedule", "1f1b"], "need a pipeline; add pp=2 or more to --mesh"),
])
def test_train_command_bad_pipeline_input_is_one_sentence_before_mpi(argv, words, capsys):
    argv = ["train", "--mesh", "pp=2", *argv] if "--mesh" not in argv else ["train", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
