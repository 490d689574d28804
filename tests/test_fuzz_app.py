"""Fuzzed widget values on every page of the app with numbers to enter (streamlit.testing.v1.AppTest):
whatever a user sets, within the widgets' ranges and at their edges (the browser clamps to them,
so nothing outside them can arrive) and far above where a widget has no maximum, the page shows no
exception; a combination it cannot draw gets a one-line st.error or st.warning sentence instead
of its figures.

One AppTest session per page, as one user changing the inputs again and again: each case sets
every choice (toggle, radio, checkbox, selectbox), reruns, sets every number input that is now on
the page (near its minimum or its default, but one of them, or none, at an edge of its range), and
reruns. Every value is drawn before the page is looked at, so that hypothesis replays a case
exactly (derandomized, no database: tests/test_fuzz_cli.py says why).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from streamlit.testing.v1 import AppTest

from tests.test_app import HOME, TIMEOUT
from tests.test_fuzz_cli import fuzz_settings

# Values far above a widget with no maximum (a user can type them), and edge costs.
HUGE = (16, 17, 64, 65, 1000, 1024, 65536, 65537, 1 << 20, (1 << 20) + 1, 10**6, 10**9)
NEAR_COSTS, EDGE_COSTS = (0.5, 1.0, 1.5, 2.0, 4.0), (0.0, 99.5, 100.0, 100.5, 1e9)
CHOICE_KINDS = ("toggle", "radio", "checkbox", "selectbox")

# page -> (number inputs by label, choices by label), the labels each page shows
PAGES = {
    "views/sharding.py": (("ranks", "dp", "tp", "pp"),
                          ("mix two axes (dp x tp with ZeRO, tp x sp, pp x tp)", "axes", "strategy",
                           "ZeRO stage over dp", "sequence parallel (SP) on tp")),
    "views/pipeline.py": (("p (stages)", "m (microbatches)", "v (chunks per rank)", "F cost", "B cost",
                           "W cost"), ("compare two schedules side by side", "schedule")),
    "views/communication.py": (("ranks on its axis", "dp replicas", "microbatches"), ("strategy",)),
    "views/memory.py": (("ranks on the strategy's axis", "microbatches (pp)"), ("precision",)),
    "views/plan.py": (("GPUs", "plans shown"), ("model", "hardware")),
    "views/run.py": (("ranks on its axis", "dp replicas", "microbatches", "steps"), ("strategy",)),
    "views/serving.py": (("requests", "new tokens per request", "requests decoded together",
                          "cached tokens per request"), ("mesh", "model", "hardware")),
}
EXAMPLES = {"views/pipeline.py": 15, "views/plan.py": 15}  # their figures cost the most to draw
# Selectboxes that show labels for their values (format_func): AppTest sets them by value.
VALUES = {"strategy": ("dp", "zero1", "zero2", "zero3", "fsdp", "tp", "sp", "ep")}  # sharding.py's NAMES


def number(widget, draw: dict, label: str):
    """The drawn value for a number input, in its range: a little above its minimum or its default,
    or for the one input the case pushes to an edge, its minimum, its maximum or (none) a huge value."""
    low, high, pick = widget.min, widget.max, draw["pick"][label]
    if isinstance(widget.value, float):
        value = EDGE_COSTS[pick % len(EDGE_COSTS)] if draw["edge"] == label else \
            NEAR_COSTS[pick % len(NEAR_COSTS)]
    elif draw["edge"] == label:
        value = [int(low), HUGE[pick % len(HUGE)] if high is None else int(high)][pick % 2]
    else:
        value = int([low, widget.proto.default][pick % 2]) + pick // 2 % 9
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


def assert_page_is_sound(at: AppTest, where: str) -> None:
    assert not at.exception, f"{where}: {[e.value for e in at.exception]}"
    for element in (*at.error, *at.warning):
        text = str(element.value)
        assert text.strip() and "\n" not in text.strip() and "Traceback" not in text, f"{where}: {text!r}"


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
        assert_page_is_sound(at, f"after the choices {draw['choice']}")
        for label in numbers:
            for w in widgets(at, "number_input", label):
                w.set_value(number(w, draw, label))
        at.run()
        values = {w.label: w.value for w in at.number_input}
        assert_page_is_sound(at, f"with {values}")
        drawn = bool(at.get("plotly_chart") or at.get("metric") or at.code)
        assert drawn or at.error, f"with {values}: neither a figure nor a sentence"
        # drawn: the page reached its figures (a section may still refuse its own inputs, as the
        # plan page's "price your own plan" does for a mesh that does not divide the GPUs)
        tally["drawn" if drawn else "refused"] += 1

    one_case()
    print(f"{path}: {sum(tally.values())} cases, {dict(tally)}")
    assert tally["drawn"], tally
