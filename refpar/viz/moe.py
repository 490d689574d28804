"""Figures of a Mixture-of-Experts run: what the router chose, what the capacity dropped, and what
the all-to-all carried.

Data in (the "moe" object of `refpar train --json`, refpar/commands/train_moe.py), a Plotly figure
out.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def routing_figure(moe: dict, block_index: int = 0, step: int = -1) -> go.Figure:
    """Two heatmaps for one MoE block: left, the assignments each expert kept at every step (the
    hover adds the step's dropped ones, the title the capacity); right, at one step, the rows each
    data rank sends to each expert, experts grouped by the ep rank that holds them, so a cell
    outside a rank's own group is all-to-all traffic."""
    block = moe["blocks"][block_index]
    kept = [s[block_index] for s in moe["tokens_per_expert"]]  # steps x E
    dropped = [s[block_index] for s in moe["dropped"]]
    steps = list(range(1, len(kept) + 1))
    step_number = steps[step]
    sends = moe["kept_counts"][step][block_index]  # D x E
    n_experts = len(kept[0]) if kept else 0
    limit = "dropless" if moe["capacity"] is None else f"capacity {moe['capacity']}"
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        f"assignments kept per expert ({limit})", f"step {step_number}: rows each data rank sends"))
    fig.add_trace(go.Heatmap(
        z=kept, x=list(range(n_experts)), y=steps, coloraxis="coloraxis",
        customdata=[[d] * n_experts for d in dropped],
        hovertemplate="step %{y}, expert %{x}: %{z} kept (%{customdata} dropped in the block)"
                      "<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Heatmap(
        z=sends, x=list(range(n_experts)), y=list(range(len(sends))), coloraxis="coloraxis",
        hovertemplate="data rank %{y} -> expert %{x}: %{z} rows<extra></extra>"), row=1, col=2)
    for experts in moe["experts_per_ep_rank"][1:]:  # boundaries between the ep ranks' experts
        fig.add_vline(x=experts[0] - 0.5, line_dash="dash", row=1, col=2)
    fig.update_xaxes(title_text="expert", dtick=1)
    fig.update_yaxes(title_text="step", dtick=1, row=1, col=1)
    fig.update_yaxes(title_text="data rank", dtick=1, autorange="reversed", row=1, col=2)
    fig.update_layout(title=f"block {block}: routing and dispatch", coloraxis={"colorscale": "Blues"})
    return fig
