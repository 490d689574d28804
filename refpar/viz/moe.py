"""Figures of a Mixture-of-Experts run: what the router chose, what the capacity dropped, and what
the all-to-all carried.

Data in (the "moe" object of `refpar train --json`, refpar/engine/report.py), a Plotly figure
out. For the Communication page, `drawn_kept` draws one step's routing with refpar's own router and
`step_rows` / `traffic_matrix` give what a dp x ep step moves, from refpar.analysis.closed_forms's exact
closed forms (which take the routing counts).
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from refpar.analysis import closed_forms as closed
from refpar.analysis.moe import load_imbalance, record_slots
from refpar.config import Plan, TrainConfig
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import MOE, init_params
from refpar.model.routing import route
from refpar.sharding import shard_sizes
from refpar.viz.comm import destinations


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


def expert_load_figure(runs: dict[str, dict], block_index: int = 0) -> go.Figure:
    """The per-expert load of one MoE block over the steps of one or more runs (label -> the "moe"
    object of each run's --json summary): above, each expert's kept assignments per step, one line
    per expert and run (dashed for the second run on); below, the load imbalance max / mean
    (analysis.moe.load_imbalance), 1 when every expert gets its share. Two runs that differ only in
    --moe-balance show what aux-loss-free balancing does (lessons/10)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=("assignments kept per expert", "load imbalance (max / mean)"))
    for r, (label, moe) in enumerate(runs.items()):
        loads = np.array([s[block_index] for s in moe["tokens_per_expert"]], dtype=float)  # (steps, E)
        steps = list(range(1, len(loads) + 1))
        dash = "solid" if r == 0 else "dash"
        for e in range(loads.shape[1]):
            fig.add_trace(go.Scatter(x=steps, y=loads[:, e], mode="lines", line={"dash": dash, "width": 1},
                                     legendgroup=label, showlegend=False,
                                     name=f"{label}: expert {e}"), row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=[load_imbalance(row) for row in loads], mode="lines+markers",
                                 line={"dash": dash}, legendgroup=label, name=label), row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    block = next(iter(runs.values()))["blocks"][block_index] if runs else block_index
    fig.update_layout(title=f"block {block}: expert load over the run", height=520)
    return fig


def drawn_kept(config, n_data: int, tokens_per_rank: int, ep: int, seed: int = 0) -> list[tuple]:
    """(kept (D, E), pairs (D, ep)) counts of each MoE block for one step: each data rank holds one
    sequence of refpar's corpus, and each block's router (`route`, the initial weights) routes the
    embedded tokens of all of them as one global batch, data rank by data rank, so the capacity drops
    what the run's would; a data rank's pairs are its tokens keeping an expert of each ep rank. The
    embeddings stand in for the block's true input: a routing drawn by refpar's router, not a
    trained one's."""
    params = init_params(config, seed)
    tokens, _ = MarkovCorpus(config.vocab_size, seed).batch(0, np.arange(n_data), tokens_per_rank)  # (D, T)
    x = params["wte.weight"][tokens] + params["wpe.weight"][:tokens_per_rank]  # (D, T, C)
    owner = np.repeat(np.arange(ep), shard_sizes(config.moe_experts, ep))  # (E,) ep rank of each expert
    out = []
    for block in config.moe_blocks:
        routing, _ = route(x.reshape(n_data * tokens_per_rank, -1), params[MOE.router_name(block)], config)
        experts = routing["experts"].reshape(n_data, tokens_per_rank, -1)  # (D, T, k)
        keep = routing["keep"].reshape(experts.shape)  # (D, T, k)
        kept = np.stack([np.bincount(experts[d][keep[d]], minlength=config.moe_experts)
                         for d in range(n_data)])  # (D, E)
        dest = np.where(keep, owner[experts], -1)  # (D, T, k)
        pairs = np.stack([np.any(dest == q, axis=-1).sum(axis=1) for q in range(ep)], axis=1)  # (D, ep)
        out.append((kept, pairs))
    return out


def step_rows(config, sizes: dict[str, int], kept_by_layer) -> list[dict]:
    """`comm_bytes` rows of one training step on every rank of a dp x ep mesh (`sizes`: every axis)
    whose MoE blocks kept `kept_by_layer` (refpar.analysis.closed_forms.rank_comm_bytes); the axis `data`
    is all dp x ep ranks."""
    dp, ep = sizes["dp"], sizes["ep"]
    kept = [dict(zip(config.moe_blocks, kept_by_layer, strict=True))]  # one microbatch
    rows = []
    for rank in range(dp * ep):  # world rank = data rank: dp is the slower axis
        coords = closed.rank_coords(sizes, rank)
        for (axis, op), b in closed.rank_comm_bytes(config, TrainConfig(batch_size=dp * ep), sizes, coords,
                                                    Plan(), kept).items():
            rows.append({"rank": rank, "axis": axis, "op": op, "bytes_sent": b[0], "bytes_recv": b[1]})
    return rows


def all_to_all_matrix(counts, ep: int, n_embd: int, itemsize: int, slots: int) -> np.ndarray:
    """(D, D) bytes one MoE block's all-to-alls move in a step, from its (kept, pairs) counts: data
    rank d sends ep peer d' its pairs for the peer's experts (dispatch, C + 2m elements a row, m
    `slots`) and d''s combined outputs for d's pairs back (combine, C); the backward sends d's
    dout per pair (C) and d''s dx with the gates' gradients back (C + m): refpar.analysis.moe."""
    pairs = np.asarray(counts[1])
    n_data, C, m = pairs.shape[0], n_embd, slots
    matrix = np.zeros((n_data, n_data))
    for d in range(n_data):
        base = d - d % ep
        for q in range(ep):
            peer = base + q
            if peer != d:
                rows = pairs[d, q] * (2 * C + 2 * m) + pairs[peer, d % ep] * (2 * C + m)  # elements
                matrix[d, peer] = rows * itemsize
    return matrix


def traffic_matrix(config, sizes: dict[str, int], kept_by_layer) -> np.ndarray:
    """(world, world) bytes of one step: the all-to-alls exactly from the counts, every ring
    collective to the next rank of its group (`refpar.viz.comm.destinations`)."""
    ep, world = sizes.get("ep", 1), sizes.get("dp", 1) * sizes.get("ep", 1)
    itemsize = np.dtype(config.dtype).itemsize
    m = record_slots(config.moe_experts, config.moe_top_k, ep)
    matrix = sum((all_to_all_matrix(k, ep, config.n_embd, itemsize, m) for k in kept_by_layer),
                 np.zeros((world, world)))
    for row in step_rows(config, sizes, kept_by_layer):
        if row["axis"] == "ep":
            continue
        axis = "world" if row["axis"] == "data" else row["axis"]
        for dst, share in destinations(sizes, row["rank"], axis, row["op"]):
            matrix[row["rank"], dst] += row["bytes_sent"] * share
    return matrix
