"""Figures of one plan of a published model at real scale (a row of
`refpar.analysis.planner.price`, the closed forms `refpar plan` prices with): memory per GPU by
category against the GPU's capacity, and the bytes each axis moves per step. Bytes are written in
readable units (`readable`). The app's Memory, Communication and Whole mesh pages draw these beside
the tiny model that was measured.
"""

from __future__ import annotations

import plotly.graph_objects as go

from refpar.viz.comm import CATEGORY_COLOURS
from refpar.viz.timeline import AXIS_COLOURS  # one colour per axis, as on the executed timeline

UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def readable(n_bytes: float) -> str:
    """1536 -> "1.5 kB", 4.5e9 -> "4.5 GB": three significant digits in the largest unit below it."""
    for size, unit in UNITS:
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes:.3g} B"


def memory_figure(row: dict, capacity_bytes: float, title: str) -> go.Figure:
    """One stacked bar of a GPU's memory by category (GB), the GPU's capacity as a dashed line."""
    fig = go.Figure()
    for category, n in row["memory_bytes"].items():
        fig.add_trace(go.Bar(x=[n / 1e9], y=["per GPU"], name=f"{category} {readable(n)}", orientation="h",
                             marker_color=CATEGORY_COLOURS.get(category, "#999999"),
                             hovertemplate=f"{category}: {readable(n)}<extra></extra>"))
    fig.add_vline(x=capacity_bytes / 1e9, line_dash="dash",
                  annotation_text=f"capacity {readable(capacity_bytes)}", annotation_position="top left")
    fig.update_layout(title=title, barmode="stack", height=260, xaxis_title="GB per GPU",
                      legend={"orientation": "h", "y": -0.45})
    return fig


def comm_figure(row: dict, title: str) -> go.Figure:
    """Bytes each axis's collectives move per GPU and per step (GB), one bar an axis that moves any."""
    moved = {axis: n for axis, n in row["comm_bytes"].items() if n > 0}
    fig = go.Figure(go.Bar(x=list(moved), y=[n / 1e9 for n in moved.values()],
                           marker_color=[AXIS_COLOURS.get(a, "#999999") for a in moved],
                           text=[readable(n) for n in moved.values()], textposition="outside",
                           hovertemplate="%{x}: %{text} per step<extra></extra>"))
    fig.update_layout(title=title, height=320, yaxis_title="GB per GPU per step", xaxis_title="axis")
    return fig


def collectives_rows(row: dict) -> list[dict]:
    """The plan's collectives, one row each, in readable units."""
    return [{"collective": c["name"], "bytes a call": readable(c["bytes"]), "ranks": c["ranks"],
             "calls a step": f"{c['calls_per_step']:,.0f}",
             "bytes a step": readable(c["bytes"] * c["calls_per_step"])} for c in row["collectives"]]
