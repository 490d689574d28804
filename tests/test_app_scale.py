"""Models at real scale on the Memory, Communication and Whole mesh pages (issue 44): a planner preset on
real GPUs, priced by refpar.analysis.planner.price with no run; the figures carry price's bytes, in
readable units, and a plan the boxes cannot make is refused in one sentence naming a box."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from tests.test_app import HOME, TIMEOUT, decode


def test_bytes_are_written_in_readable_units():
    from refpar.viz.scale import readable

    assert [readable(n) for n in (0, 999, 1536, 4.5e9, 80e9, 2.8e12)] == \
        ["0 B", "999 B", "1.54 kB", "4.5 GB", "80 GB", "2.8 TB"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path, model, gpus, mesh, options, figure", [
    ("views/memory.py", "llama3-8b", 8, {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1},
     {"zero": 3, "schedule": "none", "recompute": "selective", "sp": False}, "memory"),
    ("views/communication.py", "llama3-70b", 64, {"dp": 2, "tp": 8, "pp": 4, "cp": 1, "ep": 1},
     {"zero": 1, "schedule": "1f1b", "recompute": "selective", "sp": True}, "comm"),
])
def test_the_at_scale_section_draws_the_planners_closed_forms(path, model, gpus, mesh, options, figure):
    from refpar.analysis.hardware import hardware
    from refpar.analysis.planner import price
    from refpar.analysis.presets import preset

    want = price(preset(model), hardware("h100"), gpus, mesh, **options)
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(path)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    charts = {c.key: decode(json.loads(c.proto.spec)) for c in at.get("plotly_chart") if c.key}
    drawn = charts[f"{path[6:-3]}_scale_{figure}"]
    if figure == "memory":  # one stacked bar per category, in GB, and the H100's 80 GB as the line
        assert {t["name"].split()[0]: t["x"][0] * 1e9 for t in drawn["data"]} == \
            pytest.approx(want["memory_bytes"], rel=1e-12)
        assert drawn["layout"]["shapes"][0]["x0"] == 80
    else:  # the bytes of every axis that moves any, in GB per step
        moved = {a: n for a, n in want["comm_bytes"].items() if n > 0}
        assert dict(zip(drawn["data"][0]["x"], [y * 1e9 for y in drawn["data"][0]["y"]], strict=True)) == \
            pytest.approx(moved, rel=1e-12)
    # a mesh that does not divide the GPUs, and a box the page cannot use, each refused in one sentence
    # naming the boxes
    tp = at.number_input(key=f"{path[6:-3]}_scale_tp_{model}")
    tp.set_value(3).run()
    said = (f"tp x pp x cp x ep = {3 * mesh['pp']} does not divide {gpus} GPUs; choose sizes whose product "
            "divides it")
    assert [e.value for e in at.error] == [said]
    tp.set_value(0).run()
    assert [e.value for e in at.error] == [f"tp = 0: choose 1 to {gpus}"]
