"""Figures of a pipeline schedule: the simulated timeline as a Gantt, what each stage holds for
backward over time, and the ranks x ticks grid.

Data in (a `Schedule` and the `Timeline` that `refpar.schedules.simulate.simulate` gives),
a Plotly figure out; the app's Pipeline page lays these out. Ranks run down the y axis (rank 0 on
top, as `format_grid` prints them), time runs right. Where a rank holds more than one stage (the
interleaved, V-shaped and bidirectional schedules), its first stage's actions are drawn in the
kind's colour and its second stage's in a lighter shade (chunks 0, 2, ... and 1, 3, ... for v > 2);
an overlapped F&B takes the shade of its forward's stage.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from refpar.schedules import KINDS, OVERLAP, Action, Schedule, stage_map
from refpar.schedules.formats import action_name
from refpar.schedules.simulate import Timeline, stored

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", OVERLAP: "#b279a2", "idle": "#d62728"}
SHADES = {"F": "#9ecae9", "B": "#ffbf79", "W": "#88d27a", OVERLAP: "#d6a5c9"}  # a rank's 2nd stage
DRAWN = (*KINDS, OVERLAP)
SECOND = " (2nd chunk)"  # the name of a kind's trace for the second stage of each rank
IDLE_OPACITY = 0.25
MAX_FRAMES = 120  # a longer animation only slows the browser; frames are then spread evenly
BAR_BUDGET = 60_000  # bars over all frames: each frame repeats the bars before it


def chunk_of(actions) -> dict[int, int]:
    """Stage -> which of its rank's stages it is (0 the lowest-numbered), from (rank, action) pairs."""
    held: dict[int, set[int]] = {}
    for rank, a in actions:
        for c in a.computations():
            held.setdefault(rank, set()).add(c.stage)
    return {s: i for stages in held.values() for i, s in enumerate(sorted(stages))}


def _shade(a: Action, chunk: dict[int, int]) -> int:
    """0 for a rank's first stage (and third, ...), 1 for its second (and fourth, ...)."""
    return chunk[a.computations()[0].stage] % 2


def _bars(timeline: Timeline, until: float) -> list[go.Bar]:
    """One bar trace per kind (and per shade, where ranks hold two or more stages) and one for
    idle time, everything cut off at time `until`. Columns go in as NumPy arrays: Plotly
    validates those at once, lists element by element (minutes for a long schedule's frames)."""
    every = [s for row in timeline.slots.values() for s in row]
    chunk = chunk_of((s.rank, s.action) for s in every)
    shades = (0, 1) if max(chunk.values(), default=0) > 0 else (0,)
    traces = []
    for shade in shades:
        for kind in DRAWN:
            shown = [s for s in every if s.action.kind == kind and s.start < until
                     and _shade(s.action, chunk) == shade]
            start = np.array([s.start for s in shown], dtype=float)
            end = np.array([s.end for s in shown], dtype=float)
            traces.append(go.Bar(
                name=kind + (SECOND if shade else ""), orientation="h",
                marker_color=(SHADES if shade else COLOURS)[kind],
                y=np.array([s.rank for s in shown], dtype=int), base=start,
                x=np.minimum(end, until) - start,
                text=np.array([str(s.action) for s in shown], dtype=object),
                textposition="inside", insidetextanchor="middle",
                hovertemplate="%{text}: %{base} to %{customdata}<extra></extra>",
                customdata=end, marker_line={"color": "white", "width": 1},
            ))
    gaps = np.array([(r, a, b) for r, row in timeline.idle.items() for a, b in row if a < until],
                    dtype=float).reshape(-1, 3)
    traces.append(go.Bar(
        name="idle", orientation="h", marker_color=COLOURS["idle"], opacity=IDLE_OPACITY,
        y=gaps[:, 0].astype(int), base=gaps[:, 1], x=np.minimum(gaps[:, 2], until) - gaps[:, 1],
        hovertemplate="idle %{base} to %{customdata}<extra></extra>", customdata=gaps[:, 2],
    ))
    return traces


def frame_times(timeline: Timeline) -> list[float]:
    """The instants the animation stops at: every time an action ends, or as many of them, evenly
    spread, as MAX_FRAMES and BAR_BUDGET allow (the last is always the end)."""
    times = sorted({s.end for row in timeline.slots.values() for s in row})
    bars = sum(len(row) for row in timeline.slots.values()) + sum(map(len, timeline.idle.values()))
    most = max(2, min(MAX_FRAMES, BAR_BUDGET // max(bars, 1)))
    if len(times) > most:
        times = [times[int(i)] for i in np.linspace(0, len(times) - 1, most)]
    return times


# Pixels under the plot: the axis title, then the slider (its value, rail and tick labels, 55 to ~125),
# then the buttons on a row of their own (140 to ~170), so that in a narrow column they cannot cover
# the slider's first labels.
CONTROLS_MARGIN = 185


def play_controls(names: list[str], prefix: str, labels: list[str] | None = None, active: int | None = None,
                  frame_ms: int = 300) -> dict:
    """Play (a frame every `frame_ms`), Play x3 (three times as fast) and Pause buttons and a slider
    over the frames `names` (ticks labelled `labels`, default the names), the slider at frame
    `active` (default the last), placed in pixels under the plot so they never cover an axis, the
    buttons under the slider. `redraw` because bars and heatmaps are not scatter traces
    (ENVIRONMENT.md, Plotly 7). One frame has nothing to play: no controls."""
    if len(names) < 2:
        return {}

    def step_args(ms: int) -> dict:
        return {"frame": {"duration": ms, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}

    return {
        "updatemenus": [{
            "type": "buttons", "direction": "left", "showactive": False, "x": 0, "xanchor": "left",
            "y": 0, "yanchor": "top", "pad": {"t": 140},
            "buttons": [
                {"label": "Play", "method": "animate",
                 "args": [None, {**step_args(frame_ms), "fromcurrent": True}]},
                {"label": "Play x3", "method": "animate",
                 "args": [None, {**step_args(max(frame_ms // 3, 1)), "fromcurrent": True}]},
                {"label": "Pause", "method": "animate",
                 "args": [[None], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"}]},
            ],
        }],
        "sliders": [{
            "active": len(names) - 1 if active is None else active,
            "x": 0, "len": 1, "y": 0, "yanchor": "top", "pad": {"t": 55},
            "currentvalue": {"prefix": prefix, "xanchor": "left"},
            "steps": [{"label": label, "method": "animate", "args": [[name], step_args(frame_ms)]}
                      for name, label in zip(names, labels or names, strict=True)],
        }],
    }


def gantt_figure(timeline: Timeline, title: str = "", x_end: float | None = None,
                 animated: bool = True) -> go.Figure:
    """Ranks x time: F, B, W (and F&B) bars labelled like `format_grid` ("1F0"), a rank's second
    stage lighter, idle time shaded red. Animated: each frame shows the timeline up to the end of
    one more action. `x_end` (default the makespan) sets where the time axis ends, so that two
    timelines drawn side by side share one scale. A label that does not fit its bar at a readable
    size is left to the hover. `animated=False`: the whole timeline, no frames (a still picture)."""
    p = len(timeline.slots)
    times = frame_times(timeline) if animated else []
    names = [f"{t:g}" for t in times]  # distinct: a frame's name is its key
    labels = [f"{t:.4g}" for t in times]  # measured times in ms have 15 digits; the slider shows 4
    fig = go.Figure(data=_bars(timeline, timeline.makespan),
                    frames=[go.Frame(name=name, data=_bars(timeline, t))
                            for name, t in zip(names, times, strict=True)])
    fig.update_layout(
        title=title, barmode="overlay", height=CONTROLS_MARGIN + 120 + 50 * p, margin={"b": CONTROLS_MARGIN},
        xaxis={"title": "time (F = 1 unit)", "range": [0, x_end or timeline.makespan], "autorange": False},
        uniformtext={"minsize": 9, "mode": "hide"},
        yaxis={"title": "rank", "range": [p - 0.5, -0.5], "autorange": False,
               "tickvals": list(range(p)), "ticktext": [f"rank {r}" for r in range(p)]},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        **play_controls(names, "time ", labels),
    )
    return fig


def idle_total(fig: go.Figure) -> float:
    """The idle time a Gantt figure shades, summed over ranks (what tests and the app compare with
    the timeline's bubble)."""
    idle = next(t for t in fig.data if t.name == "idle")
    return float(np.sum(idle.x)) if idle.x is not None else 0.0


def inflight_figure(schedule: Schedule, timeline: Timeline, title: str = "",
                    x_end: float | None = None) -> go.Figure:
    """Per rank, the (stage, microbatch) pairs whose activations are stored for backward, from the
    end of each action on: `stored(schedule)` placed at the simulated times. Multiply by one
    microbatch's activation bytes per stage for memory. `x_end` as in gantt_figure."""
    counts = stored(schedule)
    fig = go.Figure()
    for rank, slots in timeline.slots.items():
        ordered = sorted(slots, key=lambda s: s.tick)
        fig.add_trace(go.Scatter(
            name=f"rank {rank}", mode="lines", line_shape="hv",
            x=[0.0] + [s.end for s in ordered] + [timeline.makespan],
            y=[0] + [counts[rank][s.tick] for s in ordered] + [counts[rank][-1] if counts[rank] else 0],
        ))
    fig.update_layout(title=title, height=320, yaxis_title="stage-microbatches held",
                      xaxis={"title": "time (F = 1 unit)", "range": [0, x_end or timeline.makespan]})
    return fig


def grid_code(a: Action | None, chunk: dict[int, int]) -> int:
    """A grid cell's colour: 0 idle; 1, 2, 3, 4 for F, B, W, F&B on a rank's first stage; 5 to 8
    on its second."""
    if a is None:
        return 0
    return 1 + DRAWN.index(a.kind) + len(DRAWN) * _shade(a, chunk)


def grid_figure(schedule: Schedule, title: str = "") -> go.Figure:
    """The ranks x ticks grid of `format_grid` as coloured cells, each labelled with its action."""
    n_ticks = max(len(row) for row in schedule.values())
    ranks = sorted(schedule)
    chunk = chunk_of((r, a) for r, row in schedule.items() for a in row if a is not None)
    z = np.zeros((len(ranks), n_ticks), dtype=int)
    text = [[""] * n_ticks for _ in ranks]
    split = stage_map(schedule).split  # a backward whose W comes apart is labelled I, as format_grid does
    for i, rank in enumerate(ranks):
        for tick, a in enumerate(schedule[rank]):
            z[i, tick] = grid_code(a, chunk)
            text[i][tick] = "" if a is None else action_name(a, split)
    scale = ["#f0f0f0", *(COLOURS[k] for k in DRAWN), *(SHADES[k] for k in DRAWN)]
    n = len(scale)
    colorscale = [[edge, c] for k, c in enumerate(scale) for edge in (k / n, (k + 1) / n)]
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", zmin=-0.5, zmax=n - 0.5,
                               colorscale=colorscale, showscale=False, xgap=1, ygap=1,
                               hovertemplate="rank %{y} tick %{x}: %{text}<extra></extra>"))
    fig.update_layout(title=title, height=100 + 35 * len(ranks),
                      xaxis={"title": "tick", "dtick": 1 if n_ticks <= 40 else None},
                      yaxis={"title": "rank", "autorange": "reversed", "tickvals": ranks,
                             "ticktext": [f"rank {r}" for r in ranks]})
    return fig
