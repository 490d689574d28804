"""The executed timeline: what a real run's ranks did in its last step, read from the Chrome trace
`refpar train --trace PATH` writes (refpar/engine/run.py:write_traces), drawn per rank as a Gantt:

    compute     each pipeline action the rank ran ("1F0", "0B3", "recompute h.2"), its thread 1
    messages    each collective and point-to-point message, named "op axis tag", its thread 0
    idle        the rest of the step: waiting, and what is neither (the optimizer, bookkeeping)

A run without a pipeline traces no actions (its executor runs one forward and backward), so there
the time between messages is drawn as "compute or idle", not split.

`simulated_from_trace` times the same run's schedule (refpar.schedules.simulate.simulate)
with the action times the trace measured, as refpar train's report does for its bubble, so the
executed Gantt can sit next to the simulated one (refpar.viz.pipeline.gantt_figure).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from refpar.config import ConfigError
from refpar.schedules import Action, Schedule, overlapped
from refpar.schedules.simulate import Slot, Timeline, simulate
from refpar.viz.pipeline import COLOURS, gantt_figure

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
# Bounds on what a trace may hold before it is drawn, far above any run the app launches (20 steps
# of 16 ranks) and far below what exhausts a laptop: an upload is read whole into memory, and its
# JSON takes ~10x its bytes as Python objects.
MAX_TRACE_BYTES = 64 << 20
MAX_EVENTS = 1_000_000
MAX_RANKS = 4096
MAX_MICROSECONDS = 1e13  # ~4 months: a trace's times count from its first event
ACTION_NAME = re.compile(r"\d{1,6}[FBW]\d{1,9}(&\d{1,6}[FBW]\d{1,9})?")  # "1F0", DualPipe's "0F5&7B2"
REDO = "give the PATH that `refpar train --trace PATH` wrote (not PATH.jsonl)"


def read_trace_upload(name: str, data: bytes) -> dict:
    """The Chrome trace in the bytes of an uploaded file `name`, or a ConfigError in one sentence
    saying what the file is instead: too large, empty, cut short (not whole JSON), nested too deep,
    a --json summary, JSON of something else, or a trace whose events lack what this refpar writes
    or hold what it never writes (another version's, another tool's, a hand-edited one's)."""
    if len(data) > MAX_TRACE_BYTES:
        raise ConfigError(f"{name} holds {len(data):,} bytes, more than the {MAX_TRACE_BYTES >> 20} MiB "
                          f"a trace of the app's runs needs; {REDO}")
    if not data.strip():
        raise ConfigError(f"{name} is empty; {REDO}")
    try:
        trace = json.loads(data)
    except RecursionError:
        raise ConfigError(f"{name} is JSON nested too deeply to be a Chrome trace; {REDO}") from None
    except ValueError as err:  # UnicodeDecodeError too: bytes that are no text
        if isinstance(err, json.JSONDecodeError) and err.pos > 0:
            raise ConfigError(f"{name} is not whole JSON (it breaks off at character {err.pos}: a file cut "
                              f"short?); {REDO}") from None
        raise ConfigError(f"{name} is not JSON; {REDO}") from None
    if isinstance(trace, dict) and "losses" in trace and "mesh" in trace:
        raise ConfigError(f"{name} is the --json summary of a run, not its trace; {REDO}")
    return check_trace(name, trace)


def read_jsonl_upload(name: str, data: bytes) -> dict:
    """The Chrome trace of an uploaded PATH.jsonl (every message of a `refpar train --trace PATH` run, one
    JSON line each: refpar.comm.trace.write_trace), checked as a kept run's is; or a ConfigError in one
    sentence naming the file and its first line that is not such a message."""
    from refpar.comm.trace import chrome_trace, event_of

    redo = "give the PATH.jsonl that `refpar train --trace PATH` wrote"
    if len(data) > MAX_TRACE_BYTES:
        raise ConfigError(f"{name} holds {len(data):,} bytes, more than the {MAX_TRACE_BYTES >> 20} MiB "
                          f"a trace of the app's runs needs; {redo}")
    events = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            event = event_of(fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError, KeyError, RecursionError):
            event = None  # bytes that are no text, not JSON, or JSON with other fields
        if event is None:
            raise ConfigError(f"line {number} of {name} is not a message as PATH.jsonl holds them; {redo}")
        events.append(event)
        if len(events) > MAX_EVENTS:
            raise ConfigError(f"{name} holds more than the {MAX_EVENTS:,} messages the app draws; {redo}")
    if not events:
        raise ConfigError(f"{name} holds no message; {redo}")
    try:
        trace = chrome_trace(events)
    except TypeError:  # a time that is no number
        raise ConfigError(f"{name} has a message whose times are not numbers; {redo}") from None
    return check_trace(name, trace, whole_run=True)


def check_trace(name: str, trace, whole_run: bool = False) -> dict:
    """`trace` if it is a Chrome trace as this refpar writes it, checked for everything the figures
    and `schedule_from_trace` read (types, finite and bounded numbers, action names), else a
    ConfigError in one sentence naming `name` and the first thing wrong. `whole_run`: every event
    of a run (refpar.comm.trace.chrome_trace of its PATH.jsonl), where a message sent outside any
    step (the report's gathers) has no step."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ConfigError(f"{name} is JSON but not a Chrome trace (it has no traceEvents list); {REDO}")
    events = trace["traceEvents"]
    if len(events) > MAX_EVENTS:
        raise ConfigError(f"{name} holds {len(events):,} events, more than the {MAX_EVENTS:,} the app "
                          f"draws; {REDO}")
    if not all(isinstance(e, dict) for e in events):
        raise ConfigError(f"{name} is a Chrome trace with an event that is not a JSON object; {REDO}")
    slices = [e for e in events if e.get("ph") == "X"]
    if not slices:
        raise ConfigError(f"{name} is a Chrome trace with no events to draw; {REDO}")
    for e in slices:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        wanted = EVENT_FIELDS + tuple(f"args.{a}" for a in
                                      (ACTION_ARGS if e.get("cat") == "compute" else MESSAGE_ARGS))
        missing = [f for f in wanted if (args if f.startswith("args.") else e).get(f.removeprefix("args."))
                   is None and not (f == "args.tick" and str(e.get("name", "")).startswith("recompute"))
                   and not (f == "args.step" and whole_run)]
        if missing:
            raise ConfigError(f"{name} is a Chrome trace but not one this refpar writes (its event "
                              f"{str(e.get('name', '?'))[:40]!r} has no {missing[0]}: another version's or "
                              "another tool's); trace the run again with this refpar's "
                              "`refpar train --trace PATH`")
        wrong = _wrong_field(e, {**args, "step": 0} if whole_run and args.get("step") is None else args)
        if wrong:
            raise ConfigError(f"{name} is a Chrome trace this refpar did not write as it stands (its event "
                              f"{str(e['name'])[:40]!r} has {wrong}); trace the run again with `refpar train "
                              "--trace PATH`")
    return trace


def _count(x, high: float) -> bool:
    """An int (not a bool) in [0, high]."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= high


def _wrong_field(e: dict, args: dict) -> str | None:
    """What in one slice event (its fields present) is not what refpar writes, in a few words."""
    if not isinstance(e["name"], str) or len(e["name"]) > 200:
        return "a name that is not a short text"
    if not isinstance(e.get("cat", ""), str):
        return "a cat that is not a text"
    if not _count(e["pid"], MAX_RANKS - 1):
        return f"pid {str(e['pid'])[:20]}, not a rank from 0 to {MAX_RANKS - 1}"
    for field in ("ts", "dur"):
        x = e[field]
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= MAX_MICROSECONDS:
            return f"{field} {str(x)[:20]}, not microseconds from 0 to {MAX_MICROSECONDS:.0e}"
    if not _count(args["step"], 10**9):
        return f"step {str(args['step'])[:20]}, not a whole number of steps"
    if e.get("cat") == "compute":
        if e["name"].startswith("recompute"):
            return None
        if not ACTION_NAME.fullmatch(e["name"]):
            return "a name that is no pipeline action (like 1F0)"
        if not _count(args["tick"], 10**9):
            return f"tick {str(args['tick'])[:20]}, not a whole number of ticks"
        return None
    if not isinstance(args["tag"], str):
        return "a tag that is not a text"
    for field in ("bytes_sent", "bytes_recv"):
        if not _count(args[field], 1 << 62):
            return f"{field} {str(args[field])[:20]}, not a whole number of bytes"
    return None


def _action_kind(name: str) -> str:
    """"1F0" -> "F"; an overlapped F&B ("0F5&7B2") -> its first kind."""
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


# Each rank's row holds two lanes, so that no bar hides another: its compute above (actions, or in
# a run without a pipeline the time between its messages) and its messages in a thin lane below.
COMPUTE_LANE, MESSAGE_LANE = {"width": 0.5, "offset": -0.4}, {"width": 0.22, "offset": 0.15}
P2P_OPS = ("isend", "irecv", "send", "recv")
# A run without a pipeline: the time between messages, named by the phase of the message that ends it.
BETWEEN = {"fwd": ("forward compute", "F"), "bwd": ("backward compute", "B"),
           None: ("the rest (loss, optimizer, waiting)", "idle")}
IDLE = "idle"


def executed_figure(trace: dict, title: str = "") -> go.Figure:
    """Ranks down, time right (ms), each rank's row in two lanes: above, its actions in their kind's
    colour (F, B, W, recomputation) and idle, the time no action runs, in red; below, each message
    as a thin bar in its axis's colour (hover: op, axis, tag, bytes), and each pipeline send joined
    to its receive by a line (sent at the send's start, arrived at the receive's end). A run without
    a pipeline traces no actions: its compute lane splits the time between messages by the phase of
    the message that ends it (forward, backward, the rest)."""
    compute, messages = spans(trace)
    ranks = sorted({s.rank for s in compute + messages})
    end = max((s.end for s in compute + messages), default=0.0)
    traces = []
    for kind in sorted({s.kind for s in compute}):
        shown = [s for s in compute if s.kind == kind]
        traces.append(_bar(shown, kind, COLOURS.get(kind, RERUN_COLOUR), COMPUTE_LANE,
                           [s.name for s in shown]))
    if compute:
        gaps = [Span(r, a, b, "", IDLE, {}) for r in ranks
                for a, b in idle_spans([(s.start, s.end) for s in compute if s.rank == r], end)]
        traces.append(_bar(gaps, IDLE, COLOURS["idle"], COMPUTE_LANE,
                           [f"idle {s.end - s.start:.3f} ms" for s in gaps], opacity=0.3))
    else:
        between = between_messages(messages, ranks, end)
        for phase, (name, colour) in BETWEEN.items():
            shown = [s for s in between if s.kind == str(phase)]
            if shown:
                traces.append(_bar(shown, name, COLOURS[colour], COMPUTE_LANE,
                                   [f"{name} {s.end - s.start:.3f} ms" for s in shown], opacity=0.45))
    for axis in sorted({s.kind for s in messages}):
        shown = [s for s in messages if s.kind == axis]
        hover = [f"{s.name}<br>{s.start:.3f} to {s.end:.3f} ms, sent {s.args.get('bytes_sent', 0):,} B, "
                 f"received {s.args.get('bytes_recv', 0):,} B" for s in shown]
        # a posted receive lasts until its data arrives, most of the step: faint, the lines carry it
        faint = all(s.name.split(" ")[0] in P2P_OPS for s in shown)
        traces.append(_bar(shown, f"{axis} messages", AXIS_COLOURS.get(axis, "#333333"), MESSAGE_LANE, hover,
                           opacity=0.3 if faint else 0.9))
    arrows = send_receive_pairs(messages)
    if arrows:
        lane = MESSAGE_LANE["offset"] + MESSAGE_LANE["width"] / 2
        x = [t for send, recv in arrows for t in (send.start, recv.end, None)]
        y = [r for send, recv in arrows for r in (send.rank + lane, recv.rank + lane, None)]
        traces.append(go.Scatter(x=x, y=y, mode="lines+markers", name="send to receive",
                                 line={"color": AXIS_COLOURS["pp"], "width": 1},
                                 marker={"size": 5, "symbol": "circle"}, hoverinfo="skip"))
    fig = go.Figure(traces)
    fig.update_layout(
        title=title, barmode="overlay", height=250 + 60 * len(ranks),
        xaxis={"title": "time in the last step (ms)", "range": [0, end]},
        yaxis={"title": "rank", "range": [max(ranks, default=0) + 0.5, min(ranks, default=0) - 0.5],
               "tickvals": ranks, "ticktext": [f"rank {r}" for r in ranks]},
        # below the axis title: above the plot it would run over the title in a half-width column
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0,
                "xanchor": "left"},
        margin={"b": 130},
        meta={"end": end})
    return fig


def between_messages(messages: list[Span], ranks: list[int], end: float) -> list[Span]:
    """The time of each rank that none of its messages covers, each gap of kind "fwd" or "bwd" when
    the message that ends it belongs to the forward or the backward (its args.phase), else "None"."""
    out = []
    for r in ranks:
        mine = sorted((s for s in messages if s.rank == r), key=lambda s: s.start)
        for a, b in idle_spans([(s.start, s.end) for s in mine], end):
            after = next((s for s in mine if s.start >= b), None)
            phase = after.args.get("phase") if after is not None else None
            out.append(Span(r, a, b, "", str(phase if phase in ("fwd", "bwd") else None), {}))
    return out


def send_receive_pairs(messages: list[Span]) -> list[tuple[Span, Span]]:
    """Each point-to-point send with the receive of the same tag on its peer (the k-th send of a tag
    to the k-th receive of it), in the order sent."""
    sends = [s for s in messages if s.name.split(" ")[0] in ("isend", "send")]
    recvs: dict[str, list[Span]] = {}
    for s in sorted(messages, key=lambda s: s.start):
        if s.name.split(" ")[0] in ("irecv", "recv"):
            recvs.setdefault(str(s.args.get("tag")), []).append(s)
    pairs = []
    for send in sorted(sends, key=lambda s: s.start):
        waiting = recvs.get(str(send.args.get("tag")), [])
        match = next((r for r in waiting if r.args.get("peer") == send.rank
                      and r.rank == send.args.get("peer")), None)
        if match is not None:
            waiting.remove(match)
            pairs.append((send, match))
    return pairs


def group_arrivals(events: list[dict]) -> list[float]:
    """For each collective event (a Chrome trace's "X" slice whose args name its group), the time in
    ms at which the last member of its group started the same call (the k-th call of this name on
    each member); a member that started earlier waited until then, however long its bar. A point-to-
    point message, or a call whose group is not all in the trace, arrives at its own start."""
    seen: dict[tuple[int, str], int] = {}
    index = []
    for e in events:
        k = seen.get((e["pid"], e["name"]), 0)
        seen[e["pid"], e["name"]] = k + 1
        index.append(k)
    starts = {(e["pid"], e["name"], k): e["ts"] / 1e3 for e, k in zip(events, index, strict=True)}
    out = []
    for e, k in zip(events, index, strict=True):
        group = e.get("args", {}).get("group")
        own = e["ts"] / 1e3
        if e["name"].split(" ")[0] in P2P_OPS or not isinstance(group, list):
            out.append(own)
            continue
        theirs = [starts.get((g, e["name"], k)) for g in group]
        out.append(max(theirs) if None not in theirs else own)
    return out


def _bar(shown: list[Span], name: str, colour: str, lane: dict, hover: list[str],
         opacity: float = 1.0) -> go.Bar:
    start = np.array([s.start for s in shown], dtype=float)
    return go.Bar(name=name, orientation="h", y=np.array([s.rank for s in shown], dtype=int), base=start,
                  x=np.array([s.end for s in shown], dtype=float) - start, **lane, marker_color=colour,
                  opacity=opacity, hovertext=hover, hoverinfo="text")


def trace_figures(trace: dict, title: str = "executed, last step") -> tuple[go.Figure, go.Figure | None, str]:
    """What the app draws of a checked trace (`check_trace`): the executed figure, the simulated
    Gantt of the same schedule and action times beside it (None where there is no pipeline, or its
    actions make no schedule), and a sentence saying what the figures show or why one is missing.
    Raises nothing but ConfigError."""
    executed = executed_figure(trace, title)
    compute, _ = spans(trace)
    if not compute:
        return executed, None, ("Without a pipeline the run traces its messages only: the time between "
                                "them is split by the phase of the message that ends it. On a CPU with "
                                "more ranks than cores, a message's time is mostly waiting for the "
                                "other ranks.")
    try:
        _, simulated = simulated_from_trace(trace)
    except ConfigError as err:
        return executed, None, f"The trace's actions do not make a schedule to simulate: {err}"
    measured = measured_from_trace(trace).bubble_fraction
    figure = gantt_figure(simulated, f"simulated: bubble {simulated.bubble_fraction:.1%}")
    figure.update_xaxes(title="ms (each action as long as it ran)")
    return executed, figure, (f"Bubble: measured {measured:.1%} of the pipeline ranks' step (as refpar "
                              f"train reports it), simulated {simulated.bubble_fraction:.1%} (the same "
                              "actions with no waiting for messages or cores). On a CPU with more ranks "
                              "than cores, a message's time is mostly waiting.")


def measured_from_trace(trace: dict) -> Timeline:
    """The executed timeline as refpar train's report measures its bubble with
    (refpar/parallel/pipeline/executor.py:PipelineExecutor.measured_timeline): each pipeline rank's
    actions on its first world rank, in ms from the earliest start, idle everything else up to the
    last end."""
    schedule = schedule_from_trace(trace)
    compute = [s for s in spans(trace)[0] if s.kind != "recompute"]
    world = max(s.rank for s in spans(trace)[1] + compute) + 1
    stride = world // len(schedule)
    mine = [s for s in compute if s.rank % stride == 0]
    t0 = min(s.start for s in mine)
    slots = {r: [] for r in schedule}
    for s in mine:
        r, t = s.rank // stride, s.args["tick"]
        slots[r].append(Slot(r, t, schedule[r][t], s.start - t0, s.end - t0))
    return Timeline(slots, [], max(s.end for s in mine) - t0)


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
    if world % pp or any(r * (world // pp) not in by_rank for r in range(pp)):
        raise ConfigError(f"this trace's actions make {pp} distinct pipeline ranks, which do not lay out "
                          f"over its {world} ranks as refpar's mesh does (pp slowest); trace the run again "
                          "with `refpar train --trace PATH`")
    rows = [by_rank[r * (world // pp)] for r in range(pp)]
    ticks = max(t for row in rows for t in row) + 1  # every row as long as the grid (simulate.unit_grid)
    # A unit grid is at most as long as its actions run one after another (simulate.unit_grid); a tick
    # far beyond that is no run's, and a list that long would exhaust the memory (a 419-byte upload
    # with tick 10^9 asked for 3 GB).
    actions = sum(len(row) for row in rows)
    if ticks > 2 * actions:
        raise ConfigError(f"this trace places an action at tick {ticks - 1}, but its {actions} actions fill "
                          f"at most {actions} ticks; trace the run again with `refpar train --trace PATH`")
    return {r: [_action(row[t]) if t in row else None for t in range(ticks)] for r, row in enumerate(rows)}


def _action(name: str) -> Action:
    """An Action from its str(): "1F0", or DualPipe's overlapped "0F5&7B2"."""
    if "&" in name:
        return overlapped(*map(_action, name.split("&")))
    kind = next(ch for ch in name if ch.isalpha())
    stage, microbatch = name.split(kind)
    return Action(int(stage), kind, int(microbatch))


def simulated_from_trace(trace: dict) -> tuple[Schedule, Timeline]:
    """The executed schedule (`schedule_from_trace`) simulated with the action times (ms) the trace
    measured on each pipeline rank's first world rank, whose executor gathered the timeline
    refpar train's report prices its "simulated" bubble with."""
    schedule = schedule_from_trace(trace)
    compute = [s for s in spans(trace)[0] if s.kind != "recompute"]
    world = max(s.rank for s in spans(trace)[1] + compute) + 1
    stride = world // len(schedule)
    durations = {(s.rank // stride, s.args["tick"]): s.end - s.start for s in compute  # ms
                 if s.rank % stride == 0}
    return schedule, simulate(schedule, durations=durations)
