"""The Streamlit app, page by page, through streamlit.testing.v1.AppTest: every page renders for
default and edge inputs without an exception, and its figures hold what refpar's own functions say.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from refpar.analysis.memory import unit_sizes
from refpar.config import TrainConfig, model_preset
from refpar.schedules.builders import build
from refpar.schedules.published import published_bubble_fraction
from refpar.schedules.simulate import simulate
from refpar.viz import comm, expected, sharding

ROOT = Path(__file__).resolve().parents[1]
HOME = str(ROOT / "app" / "Home.py")
TINY, ONE_STEP = model_preset("tiny"), TrainConfig(steps=1)
TIMEOUT = 60  # seconds per script run: two cores shared by many test processes

sys.path.insert(0, str(ROOT / "app"))
from launcher import Launcher  # noqa: E402


def decode(value):
    """Plotly 7 JSON with its base64 `bdata` arrays turned back into NumPy arrays."""
    if isinstance(value, dict):
        if "bdata" in value and "dtype" in value:
            array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
            shape = [int(s) for s in str(value.get("shape", len(array))).split(",")]
            return array.reshape(shape)
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def charts(at: AppTest) -> list[dict]:
    return [decode(json.loads(c.proto.spec)) for c in at.get("plotly_chart")]


def page(path: str) -> AppTest:
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(path)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def rerun(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_home_lists_every_page():
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
    assert not at.exception
    # first, what to do after `make demo`, in order: a tour whose steps are links to their pages
    tour = [(link.proto.label, link.proto.page, link.proto.query_string) for link in at.get("page_link")]
    assert tour == [("1. Lesson 0", "lessons", "lesson=0"), ("2. Sharding", "sharding", ""),
                    ("3. Pipeline", "pipeline", ""), ("4. Whole mesh", "mesh", ""),
                    ("5. Run for real", "run", "")]
    text = "\n".join(m.value for m in at.markdown)
    for name in ("Sharding layouts", "Pipeline schedules", "Communication", "Memory", "Plan", "Run for real",
                 "Serving", "Lessons"):
        assert name in text


def test_sharding_page_colours_are_refpars_layouts():
    at = page("views/sharding.py")
    fig = charts(at)[0]  # default: ZeRO-3 over 4 ranks
    names = sharding.block_weights(0)
    frames = {f["name"]: f for f in fig["frames"]}
    for i, name in enumerate(names):
        owner = sharding.flat_owner_grid(sharding.DEMO_MODEL, 4, name)
        np.testing.assert_array_equal(np.asarray(frames["before the step"]["data"][i]["z"]), owner)
        assert (np.asarray(frames["forward h.0"]["data"][i]["z"]) == sharding.EVERY).all()
    at.selectbox[0].set_value("tp")
    at.number_input[0].set_value(8)
    fig = charts(rerun(at))[0]
    for i, name in enumerate(names):
        np.testing.assert_array_equal(np.asarray(fig["data"][i]["z"]),
                                      sharding.tp_owner_grid(sharding.DEMO_MODEL, 8, name))


@pytest.mark.parametrize("strategy,n", [("tp", 3), ("zero3", 9), ("sp", 1), ("ep", 8)])
def test_sharding_page_edge_inputs(strategy, n):
    at = page("views/sharding.py")
    at.selectbox[0].set_value(strategy)
    at.number_input[0].set_value(n)
    rerun(at)
    if (strategy, n) in (("tp", 3), ("zero3", 9), ("sp", 1)):
        assert at.error and not at.get("plotly_chart")
    else:
        assert len(charts(at)[0]["frames"]) == 4


def test_pipeline_page_idle_time_is_the_simulated_bubble():
    at = page("views/pipeline.py")
    gantt = charts(at)[0]  # default: 1f1b, p=4, m=8, F=B=W=1
    timeline = simulate(build("1f1b", 4, 8))
    idle = next(t for t in gantt["data"] if t["name"] == "idle")
    assert np.sum(idle["x"]) == pytest.approx(sum(map(timeline.idle_time, timeline.slots)))
    assert float(at.metric[0].value) == pytest.approx(timeline.bubble_fraction, abs=5e-5)
    assert float(at.metric[1].value) == pytest.approx(published_bubble_fraction("1f1b", 4, 8), abs=5e-5)
    assert len(gantt["frames"]) > 1 and gantt["layout"]["sliders"]


def test_pipeline_page_refuses_ten_thousand_microbatches():
    at = page("views/pipeline.py")
    at.number_input(key="m").set_value(10_000)
    rerun(at)
    assert "choose 1 to 64" in at.error[0].value and not at.get("plotly_chart")


def test_pipeline_page_compares_two_schedules_and_explains_bad_ones():
    at = page("views/pipeline.py")
    at.toggle[0].set_value(True)
    rerun(at)
    assert len(at.get("plotly_chart")) == 6
    # 1F1B has no W of its own (its B bars are B + W, the page says so); zb-h1 splits them
    assert [c.value for c in at.caption if "B + W" in c.value] == [
        "This schedule runs each backward whole: its B bars are B + W long."]
    # interleaved 1F1B against 1F1B at the default costs, on one time axis: each of a rank's v = 2 chunks
    # holds half its layers and runs in half the time, so interleaving is faster, by the bubble it cuts
    # (p=4, m=8: 1F1B's (m + p - 1)(F + B + W) = 33; interleaved's m(F + B + W) + (p - 1)(F + B + W)/v = 28.5)
    at.selectbox(key="b_kind").set_value("interleaved-1f1b")
    gantts = [c for c in charts(rerun(at)) if c["layout"]["xaxis"]["title"]["text"].startswith("time")]
    one_f_one_b, interleaved = simulate(build("1f1b", 4, 8)), simulate(build("interleaved-1f1b", 4, 8, 2))
    assert one_f_one_b.makespan == 33 and interleaved.makespan / 2 == 28.5
    assert [tuple(g["layout"]["xaxis"]["range"]) for g in gantts] == [(0, 33)] * 4  # Gantt, held; each side
    assert gantts[0]["layout"]["uniformtext"] == {"minsize": 9, "mode": "hide"}  # no unreadable label
    ends = [max(np.asarray(t["base"]) + np.asarray(t["x"])) for t in gantts[2]["data"] if len(t["x"])]
    assert max(ends) == 28.5
    at.selectbox(key="b_kind").set_value("interleaved-1f1b")
    at.number_input(key="b_m").set_value(6)
    rerun(at)
    assert "divisible" in at.error[0].value and len(at.get("plotly_chart")) == 3
    at.number_input(key="a_F").set_value(0.0)  # refused under its own box, by its own label
    rerun(at)
    assert [e.value for e in at.error if e.value.startswith("F cost = 0: choose 0.1 to 100")]


def test_pipeline_page_draws_the_v_schedules_in_two_shades_with_their_published_bubble():
    at = page("views/pipeline.py")
    at.selectbox(key="kind").set_value("v-half")
    gantt = charts(rerun(at))[0]  # p=4, m=8, F=B=W=1
    names = {t["name"] for t in gantt["data"] if len(t["x"])}
    assert {"F", "F (2nd chunk)", "B", "B (2nd chunk)", "W", "W (2nd chunk)", "idle"} <= names
    timeline = simulate(build("v-half", 4, 8))
    assert float(at.metric[0].value) == pytest.approx(timeline.bubble_fraction, abs=5e-5)
    # Qi et al.'s expected bubble for the published peak: 6p - 1 - 3M = 23 - 18 chunk-forwards, each
    # half of a rank's F = 1 (a rank holds 2 chunks)
    assert at.metric[2].value == at.metric[3].value == "2.5"
    at.selectbox(key="kind").set_value("dualpipe")
    rerun(at)
    at.radio(key="overlap").set_value("max")
    gantt = charts(rerun(at))[0]
    assert any(t["name"] == "F&B" and len(t["x"]) for t in gantt["data"])
    # DualPipe README: (PP/2-1)(F&B + B - 3W) = (4/2-1)(max(1, 2) + 2 - 3) = 1 over the step
    assert at.metric[2].value == at.metric[3].value == "1"


def test_communication_page_bars_are_the_closed_forms():
    at = page("views/communication.py")
    figs = charts(at)  # default: tp=2 replicated over dp=2
    rows, _ = expected.closed_form_rows(expected.workload("tp", 2, TINY, ONE_STEP, dp=2))
    bars = figs[0]["data"][0]
    assert dict(zip(bars["x"], np.asarray(bars["y"]).tolist(), strict=True)) == comm.by_axis_op(rows)
    assert figs[1]["frames"][-1]["name"] == "whole step"
    at.selectbox[0].set_value("tp")
    at.number_input[0].set_value(3)
    rerun(at)
    assert at.error and not at.get("plotly_chart")
    at.selectbox[0].set_value("pp")
    at.number_input[0].set_value(2)
    rerun(at)
    assert len([c for c in at.get("plotly_chart") if not c.key]) == 2  # the ring's and at-scale's: keyed


def test_memory_page_shows_every_strategys_closed_form():
    at = page("views/memory.py")
    fig = charts(at)[0]  # default: 4 ranks
    zero3 = expected.closed_form_rows(expected.workload("zero3", 4, TINY, ONE_STEP))[1]
    col = list(fig["data"][0]["x"]).index("zero3 (4)")
    for trace in fig["data"]:
        assert trace["y"][col] == comm.memory_by_rank(zero3)[0].get(trace["name"], 0)
    at.number_input[0].set_value(3)
    rerun(at)
    # one sentence naming what is left out (the fuzz test holds every warning to one line), and
    # refpar's reason under it
    assert [w.value for w in at.warning] == [
        "Left out on 3 ranks: tp, sp; choose another number of ranks to see them."]
    assert "- **tp**: tp=3 does not divide n_head=4" in at.expander[0].markdown[0].value
    # 16 ranks: a batch of one sequence per data rank, so the dp family is drawn; tp, sp and pp are
    # told why not in words the page's own controls can act on (no command-line flag)
    at.number_input[0].set_value(16)
    fig = charts(rerun(at))[0]
    sixteen = TrainConfig(steps=1, batch_size=16)
    zero3 = expected.closed_form_rows(expected.workload("zero3", 16, TINY, sixteen))[1]
    assert list(fig["data"][0]["x"]) == [f"{s} (16)" for s in expected.DP_STRATEGIES]
    col = list(fig["data"][0]["x"]).index("zero3 (16)")
    for trace in fig["data"]:
        assert trace["y"][col] == comm.memory_by_rank(zero3)[0].get(trace["name"], 0)
    assert at.warning[0].value.startswith("Left out on 16 ranks: tp, sp, pp;")
    reasons = at.expander[0].markdown[0].value
    assert all(f"- **{s}**:" in reasons for s in ("tp", "sp", "pp")) and "--" not in reasons


def test_memory_page_in_bf16_mixed_shows_the_fp32_master_weights_of_the_zero_papers_16_psi():
    at = page("views/memory.py")
    at.radio[0].set_value("bf16-mixed")
    rerun(at)
    fig = charts(at)[0]
    bf16 = model_preset("tiny", dtype="bfloat16")
    rows = expected.closed_form_rows(expected.workload("zero3", 4, bf16, ONE_STEP))[1]
    zero3 = comm.memory_by_rank(rows)[0]
    col = list(fig["data"][0]["x"]).index("zero3 (4)")
    shown = {trace["name"]: trace["y"][col] for trace in fig["data"]}
    assert shown["master"] == zero3["master"] == 4 * sum(unit_sizes(bf16).values()) // 4 > 0
    # tp, sp and pp in bf16-mixed too: their closed forms are the ones `refpar train --precision
    # bf16-mixed --check` lays next to the ledger
    for strategy in ("tp", "sp", "pp"):
        rows = expected.closed_form_rows(expected.workload(strategy, 4, bf16, ONE_STEP,
                                                           microbatches=4 if strategy == "pp" else 1))[1]
        col = list(fig["data"][0]["x"]).index(f"{strategy} (4)")
        shown = {trace["name"]: trace["y"][col] for trace in fig["data"]}
        assert shown == comm.memory_by_rank(rows)[0] and shown["master"] > 0, strategy
    assert not at.warning


def test_plan_page_renders_the_planners_plans():
    at = page("views/plan.py")
    fig = charts(at)[0]
    assert "plans fit" in fig["layout"]["title"]["text"]
    at.number_input[0].set_value(1)
    rerun(at)
    assert at.error and "fits on no mesh" in at.error[0].value


def test_plan_page_prices_the_users_plan_as_the_planner_does_and_ranks_it():
    from refpar.analysis.hardware import HARDWARE
    from refpar.analysis.planner import plan, price
    from refpar.analysis.presets import PRESETS

    at = page("views/plan.py")
    # The default: gpt3-175b on 1,024 H100s, tp=8, pp=8 (dp the other 16), 1F1B, selective + sp.
    spec, h100 = PRESETS["gpt3-175b"], HARDWARE["h100"]
    mesh = {"dp": 16, "tp": 8, "pp": 8, "cp": 1, "ep": 1}
    want = price(spec, h100, 1024, mesh, schedule="1f1b", recompute="selective", sp=True)
    rank = plan(spec, h100, 1024, top=1, priced=want)["rank"]
    shown = [m.value for m in at.markdown if "rank" in m.value and "MFU" in m.value]
    assert shown and f"step {want['step_time_s']:.3f} s" in shown[0] and f"rank {rank} of" in shown[0]
    priced_figure = charts(at)[1]
    times = [t for t in priced_figure["data"] if t["legendgroup"] == "time"]
    assert sum(t["x"][0] for t in times) == pytest.approx(want["step_time_s"])
    # A mesh that does not divide the GPUs, then one that does not fit, each in one sentence.
    at.number_input[3].set_value(3)  # pp
    rerun(at)
    assert any("does not divide 1024 GPUs" in e.value for e in at.error)
    at.number_input[3].set_value(1)
    at.selectbox[4].set_value("none")  # no pipeline: all of GPT-3 on each tp group
    rerun(at)
    assert any("does not fit" in e.value and "GB over" in e.value for e in at.error)


def test_plan_page_shows_every_published_run_against_its_prediction():
    from refpar.analysis.calibration import validate

    at = page("views/plan.py")
    checked = validate()
    table = at.dataframe[-1].value
    assert list(table["run"]) == [r["name"] for r in checked["rows"]]
    assert list(table["error %"]) == [round(100 * r["relative_error"], 1) for r in checked["rows"]]
    figure = charts(at)[-1]
    assert sum(len(t["y"]) for t in figure["data"]) == len(checked["rows"])
    notes = [f"{r['name']}: {r['outside']}" for r in checked["rows"] if r["outside"]]
    assert notes and [i.value for i in at.info] == notes


def test_run_page_refuses_bad_runs_before_launching():
    at = page("views/run.py")
    assert "mpiexec -n 2" in at.code[0].value and "--mesh dp=2" in at.code[0].value
    at.number_input[3].set_value(50)
    rerun(at)
    assert "choose 1 to 20" in at.error[0].value
    at.number_input[3].set_value(2)
    at.selectbox[0].set_value("tp")
    at.number_input[0].set_value(3)
    rerun(at)
    assert at.error and at.button[0].disabled


@pytest.mark.timeout(240)
def test_a_real_run_feeds_the_communication_page_with_bytes_equal_to_the_closed_form(tmp_path, monkeypatch):
    from launcher import cache_file, load_result

    monkeypatch.setenv("REFPAR_APP_CACHE", str(tmp_path / "last-run.json"))
    at = page("views/run.py")  # default: dp=2, 3 steps
    at.number_input[3].set_value(2)
    at.button[0].click()
    rerun(at)
    deadline = time.monotonic() + 180
    while "run" not in at.session_state and time.monotonic() < deadline:
        time.sleep(1)
        rerun(at)
    assert "run" in at.session_state, [c.value for c in at.code] + [e.value for e in at.error]
    summary = at.session_state["run"]["summary"]
    assert summary["world_size"] == 2 and "--check" in at.code[0].value
    # --check: refpar's claim, on the page, with the run's own numbers (float64: within 1e-10)
    claim = next(x.value for x in at.success if x.value.startswith("matches one device"))
    assert f"{summary['max_loss_rel_diff']:.1e} in the loss" in claim
    assert summary["max_param_rel_diff"] <= 1e-10
    # the executed timeline of its last step: every message drawn once, the time between split by phase
    executed = next(c for c in charts(at) if c["layout"]["title"]["text"] == "executed, last step")
    shown = sum(len(t["x"]) for t in executed["data"] if t["name"].endswith(" messages"))
    assert shown == sum(e["ph"] == "X" for e in at.session_state["run"]["timeline"]["traceEvents"]) > 0
    # a reload (a new session) and a restart of the app (the file alone) find the same run
    again = page("views/run.py")
    assert again.session_state["run"]["summary"] == summary
    assert load_result(cache_file())["summary"] == summary
    assert load_result(cache_file())["key"] == at.session_state["run"]["key"]
    at.switch_page("views/communication.py")
    rerun(at)
    at.selectbox[0].set_value("dp")
    rerun(at)
    closed, measured = charts(at)[0]["data"]
    assert measured["name"] == "measured"
    np.testing.assert_array_equal(measured["y"], closed["y"])
    # The traced run's calls, one bar each, and as many bytes as the summary counted.
    trace = next(decode(json.loads(c.proto.spec)) for c in at.get("plotly_chart") if c.key == "run-trace")
    events = [e for e in at.session_state["run"]["trace"]["traceEvents"] if e.get("ph") == "X"]
    assert sum(len(t["y"]) for t in trace["data"] if t["name"] != comm.WAITING) == len(events) > 0
    # The summary leaves out the report's own gather of these numbers, which the trace records.
    traced = sum(e["args"]["bytes_sent"] for e in events if e["args"]["tag"] != "report")
    assert traced == sum(r["bytes_sent"] for r in at.session_state["run"]["summary"]["comm_bytes"])
    at.switch_page("views/memory.py")
    rerun(at)
    pairs = charts(at)[1]  # every rank, closed form next to measured
    assert list(pairs["data"][0]["x"]) == ["rank 0 closed form", "rank 0 measured", "rank 1 closed form",
                                           "rank 1 measured"]
    for trace in pairs["data"]:
        drawn = np.asarray(trace["y"]).tolist()
        for offset, field in ((0, "expected_memory_peak_bytes"), (1, "memory_peak_bytes")):
            assert drawn[offset::2] == [r["bytes"] for r in summary[field] if r["category"] == trace["name"]]


def test_a_failing_run_reports_its_output_and_status():
    run = Launcher()
    fails = "print('rank 0: boom', flush=True); raise SystemExit(3)"
    run.start([sys.executable, "-c", fails], "fails", None, 1)
    run.reader.join(timeout=30)
    assert not run.running()
    assert "exit status 3" in run.error and "boom" in run.error and run.result is None


def test_one_run_at_a_time_and_stop_ends_it():
    run = Launcher()
    run.start([sys.executable, "-c", "import time; time.sleep(60)"], "sleeps", None, 1)
    with pytest.raises(ValueError, match="already going"):
        run.start([sys.executable, "-c", "pass"], "second", None, 1)
    run.stop()
    run.reader.join(timeout=30)
    assert run.proc.returncode != 0 and not run.running()
    assert run.error.splitlines()[0] == "mpiexec was stopped by signal 15 (SIGTERM)", run.error


def test_refpar_app_command_runs_streamlit_headless_without_importing_it():
    from refpar.commands.app import command

    argv = command(8600)
    assert argv[1:4] == ["-m", "streamlit", "run"] and argv[4].endswith("app/Home.py")
    assert "--server.headless" in argv and argv[argv.index("--server.port") + 1] == "8600"
    probe = "import sys, refpar.cli, refpar.commands.app, refpar.viz.comm, refpar.viz.sharding, " \
            "refpar.viz.pipeline, refpar.viz.expected; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_pipeline_page_draws_its_largest_input():
    at = page("views/pipeline.py")
    at.selectbox[0].set_value("interleaved-1f1b")
    rerun(at)
    at.number_input(key="p").set_value(16)
    at.number_input(key="m").set_value(64)
    at.number_input(key="v").set_value(4)
    gantt = charts(rerun(at))[0]
    bars = sum(len(t["x"]) for f in gantt["frames"] for t in f["data"])
    assert not at.error and bars <= 60_000 + sum(len(t["x"]) for t in gantt["data"])
    timeline = simulate(build("interleaved-1f1b", 16, 64, 4))
    assert float(at.metric[0].value) == pytest.approx(timeline.bubble_fraction, abs=5e-5)


def test_communication_page_takes_sixteen_ranks_and_refuses_more():
    at = page("views/communication.py")  # tp=2
    at.number_input[1].set_value(8)  # dp replicas: 16 ranks
    figs = charts(rerun(at))
    assert np.asarray(figs[1]["data"][0]["z"]).shape == (16, 16)
    at.number_input[1].set_value(9)
    rerun(at)
    assert "at most 16" in at.error[0].value


def test_serving_page_at_scale_numbers_are_refpars_closed_forms():
    from refpar.analysis.hardware import hardware
    from refpar.analysis.presets import preset
    from refpar.analysis.serving import serving_table

    at = page("views/serving.py")  # default: llama2-70b on h100, batch 1, 4096 cached tokens
    rows = serving_table(preset("llama2-70b"), hardware("h100"), batch=1, context=4096)
    assert float(at.metric[0].value) == pytest.approx(1e3 * rows[0]["decode_s_per_token"], abs=5e-4)
    assert float(at.metric[1].value) == pytest.approx(1e3 * rows[1]["decode_s_per_token"], abs=5e-4)
    table = at.dataframe[0].value
    assert list(table["layout"]) == [r["layout"] for r in rows]
    np.testing.assert_allclose(table["decode ms/token"], [1e3 * r["decode_s_per_token"] for r in rows])
    np.testing.assert_allclose(table["tokens/s"], [r["decode_tokens_per_s"] for r in rows])
    at.selectbox[2].set_value("h200")
    at.number_input[2].set_value(16)
    rerun(at)
    rows = serving_table(preset("llama2-70b"), hardware("h200"), batch=16, context=4096)
    np.testing.assert_allclose(at.dataframe[0].value["tokens/s"], [r["decode_tokens_per_s"] for r in rows])
    at.number_input[0].set_value(7)
    at.number_input[3].set_value(1 << 21)
    rerun(at)
    assert "choose 1 to 6" in at.error[0].value and at.button[0].disabled
    assert at.error[1].value == "cached tokens per request = 2,097,152: choose 1 to 1,048,576"
    assert not at.dataframe


@pytest.mark.timeout(120)
def test_a_real_generate_draws_each_ranks_kv_cache_from_its_summary():
    """A paged run (blocks of 4 slots): the ledger's figures as for the contiguous cache, and the
    pool drawn moment by moment from each request's block table."""
    at = page("views/serving.py")  # default mesh tp=2
    at.number_input[0].set_value(2)
    at.number_input[1].set_value(2)
    at.checkbox[0].set_value(True)  # paged
    rerun(at)
    assert "--paged --block-size 4" in at.code[0].value
    at.button[0].click()
    rerun(at)
    deadline = time.monotonic() + 90
    while "serving" not in at.session_state and time.monotonic() < deadline:
        time.sleep(1)
        rerun(at)
    assert "serving" in at.session_state, [c.value for c in at.code] + [e.value for e in at.error]
    summary = at.session_state["serving"]["summary"]
    assert summary["world_size"] == 2 and summary["kv_matches_closed_form"]
    kv, per_token = charts(at)[:2]
    for rank in summary["kv_cache"]:  # rank 0's bars first, then rank 1's, each a request then the line
        traces = kv["data"][rank["rank"] * 3: rank["rank"] * 3 + 3]
        for rid, trace in zip("01", traces[:2], strict=True):
            assert np.asarray(trace["y"]).tolist() == [d.get(rid, 0) for d in rank["bytes_by_request"]]
        assert np.asarray(traces[2]["y"]).tolist() == rank["expected_bytes_timeline"]
    drawn = sum(np.sum(t["y"]) for t in per_token["data"] if t["type"] == "bar")
    tokens = {"prefill": summary["latency"]["prefill"]["prompt_tokens"],
              "decode": summary["latency"]["decode"]["tokens"]}
    assert drawn == pytest.approx(sum(r["bytes_sent"] / tokens[r["phase"]] for r in summary["comm_bytes"]))
    pool = charts(at)[2]["data"][0]  # rank 0's blocks: the request holding each, at every moment
    tables = summary["paged"]["pool"][0]["tables"]
    z = np.asarray(pool["z"], dtype=float)
    for i, held in enumerate(tables):
        owners = {b: int(rid) for rid, table in held.items() for b in table}
        assert [owners.get(b) for b in range(len(z[i]))] == \
            [None if np.isnan(v) else int(v) for v in z[i]]
    last = len(tables) - 1
    assert tables[0] and not tables[last], "the pool fills, then every block is given back"
    at.select_slider[0].set_value(summary["kv_moments"][0])
    rerun(at)
    assert at.dataframe[0].value["blocks"].tolist() == [" ".join(map(str, t)) for t in tables[0].values()]
    # One launcher for the whole app: the Run page sees this run ended and does not take it for training.
    at.switch_page("views/run.py")
    rerun(at)
    assert "run" not in at.session_state and not at.button[0].disabled


def test_lessons_page_shows_every_lessons_title_in_order():
    from lessons import course as lessons

    at = page("views/lessons.py")
    files = lessons.lesson_files()
    if not files:
        assert "No lessons found" in at.info[0].value and not at.selectbox
        return
    titles = [lessons.title(p) for p in files]
    assert at.selectbox[0].options == titles
    for path, title in zip(files, titles, strict=True):
        at.selectbox[0].set_value(int(path.name[:2]))
        rerun(at)
        shown = [m.value.strip() for m in at.markdown]
        # the lesson as a reader sees it: its text less the comparison markers (lessons/course.py)
        assert lessons.reader_text(int(path.name[:2])).strip() in shown
        assert shown[-1].startswith(f"# {title}\n")
        assert "<!--" not in shown[-1]


LESSON_OF = {"views/sharding.py": 4, "views/pipeline.py": 8, "views/communication.py": 1,
             "views/memory.py": 2, "views/plan.py": 11, "views/run.py": 11, "views/serving.py": 15}


def test_each_view_links_to_its_lesson_and_the_lessons_page_opens_on_it():
    from lessons import course as lessons

    if not lessons.lesson_files():
        pytest.skip("no lessons/ in this checkout")
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
    for path, n in LESSON_OF.items():
        at.switch_page(path)
        links = [(link.proto.page, link.proto.query_string) for link in rerun(at).get("page_link")]
        assert links == [("lessons", f"lesson={n}")], path
    at.switch_page("views/sharding.py")
    rerun(at)
    for strategy, n in (("dp", 3), ("tp", 6), ("sp", 7), ("ep", 10)):
        at.selectbox[0].set_value(strategy)
        assert rerun(at).get("page_link")[0].proto.query_string == f"lesson={n}"
    at.switch_page("views/memory.py")
    rerun(at).radio[0].set_value("bf16-mixed")
    assert [link.proto.query_string for link in rerun(at).get("page_link")] == ["lesson=2", "lesson=13"]
    # What following the link does: the address carries lesson=N and the Lessons page opens on lesson N.
    at.query_params["lesson"] = "8"
    at.switch_page("views/lessons.py")
    rerun(at)
    assert at.selectbox[0].value == 8
    assert at.markdown[1].value.strip() == lessons.reader_text(8).strip()
    at.selectbox[0].set_value(2)
    assert rerun(at).selectbox[0].value == 2  # the link chose the first lesson shown, not every later one


def test_sharding_page_mixes_dp_and_tp_with_zero_and_refuses_too_many_ranks():
    from refpar.viz import mesh_sharding

    at = page("views/sharding.py")
    at.toggle[0].set_value(True)
    rerun(at)
    for zero in (3, 0):
        at.selectbox(key="mix_zero").set_value(zero)
        fig = charts(rerun(at))[0]  # dp=2 x tp=2
        sets = fig["layout"]["meta"]["holders"]
        for i, (name, grid) in enumerate(mesh_sharding.mix_grids(2, 2, zero)["params"].items()):
            drawn = [tuple(sets[k]) for k in np.asarray(fig["data"][i]["z"]).ravel()]
            assert drawn == list(grid.ravel()), name
        assert [f["name"] for f in fig["frames"]] == [s.label for s in mesh_sharding.mix_steps(2, 2, zero)]
    at.checkbox(key="mix_sp").set_value(True)
    assert rerun(at).get("page_link")[0].proto.query_string == "lesson=7"  # 07-sequence-and-context
    at.number_input(key="mix_dp").set_value(3)
    at.number_input(key="mix_tp").set_value(4)
    rerun(at)
    assert "choose at most 8" in at.error[0].value and not at.get("plotly_chart")


def test_communication_page_draws_ep_bytes_equal_to_the_moe_closed_form():
    from refpar.config import ParallelConfig
    from refpar.viz import moe as mv

    at = page("views/communication.py")
    at.selectbox[0].set_value("ep")
    at.number_input[0].set_value(4)
    rerun(at)  # dp=2 x ep=4
    bars, matrix = charts(at)
    config = model_preset("tiny", moe_experts=8)
    sizes = ParallelConfig({"dp": 2, "ep": 4}).sizes
    kept = mv.drawn_kept(config, 8, ONE_STEP.seq_len, 4)
    rows = mv.step_rows(config, sizes, kept)
    drawn = dict(zip(bars["data"][0]["x"], np.asarray(bars["data"][0]["y"]).tolist(), strict=True))
    assert drawn == comm.by_axis_op(rows) and drawn["ep all_to_all"] > 0
    np.testing.assert_array_equal(np.asarray(matrix["data"][0]["z"]), mv.traffic_matrix(config, sizes, kept))
    at.number_input[1].set_value(3)
    rerun(at)
    assert at.error and "at most 8" in at.error[0].value


def test_sharding_page_mixes_pp_and_tp_by_stage_and_refuses_more_stages_than_blocks():
    from refpar.viz import mesh_sharding

    at = page("views/sharding.py")
    at.toggle[0].set_value(True)
    rerun(at)
    at.radio(key="mix_axes").set_value("pp x tp")
    fig = charts(rerun(at))[0]  # pp=2 x tp=2
    sets = fig["layout"]["meta"]["holders"]
    grids = [g for row in mesh_sharding.pp_tp_steps(2, 2)[0].grids.values() for g in row.values()]
    for i, grid in enumerate(grids):
        assert [tuple(sets[k]) for k in np.asarray(fig["data"][i]["z"]).ravel()] == list(grid.ravel())
    at.number_input(key="mix_pp").set_value(3)
    rerun(at)
    assert "stages need at least 3 blocks" in at.error[0].value and not at.get("plotly_chart")


LLAMA = model_preset("llama-tiny")  # 4 query heads over 2 kv heads


def test_each_page_showing_refpars_model_draws_llama_when_the_user_picks_it():
    at = page("views/memory.py")
    at.radio(key="family").set_value("Llama")
    fig = charts(rerun(at))[0]  # 4 ranks: tp=4 replicates each kv head on 2 ranks

    def rank0(strategy, model):
        rows = expected.closed_form_rows(expected.workload(strategy, 4, model, ONE_STEP))[1]
        return comm.memory_by_rank(rows)[0]

    for strategy in ("zero3", "tp"):
        col = list(fig["data"][0]["x"]).index(f"{strategy} (4)")
        for trace in fig["data"]:
            assert trace["y"][col] == rank0(strategy, LLAMA).get(trace["name"], 0), (strategy, trace["name"])
    assert rank0("zero3", TINY) != rank0("zero3", LLAMA)

    at.switch_page("views/communication.py")
    rerun(at).radio(key="family").set_value("Llama")
    bars = charts(rerun(at))[0]["data"][0]  # default: tp=2 replicated over dp=2
    rows, _ = expected.closed_form_rows(expected.workload("tp", 2, LLAMA, ONE_STEP, dp=2))
    assert dict(zip(bars["x"], np.asarray(bars["y"]).tolist(), strict=True)) == comm.by_axis_op(rows)

    at.switch_page("views/run.py")
    rerun(at).radio(key="family").set_value("Llama")
    assert "--model llama-tiny" in rerun(at).code[0].value and not at.button[0].disabled
    at.switch_page("views/serving.py")
    rerun(at).radio(key="family").set_value("Llama")
    assert "generate --model llama-tiny --mesh tp=2" in rerun(at).code[0].value


@pytest.mark.timeout(120)
def test_a_real_llama_generate_at_tp_4_caches_one_whole_kv_head_per_rank():
    at = page("views/serving.py")
    at.radio(key="family").set_value("Llama")
    at.selectbox[0].set_value("tp=4")
    at.number_input[0].set_value(2)
    at.number_input[1].set_value(2)
    rerun(at)
    at.button[0].click()
    rerun(at)
    deadline = time.monotonic() + 90
    key = ("tp=4", 2, 2, "llama-tiny")  # this run's, not an earlier test's run the app's launcher still holds

    def done():
        return "serving" in at.session_state and tuple(at.session_state["serving"]["key"]) == key

    while not done() and time.monotonic() < deadline:
        time.sleep(1)
        rerun(at)
    assert done(), [c.value for c in at.code] + [e.value for e in at.error]
    summary = at.session_state["serving"]["summary"]
    assert summary["model"]["arch"] == "llama" and summary["kv_matches_closed_form"]
    # each rank: 1 kv head of 2 (its query heads' one, held by 2 ranks), 4 layers, 16 channels, float64
    L, hs = LLAMA.n_layer, LLAMA.head_size
    for k in summary["kv_cache"]:
        assert k["peak_bytes"] == 2 * L * 1 * hs * summary["kv_peak_tokens"] * 8


def test_sharding_page_draws_llamas_replicated_kv_heads_when_the_user_picks_llama():
    from refpar.viz import mesh_sharding
    from refpar.viz import sharding as sh

    at = page("views/sharding.py")
    at.toggle[0].set_value(True)
    rerun(at).radio(key="family").set_value("Llama")
    at.number_input(key="mix_dp").set_value(1)
    at.number_input(key="mix_tp").set_value(4)
    fig = charts(rerun(at))[0]
    sets = fig["layout"]["meta"]["holders"]
    params = mesh_sharding.mix_grids(1, 4, 3, config=sh.DEMO_LLAMA)["params"]  # the page's default ZeRO-3
    for i, (name, grid) in enumerate(params.items()):
        drawn = [tuple(sets[k]) for k in np.asarray(fig["data"][i]["z"]).ravel()]
        assert drawn == list(grid.ravel()), name
    assert [0, 1] in sets and [2, 3] in sets  # kv head 0 on ranks 0 and 1, kv head 1 on 2 and 3


def test_whole_mesh_page_lays_ranks_out_as_the_mesh_does_and_steps_through_their_bytes():
    from refpar.analysis.closed_forms import MOMENTS, rank_comm_bytes, rank_coords
    from refpar.engine import Plan

    at = page("views/mesh.py")  # default: pp=2 x dp=2 x tp=2, ZeRO-3, 2 microbatches of GPT-2 tiny
    grid = charts(at)[0]["data"][0]
    # DeviceMesh's grid arange(8).reshape(pp, dp, tp): rank = 4 pp + 2 dp + tp; rows (pp, dp), columns tp
    for rank, x, y in zip(grid["customdata"], grid["x"], grid["y"], strict=True):
        assert (x, y) == (rank % 2, rank // 2), rank
    at.selectbox(key="mesh_rank").set_value(5)  # pp=1, dp=0, tp=1
    rerun(at)
    held = dict(zip(at.table[0].value["what"], at.table[0].value["held"], strict=True))
    assert held["stages and layers"] == "stage 1: blocks 2-3 + head"  # 4 blocks over 2 stages
    assert held["attention heads"].startswith("heads 2-3")  # 4 heads over tp=2
    assert held["vocabulary rows"] == "rows 48-95"  # 96 rows over tp=2
    assert held["samples"] == "microbatch 0: 0, 1; microbatch 1: 2, 3"  # dp rank 0's half of 8, in 2
    assert held["ZeRO shard of h.2"].endswith("(1/2 over dp)")
    # the step's moments add up to the closed form of the step's bytes, which runs match exactly
    sent = 0
    for moment in MOMENTS:
        at.select_slider(key="mesh_moment").set_value(moment)
        rerun(at)
        sent += int(charts(at)[1]["data"][0]["text"][5].split("<br>")[1][:-2].replace(",", ""))
    sizes = {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2}
    closed = rank_comm_bytes(TINY, ONE_STEP, sizes, rank_coords(sizes, 5), Plan(zero=3, microbatches=2))
    assert sent == sum(s for s, _ in closed.values()) > 0
    at.number_input(key="mesh_ep").set_value(4)
    rerun(at)
    assert "at most 16" in at.error[0].value


def test_whole_mesh_prices_moe_routing_with_a_runs_counts_exactly_and_balanced_routing_by_its_closed_form(
        moe_pipeline_run, monkeypatch):
    from refpar.analysis.closed_forms import rank_coords, rank_memory_rows
    from refpar.engine import Plan
    from refpar.viz.mesh_grid import mesh_model

    monkeypatch.setenv("REFPAR_APP_CACHE", str(moe_pipeline_run["cache"]))  # Run for real's last run
    summary, path = moe_pipeline_run["summary"], moe_pipeline_run["trace_path"]
    events = [json.loads(x) for x in path.with_name(path.name + ".jsonl").read_text().splitlines()]
    at = page("views/mesh.py")
    for axis, n in {"pp": 2, "dp": 1, "ep": 2, "cp": 1, "tp": 1}.items():  # the run's mesh and plan
        at.number_input(key=f"mesh_{axis}").set_value(n)
    at.selectbox(key="mesh_strategy").set_value("dp")
    rerun(at)

    def shown(rank: int) -> tuple[dict, tuple]:
        """(peak bytes by category, (sent, received) by the all-to-alls) the page shows for `rank`."""
        at.selectbox(key="mesh_rank").set_value(rank)
        at.select_slider(key="mesh_moment").set_value("forward")  # the routing's total for both passes
        rerun(at)
        held = dict(zip(at.table[0].value["what"], at.table[0].value["held"], strict=True))
        peaks = {w.removeprefix("peak ").removesuffix(" bytes"): int(h.replace(",", ""))
                 for w, h in held.items() if w.startswith("peak ")}
        calls = at.dataframe[0].value
        a2a = calls[calls["op"] == "all_to_all"]
        return peaks, (int(a2a["bytes_sent"].sum()), int(a2a["bytes_recv"].sum()))

    # The run's own counts (the default once a run of this mesh is kept): its ledger and its trace.
    assert at.radio(key="mesh_routing").value.startswith("the last run's counts")
    for rank in range(4):
        peaks, a2a = shown(rank)
        assert peaks == {r["category"]: r["bytes"] for r in summary["memory_peak_bytes"] if r["rank"] == rank}
        traced = [e for e in events if e["rank"] == rank and e["op"] == "all_to_all"]
        assert a2a == (sum(e["bytes_sent"] for e in traced), sum(e["bytes_recv"] for e in traced)), rank
    # Balanced, said so: each of the 2 data ranks routes 2 rows x 16 tokens of each of 2 microbatches,
    # 64 assignments, 16 per expert (capacity ceil(128 x 2 x 1.25 / 4) = 80 drops none), each its
    # own pair (the balanced assumption). Per MoE block and microbatch it sends the 32 pairs for the
    # other ep rank's 2 experts and receives 32 for its own: rows of C = 32 float64s, and records of
    # m = 2 slots (dispatch C + 2m, combine C, combine:bwd C, dispatch:bwd C + m), over its stage's
    # 2 blocks and 2 microbatches.
    at.radio(key="mesh_routing").set_value("balanced (assumed)")
    rerun(at)
    assert any("balanced (an assumption)" in c.value for c in at.caption)
    model, sizes, plan = mesh_model("tiny", 2), summary["mesh"], Plan(schedule="1f1b", microbatches=2)
    for rank in range(4):
        peaks, a2a = shown(rank)
        assert a2a == ((32 * (2 * 32 + 2 * 2) + 32 * (2 * 32 + 2)) * 8 * 2 * 2,) * 2, rank
        stage = range(2 * (rank // 2), 2 * (rank // 2) + 2)
        counts = (np.full((2, 4), 16), np.full((2, 2), 32))  # (kept, pairs): one pair an assignment
        balanced = [[{block: counts for block in stage}] * 2]  # one step, 2 microbatches
        closed = rank_memory_rows(model, ONE_STEP, sizes, rank_coords(sizes, rank), plan, balanced)
        assert peaks == {r["category"]: r["bytes"] for r in closed}, rank


def test_an_uploaded_trace_is_read_whole_and_a_bad_one_gets_one_sentence_saying_what_it_is(moe_pipeline_run):
    from refpar.config import ConfigError
    from refpar.viz.timeline import read_trace_upload

    data = moe_pipeline_run["trace_path"].read_bytes()
    assert read_trace_upload("trace.json", data) == json.loads(data)  # what the page draws (Chromium too)
    trace = json.loads(data)

    def without(field: str) -> bytes:  # every event without args[field]: another version's trace
        return json.dumps({**trace, "traceEvents": [
            {**e, "args": {k: v for k, v in e.get("args", {}).items() if k != field}}
            for e in trace["traceEvents"]]}).encode()

    bad = {b"": "f.json is empty", b"\xff\xfe\x00": "f.json is not JSON", b"<html>": "f.json is not JSON",
           data[: len(data) // 2]: "f.json is not whole JSON (it breaks off at character",
           json.dumps(moe_pipeline_run["summary"]).encode(): "f.json is the --json summary of a run, not its",
           b"[1, 2]": "f.json is JSON but not a Chrome trace",
           b'{"traceEvents": []}': "a Chrome trace with no events to draw",
           without("tick"): "has no args.tick: another version's",  # an action without its tick
           without("tag"): "has no args.tag: another version's or another tool's"}
    for upload, words in bad.items():
        with pytest.raises(ConfigError) as err:
            read_trace_upload("f.json", upload)
        sentence = str(err.value)
        assert words in sentence and "refpar train --trace PATH" in sentence, sentence
        assert "\n" not in sentence and sentence.count(". ") == 0, sentence  # one sentence


def test_run_page_launches_any_mesh_the_engine_runs_the_demos_3d_mesh_by_default():
    at = page("views/run.py")
    at.toggle(key="run_whole").set_value(True)
    rerun(at)
    command = at.code[0].value  # make demo's mesh, checked against one device
    assert " -n 8 " in command and "train --mesh pp=2,dp=2,tp=2 " in command and "--check" in command
    at.number_input(key="run_tp").set_value(3)
    rerun(at)
    assert "tp=3 does not divide n_head=4" in at.error[0].value and at.button[0].disabled
    at.number_input(key="run_tp").set_value(2)
    at.number_input(key="run_ep").set_value(2)
    at.selectbox(key="run_strategy").set_value("zero3")
    at.number_input(key="run_m").set_value(2)  # a MoE microbatch needs a sequence for each of dp x ep
    rerun(at)
    assert not at.error, [e.value for e in at.error]
    assert " -n 16 " in at.code[0].value and "--moe-experts 4 --moe-topk 2 --check" in at.code[0].value
    assert "--zero 3" in at.code[0].value


def test_the_kept_run_is_written_whole_and_a_damaged_file_is_no_run(tmp_path, monkeypatch):
    from launcher import cache_file, load_result, save_result

    monkeypatch.setenv("REFPAR_APP_CACHE", str(tmp_path / "cache" / "last-run.json"))
    result = {"key": ("dp", 2, 1, 2, "tiny"), "label": "dp=2 dp (tiny)",  # what every page reads of it
              "summary": {"steps": 1, "losses": [4.5], "step_time_s": 0.1, "comm_bytes": [],
                          "mesh": {"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 1}}}
    save_result(result, cache_file())
    assert load_result(cache_file()) == result  # the key a tuple again, as the pages compare it
    assert [p.name for p in cache_file().parent.iterdir()] == ["last-run.json"]  # no partial file left
    cache_file().write_text('{"key": ["dp", 2')  # a file cut short (a full disk, a kill mid-write)
    assert load_result(cache_file()) is None and Launcher().last() is None


def test_plain_streamlit_run_from_the_checkout_listens_on_this_machine_only(monkeypatch):
    """`streamlit run app/Home.py` from the checkout reads .streamlit/config.toml: 127.0.0.1, not
    Streamlit's every interface (issue 43), and the browser's upload bound is the reader's."""
    from streamlit import config

    from refpar.viz.timeline import MAX_TRACE_BYTES

    monkeypatch.chdir(ROOT)
    try:
        config.get_config_options(force_reparse=True)
        assert config.get_option("server.address") == "127.0.0.1"
        assert config.get_option("server.maxUploadSize") << 20 == MAX_TRACE_BYTES
    finally:
        monkeypatch.undo()
        config.get_config_options(force_reparse=True)


def test_the_app_writes_its_traces_in_a_private_directory_never_through_a_planted_symlink(tmp_path):
    """Another local user's symlink at the old fixed name, /tmp/refpar-app-trace-<pid>.json(l),
    pointing at a file of ours: the page's command writes its trace elsewhere, in a directory of
    this user's alone made afresh, and a run writing there leaves the file untouched."""
    import os
    import stat
    import tempfile

    import launcher

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    old = Path(tempfile.gettempdir()) / f"refpar-app-trace-{os.getpid()}"
    planted = [old.with_suffix(suffix) for suffix in (".json", ".jsonl")]
    for link in planted:
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
    try:
        at = page("views/run.py")
        argv = at.code[0].value.split()
        trace = Path(argv[argv.index("--trace") + 1])
        assert trace not in planted and trace.with_suffix(".jsonl") not in planted
        folder = trace.parent.stat(follow_symlinks=False)
        assert stat.S_ISDIR(folder.st_mode) and stat.S_IMODE(folder.st_mode) == 0o700
        assert folder.st_uid == os.getuid() and trace.parent == Path(launcher.shared().trace_path()).parent
        # what refpar train does with --trace PATH: write PATH and PATH.jsonl
        writes = f"import pathlib; p = pathlib.Path({str(trace)!r}); p.write_text('{{}}'); " \
                 "p.with_suffix('.jsonl').write_text('')"
        run = Launcher()
        run.start([sys.executable, "-c", writes], "writes", None, 1, str(trace))
        run.reader.join(timeout=30)
        assert run.proc.returncode == 0 and victim.read_text() == "keep me"
        assert not trace.exists() and not trace.with_suffix(".jsonl").exists()  # taken in, then removed
    finally:
        for link in planted:
            link.unlink(missing_ok=True)


# The uploads issue 43 found: 419 bytes that asked for 3 GB (tick 10^9), and the ones that raised.
HOSTILE_EVENT = {"name": "0F0", "cat": "compute", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 5,
                 "args": {"tick": 10**9, "step": 1}}
HOSTILE = {"tick 10^9": {"traceEvents": [HOSTILE_EVENT, {**HOSTILE_EVENT, "name": "0B0", "ts": 9,
                                                         "args": {"tick": 1, "step": 1}}]},
           'ts "abc"': {"traceEvents": [{**HOSTILE_EVENT, "ts": "abc"}]},
           'name "123"': {"traceEvents": [{**HOSTILE_EVENT, "name": "123"}]},
           'pid "zero"': {"traceEvents": [{**HOSTILE_EVENT, "pid": "zero"}]},
           "tick 0.5": {"traceEvents": [{**HOSTILE_EVENT, "args": {"tick": 0.5, "step": 1}}]}}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_a_hostile_upload_gets_one_sentence_in_little_memory(what):
    """What the Run for real page does with an upload (app/executed.py:show_upload): read it, then
    draw it. Each of issue 43's uploads is one sentence, a ConfigError or (a trace that reads but
    makes no schedule) the note under the executed figure, and the 419-byte one with tick 10^9 is
    refused before any grid is built: under 4 MB traced (a list of 10^9 ticks is 8 GB)."""
    import tracemalloc

    from refpar.config import ConfigError
    from refpar.viz.timeline import read_trace_upload, trace_figures

    data = json.dumps(HOSTILE[what]).encode()
    assert len(data) < 420
    tracemalloc.start()
    try:
        _, simulated, sentence = trace_figures(read_trace_upload("f.json", data))
        assert simulated is None
    except ConfigError as err:
        sentence = str(err)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert "\n" not in sentence and "refpar train --trace PATH" in sentence, sentence
    words = {"tick 10^9": "places an action at tick 1000000000", 'ts "abc"': "has ts abc",
             'name "123"': "no pipeline action", 'pid "zero"': "has pid zero", "tick 0.5": "has tick 0.5"}
    assert words[what] in sentence, sentence


def test_an_upload_nested_too_deep_or_too_large_is_one_sentence():
    from refpar.config import ConfigError
    from refpar.viz.timeline import MAX_TRACE_BYTES, read_trace_upload

    for data, words in ((b"[" * 200_000, "nested too deeply"),
                        (b" " * (MAX_TRACE_BYTES + 1), "more than the 64 MiB")):
        with pytest.raises(ConfigError, match=words):
            read_trace_upload("f.json", data)


def test_the_executed_timeline_draws_the_traces_actions_apart_from_its_messages_and_the_reports_bubble(
        moe_pipeline_run):
    """Every action of the trace drawn once in the compute lane, every message once in the message
    lane below it (never over an action), each send joined to its receive, and the measured bubble
    the report printed."""
    from refpar.viz import timeline

    trace = moe_pipeline_run["timeline"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    figure, simulated, note = timeline.trace_figures(trace)
    bars = [t for t in figure.data if t.type == "bar"]
    actions = sorted((int(y), text) for t in bars if t.name in ("F", "B", "W")
                     for y, text in zip(t.y, t.hovertext, strict=True))
    assert actions == sorted((e["pid"], e["name"]) for e in events if e["cat"] == "compute")
    messages = [t for t in bars if t.name.endswith(" messages")]
    assert sum(len(t.x) for t in messages) == sum(e["cat"] != "compute" for e in events)
    for t in bars:  # the lanes: actions and idle in [rank - 0.4, rank + 0.1], messages in [+0.15, +0.37]
        low, high = t.offset, t.offset + t.width
        assert (low >= 0.15) if t in messages else (high <= 0.1), t.name
    sends = sum(e["name"].startswith("isend") for e in events)
    lines = next(t for t in figure.data if t.name == "send to receive")
    assert len(lines.x) == 3 * sends > 0  # each send to its receive: two points and a break
    measured = moe_pipeline_run["summary"]["bubble_fraction"]["measured"]
    assert abs(timeline.measured_from_trace(trace).bubble_fraction - measured) <= 1e-12
    assert f"measured {measured:.1%}" in note and simulated is not None
    assert simulated.layout.xaxis.title.text.startswith("ms")  # one unit: both in ms
    labels = [s["label"] for s in simulated.layout.sliders[0].steps]
    assert all(len(label.replace(".", "").replace("-", "")) <= 4 for label in labels), labels


def test_the_communication_trace_draws_a_ranks_wait_for_its_group_as_waiting():
    """Two ranks of a dp group: rank 1 reaches the first all-reduce 1.9 s after rank 0; rank 0's
    first 1.9 s are drawn as waiting, and rank 1, the last to arrive, waits for nobody."""
    from refpar.comm.trace import CommEvent, chrome_trace

    def call(rank, start, end):
        return CommEvent(rank=rank, op="all_reduce", axis="dp", group=(0, 1), algo="native(ring)", peer=None,
                         dtype="float64", shape=(4,), bytes_sent=32, bytes_recv=32, tag="loss", step=1,
                         microbatch=None, phase=None, t_start=start, t_end=end)

    fig = comm.trace_figure(chrome_trace([call(0, 0.0, 1.902), call(1, 1.9, 1.902)]))
    waiting = next(t for t in fig.data if t.name == comm.WAITING)
    assert list(waiting.y) == [0]
    np.testing.assert_allclose(waiting.x, [1900.0])  # ms


BANNER = ("=" * 80 + "\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
          "=   RANK 0 PID 1 RUNNING AT host\n" + "=" * 80)


def test_stop_says_stopped_in_one_line_keeps_mpis_output_as_code_and_the_last_result(moe_pipeline_run,
                                                                                     monkeypatch):
    """A run stopped midway: one neutral line (not MPICH's banner as red headings), the banner in a
    code block, and the last finished run still shown below it."""
    import launcher

    run = Launcher()
    run.result = {k: moe_pipeline_run[k] for k in ("key", "label", "summary", "trace", "timeline")}
    monkeypatch.setattr(launcher, "shared", lambda: run)
    prints = f"import sys, time; print({BANNER!r}, flush=True); time.sleep(60)"
    run.start([sys.executable, "-c", prints], "pp=2 x ep=2 dp (tiny)", None, 3)
    deadline = time.monotonic() + 30
    while not run.lines and time.monotonic() < deadline:
        time.sleep(0.1)
    run.stop()
    run.reader.join(timeout=30)
    at = page("views/run.py")
    assert not at.error, [e.value for e in at.error]
    stopped = [i.value for i in at.info if "stopped" in i.value]
    assert len(stopped) == 1 and "\n" not in stopped[0] and "BAD TERMINATION" not in stopped[0], stopped
    assert any("BAD TERMINATION" in c.value for c in at.code)
    assert any(s.value.startswith(moe_pipeline_run["label"]) for s in at.success)  # the last good run


BAD_CACHES = {"wrong shape": '{"key": 5, "summary": {"steps": "two"}}', "a list": "[1, 2]",
              "cut short": '{"key": ["dp", 2', "a hostile trace": None}


def test_a_bad_run_cache_is_one_sentence_on_every_page_that_shows_the_run(moe_pipeline_run, tmp_path,
                                                                          monkeypatch):
    """A kept run of the wrong shape (hand-edited, another version's, cut short) is no run: each page
    that shows the last run says so in one st.error sentence naming the file, and draws the rest."""
    import launcher

    cache = tmp_path / "last-run.json"
    monkeypatch.setenv("REFPAR_APP_CACHE", str(cache))
    monkeypatch.setattr(launcher, "shared", Launcher)  # no run of this app process: the kept file alone
    hostile = json.loads(moe_pipeline_run["cache"].read_text())
    hostile["timeline"] = {"traceEvents": [{**HOSTILE_EVENT, "pid": "zero"}]}
    for what, text in BAD_CACHES.items():
        cache.write_text(text if text is not None else json.dumps(hostile))
        sentence = launcher.cache_problem(cache)
        assert sentence.startswith(f"the kept run {cache} ") and "\n" not in sentence, sentence
        if what not in ("wrong shape", "a hostile trace"):
            continue  # the pages show what cache_problem says: two kinds are enough to see it there
        for path in ("views/run.py", "views/communication.py", "views/memory.py"):
            at = page(path)
            errors = [e.value for e in at.error]
            assert len(errors) == 1 and str(cache) in errors[0], (what, path, errors)
            assert "\n" not in errors[0], errors
            assert f"delete {cache}" in errors[0]


def test_the_last_run_any_mesh_is_on_communication_and_memory_whatever_their_controls(moe_pipeline_run,
                                                                                      monkeypatch):
    """An any-mesh run (pp=2 x ep=2), found by a fresh session in the kept file alone (a reload, a new
    tab): Communication shows its bytes per step equal to the closed form its report priced, and
    every traced call; Memory shows every rank's measured peaks beside the closed form."""
    import launcher

    monkeypatch.setenv("REFPAR_APP_CACHE", str(moe_pipeline_run["cache"]))
    monkeypatch.setattr(launcher, "shared", Launcher)  # a new start of the app: the kept file alone
    summary = moe_pipeline_run["summary"]
    at = page("views/communication.py")  # its controls at their defaults: tp, not this mesh
    assert at.selectbox(key="comm_strategy").value == "tp"
    assert f"The last real run: {moe_pipeline_run['label']}" in [h.value for h in at.subheader]
    assert any(s.value.startswith("Measured equals the closed form") for s in at.success)
    by_title = {c["layout"]["title"]["text"]: c for c in charts(at)
                if isinstance(c["layout"].get("title"), dict)}
    closed, measured = by_title[next(t for t in by_title if t.startswith("the run's bytes per step"))]["data"]
    steps = summary["steps"]
    assert measured["name"] == "measured"
    np.testing.assert_array_equal(measured["y"], closed["y"])
    assert sum(measured["y"]) == sum(r["bytes_sent"] for r in summary["comm_bytes"]) // steps
    calls = by_title["measured: every call of the traced run, rank by rank"]["data"]
    events = [e for e in moe_pipeline_run["trace"]["traceEvents"] if e.get("ph") == "X"]
    assert sum(len(t["y"]) for t in calls if t["name"] != comm.WAITING) == len(events)
    at.switch_page("views/memory.py")
    rerun(at)
    pairs = charts(at)[1]
    assert list(pairs["data"][0]["x"])[:2] == ["rank 0 closed form", "rank 0 measured"]


def test_show_the_last_run_sets_the_communication_controls_to_its_mesh(tmp_path, monkeypatch):
    import launcher

    monkeypatch.setenv("REFPAR_APP_CACHE", str(tmp_path / "none.json"))
    result = {"key": ("zero3", 4, 1, 2, "llama-tiny"), "label": "dp=4 zero3 (llama-tiny)",
              "summary": {"steps": 1, "losses": [4.5], "step_time_s": 0.1, "comm_bytes": [],
                          "mesh": {"pp": 1, "dp": 4, "ep": 1, "cp": 1, "tp": 1}}}
    assert launcher.result_problem(result) is None
    run = Launcher()
    run.result, run.kind = result, "train"
    monkeypatch.setattr(launcher, "shared", lambda: run)
    at = page("views/communication.py")
    at.button[0].click()
    rerun(at)
    assert (at.selectbox(key="comm_strategy").value, at.number_input(key="comm_n").value,
            at.number_input(key="comm_m").value, at.radio(key="family").value) == ("zero3", 4, 2, "Llama")
    assert any(s.value.startswith("This is the last real run's mesh") for s in at.success)


def test_sharding_opens_on_the_first_moment_and_steps_through_refpars_moments_with_their_narration():
    """The figure opens before the step (not after it), its Play shows a moment a second (Play x3 is
    faster), and the arrows move every figure of the page and the narration beside it one moment."""
    steps = sharding.steps_for("zero3", 4)  # the page's default
    at = page("views/sharding.py")
    fig = charts(at)[0]
    slider, buttons = fig["layout"]["sliders"][0], fig["layout"]["updatemenus"][0]["buttons"]
    assert slider["active"] == 0 and fig["frames"][0]["name"] == steps[0].label
    for shown, first in zip(fig["data"], fig["frames"][0]["data"], strict=False):
        np.testing.assert_array_equal(np.asarray(shown["z"]), np.asarray(first["z"]))
    assert [b["label"] for b in buttons] == ["Play", "Play x3", "Pause"]
    assert [b["args"][1]["frame"]["duration"] for b in buttons[:2]] == [1000, 333]
    assert at.info[0].value == f"**1 of {len(steps)}, {steps[0].label}**: {steps[0].moves}"
    assert at.button(key="moment_back").disabled
    at.button(key="moment_forward").click()
    fig = charts(rerun(at))[0]
    assert fig["layout"]["sliders"][0]["active"] == 1
    assert at.info[0].value == f"**2 of {len(steps)}, {steps[1].label}**: {steps[1].moves}"
    for shown, second in zip(fig["data"], fig["frames"][1]["data"], strict=False):
        np.testing.assert_array_equal(np.asarray(shown["z"]), np.asarray(second["z"]))


def test_pipeline_page_asks_for_the_bubble_first_and_grades_it_against_the_simulation():
    """Predict, then reveal: with "predict first" on, no figure and no bubble until a guess; a guess
    within 0.01 of the simulated bubble is right, another is corrected with the simulated number.
    Equal costs other than 1 keep the closed form: the bubble is a ratio of times."""
    timeline = simulate(build("1f1b", 4, 8))  # the page's default
    at = page("views/pipeline.py")
    at.toggle(key="predict").set_value(True)
    rerun(at)
    assert not at.get("plotly_chart") and not at.metric and "Guess the bubble" in at.info[0].value
    at.number_input(key="guess").set_value(round(timeline.bubble_fraction, 2))
    rerun(at)
    assert at.success[0].value.startswith(f"Right: {timeline.bubble_fraction:.4f}") and at.get("plotly_chart")
    at.number_input(key="guess").set_value(0.9)
    rerun(at)
    assert at.warning[0].value.startswith(f"Not quite: {timeline.bubble_fraction:.4f}")
    for cost in ("F", "B", "W"):
        at.number_input(key=cost).set_value(2.5)
    rerun(at)
    assert float(at.metric[1].value) == pytest.approx(published_bubble_fraction("1f1b", 4, 8), abs=5e-5)
    assert float(at.metric[0].value) == pytest.approx(timeline.bubble_fraction, abs=5e-5)
