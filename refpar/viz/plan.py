"""Figures of a `refpar plan` result: where each plan's memory and step time go.

Data in (the dict `refpar.analysis.planner.plan` returns, the `refpar plan --json` object), a
Plotly figure out; the app's Plan page lays these out.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from refpar.viz.comm import CATEGORY_COLOURS
from refpar.viz.timeline import AXIS_COLOURS

# Step time by cause, in colours of their own (the memory bars keep the Memory page's), and hatched: a
# bar of either legend cannot be taken for one of the other (both have an "optimizer").
TIME_COLOURS = {"compute": "#3a3a3a", "bubble": "#d62728", "optimizer": "#bdbdbd",
                **{axis: AXIS_COLOURS[axis] for axis in ("tp", "cp", "ep", "pp", "dp")}}  # every page's


def plan_label(p: dict) -> str:
    """`dp=16 tp=8 pp=32 zero=1 zb-h2 selective`: the mesh axes above 1 and the options."""
    mesh = " ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1) or "one GPU"
    chunks = f" v={p['chunks']}" if p["chunks"] > 1 else ""
    return f"{mesh} zero={p['zero']} {p['schedule']}{chunks} {p['recompute']}"


def plan_figure(result: dict) -> go.Figure:
    """Two stacked horizontal bars per plan: memory per GPU by category (GB, with the GPU's
    capacity as a line when `memory_capacity_bytes` is given) and step time by cause (s)."""
    plans = result["plans"]
    labels = [f"{i + 1}. {plan_label(p)}" for i, p in enumerate(plans)]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=("memory per GPU (GB)", "step time (s)"))
    for category in plans[0]["memory_bytes"] if plans else ():
        fig.add_trace(go.Bar(y=labels, x=[p["memory_bytes"][category] / 1e9 for p in plans],
                             name=category, orientation="h", legendgroup="memory",
                             legendgrouptitle_text="memory", marker_color=CATEGORY_COLOURS[category]),
                      row=1, col=1)
    for cause in plans[0]["time_s"] if plans else ():
        fig.add_trace(go.Bar(y=labels, x=[p["time_s"][cause] for p in plans], name=cause,
                             orientation="h", legendgroup="time", legendgrouptitle_text="step time",
                             marker={"color": TIME_COLOURS[cause], "pattern_shape": "/"}), row=1, col=2)
    if "memory_capacity_bytes" in result:
        fig.add_vline(x=result["memory_capacity_bytes"] / 1e9, line_dash="dash", row=1, col=1)
    fig.update_layout(
        barmode="stack",
        title=f"{result['model']} on {result['gpus']} {result['hardware']} GPUs: "
              f"{result['fitting']} of {result['candidates']} plans fit",
        yaxis={"autorange": "reversed"},
        # under the bars, the two legends side by side: a 14-entry column at the right ran off the page
        legend={"orientation": "h", "y": -0.12, "yanchor": "top", "x": 0, "xanchor": "left",
                "traceorder": "grouped"},
    )
    return fig


def validation_figure(result: dict) -> go.Figure:
    """Each published run's signed relative error (predicted / published - 1, in %), the fit rows
    and the held-out ones apart, with the +-10% band (the `refpar plan --validate --json` object in)."""
    fig = go.Figure()
    for held_out, name in ((False, "fit"), (True, "held out")):
        rows = [r for r in result["rows"] if r["held_out"] == held_out]
        fig.add_trace(go.Bar(y=[r["name"] for r in rows], x=[100 * r["relative_error"] for r in rows],
                             name=name, orientation="h",
                             customdata=[[r["predicted"], r["published"], r["source"]] for r in rows],
                             hovertemplate="%{y}: %{x:+.1f}%<br>predicted %{customdata[0]:.4g}, "
                                           "published %{customdata[1]:.4g}<br>%{customdata[2]}"
                                           "<extra></extra>"))
    for edge in (-10, 10):
        fig.add_vline(x=edge, line_dash="dash")
    fig.update_layout(title=f"predicted against published: largest error "
                            f"{100 * result['largest_error']:.1f}% (held out "
                            f"{100 * result['largest_held_out_error']:.1f}%)",
                      xaxis_title="predicted / published - 1 (%)", yaxis={"autorange": "reversed"},
                      barmode="overlay", height=max(400, 22 * len(result["rows"])))
    return fig
