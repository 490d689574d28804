"""Figures of a serving run: each rank's KV cache filling and emptying as requests come and go.

Data in (the summary of `refpar generate --json`, refpar/serving/runner.py), a Plotly figure out.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from refpar.config import MESH_AXES


def _rank_title(k: dict) -> str:
    coords = ", ".join(f"{a}{k['coords'][a]}" for a in MESH_AXES if a in k["coords"])
    return f"rank {k['rank']} ({coords})"


# Requests in colours that can be told apart (Plotly's qualitative Dark24), one each, the same on every
# figure of a serving run.
REQUEST_COLOURS = ("#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#222A2A", "#B68100", "#750D86",
                   "#EB663B", "#511CFB", "#00A08B", "#FB00D1", "#FC0080", "#B2828D", "#6C7C32", "#778AAE",
                   "#862A16", "#A777F1", "#620042", "#1616A7", "#DA60CA", "#6C4516", "#0D2A63", "#AF0038")


def request_colour(i: int) -> str:
    """The colour of the i-th request of a run."""
    return REQUEST_COLOURS[i % len(REQUEST_COLOURS)]


def kv_cache_figure(summary: dict) -> go.Figure:
    """One panel per rank: the KV cache bytes the MemoryLedger counted after every pass and after
    every step's frees, stacked by request (a request's band grows by one token per decode pass
    and vanishes when it finishes); the dashed line is the closed form for that moment."""
    ranks = summary["kv_cache"]
    moments = summary["kv_moments"]
    rids = [str(r["rid"]) for r in summary["requests"]]
    fig = make_subplots(rows=len(ranks), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[_rank_title(k) for k in ranks])
    x = list(range(len(moments)))
    for row, k in enumerate(ranks, start=1):
        for i, rid in enumerate(rids):
            fig.add_trace(go.Bar(
                x=x, y=[d.get(rid, 0) for d in k["bytes_by_request"]], name=f"request {rid}",
                legendgroup=rid, showlegend=row == 1, marker_color=request_colour(i),
                customdata=moments, hovertemplate="%{customdata}: %{y} B of request " + rid
                + "<extra></extra>"), row=row, col=1)
        fig.add_trace(go.Scatter(
            x=x, y=k["expected_bytes_timeline"], mode="lines", line={"dash": "dash", "color": "black",
            "shape": "hv"}, name="closed form", legendgroup="closed", showlegend=row == 1,
            customdata=moments, hovertemplate="%{customdata}: closed form %{y} B<extra></extra>"),
            row=row, col=1)
        fig.update_yaxes(title_text="KV bytes", row=row, col=1)
    fig.update_xaxes(title_text="after each pass and each step's frees", row=len(ranks), col=1,
                     tickvals=x, ticktext=moments, tickangle=-60)
    mesh = "-".join(f"{a.upper()}({n})" for a, n in summary["mesh"].items() if n > 1) or "one device"
    fig.update_layout(barmode="stack", height=220 * len(ranks) + 160,
                      title=f"KV cache per rank on {mesh}, {len(rids)} requests, at most "
                            f"{summary['max_batch']} at once")
    return fig


def comm_per_token_figure(summary: dict) -> go.Figure:
    """Bytes each rank sent per token, by phase, axis and op (bars, traced), with the closed form
    of the same calls (diamonds): under tp the decode bars are 2 · layers + 1 all-reduces of one
    token's activations plus the gathered logits; under pp one activation hop and the tokens."""
    tokens = {"prefill": summary["latency"]["prefill"]["prompt_tokens"],
              "decode": summary["latency"]["decode"]["tokens"]}
    ranks = [k["rank"] for k in summary["kv_cache"]]

    def per_token(rows):
        out: dict = {}
        for r in rows:
            key = f"{r['phase']} {r['axis']} {r['op']}"
            out.setdefault(key, dict.fromkeys(ranks, 0.0))[r["rank"]] += r["bytes_sent"] / tokens[r["phase"]]
        return out

    measured, expected = per_token(summary["comm_bytes"]), per_token(summary["expected_comm_bytes"])
    fig = go.Figure()
    for i, (key, by_rank) in enumerate(sorted(measured.items())):
        color = f"hsl({(i * 67) % 360}, 60%, 55%)"
        fig.add_trace(go.Bar(x=ranks, y=[by_rank[r] for r in ranks], name=key, offsetgroup=key,
                             marker_color=color,
                             hovertemplate="rank %{x}: %{y:.1f} B per token<extra>" + key + "</extra>"))
        fig.add_trace(go.Scatter(x=ranks, y=[expected.get(key, {}).get(r, 0.0) for r in ranks],
                                 mode="markers", marker={"symbol": "diamond", "color": "black"},
                                 name=f"{key} (closed form)", showlegend=False,
                                 hovertemplate="closed form %{y:.1f} B per token<extra></extra>"))
    fig.update_layout(barmode="group", xaxis_title="rank", yaxis_title="bytes sent per token",
                      xaxis={"tickvals": ranks}, title="bytes per token by phase, axis and op")
    return fig


def block_pool_figure(summary: dict, rank: int = 0) -> go.Figure:
    """A paged run's pool on one rank: a row per moment (after each pass and each step's frees), a
    column per block, coloured by the request whose table holds it (its first holder where a prefix
    is shared; blank: free). Blocks are taken as requests are planned and given back as they finish
    or are preempted; the hover names every holder and the block's place in its table."""
    pool = next(p for p in summary["paged"]["pool"] if p["rank"] == rank)
    moments = summary["kv_moments"]
    # the lowest free block is taken first, so the blocks ever taken are 0 .. the highest one seen
    blocks = 1 + max((b for tables in pool["tables"] for t in tables.values() for b in t), default=0)
    z, text = [], []
    for tables in pool["tables"]:
        owner, where = [None] * blocks, [""] * blocks
        for rid, table in tables.items():
            for i, b in enumerate(table):
                owner[b] = int(rid) if owner[b] is None else owner[b]
                where[b] += f"request {rid} (its block {i}) "
        z.append(owner)
        text.append([w or "free" for w in where])
    rids = [r["rid"] for r in summary["requests"]]
    # one step of the scale per request, in the request's colour of the KV cache figure: ids, not a range
    low, n = min(rids), max(rids) - min(rids) + 1
    steps = [[edge, request_colour(rids.index(low + k) if low + k in rids else k)]
             for k in range(n) for edge in (k / n, (k + 1) / n)]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(blocks)), y=list(range(len(moments))), text=text, customdata=[[m] * blocks
                                                                                         for m in moments],
        zmin=low - 0.5, zmax=low + n - 0.5, colorscale=steps, xgap=1, ygap=1,
        colorbar={"title": "request", "tickvals": rids, "ticktext": [str(r) for r in rids]},
        hovertemplate="%{customdata}, block %{x}: %{text}<extra></extra>"))
    fig.update_yaxes(title_text="moment", tickvals=list(range(len(moments))), ticktext=moments,
                     autorange="reversed")
    fig.update_xaxes(title_text=f"block of {summary['paged']['block_size']} slots")
    fig.update_layout(height=18 * len(moments) + 200,
                      title=f"Block pool of rank {rank}: {blocks} of its {summary['paged']['kv_blocks']} "
                            "blocks ever taken, "
                            f"{len(summary['paged']['preemptions'])} preemptions")
    return fig
