import schedule_figures as parts
import streamlit as st
from lesson_link import lesson_link
from page_words import in_page_words

from refpar.config import ConfigError
from refpar.schedules.builders import BUILDERS, default_chunks

OVERLAPPED = ("dualpipev", "dualpipe")  # the schedules with overlapped F&B pairs


@st.cache_data(max_entries=64)
def figures(kind: str, p: int, m: int, v: int, F: float, B: float, W: float, overlap: str = "sum",
            x_end: float | None = None) -> dict:
    return parts.figures(kind, p, m, v, F, B, W, overlap, x_end)


@st.cache_data(max_entries=64)
def makespan(kind: str, p: int, m: int, v: int, F: float, B: float, W: float, overlap: str = "sum") -> float:
    """The simulated step's length alone: two schedules side by side are drawn once, on one axis."""
    return parts.timeline_of(kind, p, m, v, F, B, W, overlap)[1].makespan


def controls(key: str, default_kind: str) -> tuple:
    kinds = list(BUILDERS)
    kind = st.selectbox("schedule", kinds, index=kinds.index(default_kind), key=f"{key}kind")
    a, b, c = st.columns(3)
    # No limits on the boxes: a value the page cannot use reaches it and is refused under the boxes,
    # rather than left in a box the page silently ignores.
    p = a.number_input("p (stages)", value=4, key=f"{key}p", help=f"1 to {parts.MAX_P}")
    m = b.number_input("m (microbatches)", value=8, key=f"{key}m", help=f"1 to {parts.MAX_M}")
    v = default_chunks(kind)  # 1, or the 2 stages per rank of the V-shaped and bidirectional ones
    if kind == "interleaved-1f1b":
        v = c.number_input("v (chunks per rank)", value=2, key=f"{key}v", help=f"1 to {parts.MAX_V}")
    elif v == 2:
        c.caption("two stages per rank: the first in the kind's colour, the second lighter")
    a, b, c = st.columns(3)
    per = (f"one microbatch through all of a rank's chunks, {parts.MIN_COST:g} to {parts.MAX_COST:g} "
           "time units")
    F, B, W = (col.number_input(label, value=1.0, step=0.5, key=f"{key}{label[0]}", help=f"{what} of {per}")
               for col, label, what in zip((a, b, c), parts.COSTS, ("forward", "backward for the inputs",
                                                              "backward for the weights"), strict=True))
    try:  # refused here, under the boxes, before anything is drawn with them
        parts.check_counts(int(p), int(m), int(v))
        parts.check_costs((float(F), float(B), float(W)))
    except ConfigError as err:
        st.error(str(err))
    overlap = "sum"
    if kind in OVERLAPPED:
        overlap = st.radio("an overlapped F&B costs", ("sum", "max"), horizontal=True, key=f"{key}overlap",
                           help="sum: F + B, the two run one after the other; max: max(F, B), each "
                                "hides the other's communication (DualPipe's premise)")
    return key, kind, int(p), int(m), int(v), float(F), float(B), float(W), overlap


def valid(key, kind, p, m, v, F, B, W, overlap="sum") -> bool:
    """Whether the side's inputs make a schedule (its controls have said why not)."""
    try:
        parts.check_counts(p, m, v)
        parts.check_costs((F, B, W))
    except ConfigError:
        return False
    return True


def computed(key, kind, p, m, v, F, B, W, overlap="sum", x_end=None) -> dict | None:
    if not valid(key, kind, p, m, v, F, B, W, overlap):
        return None
    try:
        return figures(kind, p, m, v, F, B, W, overlap, x_end)
    except ConfigError as err:  # a schedule its builder refuses (interleaved 1F1B's m and p)
        st.error(in_page_words(str(err), parts.CONTROLS))
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
    x_end = None
    if valid(*a) and valid(*b):  # one time axis for both: their lengths compare by eye
        try:
            x_end = max(makespan(*a[1:]), makespan(*b[1:]))
        except ConfigError:
            pass  # the side its builder refuses says so below
    with left:
        first = computed(*a, x_end=x_end)
    with right:
        second = computed(*b, x_end=x_end)
    with left:
        show(a[0], first, a[2])
    with right:
        show(b[0], second, b[2])
else:
    single = controls("", "1f1b")
    show(single[0], computed(*single), single[2])
