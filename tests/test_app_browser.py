"""The app in a real browser: start it with `refpar app` on a free localhost port, open it in Chromium via
Playwright, click through every page, play an animation, take screenshots, and check that no page
shows a Streamlit exception.

    REFPAR_SCREENSHOTS=docs python -m pytest tests/test_app_browser.py   # refresh docs/app-*.png
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PAGES = ["Sharding layouts", "Pipeline schedules", "Whole mesh", "Communication", "Memory", "Plan",
         "Run for real", "Serving", "Lessons"]
NO_FIGURE = ("Run for real", "Serving", "Lessons")  # Serving draws its figures after a run
CHANGED = "t => document.querySelector('.js-plotly-plot .gtitle').textContent !== t"
# Every figure's text inside the figure (a Plotly title or a subplot title is never wrapped: too long,
# it is cut at the figure's edge), and no Play/Pause button over a slider's labels. Returns what is wrong.
LAYOUT_PROBLEMS = """() => {
  const box = e => e.getBoundingClientRect();
  const meets = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const problems = [];
  document.querySelectorAll('.js-plotly-plot').forEach((plot, k) => {
    const edge = box(plot);
    plot.querySelectorAll('.gtitle, .annotation-text').forEach(t => {
      const b = box(t);
      if (b.width && (b.left < edge.left - 1 || b.right > edge.right + 1))
        problems.push(`figure ${k}: "${t.textContent}" runs past the figure's edge`);
    });
    const labels = [...plot.querySelectorAll('.slider-label, .slider-group text')].map(box);
    plot.querySelectorAll('.updatemenu-button').forEach(button => {
      if (labels.some(l => l.width && meets(l, box(button))))
        problems.push(`figure ${k}: a button covers a slider label`);
    });
  });
  return problems;
}"""
# Every page and its distinctive modes, as docs/app.md lists them (REFPAR_SCREENSHOTS=docs writes them).
SHOTS = ("app-home.png", "app-sharding.png", "app-sharding-mixed.png", "app-pipeline.png",
         "app-pipeline-compare.png", "app-mesh.png", "app-mesh-step.png", "app-communication.png",
         "app-memory.png", "app-plan.png", "app-run.png", "app-run-timeline.png", "app-serving.png",
         "app-lessons.png")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is not installed: pip install -e '.[dev]'"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def app_url(moe_pipeline_run, tmp_path):
    """The app, its last run the kept result of a real traced pp=2 x ep=2 run (as if Run for real had
    launched it): the pages show what they show after a run."""
    port = free_port()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cache = tmp_path / "last-run.json"
    cache.write_bytes(moe_pipeline_run["cache"].read_bytes())
    env = {**os.environ, "PYTHONPATH": path, "REFPAR_APP_CACHE": str(cache)}
    # Through `refpar app`, as a user starts it; its own process group, so that ending the group
    # ends the Streamlit server it started too.
    server = subprocess.Popen([sys.executable, "-m", "refpar", "app", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://localhost:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# The figure's bars as Plotly drew them: each trace's name, ranks and hover text (_fullData: the
# arrays decoded from the base64 Streamlit sends).
BARS = ("el => el._fullData.filter(t => t.type === 'bar')"  # not the lines from each send to its receive
        ".map(t => ({name: t.name, y: Array.from(t.y), text: Array.from(t.hovertext)}))")


def open_uploaded_traces(page, trace: Path, tmp_path: Path) -> None:
    """Run for real's uploader given the trace file a real run wrote: the executed Gantt draws every
    rank, each action and each message with its tag, as the file holds them; then a file cut short
    gets one sentence, and no traceback."""
    box = page.get_by_test_id("stExpander").filter(has_text="open the trace of another run")
    box.get_by_text("open the trace of another run").click()
    box.locator("input[type=file]").set_input_files(str(trace))
    executed = box.locator(".js-plotly-plot").filter(has_text="executed, last step")
    executed.wait_for()
    settle(page)
    assert page.get_by_test_id("stException").count() == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    bars = executed.evaluate(BARS)
    assert executed.evaluate("el => el.layout.yaxis.tickvals") == sorted({e["pid"] for e in events})
    drawn = sorted((rank, text.split("<br>")[0]) for b in bars if b["name"].endswith(" messages")
                   for rank, text in zip(b["y"], b["text"], strict=True))
    assert drawn == sorted((e["pid"], e["name"]) for e in events if e["cat"] != "compute")
    assert any(" ep h.0.mlp.experts:dispatch" in name for _, name in drawn)  # the tags, drawn
    actions = sorted((rank, text) for b in bars if not b["name"].endswith(("messages", "idle"))
                     for rank, text in zip(b["y"], b["text"], strict=True))
    assert actions == sorted((e["pid"], e["name"]) for e in events if e["cat"] == "compute")
    cut = tmp_path / "cut.json"
    cut.write_bytes(trace.read_bytes()[:5000])  # a file cut short: a kill mid-write, a full disk
    box.locator("input[type=file]").set_input_files(str(cut))
    alert = box.get_by_test_id("stAlert").filter(has_text="cut.json")
    alert.wait_for()
    assert "cut.json is not whole JSON" in alert.text_content()
    assert page.get_by_test_id("stException").count() == 0


def settle(page) -> None:
    """Waits for the script run to end (Streamlit's running indicator gone)."""
    page.wait_for_function("!document.querySelector('[data-testid=\"stStatusWidget\"]')")


@pytest.mark.timeout(300)
def test_every_page_renders_in_chromium_without_an_exception(app_url, moe_pipeline_run, tmp_path):
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("REFPAR_SCREENSHOTS", tmp_path))
    taken = set()

    def shoot(name: str) -> None:
        if "REFPAR_SCREENSHOTS" in os.environ:
            # not mid-rerun, when Streamlit greys out what it is about to redraw, nor before the
            # browser has drawn what the rerun sent
            settle(page)
            page.wait_for_timeout(500)
            settle(page)
            page.screenshot(path=str(shots / name), full_page=False)
            taken.add(name)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(90_000)
            page.goto(app_url)
            page.get_by_text("parallel training, step by step").wait_for()
            page.locator(".js-plotly-plot").first.wait_for()  # Home's picture
            shoot("app-home.png")
            for name in PAGES:
                page.get_by_test_id("stSidebarNav").get_by_role("link", name=name).click()
                page.get_by_role("heading", name=name).wait_for()
                settle(page)
                if name not in NO_FIGURE:
                    page.locator(".js-plotly-plot").first.wait_for()
                if name == "Sharding layouts":
                    # It opens on the first moment (issue 44); Play: the title names the frame
                    # shown, so it changes, until the last moment.
                    plot = page.locator(".js-plotly-plot").first
                    plot.scroll_into_view_if_needed()
                    title = plot.locator(".gtitle")
                    first = title.text_content()
                    assert "before the step" in first
                    plot.locator(".updatemenu-button").first.click()
                    page.wait_for_function(CHANGED, arg=first)
                    page.wait_for_function(CHANGED.replace("!== t", ".includes(t)"), arg="after the step")
                    page.evaluate("window.scrollTo(0, 0)")
                    shoot("app-sharding.png")
                    page.get_by_text("mix two axes").click()  # dp x tp with ZeRO-3, each slice by its ranks
                    intro = page.get_by_text("Two axes at once", exact=False)
                    intro.wait_for()
                    settle(page)
                    page.locator(".js-plotly-plot").first.wait_for()
                    assert page.evaluate(LAYOUT_PROBLEMS) == [], "the mixed axes"
                    intro.evaluate("e => e.scrollIntoView({block: 'start'})")  # its figure below it
                    shoot("app-sharding-mixed.png")
                    page.get_by_text("mix two axes").click()
                    settle(page)
                assert page.evaluate(LAYOUT_PROBLEMS) == [], name
                if name == "Pipeline schedules":  # two columns: the narrowest figures the app draws
                    shoot("app-pipeline.png")
                    page.get_by_text("compare two schedules side by side").click()
                    page.locator(".js-plotly-plot").nth(5).wait_for()
                    assert page.evaluate(LAYOUT_PROBLEMS) == [], "the pipeline schedules side by side"
                    page.locator(".js-plotly-plot").nth(3).scroll_into_view_if_needed()
                    shoot("app-pipeline-compare.png")
                    page.get_by_text("compare two schedules side by side").click()
                    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length == 3")
                if name == "Whole mesh":
                    # A click on rank 5's square selects it: its holdings, its groups ringed.
                    # (Plotly's drag layer over the points takes the click and picks the point under it.)
                    point = page.locator(".js-plotly-plot").first.locator(".scatterlayer .point").nth(5)
                    point.evaluate("p => p.scrollIntoView({block: 'center'})")
                    box = point.bounding_box()
                    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
                    page.get_by_text("What rank 5 holds").wait_for()
                    page.get_by_test_id("stTable").get_by_text("stage 1: blocks 2-3 + head").wait_for()
                    settle(page)
                    assert page.evaluate(LAYOUT_PROBLEMS) == [], "the whole mesh, rank 5 selected"
                    shoot("app-mesh.png")
                    page.get_by_role("heading", name="Through one training step").scroll_into_view_if_needed()
                    shoot("app-mesh-step.png")
                assert page.get_by_test_id("stException").count() == 0, f"{name} shows an exception"
                assert page.get_by_test_id("stAlert").filter(has_text="Traceback").count() == 0
                if name == "Communication":
                    page.locator(".js-plotly-plot").nth(1).scroll_into_view_if_needed()  # the traffic matrix
                    shoot("app-communication.png")
                if name in ("Memory", "Plan", "Serving", "Lessons"):
                    shoot(f"app-{name.lower()}.png")
                if name == "Run for real":  # the kept run: its claim, its routing, its executed timeline
                    claim = page.get_by_text("matches one device")
                    claim.wait_for()
                    claim.evaluate("e => e.scrollIntoView({block: 'center'})")
                    shoot("app-run.png")
                    executed = page.locator(".js-plotly-plot").filter(has_text="executed, last step").first
                    executed.wait_for()
                    assert page.evaluate(LAYOUT_PROBLEMS) == [], "the executed timeline"
                    executed.scroll_into_view_if_needed()
                    shoot("app-run-timeline.png")
                    open_uploaded_traces(page, moe_pipeline_run["trace_path"], tmp_path)
            if "REFPAR_SCREENSHOTS" in os.environ:
                assert taken == set(SHOTS)
                for f in SHOTS:  # readable, and small enough to keep in the repository
                    assert 10_000 < (shots / f).stat().st_size < 250_000, f
        finally:
            browser.close()
