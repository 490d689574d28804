"""Figures of a pipeline timeline: who runs what when, and where each rank waits.

Data in (a `refpar.parallel.pipeline.schedules.Timeline`, simulated or measured), a Plotly figure
out: one row per rank, one bar per action from its start to its end, coloured by kind; the gaps
between bars are the bubble.

    timeline_figure(simulate(zb_h1(4, 8)), "ZB-H1, p=4, m=8")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

if TYPE_CHECKING:  # viz reads the data it is given; it imports no strategy
    from refpar.parallel.pipeline.schedules import Timeline

COLOURS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}
NAMES = {"F": "forward", "B": "backward (input grad, or full)", "W": "weight grad"}


def timeline_figure(timeline: Timeline, title: str = "", unit: str = "tick") -> go.Figure:
    """Horizontal bars drawn with `base` (Plotly's timeline wants dates): x is time in `unit`."""
    fig = go.Figure()
    for kind, colour in COLOURS.items():
        slots = [s for rank in sorted(timeline.slots) for s in timeline.slots[rank]
                 if s.action.kind == kind]
        if not slots:
            continue
        fig.add_trace(go.Bar(
            y=[f"rank {s.rank}" for s in slots], base=[s.start for s in slots],
            x=[s.end - s.start for s in slots], orientation="h", name=NAMES[kind],
            marker_color=colour, text=[str(s.action) for s in slots], textposition="inside",
            insidetextanchor="middle",
            hovertemplate="%{text}: %{base:.3g} to %{customdata:.3g} " + unit + "<extra></extra>",
            customdata=[s.end for s in slots]))
    idle = sum(map(timeline.idle_time, timeline.slots))
    fig.update_layout(
        barmode="overlay",
        title=f"{title} — makespan {timeline.makespan:.3g} {unit}, bubble "
              f"{timeline.bubble_fraction:.1%} of rank-time ({idle:.3g} {unit} idle)".lstrip(" —"),
        xaxis={"title": unit, "range": [0, timeline.makespan]},
        yaxis={"autorange": "reversed"},
    )
    return fig
