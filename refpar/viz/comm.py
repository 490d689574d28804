"""Figures of communication and memory: bytes by axis and op, who sends to whom, each collective
of a step in turn, and memory per rank by category.

Data in: the `comm_bytes` / `memory_peak_bytes` rows of `refpar train --json` (measured) or
`refpar.viz.expected` (closed form), and the mesh sizes; a Plotly figure out.

Who sends to whom follows the algorithms whose bytes the rows count (`refpar.comm.cost`): a ring
collective (all-reduce, reduce-scatter, all-gather, and ring attention's messages) sends all of a
rank's bytes to the next rank of its group's ring; an all-to-all spreads them evenly over the
group's other ranks; a broadcast goes down the group from the root; the pipeline's messages go to
the neighbouring stages, split evenly between them (activations forward, gradients back).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import plotly.graph_objects as go

from refpar.config import MESH_AXES
from refpar.viz.pipeline import CONTROLS_MARGIN, play_controls
from refpar.viz.timeline import AXIS_COLOURS, group_arrivals

CATEGORY_COLOURS = {"params": "#4c78a8", "grads": "#f58518", "master": "#9d755d", "optimizer": "#54a24b",
                    "activations": "#e45756", "comm": "#72b7b2"}


# The mesh's groups over several axes (refpar/mesh.py), in world-rank order
SPANS = {"dp_cp": ("dp", "cp"), "data": ("dp", "ep", "cp")}


def axis_group(sizes: dict[str, int], rank: int, axis: str) -> list[int]:
    """World ranks of `rank`'s group on `axis` (or one of the mesh's groups over several axes), in
    axis order (DeviceMesh's layout, tp fastest)."""
    shape = tuple(sizes[a] for a in MESH_AXES)
    ranks = np.arange(int(np.prod(shape))).reshape(shape)  # (pp, dp, ep, cp, tp)
    if axis == "world":
        return list(range(ranks.size))
    position = list(np.unravel_index(rank, shape))
    for a in SPANS.get(axis, (axis,)):
        position[MESH_AXES.index(a)] = slice(None)
    return [int(r) for r in np.ravel(ranks[tuple(position)])]


def destinations(sizes: dict[str, int], rank: int, axis: str, op: str) -> list[tuple[int, float]]:
    """(world rank, share of the bytes) that `rank`'s sends of `op` on `axis` go to."""
    group = axis_group(sizes, rank, axis)
    me, p = group.index(rank), len(group)
    if p == 1:
        return []
    if op == "all_to_all":
        return [(g, 1 / (p - 1)) for g in group if g != rank]
    if axis == "pp" and op in ("send", "isend"):
        near = [group[i] for i in (me - 1, me + 1) if 0 <= i < p]
        return [(g, 1 / len(near)) for g in near]
    if op == "broadcast":
        return [(g, 1 / (p - 1)) for g in group if g != rank]
    return [(group[(me + 1) % p], 1.0)]


def traffic_matrix(rows: list[dict], sizes: dict[str, int]) -> np.ndarray:
    """(world, world) bytes: entry [src, dst] is what src sends to dst, from `comm_bytes` rows."""
    world = int(np.prod([sizes[a] for a in MESH_AXES]))
    matrix = np.zeros((world, world))
    for row in rows:
        for dst, share in destinations(sizes, row["rank"], row["axis"], row["op"]):
            matrix[row["rank"], dst] += row["bytes_sent"] * share
    return matrix


def _matrix_heatmap(matrix: np.ndarray, zmax: float) -> go.Heatmap:
    world = matrix.shape[0]
    text = [[f"{v:,.0f}" if v else "" for v in row] for row in matrix]
    return go.Heatmap(z=matrix, x=list(range(world)), y=list(range(world)), zmin=0, zmax=max(zmax, 1),
                      colorscale="Blues", text=text, texttemplate="%{text}" if world <= 8 else None,
                      colorbar={"title": "bytes"},
                      hovertemplate="rank %{y} -> rank %{x}: %{z:,.0f} bytes<extra></extra>")


def _matrix_layout(fig: go.Figure, world: int, title: str) -> None:
    fixed = {"dtick": 1, "autorange": False}
    fig.update_layout(title=title, height=260 + 28 * world,
                      xaxis={"title": "to rank", "range": [-0.5, world - 0.5], **fixed},
                      yaxis={"title": "from rank", "range": [world - 0.5, -0.5], **fixed})


def matrix_figure(matrix: np.ndarray, title: str = "") -> go.Figure:
    """A (world, world) matrix of bytes, entry [src, dst] what src sends to dst, as a heatmap."""
    fig = go.Figure(_matrix_heatmap(matrix, matrix.max()))
    _matrix_layout(fig, matrix.shape[0], title)
    return fig


def traffic_figure(rows: list[dict], sizes: dict[str, int], title: str = "") -> go.Figure:
    return matrix_figure(traffic_matrix(rows, sizes), title)


def call_rows(call: dict) -> list[dict]:
    """One collective (an item of `refpar.viz.expected.calls`) as `comm_bytes` rows."""
    return [{"rank": r, "axis": call["axis"], "op": call["op"], "bytes_sent": b, "bytes_recv": 0}
            for r, b in enumerate(call["bytes_sent"])]


def calls_figure(calls: list[dict], sizes: dict[str, int], title: str = "") -> go.Figure:
    """The traffic matrix of each collective of the step in turn (frame k: the links call k uses),
    ending on the whole step; a slider scrubs through the calls."""
    mats = [traffic_matrix(call_rows(c), sizes) for c in calls]
    world = int(np.prod([sizes[a] for a in MESH_AXES]))
    whole = sum(mats, np.zeros((world, world)))
    zmax = max([m.max() for m in mats], default=1.0)
    labels = [f"{k + 1}. {c['axis']} {c['op']} {c['tag']}" for k, c in enumerate(calls)] + ["whole step"]
    frames = [go.Frame(name=label, data=[_matrix_heatmap(m, zmax if label != "whole step" else whole.max())],
                       layout={"title": {"text": f"{title}{label}"}})
              for label, m in zip(labels, [*mats, whole], strict=True)]
    fig = go.Figure(data=[_matrix_heatmap(whole, whole.max())], frames=frames)
    _matrix_layout(fig, whole.shape[0], f"{title}whole step")
    fig.update_layout(margin={"b": CONTROLS_MARGIN}, height=max(fig.layout.height, 470),
                      **play_controls(labels, "", [str(k + 1) for k in range(len(calls))] + ["all"]))
    return fig


def timeline_figure(calls: list[dict], title: str = "") -> go.Figure:
    """The step's collectives in program order: bytes rank 0 sends in each, coloured by axis."""
    by_axis = defaultdict(list)
    for k, c in enumerate(calls):
        by_axis[c["axis"]].append((k + 1, c["bytes_sent"][0], f"{c['op']} {c['tag']}"))
    fig = go.Figure([go.Bar(name=axis, x=[k for k, _, _ in items], y=[b for _, b, _ in items],
                            text=[t for _, _, t in items], textposition="none",
                            hovertemplate="call %{x}: %{text}, %{y:,} bytes<extra></extra>")
                     for axis, items in by_axis.items()])
    fig.update_layout(title=title, xaxis_title="call, in program order", yaxis_title="bytes sent by rank 0",
                      height=320)
    return fig


def by_axis_op(rows: list[dict]) -> dict[str, int]:
    """{"axis op": bytes sent summed over ranks}, in first-seen order."""
    out: dict[str, int] = {}
    for r in rows:
        key = f"{r['axis']} {r['op']}"
        out[key] = out.get(key, 0) + r["bytes_sent"]
    return out


def bytes_figure(expected: list[dict], measured: list[dict] | None = None, title: str = "") -> go.Figure:
    """Bytes sent per step, all ranks together, by axis and op: closed form, and measured beside it."""
    series = [("closed form", expected)] + ([("measured", measured)] if measured is not None else [])
    keys = list(dict.fromkeys(k for _, rows in series for k in by_axis_op(rows)))
    fig = go.Figure([go.Bar(name=name, x=keys, y=[by_axis_op(rows).get(k, 0) for k in keys])
                     for name, rows in series])
    fig.update_layout(title=title, barmode="group", yaxis_title="bytes sent (all ranks)", height=340)
    return fig


def memory_by_rank(rows: list[dict]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for r in rows:
        out[r["rank"]][r["category"]] = r["bytes"]
    return dict(out)


def memory_figure(columns: dict[str, dict[str, int]], title: str = "") -> go.Figure:
    """Stacked bars: one column per label (a strategy, "rank 3 measured", ...), bytes by category."""
    labels = list(columns)
    categories = list(dict.fromkeys(c for col in columns.values() for c in col))
    fig = go.Figure([go.Bar(name=c, x=labels, y=[columns[k].get(c, 0) for k in labels],
                            marker_color=CATEGORY_COLOURS.get(c)) for c in categories])
    fig.update_layout(title=title, barmode="stack", yaxis_title="peak bytes", height=380)
    return fig


WAITING = "waiting for the group"


def trace_figure(trace: dict, title: str = "") -> go.Figure:
    """A real run's communication events (the Chrome trace `refpar train --trace` writes, as
    `refpar.comm.trace.chrome_trace` builds it): one bar per call, rank by rank over time,
    coloured by axis; hovering names the op, the tag and the bytes. The part of a collective before
    the last rank of its group called it (refpar.viz.timeline.group_arrivals) is drawn grey over its
    bar, as waiting: on an oversubscribed CPU, most of a call's time, and the whole start-up (the
    first collective waits for the slowest rank to import and build its model)."""
    calls = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] != "compute"]  # no F/B
    fig = go.Figure()
    for axis in dict.fromkeys(e["cat"] for e in calls):
        mine = [e for e in calls if e["cat"] == axis]
        fig.add_trace(go.Bar(
            name=axis, orientation="h", y=[e["pid"] for e in mine], base=[e["ts"] / 1e3 for e in mine],
            x=[max(e["dur"], 1.0) / 1e3 for e in mine],  # a call shorter than 1 us still shows
            marker_color=AXIS_COLOURS.get(axis),
            text=[f"{e['name']}: {e['args']['bytes_sent']:,} bytes sent" for e in mine], textposition="none",
            hovertemplate="rank %{y}, %{base:.3f} ms: %{text}<extra></extra>"))
    waits = [(e, min(arrived, (e["ts"] + e["dur"]) / 1e3) - e["ts"] / 1e3)
             for e, arrived in zip(calls, group_arrivals(calls), strict=True)]
    waits = [(e, w) for e, w in waits if w > 0]
    if waits:
        fig.add_trace(go.Bar(
            name=WAITING, orientation="h", y=[e["pid"] for e, _ in waits],
            base=[e["ts"] / 1e3 for e, _ in waits],
            x=[w for _, w in waits], marker_color="#d9d9d9", marker_pattern_shape="/",
            text=[f"{e['name']}: waited {w:.3f} ms for the last rank of its group" for e, w in waits],
            textposition="none", hovertemplate="rank %{y}, %{base:.3f} ms: %{text}<extra></extra>"))
    ranks = sorted({e["pid"] for e in calls})
    fig.update_layout(title=title, barmode="overlay", height=160 + 40 * max(len(ranks), 1),
                      xaxis_title="ms since the first call",
                      yaxis={"title": "rank", "autorange": "reversed", "tickvals": ranks})
    return fig
