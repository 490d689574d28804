"""The ring all-reduce, step by step: p ranks each hold p chunks of an n-element tensor; in the p - 1
steps of the reduce-scatter each rank sends one chunk of partial sums to its right neighbour, which adds
its own copy, until rank r holds chunk r summed over every rank; in the p - 1 steps of the all-gather
each finished chunk travels round the ring. The order is refpar's own (refpar.comm.algorithms.ring_round),
and a rank's bytes over the steps add up to refpar.comm.cost.all_reduce_bytes. The app's Communication
page steps through these with one slider.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from refpar.comm.algorithms import ring_round
from refpar.comm.cost import chunk


@dataclass(frozen=True)
class RingStep:
    """The state after one step (step 0: before the first): which ranks' contributions each (rank,
    chunk) holds, what each rank sent in this step (chunk, bytes), and the step's narration."""

    holds: tuple[tuple[frozenset, ...], ...]  # holds[r][c]: the ranks whose chunk c is summed on rank r
    sent: tuple[tuple[int, int], ...]  # sent[r] = (chunk, bytes) rank r sent to r + 1 in this step
    phase: str  # "start", "reduce-scatter" or "all-gather"
    text: str


def ring_steps(p: int, n: int, itemsize: int) -> list[RingStep]:
    """The 2(p - 1) steps of a ring all-reduce of n elements of `itemsize` bytes on p ranks (p >= 2),
    after a step 0 with every rank holding its own contribution only."""
    holds = [[frozenset({r}) for _ in range(p)] for r in range(p)]
    steps = [RingStep(tuple(map(tuple, holds)), tuple((0, 0) for _ in range(p)), "start",
                      f"Each of the {p} ranks holds its own {n:,} elements in {p} chunks; none is summed "
                      "yet.")]
    for k in range(2 * (p - 1)):
        sends = [ring_round(p, r, k)[0] for r in range(p)]
        sent = tuple((c, chunk(n, p, c) * itemsize) for c in sends)
        before = [row[:] for row in holds]
        for r in range(p):
            c, _ = sent[r]
            right = (r + 1) % p
            _, received, adds = ring_round(p, right, k)
            assert received == c  # the chunk rank r sends is the one its right neighbour expects
            holds[right][c] = before[right][c] | before[r][c] if adds else before[r][c]
        phase = "reduce-scatter" if k < p - 1 else "all-gather"
        step = k + 1 if k < p - 1 else k - p + 2  # 1 to p - 1 within its phase
        back = step if k < p - 1 else step - 1  # rank r sends chunk r - back (ring_round)
        each = f"{sent[0][1]:,} bytes" if len({b for _, b in sent}) == 1 else "one chunk"
        which = f"(r - {back}) mod {p}" if back else "r"
        text = (f"{phase}, step {step} of {p - 1}: every rank r sends chunk {which} ({each}) to rank "
                f"(r + 1) mod {p}, which "
                + ("adds its own copy of that chunk" if k < p - 1 else "keeps the finished chunk")
                + (f"; now rank r holds chunk r summed over all {p} ranks." if k == p - 2 else
                   "; now every rank holds every chunk summed." if k == 2 * p - 3 else "."))
        steps.append(RingStep(tuple(map(tuple, holds)), sent, phase, text))
    return steps


def ring_figure(steps: list[RingStep], at: int, title: str = "") -> go.Figure:
    """Ranks x chunks after step `at`: each cell shaded by how many ranks' contributions it sums (dark:
    all p, the finished chunk), labelled with them; the chunk each rank sent in the step outlined."""
    step, p = steps[at], len(steps[at].holds)
    counts = np.array([[len(h) for h in row] for row in step.holds])  # (p ranks, p chunks)
    text = [["+".join(map(str, sorted(h))) for h in row] for row in step.holds]
    fig = go.Figure(go.Heatmap(
        z=counts, zmin=0, zmax=p, colorscale=[[0, "#f7fbff"], [1, "#08306b"]], text=text,
        texttemplate="%{text}", xgap=2, ygap=2,
        colorbar={"title": "ranks summed", "tickvals": list(range(1, p + 1))},
        hovertemplate="rank %{y}, chunk %{x}: the sum of ranks %{text}<extra></extra>"))
    if step.phase != "start":
        for r, (c, _) in enumerate(step.sent):
            fig.add_shape(type="rect", x0=c - 0.5, x1=c + 0.5, y0=r - 0.5, y1=r + 0.5,
                          line={"color": "#d62728", "width": 3})
            fig.add_annotation(x=c, y=(r + 1) % p, ax=c, ay=r, xref="x", yref="y", axref="x", ayref="y",
                               showarrow=True, arrowhead=2, arrowcolor="#d62728", text="")
    fig.update_layout(title=title, height=120 + 60 * p,
                      xaxis={"title": "chunk", "tickvals": list(range(p)), "side": "top"},
                      yaxis={"title": "rank", "tickvals": list(range(p)), "autorange": "reversed"})
    return fig


def bytes_per_rank(steps: list[RingStep]) -> list[int]:
    """Bytes each rank sent over every step (what refpar.comm.cost.all_reduce_bytes gives)."""
    p = len(steps[0].holds)
    return [sum(s.sent[r][1] for s in steps[1:]) for r in range(p)]
