"""Fuzzed widget values on every page of the app with numbers to enter (streamlit.testing.v1.AppTest):
whatever a user sets, within the widgets' ranges and at their edges (the browser clamps to them,
so nothing outside them can arrive) and far above where a widget has no maximum, the page shows no
exception; a combination it cannot draw gets a one-line st.error or st.warning sentence instead
of its figures.

The Pipeline page's figures cost the most to draw (seconds a case): its inputs are fuzzed through the
page's own functions (app/schedule_figures.py), and the page itself is driven through chosen cases
in one session.

One AppTest session per page, as one user changing the inputs again and again: each case sets
every choice (toggle, radio, checkbox, selectbox), reruns, sets every number input that is now on
the page (near its minimum or its default, but one of them, or none, at an edge of its range), and
reruns. Every value is drawn before the page is looked at, so that hypothesis replays a case
exactly (derandomized, no database: tests/test_fuzz_cli.py says why).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from streamlit.testing.v1 import AppTest

from tests.test_app import HOME, TIMEOUT
from tests.test_fuzz_cli import fuzz_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))  # the app's launcher

# Values far above a widget with no maximum (a user can type them), and edge costs.
HUGE = (16, 17, 64, 65, 1000, 1024, 65536, 65537, 1 << 20, (1 << 20) + 1, 10**6, 10**9)
NEAR_COSTS, EDGE_COSTS = (0.5, 1.0, 1.5, 2.0, 4.0), (0.0, 99.5, 100.0, 100.5, 1e9)
CHOICE_KINDS = ("toggle", "radio", "checkbox", "selectbox")

# page -> (number inputs by label, choices by label), the labels each page shows
PAGES = {
    "views/sharding.py": (("ranks", "dp", "tp", "pp"),
                          ("mix two axes (dp x tp with ZeRO, tp x sp, pp x tp)", "axes", "strategy",
                           "ZeRO stage over dp", "sequence parallel (SP) on tp")),
    "views/communication.py": (("ranks on its axis", "dp replicas", "microbatches"), ("strategy",)),
    "views/memory.py": (("ranks on the strategy's axis", "microbatches (pp)"), ("precision",)),
    "views/plan.py": (("GPUs", "plans shown"), ("model", "hardware")),
    "views/run.py": (("ranks on its axis", "dp replicas", "microbatches", "steps"), ("strategy",)),
    "views/serving.py": (("requests", "new tokens per request", "requests decoded together",
                          "cached tokens per request"), ("mesh", "model", "hardware")),
}
EXAMPLES = {"views/plan.py": 15}  # its figures cost the most to draw (the Pipeline page: below)
# Selectboxes that show labels for their values (format_func): AppTest sets them by value.
VALUES = {"strategy": ("dp", "zero1", "zero2", "zero3", "fsdp", "tp", "sp", "ep")}  # sharding.py's NAMES


def number(widget, draw: dict, label: str):
    """The drawn value for a number input, in its range: a little above its minimum or its default,
    or for the one input the case pushes to an edge, its minimum, its maximum or (none) a huge value."""
    low, high, pick = widget.min, widget.max, draw["pick"][label]
    if isinstance(widget.value, float):
        value = EDGE_COSTS[pick % len(EDGE_COSTS)] if draw["edge"] == label else \
            NEAR_COSTS[pick % len(NEAR_COSTS)]
    elif draw["edge"] == label:  # a box without a minimum: the page refuses 0 and below itself
        lowest = 1 - pick // 2 % 3 if low is None else int(low)
        value = [lowest, HUGE[pick % len(HUGE)] if high is None else int(high)][pick % 2]
    else:
        value = int([1 if low is None else low, widget.proto.default][pick % 2]) + pick // 2 % 9
    value = value if high is None else min(value, high)
    return float(value) if isinstance(widget.value, float) else int(value)


def widgets(at: AppTest, kind: str, label: str) -> list:
    return [w for w in getattr(at, kind) if w.label == label and not w.disabled]


def choose(widget, index: int, path: str) -> None:
    if widget.type in ("toggle", "checkbox"):
        widget.set_value(bool(index % 2))
    elif widget.type == "selectbox" and path == "views/sharding.py" and widget.label in VALUES:
        widget.set_value(VALUES[widget.label][index % len(VALUES[widget.label])])
    elif widget.type == "selectbox":
        widget.select_index(index % len(widget.options))
    else:
        widget.set_value(widget.options[index % len(widget.options)])


# Pages whose errors must name only their own controls: no command-line flag (issue 44).
IN_PAGE_WORDS = ("views/communication.py", "views/memory.py", "views/pipeline.py", "views/plan.py",
                 "views/run.py")


def assert_page_is_sound(at: AppTest, where: str, path: str = "") -> None:
    assert not at.exception, f"{where}: {[e.value for e in at.exception]}"
    for element in (*at.error, *at.warning):
        text = str(element.value)
        assert text.strip() and "\n" not in text.strip() and "Traceback" not in text, f"{where}: {text!r}"
        assert path not in IN_PAGE_WORDS or "--" not in text, f"{where}: {text!r} names a flag"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", sorted(PAGES))
def test_fuzzed_widget_values_never_raise_and_bad_ones_get_one_sentence(path):
    numbers, choices = PAGES[path]
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(path)
    at.run()
    assert_page_is_sound(at, "opening")
    tally: Counter = Counter()

    @fuzz_settings(EXAMPLES.get(path, 20))
    @given(st.fixed_dictionaries({
        "choice": st.fixed_dictionaries({c: st.integers(0, 63) for c in choices}),
        "pick": st.fixed_dictionaries({n: st.integers(0, 63) for n in numbers}),
        "edge": st.sampled_from([None, *numbers]),
    }))
    def one_case(draw):
        for label, index in draw["choice"].items():
            for kind in CHOICE_KINDS:
                for w in widgets(at, kind, label):
                    choose(w, index, path)
        at.run()
        assert_page_is_sound(at, f"after the choices {draw['choice']}", path)
        for label in numbers:
            for w in widgets(at, "number_input", label):
                w.set_value(number(w, draw, label))
        at.run()
        values = {w.label: w.value for w in at.number_input}
        assert_page_is_sound(at, f"with {values}", path)
        drawn = bool(at.get("plotly_chart") or at.get("metric") or at.code)
        assert drawn or at.error, f"with {values}: neither a figure nor a sentence"
        # drawn: the page reached its figures (a section may still refuse its own inputs, as the
        # plan page's "price your own plan" does for a mesh that does not divide the GPUs)
        tally["drawn" if drawn else "refused"] += 1

    one_case()
    print(f"{path}: {sum(tally.values())} cases, {dict(tally)}")
    assert tally["drawn"], tally


# -- the Pipeline page: its inputs through the page's own functions, the page on chosen cases ----------

PIPELINE_BOXES = ("p (stages)", "m (microbatches)", "v (chunks per rank)", "F cost", "B cost", "W cost")


def names_a_box(sentence: str, boxes=PIPELINE_BOXES) -> bool:
    """Whether `sentence` names one of `boxes`, by its label or by its symbol ("m=6", "p in {2, 4}")."""
    return any(box in sentence or re.search(rf"\b{re.escape(box.split(' (')[0])}(=| in \{{)", sentence)
               for box in boxes)


@pytest.mark.timeout(300)
def test_fuzzed_pipeline_inputs_are_refused_naming_their_box_or_simulated():
    """Every schedule and any value a user can type (no limits on the boxes: typed values reach the
    page): the page's checks refuse it in one sentence that opens with the box's label, or the
    schedule's builder refuses it in one sentence (said in the page's words, no flag) naming a box,
    or it is simulated: a bubble in [0, 1), and for equal costs the published bubble where one is."""
    import schedule_figures as parts
    from page_words import in_page_words

    from refpar.config import ConfigError
    from refpar.schedules.builders import BUILDERS, default_chunks
    from refpar.schedules.published import published_bubble_fraction

    tally: Counter = Counter()
    counts = st.sampled_from((-1, 0, 1, 2, 3, 4, 5, 6, 8, 16, 17, 64, 65, 10**6))
    costs = st.sampled_from((-1.0, 0.0, 0.05, 0.1, *NEAR_COSTS, 100.0, 100.5, 1e9))

    @fuzz_settings(60)
    @given(st.sampled_from(tuple(BUILDERS)), counts, counts, st.integers(-1, 5),
           st.tuples(costs, costs, costs), st.sampled_from(("sum", "max")), st.booleans())
    def one_case(kind, p, m, v, three, overlap, equal):
        three = (three[0],) * 3 if equal else three
        v = v if kind == "interleaved-1f1b" else default_chunks(kind)  # the page's v box is interleaved's
        overlap = overlap if kind in ("dualpipev", "dualpipe") else "sum"
        try:
            parts.check_counts(p, m, v)
            parts.check_costs(three)
        except ConfigError as err:
            said = str(err)
            assert "\n" not in said and said.startswith(PIPELINE_BOXES), said
            tally["refused by the page"] += 1
            return
        try:
            _, timeline, _ = parts.timeline_of(kind, p, m, v, *three, overlap)
        except ConfigError as err:
            said = in_page_words(str(err), parts.CONTROLS)
            assert "\n" not in said and "--" not in said and names_a_box(said), said
            tally["refused by the builder"] += 1
            return
        assert 0 <= timeline.bubble_fraction < 1 and timeline.makespan > 0
        closed = published_bubble_fraction(kind, p, m, v)
        if equal and closed is not None:
            assert timeline.bubble_fraction == pytest.approx(closed, abs=1e-12), (kind, p, m, v)
        tally["simulated"] += 1

    one_case()
    print(dict(tally))
    assert len(tally) == 3, tally


PIPELINE_DEFAULTS = {"kind": "1f1b", "p": 4, "m": 8, "v": 2, "F": 1.0, "B": 1.0, "W": 1.0, "overlap": "sum"}
def set_widgets(at: AppTest, values: dict) -> AppTest:
    """Sets those of `values` (widget key -> value) whose widgets are on the page and differ, and reruns
    if any did."""
    changed = False
    for widget in (*at.selectbox, *at.radio, *at.number_input):
        if widget.key in values and widget.value != values[widget.key]:
            widget.set_value(values[widget.key])
            changed = True
    return at.run() if changed else at


# (widget key -> value) to set, then what the page must show: "drawn" (its figures, no error) or the
# start of its one error, which names the box. One session, each case on the page's defaults; the
# side-by-side comparison is tests/test_app.py's.
PIPELINE_CASES = (
    ({"p": 0}, "p (stages) = 0: choose 1 to 16"),
    ({"p": 17}, "p (stages) = 17: choose 1 to 16"),
    ({"m": 65}, "m (microbatches) = 65: choose 1 to 64"),
    ({"W": 0.0}, "W cost = 0: choose 0.1 to 100"),
    ({"F": 1e9}, "F cost = 1e+09: choose 0.1 to 100"),
    ({"kind": "dualpipev", "m": 2}, "dualpipev needs at least 2p = 8 microbatches, got m=2; "
                                    "set m (microbatches) to 8 or more"),
    ({"kind": "interleaved-1f1b", "v": 0}, "v (chunks per rank) = 0: choose 1 to 4"),
    ({"kind": "interleaved-1f1b", "v": 1}, "interleaved 1F1B needs at least 2 chunks per rank, got v=1; "
                                           "set v (chunks per rank) to 2 or more"),
    ({"kind": "dualpipe", "p": 3, "overlap": "max"}, "dualpipe feeds the pipeline from both ends"),
    ({"kind": "dualpipe", "overlap": "max", "F": 0.5, "B": 2.0, "W": 99.5}, "drawn"),
)


@pytest.mark.timeout(300)
def test_pipeline_page_refuses_each_bad_box_by_its_label_and_draws_the_rest():
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/pipeline.py")
    at.run()
    assert_page_is_sound(at, "opening", "views/pipeline.py")
    previous: dict = {}
    for settings, shown in PIPELINE_CASES:
        # First the case's kind and what boxes it already has, while the last case's bad value still
        # keeps the page from drawing (figures cost seconds); then the last case's boxes back to the
        # page's defaults and the boxes the kind brought.
        at = set_widgets(at, settings)
        set_widgets(at, {k: PIPELINE_DEFAULTS[k] for k in previous if k not in settings} | settings)
        assert_page_is_sound(at, f"with {settings}", "views/pipeline.py")
        errors = [e.value for e in at.error]
        if shown == "drawn":
            assert not errors and at.get("plotly_chart"), (settings, errors)
        else:
            assert len(errors) == 1 and errors[0].startswith(shown), (settings, errors)
            assert names_a_box(errors[0]) and not at.get("plotly_chart"), errors
        previous = settings


# -- uploaded traces and kept runs (issue 43): hostile files, not widget values ------------------------

def good_trace() -> dict:
    """A Chrome trace as `refpar train --trace` writes it, built without a run: 1F1B on 2 stages of 2
    microbatches at unit costs (ms), each stage's activations sent to the next and their gradients
    back, and a dp all-reduce of the loss on both ranks."""
    from refpar.schedules.builders import build
    from refpar.schedules.simulate import simulate

    timeline = simulate(build("1f1b", 2, 2))
    events = [{"name": str(s.action), "cat": "compute", "ph": "X", "pid": r, "tid": 1, "ts": s.start * 1e3,
               "dur": (s.end - s.start) * 1e3, "args": {"tick": s.tick, "step": 1}}
              for r, row in timeline.slots.items() for s in row]
    for mb in range(2):
        for op, rank, peer in (("isend", 0, 1), ("irecv", 1, 0)):
            events.append({"name": f"{op} pp pp:act:s0:mb{mb}", "cat": "pp", "ph": "X", "pid": rank, "tid": 0,
                           "ts": 1e3 * mb, "dur": 500.0, "args": {"tag": f"pp:act:s0:mb{mb}", "peer": peer,
                                                                   "bytes_sent": 4096 * (op == "isend"),
                                                                   "bytes_recv": 4096 * (op == "irecv"),
                                                                   "step": 1, "phase": "fwd"}})
    events += [{"name": "all_reduce dp loss", "cat": "dp", "ph": "X", "pid": r, "tid": 0, "ts": 6e3 + r * 100,
                "dur": 200.0, "args": {"tag": "loss", "group": [0, 1], "bytes_sent": 8, "bytes_recv": 8,
                                       "step": 1}} for r in range(2)]
    return {"traceEvents": events}


JSON = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, 1, -1, 2**31, 10**9, 10**20, 10**400]) | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
EVENT_FIELDS = ("name", "cat", "ph", "pid", "ts", "dur", "args", "args.tick", "args.step", "args.tag",
                "args.peer", "args.group", "args.phase", "args.bytes_sent", "args.bytes_recv")


def mutated(document: dict, path: str, value) -> dict:
    """`document` with the field at `path` ("args.tick") set to `value`."""
    out = json.loads(json.dumps(document))
    *parents, last = path.split(".")
    where = out
    for key in parents:
        where = where.setdefault(key, {}) if isinstance(where.get(key, {}), dict) else {}
    where[last] = value
    return out


def sentence_or_drawn(draw_it) -> str | None:
    """None if `draw_it()` drew, else the ConfigError's sentence, which must be one line."""
    from refpar.config import ConfigError

    try:
        draw_it()
    except ConfigError as err:
        assert str(err).strip() and "\n" not in str(err), str(err)
        return str(err)
    return None


@pytest.mark.timeout(300)
def test_fuzzed_uploaded_traces_draw_or_get_one_sentence():
    """What the Run for real page does with an upload (app/executed.py:show_upload), for a real-shaped
    trace with one field of one event, or the whole file, replaced by drawn JSON: it draws, or it
    says in one sentence what is wrong; never another exception."""
    from refpar.viz.timeline import read_trace_upload, trace_figures

    good = good_trace()
    tally: Counter = Counter()

    @fuzz_settings(25)
    @given(st.integers(0, len(good["traceEvents"]) - 1), st.sampled_from((*EVENT_FIELDS, "whole", "tick")),
           JSON)
    def one_case(index, field, value):
        if field == "whole":
            document = value
        elif field == "tick":  # a tick far beyond the schedule: the 419-byte upload of issue 43
            document = mutated(good, "traceEvents", [*good["traceEvents"][:-1], mutated(
                good["traceEvents"][0], "args.tick", abs(value) if isinstance(value, int) else 10**9)])
        else:
            events = list(good["traceEvents"])
            events[index] = mutated(events[index], field, value)
            document = {"traceEvents": events}
        data = json.dumps(document).encode()
        said = sentence_or_drawn(lambda: trace_figures(read_trace_upload("f.json", data)))
        tally["drawn" if said is None else "refused"] += 1

    one_case()
    print(dict(tally))
    assert tally["drawn"] and tally["refused"], tally


@pytest.mark.timeout(300)
def test_fuzzed_kept_runs_are_drawn_by_every_page_or_refused_in_one_sentence(tmp_path):
    """A kept run (app/launcher.py) with one field replaced by drawn JSON: `read_result` refuses it in
    one sentence naming the file, or what it accepts every page can draw (the figures the Run for
    real, Communication and Memory pages make of it)."""
    import launcher

    from refpar.viz import comm, timeline

    good = {"key": ["dp", 2, 1, 2, "tiny"], "label": "dp=2 dp (tiny)", "timeline": good_trace(),
            "trace": good_trace(), "summary": {
                "steps": 2, "losses": [4.6, 4.5], "step_time_s": 0.1, "dtype": "float64",
                "mesh": {"pp": 2, "dp": 1, "ep": 1, "cp": 1, "tp": 1},
                "comm_bytes": [{"rank": r, "axis": "pp", "op": "isend", "bytes_sent": 8192, "bytes_recv": 0}
                               for r in range(2)],
                "memory_peak_bytes": [{"rank": r, "category": "params", "bytes": 100} for r in range(2)],
                "expected_memory_peak_bytes": None, "max_loss_rel_diff": None}}
    fields = ("key", "label", "timeline", "trace", "summary", "summary.steps", "summary.losses",
              "summary.step_time_s", "summary.mesh", "summary.mesh.dp", "summary.comm_bytes",
              "summary.memory_peak_bytes", "summary.max_loss_rel_diff", "summary.moe", "whole")
    cache = tmp_path / "last-run.json"
    tally: Counter = Counter()

    def draw(result: dict) -> None:
        s = result["summary"]
        measured = [{**r, "bytes_sent": r["bytes_sent"] // s["steps"]} for r in s["comm_bytes"]]
        comm.bytes_figure(measured)
        comm.traffic_figure(measured, s["mesh"])
        peaks = comm.memory_by_rank(s["memory_peak_bytes"] or [])
        comm.memory_figure({f"rank {r}": c for r, c in peaks.items()})
        assert f"{s['losses'][-1]:.4f} {s['step_time_s'] * 1e3:.1f} ms {result['label']}"  # Run's line
        if result.get("trace"):
            comm.trace_figure(result["trace"])
        if result.get("timeline"):
            timeline.trace_figures(result["timeline"])

    @fuzz_settings(20)
    @given(st.sampled_from(fields), JSON)
    def one_case(field, value):
        cache.write_text(json.dumps(value if field == "whole" else mutated(good, field, value)))
        problem = launcher.cache_problem(cache)
        if problem is None:
            draw(launcher.read_result(cache))
        else:
            assert problem.startswith(f"the kept run {cache} ") and "\n" not in problem, problem
        tally["drawn" if problem is None else "refused"] += 1

    one_case()
    print(dict(tally))
    assert tally["drawn"] and tally["refused"], tally


def good_jsonl() -> list[dict]:
    """PATH.jsonl's lines as `refpar train --trace PATH` writes them (refpar.comm.trace.write_trace): a dp
    all-reduce of the gradients on 2 ranks, the second rank arriving later, and a pp send and receive."""
    from refpar.comm.trace import CommEvent

    common = {"algo": "native(ring)", "dtype": "float64", "shape": [4], "step": 1, "microbatch": None,
              "phase": None}
    events = [CommEvent(rank=r, op="all_reduce", axis="dp", group=(0, 1), peer=None, bytes_sent=32,
                        bytes_recv=32, tag="grads", t_start=1.0 + r / 100, t_end=1.05, **common)
              for r in range(2)]
    events += [CommEvent(rank=r, op=op, axis="pp", group=(0, 1), peer=1 - r, bytes_sent=32 * (r == 0),
                         bytes_recv=32 * (r == 1), tag="pp:act:s0:mb0", t_start=1.1, t_end=1.2, **common)
               for r, op in ((0, "isend"), (1, "irecv"))]
    return [e.to_dict() for e in events]


@pytest.mark.timeout(300)
def test_fuzzed_jsonl_uploads_draw_every_call_or_get_one_sentence():
    """What the Run for real and Communication pages do with an uploaded PATH.jsonl
    (app/executed.py:show_upload): the file as refpar writes it draws one bar per message; with one
    field of one line, or one whole line, replaced by drawn JSON, it draws or is refused in one
    sentence; never another exception."""
    from refpar.viz.comm import trace_figure
    from refpar.viz.timeline import read_jsonl_upload

    lines = good_jsonl()
    figure = trace_figure(read_jsonl_upload("f.jsonl", "\n".join(map(json.dumps, lines)).encode()))
    # one bar per message, by axis, and rank 0's wait for rank 1 at the all-reduce drawn apart
    assert {t.name: len(t.x) for t in figure.data} == {"dp": 2, "pp": 2, "waiting for the group": 1}
    tally: Counter = Counter()

    @fuzz_settings(25)
    @given(st.integers(0, len(lines) - 1), st.sampled_from((*lines[0], "whole line")), JSON)
    def one_case(index, field, value):
        changed = list(lines)
        changed[index] = value if field == "whole line" else {**lines[index], field: value}
        data = "\n".join(json.dumps(line) for line in changed).encode()
        said = sentence_or_drawn(lambda: trace_figure(read_jsonl_upload("f.jsonl", data)))
        tally["drawn" if said is None else "refused"] += 1

    one_case()
    print(dict(tally))
    assert tally["refused"], tally
