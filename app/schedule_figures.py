"""The Pipeline page's checks and figures (app/views/pipeline.py), without Streamlit: what a user's
inputs must be, refused in one sentence naming the page's control, and the figures of a valid
schedule. tests/test_fuzz_app.py calls these directly, the page through st.cache_data."""

from dataclasses import replace

from refpar.config import ConfigError
from refpar.schedules import stage_map
from refpar.schedules.builders import build, model_parts
from refpar.schedules.formats import format_grid
from refpar.schedules.published import published_bubble_fraction, published_idle
from refpar.schedules.simulate import Costs, simulate
from refpar.viz.pipeline import gantt_figure, grid_figure, idle_total, inflight_figure

MAX_P, MAX_M, MAX_V = 16, 64, 4
MIN_COST, MAX_COST = 0.1, 100.0  # a cost of 0 is no action at all; the costs' boxes hold these limits
COSTS = ("F cost", "B cost", "W cost")  # the page's labels of the three costs


def check_counts(p: int, m: int, v: int) -> None:
    """Refuses a p, m or v that would freeze the browser or mean nothing, naming the page's box."""
    if not 1 <= p <= MAX_P:
        raise ConfigError(f"p (stages) = {p}: choose 1 to {MAX_P}")
    if not 1 <= m <= MAX_M:
        raise ConfigError(f"m (microbatches) = {m}: choose 1 to {MAX_M} (at {m:,} the Gantt would hold "
                          f"{max(m, 0) * p * 3:,} bars)")
    if not 1 <= v <= MAX_V:
        raise ConfigError(f"v (chunks per rank) = {v}: choose 1 to {MAX_V}")


def check_costs(costs: tuple[float, float, float]) -> None:
    """Refuses a cost outside the boxes' limits, naming the first such box."""
    for label, cost in zip(COSTS, costs, strict=True):
        if not MIN_COST <= cost <= MAX_COST:
            raise ConfigError(f"{label} = {cost:g}: choose {MIN_COST:g} to {MAX_COST:g} time units")


def chunks_per_rank(kind: str, p: int, v: int) -> int:
    """How many of the model's parts one rank runs a microbatch through: v for interleaved 1F1B, 2
    for the V-shaped ones, 1 for the others (DualPipe's two copies each cut the model in p)."""
    return model_parts(kind, p, v) // p


def timeline_of(kind: str, p: int, m: int, v: int, F: float, B: float, W: float, overlap: str = "sum"):
    """(schedule, simulated timeline, a chunk's share of the costs). F, B and W are what one rank spends
    on one microbatch, whatever the schedule: a rank that holds c chunks of the model runs each in a c-th
    of the time, so that schedules of the same model on the same ranks compare (undivided,
    interleaving would look slower for doing v times the work). A schedule its builder refuses
    (interleaved 1F1B's m not a multiple of p) raises its ConfigError."""
    schedule = build(kind, p, m, v)
    share = 1 / chunks_per_rank(kind, p, v)
    return schedule, simulate(schedule, Costs(F=F * share, B=B * share, W=W * share, overlap=overlap)), share


def figures(kind: str, p: int, m: int, v: int, F: float, B: float, W: float, overlap: str = "sum",
            x_end: float | None = None) -> dict:
    """The page's figures and numbers of one schedule; `x_end` ends the time axis (two schedules side
    by side share one)."""
    schedule, timeline, share = timeline_of(kind, p, m, v, F, B, W, overlap)
    label = f"{kind}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    gantt = gantt_figure(timeline, label, x_end)
    # The published idles are in the costs of one chunk; each is a sum of F, B and W, so a chunk's
    # share of the costs scales it by the same share.
    published = published_idle(kind, p, m, Costs(F=F, B=B, W=W, overlap=overlap))
    if published is not None:
        published = replace(published, idle=published.idle * share)
    busiest = None
    if published is not None:  # the rank that idles most, as the published figure counts idle time
        count = timeline.inner_idle_time if published.steady else timeline.idle_time
        busiest = max(map(count, timeline.slots))
    return {"gantt": gantt, "inflight": inflight_figure(schedule, timeline, "held for backward", x_end),
            "grid": grid_figure(schedule, "unit-cost grid"), "text": format_grid(schedule),
            "bubble": timeline.bubble_fraction, "idle": idle_total(gantt), "makespan": timeline.makespan,
            # the bubble is a ratio of times: equal costs, whatever their size, give the unit-cost form
            "closed": published_bubble_fraction(kind, p, m, v) if F == B == W else None,
            "published": published, "busiest": busiest,
            "whole_backward": not stage_map(schedule).split}  # no W of its own: its B bars are B + W

# The flags refpar.schedules.builders names, as this page's boxes (app/page_words.py).
CONTROLS = {"microbatches": "m (microbatches)", "stages": "p (stages)", "chunks": "v (chunks per rank)"}
