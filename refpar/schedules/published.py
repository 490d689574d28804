"""What the papers publish about their schedules, with uniform costs unless a cost is named: the
bubble (`published_bubble_fraction` for the loop schedules, `published_idle` for the V-shaped and
bidirectional ones) and the peak of stored activations (`published_peak`). Tests and the app hold
the simulations (simulate.py) against these.
"""

from __future__ import annotations

from dataclasses import dataclass

from refpar.schedules.simulate import Costs


def published_bubble_fraction(kind: str, p: int, m: int, v: int = 1) -> float | None:
    """The published bubble with uniform costs F = B = W, as a fraction of total time, where the
    schedule's builder attains it: GPipe and 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v*m) of
    compute, i.e. (p-1)/(v*m+p-1) of total; ZB-H1 idle (p-1)(F+B-W) per rank."""
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1" and m >= p:
        return (p - 1) / (3 * m + p - 1)
    return None


def published_peak(kind: str, p: int) -> int | None:
    """The most stage activations a rank holds at once (from a stage's F to its W, or to its
    full B), as published, where m is large enough to fill the pipeline: ZB-V 2p, that is p
    microbatches of two stages each, 1F1B's p (zero-bubble README, "1x"); V-Half (p+2)//2 and
    V-Min (p+4)//3 microbatches, twice that in stages (Qi et al.'s playground, "Activation Memory
    (by #micro-batch)"; README "1/2x", "1/3x"); DualPipeV PP+1 stages with PP = 2p and DualPipe
    PP+1 with PP = p, each stage of DualPipe a rank's 1/p of the model (DualPipe README)."""
    return {"zbv": 2 * p, "v-half": 2 * ((p + 2) // 2), "v-min": 2 * ((p + 4) // 3),
            "dualpipev": 2 * p + 1, "dualpipe": p + 1}.get(kind)


def expected_v_bubble(p: int, M: int) -> int:
    """Qi et al.'s expected bubble of a V schedule whose ranks hold at most M stage activations:
    idle ticks between a rank's first and last action, F = B = W = 1 tick,
    3p - 1 - 3M + max(3p, p - 1 + 2(1 + (M+1)//2)) (sail-sg/zero-bubble,
    megatron/core/pipeline_parallel/zerobubble/scheduler/v_auto_schedule.py, schedule()). For
    M = 2p it is 0 (ZB-V); for M <= 2p - 2 it is 6p - 1 - 3M, so M = p gives 3p - 1 and
    M = 2p/3 gives 4p - 1: half and two thirds of 1F1B's 6(p-1) as p grows, the README's B/2 for
    V-Half and 2B/3 for V-Min."""
    return 3 * p - 1 - 3 * M + max(3 * p, p - 1 + 2 * (1 + (M + 1) // 2))


@dataclass(frozen=True)
class Published:
    """A published bubble: the idle time of the rank that idles most, counted between its own
    first and last action (`steady`, what back-to-back steps keep) or over the whole step."""

    idle: float
    steady: bool
    source: str


def published_idle(kind: str, p: int, m: int, costs: Costs) -> Published | None:
    """The published bubble of a V-shaped or bidirectional schedule, where its source states one
    for these p, m and costs:
      zbv      0 between first and last action, F = B = W and m >= 2p-1 (Qi et al. 2024, section 6);
      v-half, v-min  expected_v_bubble(p, published_peak), F = B = W, p >= 3 and m >= p;
      dualpipe, dualpipev  (PP/2-1)(F&B + B - 3W) over the step, B the full backward (refpar's
               B + W), F&B as costs.overlap prices it (DualPipe README). The README draws it with a
               backward for inputs as long as a forward (B = F); other costs are left to the
               simulation."""
    unit = (costs.F, costs.B, costs.W) == (1.0, 1.0, 1.0)
    if kind == "zbv" and unit and m >= 2 * p - 1:
        return Published(0.0, True, "Qi et al. 2024, ZB-V (section 6)")
    if kind in ("v-half", "v-min") and unit and p >= 3 and m >= p:
        return Published(float(expected_v_bubble(p, published_peak(kind, p))), True,
                         "Qi et al. 2024b, expected bubble for the peak memory (v_auto_schedule.py)")
    if kind in ("dualpipe", "dualpipev") and costs.B == costs.F:
        PP = p if kind == "dualpipe" else 2 * p  # stages of the README's table
        full = costs.B + costs.W
        pair = costs.F + full if costs.overlap == "sum" else max(costs.F, full)
        return Published((PP / 2 - 1) * (pair + full - 3 * costs.W), False,
                         "DualPipe README, (PP/2-1)(F&B+B-3W)")
    return None
