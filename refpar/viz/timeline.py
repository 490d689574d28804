"""The executed timeline: what a real run's ranks did in its last step, read from the Chrome trace
`refpar train --trace PATH` writes (refpar/engine/run.py:write_traces), drawn per rank as a Gantt:

    compute     each pipeline action the rank ran ("1F0", "0B3", "recompute h.2"), its thread 1
    messages    each collective and point-to-point message, named "op axis tag", its thread 0
    idle        the rest of the step: waiting, and what is neither (the optimizer, bookkeeping)

A run without a pipeline traces no actions (its executor runs one forward and backward), so there
the time between messages is drawn as "compute or idle", not split.

`simulated_from_trace` times the same run's schedule (refpar.parallel.pipeline.simulate.simulate)
with the action times the trace measured, as refpar train's report does for its bubble, so the
executed Gantt can sit next to the simulated one (refpar.viz.pipeline.gantt_figure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from refpar.config import ConfigError
from refpar.parallel.pipeline.schedules import Action, Schedule, overlapped
from refpar.parallel.pipeline.simulate import Timeline, simulate
from refpar.viz.pipeline import COLOURS

AXIS_COLOURS = {"dp": "#9467bd", "dp_cp": "#8c564b", "data": "#8c564b", "tp": "#17becf", "cp": "#bcbd22",
                "ep": "#e377c2", "pp": "#7f7f7f", "world": "#393b79"}
RERUN_COLOUR = "#c49c94"


@dataclass(frozen=True)
class Span:
    rank: int
    start: float  # ms from the trace's first event
    end: float
    name: str  # "1F0" for an action, "op axis tag" for a message
    kind: str  # an action's kind (F, B, W, "recompute") or a message's axis
    args: dict


def spans(trace: dict) -> tuple[list[Span], list[Span]]:
    """(compute spans, message spans) of a Chrome trace, times in ms."""
    compute, messages = [], []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        start, end = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if e.get("cat") == "compute":
            kind = "recompute" if e["name"].startswith("recompute") else _action_kind(e["name"])
            compute.append(Span(e["pid"], start, end, e["name"], kind, e.get("args", {})))
        else:
            messages.append(Span(e["pid"], start, end, e["name"], e.get("cat", ""), e.get("args", {})))
    return compute, messages


# What each event of a trace `refpar train --trace` writes carries (refpar/comm/trace.chrome_trace,
# refpar/engine/run.py:write_traces), which the figures read.
EVENT_FIELDS = ("name", "pid", "ts", "dur")
MESSAGE_ARGS = ("tag", "bytes_sent", "bytes_recv", "step")
ACTION_ARGS = ("tick", "step")


def read_trace_upload(name: str, data: bytes) -> dict:
    """The Chrome trace in the bytes of an uploaded file `name`, or a ConfigError in one sentence
    saying what the file is instead: empty, cut short (not whole JSON), a --json summary, JSON of
    something else, or a trace whose events lack what this refpar writes (another version's, or
    another tool's)."""
    redo = "give the PATH that `refpar train --trace PATH` wrote (not PATH.jsonl)"
    if not data.strip():
        raise ConfigError(f"{name} is empty; {redo}")
    try:
        trace = json.loads(data)
    except ValueError as err:  # UnicodeDecodeError too: bytes that are no text
        if isinstance(err, json.JSONDecodeError) and err.pos > 0:
            raise ConfigError(f"{name} is not whole JSON (it breaks off at character {err.pos}: a file cut "
                              f"short?); {redo}") from None
        raise ConfigError(f"{name} is not JSON; {redo}") from None
    if isinstance(trace, dict) and "losses" in trace and "mesh" in trace:
        raise ConfigError(f"{name} is the --json summary of a run, not its trace; {redo}")
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ConfigError(f"{name} is JSON but not a Chrome trace (it has no traceEvents list); {redo}")
    slices = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    if not slices:
        raise ConfigError(f"{name} is a Chrome trace with no events to draw; {redo}")
    for e in slices:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        wanted = EVENT_FIELDS + tuple(f"args.{a}" for a in
                                      (ACTION_ARGS if e.get("cat") == "compute" else MESSAGE_ARGS))
        missing = [f for f in wanted if (args if f.startswith("args.") else e).get(f.removeprefix("args."))
                   is None and not (f == "args.tick" and str(e.get("name", "")).startswith("recompute"))]
        if missing:
            raise ConfigError(f"{name} is a Chrome trace but not one this refpar writes (its event "
                              f"{e.get('name', '?')!r} has no {missing[0]}: another version's or another "
                              "tool's); trace the run again with this refpar's `refpar train --trace PATH`")
    return trace


def _action_kind(name: str) -> str:
    """"1F0" -> "F"; an overlapped F&B ("1F0+2B1" or the like) -> its first kind."""
    return next(ch for ch in name if ch.isalpha())


def idle_spans(busy: list[tuple[float, float]], end: float) -> list[tuple[float, float]]:
    """The gaps of [0, end] that no (start, end) of `busy` covers."""
    gaps, t = [], 0.0
    for a, b in sorted(busy):
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if t < end:
        gaps.append((t, end))
    return gaps


def executed_figure(trace: dict, title: str = "") -> go.Figure:
    """Ranks down, time right (ms): actions as wide bars in their kind's colour, each message as a
    narrow bar over them in its axis's colour (hover: op, axis, tag, bytes), idle in red."""
    compute, messages = spans(trace)
    ranks = sorted({s.rank for s in compute + messages})
    end = max((s.end for s in compute + messages), default=0.0)
    traces = []
    for kind in sorted({s.kind for s in compute}):
        shown = [s for s in compute if s.kind == kind]
        traces.append(_bar(shown, kind, COLOURS.get(kind, RERUN_COLOUR), 0.8, [s.name for s in shown]))
    for axis in sorted({s.kind for s in messages}):
        shown = [s for s in messages if s.kind == axis]
        hover = [f"{s.name}<br>sent {s.args.get('bytes_sent', 0):,} B, "
                 f"received {s.args.get('bytes_recv', 0):,} B" for s in shown]
        traces.append(_bar(shown, f"{axis} messages", AXIS_COLOURS.get(axis, "#333333"), 0.35, hover))
    gaps = [Span(r, a, b, "", "", {}) for r in ranks
            for a, b in idle_spans([(s.start, s.end) for s in compute + messages if s.rank == r], end)]
    idle = "idle" if compute else "compute or idle"
    traces.append(_bar(gaps, idle, COLOURS["idle"] if compute else "#bbbbbb", 0.8,
                       [f"{idle} {s.end - s.start:.3f} ms" for s in gaps], opacity=0.3))
    fig = go.Figure(traces)
    fig.update_layout(
        title=title, barmode="overlay", height=250 + 40 * len(ranks),
        xaxis={"title": "time in the last step (ms)", "range": [0, end]},
        yaxis={"title": "rank", "range": [len(ranks) - 0.5, -0.5], "tickvals": ranks,
               "ticktext": [f"rank {r}" for r in ranks]},
        # below the axis title: above the plot it would run over the title in a half-width column
        legend={"orientation": "h", "y": -0.22, "yanchor": "top", "x": 0, "xanchor": "left"},
        margin={"b": 130},
        meta={"end": end})
    return fig


def _bar(shown: list[Span], name: str, colour: str, width: float, hover: list[str],
         opacity: float = 1.0) -> go.Bar:
    start = np.array([s.start for s in shown], dtype=float)
    return go.Bar(name=name, orientation="h", y=np.array([s.rank for s in shown], dtype=int), base=start,
                  x=np.array([s.end for s in shown], dtype=float) - start, width=width, marker_color=colour,
                  opacity=opacity, hovertext=hover, hoverinfo="text")


def schedule_from_trace(trace: dict) -> Schedule:
    """The schedule the run executed, read back from its actions: every world rank of a pipeline
    rank runs the same list, and two pipeline ranks never hold the same stages, so the distinct
    lists are the pp ranks' (pp slowest in refpar/mesh.py: pp rank r is world rank r x world/pp);
    each action at its tick, None at a tick the rank idled."""
    compute = [s for s in spans(trace)[0] if s.kind != "recompute"]
    by_rank: dict[int, dict[int, str]] = {}
    for s in compute:
        by_rank.setdefault(s.rank, {})[s.args["tick"]] = s.name
    if not by_rank:
        raise ConfigError("this trace holds no pipeline actions (a run with pp=1), so there is no schedule "
                          "to simulate; trace a run with pp=2 or more")
    world = max(s.rank for s in spans(trace)[1] + compute) + 1
    pp = len({tuple(sorted(row.items())) for row in by_rank.values()})
    rows = [by_rank[r * (world // pp)] for r in range(pp)]
    ticks = max(t for row in rows for t in row) + 1  # every row as long as the grid (simulate.unit_grid)
    return {r: [_action(row[t]) if t in row else None for t in range(ticks)] for r, row in enumerate(rows)}


def _action(name: str) -> Action:
    """An Action from its str(): "1F0", or DualPipe's overlapped "0F5&7B2"."""
    if "&" in name:
        return overlapped(*map(_action, name.split("&")))
    kind = next(ch for ch in name if ch.isalpha())
    stage, microbatch = name.split(kind)
    return Action(int(stage), kind, int(microbatch))


def simulated_from_trace(trace: dict) -> tuple[Schedule, Timeline]:
    """The executed schedule (`schedule_from_trace`) simulated with the action times the trace
    measured on each pipeline rank's first world rank, whose executor gathered the timeline
    refpar train's report prices its "simulated" bubble with."""
    schedule = schedule_from_trace(trace)
    compute = [s for s in spans(trace)[0] if s.kind != "recompute"]
    world = max(s.rank for s in spans(trace)[1] + compute) + 1
    stride = world // len(schedule)
    durations = {(s.rank // stride, s.args["tick"]): (s.end - s.start) / 1e3 for s in compute
                 if s.rank % stride == 0}
    return schedule, simulate(schedule, durations=durations)
