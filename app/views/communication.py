import streamlit as st
from at_scale import show_at_scale
from executed import show_upload
from family import FAMILIES, family_picker
from last_run import last_run
from lesson_link import lesson_link
from page_words import axis_in_page_words
from ring_view import show_ring

from refpar.config import ConfigError, ParallelConfig, TrainConfig, model_preset
from refpar.parallel.expert_parallel import check_expert_parallel
from refpar.viz import comm, expected, moe

EP_MODEL = model_preset("tiny", moe_experts=8)  # every block an MoE block of 8 experts, top-1
EP_MAX_WORLD = 8


BATCH, SEQ = TrainConfig().batch_size, TrainConfig().seq_len


def priced(strategy: str, n: int, dp: int, microbatches: int, model: str, batch: int):
    w = expected.workload(strategy, n, model_preset(model), TrainConfig(steps=1, batch_size=batch), dp=dp,
                          microbatches=microbatches)
    rows, _ = expected.closed_form_rows(w)
    return w.sizes, rows, expected.calls(w)


@st.cache_data(max_entries=64)
def closed_form(strategy: str, n: int, dp: int, microbatches: int, model: str = "tiny"):
    """The mesh's closed forms and the global batch they price: refpar's default, which the Run for
    real page runs, unless the mesh's data ranks need more sequences than it holds (each its
    microbatches' worth); then as many as they need, so that no mesh asks for a batch control."""
    try:
        return (*priced(strategy, n, dp, microbatches, model, BATCH), BATCH)
    except ConfigError as err:
        if "--batch-size" not in str(err):
            raise
    batch = (n if expected.AXIS[strategy] == "dp" else dp) * microbatches
    return (*priced(strategy, n, dp, microbatches, model, batch), batch)


@st.cache_data(max_entries=16)
def ep_closed_form(ep: int, dp: int):
    """dp x ep: the rows and traffic of a step whose routing refpar's router draws."""
    if dp * ep > EP_MAX_WORLD:
        raise ConfigError(f"the mesh has {dp * ep} ranks; the ep view draws at most {EP_MAX_WORLD}")
    check_expert_parallel(EP_MODEL, ep)
    sizes = ParallelConfig({"dp": dp, "ep": ep}).sizes
    kept = moe.drawn_kept(EP_MODEL, dp * ep, TrainConfig().seq_len, ep)
    return moe.step_rows(EP_MODEL, sizes, kept), moe.traffic_matrix(EP_MODEL, sizes, kept)


def per_step(rows: list[dict], steps: int) -> list[dict]:
    """A run's byte rows (totals over its steps) per step."""
    return [{**r, "bytes_sent": r["bytes_sent"] // steps, "bytes_recv": r["bytes_recv"] // steps}
            for r in rows]


def show_run(run: dict) -> None:
    """The last real run, whatever this page's controls say: its bytes per step next to the closed form
    its own report priced (a check, or the differences), who sent to whom, and every traced call."""
    summary = run["summary"]
    steps = summary["steps"]
    st.subheader(f"The last real run: {run['label']}")
    measured = per_step(summary["comm_bytes"], steps)
    closed = summary.get("expected_comm_bytes")
    if closed is not None:
        closed = per_step(closed, steps)
        key = ("rank", "axis", "op", "bytes_sent", "bytes_recv")
        differ = {tuple(r[k] for k in key) for r in measured} ^ {tuple(r[k] for k in key) for r in closed}
        if not differ:
            st.success(f"Measured equals the closed form: every rank, axis and op, byte for byte "
                       f"({sum(r['bytes_sent'] for r in measured):,} bytes sent per step, all ranks).")
        else:
            st.warning(f"Measured differs from the closed form in {len(differ)} rows (rank, axis, op); "
                       "the table below lists them.")
            st.dataframe([dict(zip(key, row, strict=True)) for row in sorted(differ)], hide_index=True)
    st.plotly_chart(comm.bytes_figure(closed or measured, measured if closed else None,
                                      f"the run's bytes per step by axis and op ({steps} steps run)"),
                    width="stretch", key="run-bytes")
    st.plotly_chart(comm.traffic_figure(measured, summary["mesh"], "measured: who sends to whom, per step"),
                    width="stretch", key="run-traffic")
    if run.get("trace"):
        title = "measured: every call of the traced run, rank by rank"
        st.plotly_chart(comm.trace_figure(run["trace"], title), width="stretch", key="run-trace")
        st.caption("Grey hatched: a rank waiting for the last rank of its group to reach the same call. On "
                   "a CPU with more ranks than cores most of a call's time is waiting; the first call also "
                   "waits for every rank to start up.")



st.title("Communication")
st.markdown(
    "Bytes one training step of refpar's tiny GPT-2 or tiny Llama moves, from the closed forms the "
    "tests check every trace against. Drag the slider under the matrix to light up the links each collective "
    "uses, in program order: a ring sends everything to the next rank of its group, so a tp group's "
    "traffic stays on the diagonal band of neighbours while dp's jumps across it."
)
lesson_link(1)
run = last_run()
shown = run["key"] if run is not None else None
if (shown is not None and len(shown) == 5 and shown[0] in expected.STRATEGIES
        and shown[4] in FAMILIES.values() and all(isinstance(x, int) and x >= 1 for x in shown[1:4])):
    # The Run for real page's single-axis run: a button sets this page's controls to its mesh.
    def show_this_run(key=tuple(shown)) -> None:
        for name, value in zip(("comm_strategy", "comm_n", "comm_dp", "comm_m"), key, strict=False):
            st.session_state[name] = value
        st.session_state["family"] = next(label for label, preset in FAMILIES.items() if preset == key[4])

    st.button(f"show the last run's mesh ({run['label']})", on_click=show_this_run,
              help="sets the controls below to the mesh the Run for real page launched")
# The defaults through session state, never as the widgets' own: "show the last run's mesh" sets them.
for name, default in (("comm_strategy", "tp"), ("comm_n", 2), ("comm_dp", 2), ("comm_m", 2)):
    st.session_state.setdefault(name, default)
a, b, c, d = st.columns(4)
strategy = a.selectbox("strategy", (*expected.STRATEGIES, "ep"), key="comm_strategy")
n = b.number_input("ranks on its axis", step=1, key="comm_n",
                   help="dp for DP, ZeRO and FSDP; tp for TP and SP; cp for CP; pp for PP; ep for EP")
dp = c.number_input("dp replicas", step=1, key="comm_dp",
                    disabled=strategy != "ep" and expected.AXIS[strategy] == "dp",
                    help="tp, sp, cp, pp and ep can be replicated over dp")
m = d.number_input("microbatches", step=1, disabled=strategy == "ep", key="comm_m",
                   help="pp: m per step; dp strategies: gradient accumulation")
model = family_picker() if strategy != "ep" else "tiny"
for label, value in (("ranks on its axis", n), ("dp replicas", dp), ("microbatches", m)):
    if value < 1:  # the boxes have no limits: a typed value reaches the page and is refused here
        st.error(f"{label} = {value:,}: choose 1 or more")
        st.stop()
if strategy == "ep":
    st.markdown(f"A tiny GPT-2 whose {EP_MODEL.n_layer} blocks each hold {EP_MODEL.moe_experts} experts "
                "(top-1, capacity factor 1.25), one sequence per data rank. Each block's router picks "
                "the experts of this step's tokens, and the all-to-all bytes are exact for those "
                "counts (refpar.analysis.moe): a rank sends a peer the rows bound for the peer's "
                "experts and gets back their outputs, forward and backward.")
    try:
        rows, matrix = ep_closed_form(int(n), int(dp))
    except ConfigError as err:
        st.error(str(err))
        st.stop()
    st.plotly_chart(comm.bytes_figure(rows, None, "bytes per step by axis and op"), width="stretch")
    st.plotly_chart(comm.matrix_figure(matrix, "who sends to whom, one step"), width="stretch")
    st.stop()
try:
    key = (strategy, int(n), 1 if expected.AXIS[strategy] == "dp" else int(dp), int(m), model)
    sizes, rows, calls, batch = closed_form(*key)
except ConfigError as err:
    st.error(axis_in_page_words(str(err), strategy, int(n), SEQ))
    st.stop()
if batch != BATCH:
    st.caption(f"A batch of {batch} sequences, each data rank's {int(m)} microbatches "
               f"(refpar's default is {BATCH}).")
measured = None
if run is not None and run["key"] == key:
    measured = per_step(run["summary"]["comm_bytes"], run["summary"]["steps"])
    st.success("This is the last real run's mesh: its measured bytes per step are beside the closed form.")
st.plotly_chart(comm.bytes_figure(rows, measured, "bytes per step by axis and op"), width="stretch")
left, right = st.columns(2)
if calls:
    left.plotly_chart(comm.calls_figure(calls, sizes, "who sends to whom: "), width="stretch")
    right.plotly_chart(comm.timeline_figure(calls, "the step's collectives, in order"), width="stretch")
else:
    left.plotly_chart(comm.traffic_figure(rows, sizes, "who sends to whom, one step"), width="stretch")
    right.markdown("The pipeline's messages are per microbatch: the Pipeline page draws when each "
                   "one is sent.")
show_ring(int(n))
with st.expander("open the messages of another run (refpar train --trace PATH writes PATH.jsonl)"):
    uploaded = st.file_uploader("its PATH.jsonl, every message, or its Chrome trace PATH (.json)",
                                type=["jsonl", "json"], key="comm_upload")
    if uploaded is not None:
        show_upload(uploaded.name, uploaded.getvalue(), "comm-uploaded")
if run is None:
    st.info("Launch a run on the Run for real page: its measured bytes appear here, whatever the mesh above.")
else:
    show_run(run)

show_at_scale("communication_scale", "llama3-70b", memory=False)
