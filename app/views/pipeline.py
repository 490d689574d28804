from dataclasses import replace

import streamlit as st
from lesson_link import lesson_link

from refpar.config import ConfigError
from refpar.schedules import stage_map
from refpar.schedules.builders import BUILDERS, build, default_chunks, model_parts
from refpar.schedules.formats import format_grid
from refpar.schedules.published import published_bubble_fraction, published_idle
from refpar.schedules.simulate import Costs, simulate
from refpar.viz.pipeline import gantt_figure, grid_figure, idle_total, inflight_figure

OVERLAPPED = ("dualpipev", "dualpipe")  # the schedules with overlapped F&B pairs

MAX_P, MAX_M, MAX_V, MAX_COST = 16, 64, 4, 100.0


def check(p: int, m: int, v: int, costs: tuple[float, float, float]) -> None:
    """Refuses what would freeze the browser or mean nothing, in one sentence each."""
    if not 1 <= p <= MAX_P:
        raise ConfigError(f"p={p} stages: choose 1 to {MAX_P}")
    if not 1 <= m <= MAX_M:
        raise ConfigError(f"m={m} microbatches would draw {m * p * 3:,} bars; choose 1 to {MAX_M}")
    if not 1 <= v <= MAX_V:
        raise ConfigError(f"v={v} chunks: choose 1 to {MAX_V}")
    if not all(0 < c <= MAX_COST for c in costs):
        raise ConfigError(f"F, B and W must each take more than 0 and at most {MAX_COST:g} units")


def chunks_per_rank(kind: str, p: int, v: int) -> int:
    """How many of the model's parts one rank runs a microbatch through: v for interleaved 1F1B, 2
    for the V-shaped ones, 1 for the others (DualPipe's two copies each cut the model in p)."""
    return model_parts(kind, p, v) // p


@st.cache_data(max_entries=64)
def figures(kind: str, p: int, m: int, v: int, F: float, B: float, W: float, overlap: str = "sum",
            x_end: float | None = None):
    """F, B and W are what one rank spends on one microbatch, whatever the schedule: a rank that holds
    c chunks of the model runs each in a c-th of the time, so that schedules of the same model on the
    same ranks compare (undivided, interleaving would look slower for doing v times the work)."""
    schedule = build(kind, p, m, v)
    share = 1 / chunks_per_rank(kind, p, v)
    timeline = simulate(schedule, Costs(F=F * share, B=B * share, W=W * share, overlap=overlap))
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


def controls(key: str, default_kind: str) -> tuple:
    kinds = list(BUILDERS)
    kind = st.selectbox("schedule", kinds, index=kinds.index(default_kind), key=f"{key}kind")
    a, b, c = st.columns(3)
    p = a.number_input("p (stages)", min_value=1, value=4, key=f"{key}p")
    m = b.number_input("m (microbatches)", min_value=1, value=8, key=f"{key}m")
    v = default_chunks(kind)  # 1, or the 2 stages per rank of the V-shaped and bidirectional ones
    if kind == "interleaved-1f1b":
        v = c.number_input("v (chunks per rank)", min_value=1, value=2, key=f"{key}v")
    elif v == 2:
        c.caption("two stages per rank: the first in the kind's colour, the second lighter")
    a, b, c = st.columns(3)
    per = "one microbatch through all of a rank's chunks"
    F = a.number_input("F cost", min_value=0.0, value=1.0, step=0.5, key=f"{key}F", help=f"forward of {per}")
    B = b.number_input("B cost", min_value=0.0, value=1.0, step=0.5, key=f"{key}B",
                       help=f"backward for the inputs of {per}")
    W = c.number_input("W cost", min_value=0.0, value=1.0, step=0.5, key=f"{key}W",
                       help=f"backward for the weights of {per}")
    overlap = "sum"
    if kind in OVERLAPPED:
        overlap = st.radio("an overlapped F&B costs", ("sum", "max"), horizontal=True, key=f"{key}overlap",
                           help="sum: F + B, the two run one after the other; max: max(F, B), each "
                                "hides the other's communication (DualPipe's premise)")
    return key, kind, int(p), int(m), int(v), float(F), float(B), float(W), overlap


def computed(key, kind, p, m, v, F, B, W, overlap="sum", x_end=None) -> dict | None:
    try:
        check(p, m, v, (F, B, W))
        return figures(kind, p, m, v, F, B, W, overlap, x_end)
    except ConfigError as err:
        st.error(str(err))
        return None


def predicted(key: str, out: dict) -> bool:
    """Predict, then reveal: with "predict first" on, the learner's guess of the bubble, graded
    against the simulation; True once they have guessed (or with it off), when the answers show."""
    if not st.session_state.get("predict"):
        return True
    guess = st.number_input("your guess: the share of rank-time idle (0 to 1)", min_value=0.0, max_value=1.0,
                            value=None, step=0.01, key=f"{key}guess",
                            help="count the idle slots of the grid, or use the formula of the lesson")
    if guess is None:
        st.info("Guess the bubble of this schedule first: the answers appear once you have.")
        return False
    if abs(guess - out["bubble"]) <= 0.01:
        st.success(f"Right: {out['bubble']:.4f} of the rank-time is idle.")
    else:
        st.warning(f"Not quite: {out['bubble']:.4f} of the rank-time is idle, not {guess:.2f}; the Gantt "
                   "below shows where.")
    return True


def show(key, out: dict | None, p: int) -> None:
    if out is None or not predicted(key, out):
        return
    a, b = st.columns(2)
    a.metric("bubble (simulated)", f"{out['bubble']:.4f}",
             help=f"idle time shaded in the Gantt, {out['idle']:g}, over p x makespan = {p} x "
                  f"{out['makespan']:g}")
    b.metric("bubble (closed form)", "n/a" if out["closed"] is None else f"{out['closed']:.4f}",
             help="the published form, which holds for F = B = W (any one cost: the bubble is a ratio of "
                  "times); n/a for unequal costs or where none is published")
    published = out["published"]
    if published is not None:
        where = "between its first and last action" if published.steady else "over the step"
        a, b = st.columns(2)
        a.metric("idle of the rank that idles most (simulated)", f"{out['busiest']:g}",
                 help=f"time units, {where}")
        b.metric("idle of the rank that idles most (published)", f"{published.idle:g}",
                 help=f"{published.source}; time units, {where}")
    if out["whole_backward"]:
        st.caption("This schedule runs each backward whole: its B bars are B + W long.")
    # keyed by side: two sides set alike draw the same figures, which need two element ids
    st.plotly_chart(out["gantt"], width="stretch", key=f"{key}gantt")
    st.plotly_chart(out["inflight"], width="stretch", key=f"{key}inflight")
    st.plotly_chart(out["grid"], width="stretch", key=f"{key}grid")
    with st.expander("the grid as `refpar schedule` prints it"):
        st.code(out["text"], language=None)


st.title("Pipeline schedules")
st.markdown(
    "Each bar is one action (`1F0`: stage 1's forward of microbatch 0) at the time the simulator "
    "runs it; red shading is idle time, and its share of all rank-time is the bubble, shown next "
    "to the published formula. Press Play to watch the schedule tick by tick, and compare how many "
    "microbatches each stage holds for backward: GPipe holds all m, 1F1B at most p. The V-shaped "
    "schedules (zbv, v-half, v-min, dualpipev) put stages r and 2p-1-r on rank r, dualpipe two "
    "copies of the model fed from both ends: a rank's second stage is drawn lighter."
)
lesson_link(8)
compare = st.toggle("compare two schedules side by side")
st.toggle("predict first", key="predict", help="hide the bubble and the figures until you have guessed it")
if compare:
    left, right = st.columns(2)
    with left:
        a = controls("a_", "1f1b")
    with right:
        b = controls("b_", "zb-h1")
    with left:
        first = computed(*a)
    with right:
        second = computed(*b)
    if first is not None and second is not None:  # one time axis for both: their lengths compare by eye
        x_end = max(first["makespan"], second["makespan"])
        first, second = computed(*a, x_end=x_end), computed(*b, x_end=x_end)
    with left:
        show(a[0], first, a[2])
    with right:
        show(b[0], second, b[2])
else:
    single = controls("", "1f1b")
    show(single[0], computed(*single), single[2])
