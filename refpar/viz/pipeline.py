"""Figures of a pipeline schedule: the simulated timeline as a Gantt, what each stage holds for
backward over time, and the ranks x ticks grid.

Data in (a `Schedule` and the `Timeline` that `refpar.parallel.pipeline.schedules.simulate` gives),
a Plotly figure out; the app's Pipeline page lays these out. Ranks run down the y axis (rank 0 on
top, as `format_grid` prints them), time runs right.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from refpar.parallel.pipeline.schedules import KINDS, Schedule, Timeline, stored

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "idle": "#d62728"}
IDLE_OPACITY = 0.25
MAX_FRAMES = 120  # a longer animation only slows the browser; frames are then spread evenly


def _bars(timeline: Timeline, until: float) -> list[go.Bar]:
    """One bar trace per kind and one for idle time, everything cut off at time `until`."""
    traces = []
    for kind in KINDS:
        slots = [s for row in timeline.slots.values() for s in row if s.action.kind == kind]
        shown = [s for s in slots if s.start < until]
        traces.append(go.Bar(
            name=kind, orientation="h", marker_color=COLOURS[kind],
            y=[s.rank for s in shown], base=[s.start for s in shown],
            x=[min(s.end, until) - s.start for s in shown], text=[str(s.action) for s in shown],
            textposition="inside", insidetextanchor="middle",
            hovertemplate="%{text}: %{base} to %{customdata}<extra></extra>",
            customdata=[s.end for s in shown], marker_line={"color": "white", "width": 1},
        ))
    gaps = [(r, a, b) for r, row in timeline.idle.items() for a, b in row if a < until]
    traces.append(go.Bar(
        name="idle", orientation="h", marker_color=COLOURS["idle"], opacity=IDLE_OPACITY,
        y=[r for r, _, _ in gaps], base=[a for _, a, _ in gaps],
        x=[min(b, until) - a for _, a, b in gaps],
        hovertemplate="idle %{base} to %{customdata}<extra></extra>",
        customdata=[b for _, _, b in gaps],
    ))
    return traces


def frame_times(timeline: Timeline) -> list[float]:
    """The instants the animation stops at: every time an action ends (at most MAX_FRAMES)."""
    times = sorted({s.end for row in timeline.slots.values() for s in row})
    if len(times) > MAX_FRAMES:
        times = [times[int(i)] for i in np.linspace(0, len(times) - 1, MAX_FRAMES)]
    return times


def play_controls(labels: list[str], prefix: str) -> dict:
    """A play/pause pair and a slider over frames named by `labels` (redraw: bars are not scatter)."""
    step_args = {"frame": {"duration": 300, "redraw": True}, "mode": "immediate",
                 "transition": {"duration": 0}}
    return {
        "updatemenus": [{
            "type": "buttons", "showactive": False, "x": 0, "y": -0.12, "xanchor": "left",
            "buttons": [
                {"label": "Play", "method": "animate", "args": [None, {**step_args, "fromcurrent": True}]},
                {"label": "Pause", "method": "animate",
                 "args": [[None], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"}]},
            ],
        }],
        "sliders": [{
            "active": len(labels) - 1, "x": 0.12, "len": 0.88, "y": -0.05,
            "currentvalue": {"prefix": prefix},
            "steps": [{"label": label, "method": "animate", "args": [[label], step_args]}
                      for label in labels],
        }],
    }


def gantt_figure(timeline: Timeline, title: str = "") -> go.Figure:
    """Ranks x time: F, B and W bars labelled like `format_grid` ("1F0"), idle time shaded red.
    Animated: each frame shows the timeline up to the end of one more action."""
    p = len(timeline.slots)
    times = frame_times(timeline)
    labels = [f"{t:g}" for t in times]
    fig = go.Figure(data=_bars(timeline, timeline.makespan),
                    frames=[go.Frame(name=label, data=_bars(timeline, t))
                            for label, t in zip(labels, times, strict=True)])
    fig.update_layout(
        title=title, barmode="overlay", height=140 + 45 * p, margin={"b": 110},
        xaxis={"title": "time (F = 1 unit)", "range": [0, timeline.makespan], "autorange": False},
        yaxis={"title": "rank", "range": [p - 0.5, -0.5], "autorange": False,
               "tickvals": list(range(p)), "ticktext": [f"rank {r}" for r in range(p)]},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        **play_controls(labels, "time "),
    )
    return fig


def idle_total(fig: go.Figure) -> float:
    """The idle time a Gantt figure shades, summed over ranks (what tests and the app compare with
    the timeline's bubble)."""
    idle = next(t for t in fig.data if t.name == "idle")
    return float(np.sum(idle.x)) if idle.x is not None else 0.0


def inflight_figure(schedule: Schedule, timeline: Timeline, title: str = "") -> go.Figure:
    """Per rank, the (stage, microbatch) pairs whose activations are stored for backward, from the
    end of each action on: `stored(schedule)` placed at the simulated times. Multiply by one
    microbatch's activation bytes per stage for memory."""
    counts = stored(schedule)
    fig = go.Figure()
    for rank, slots in timeline.slots.items():
        ordered = sorted(slots, key=lambda s: s.tick)
        fig.add_trace(go.Scatter(
            name=f"rank {rank}", mode="lines", line_shape="hv",
            x=[0.0] + [s.end for s in ordered] + [timeline.makespan],
            y=[0] + [counts[rank][s.tick] for s in ordered] + [counts[rank][-1] if counts[rank] else 0],
        ))
    fig.update_layout(title=title, xaxis_title="time (F = 1 unit)",
                      yaxis_title="microbatches held for backward", height=320)
    return fig


GRID_CODES = {None: 0, "F": 1, "B": 2, "W": 3}


def grid_figure(schedule: Schedule, title: str = "") -> go.Figure:
    """The ranks x ticks grid of `format_grid` as coloured cells, each labelled with its action."""
    n_ticks = max(len(row) for row in schedule.values())
    ranks = sorted(schedule)
    z = np.zeros((len(ranks), n_ticks), dtype=int)
    text = [[""] * n_ticks for _ in ranks]
    for i, rank in enumerate(ranks):
        for tick, a in enumerate(schedule[rank]):
            z[i, tick] = GRID_CODES[None if a is None else a.kind]
            text[i][tick] = "" if a is None else str(a)
    scale = ["#f0f0f0", COLOURS["F"], COLOURS["B"], COLOURS["W"]]
    colorscale = [[edge, c] for k, c in enumerate(scale) for edge in (k / 4, (k + 1) / 4)]
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", zmin=-0.5, zmax=3.5,
                               colorscale=colorscale, showscale=False, xgap=1, ygap=1,
                               hovertemplate="rank %{y} tick %{x}: %{text}<extra></extra>"))
    fig.update_layout(title=title, height=100 + 35 * len(ranks),
                      xaxis={"title": "tick", "dtick": 1 if n_ticks <= 40 else None},
                      yaxis={"title": "rank", "autorange": "reversed", "tickvals": ranks,
                             "ticktext": [f"rank {r}" for r in ranks]})
    return fig
