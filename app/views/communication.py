import streamlit as st
from family import family_picker
from lesson_link import lesson_link

from refpar.config import ConfigError, ParallelConfig, TrainConfig, model_preset
from refpar.parallel.expert_parallel import check_expert_parallel
from refpar.viz import comm, expected, moe

EP_MODEL = model_preset("tiny", moe_experts=8)  # every block an MoE block of 8 experts, top-1
EP_MAX_WORLD = 8


@st.cache_data(max_entries=64)
def closed_form(strategy: str, n: int, dp: int, microbatches: int, model: str = "tiny"):
    w = expected.workload(strategy, n, model_preset(model), TrainConfig(steps=1), dp=dp,
                          microbatches=microbatches)
    rows, _ = expected.closed_form_rows(w)
    return w.sizes, rows, expected.calls(w)


@st.cache_data(max_entries=16)
def ep_closed_form(ep: int, dp: int):
    """dp x ep: the rows and traffic of a step whose routing refpar's router draws."""
    if dp * ep > EP_MAX_WORLD:
        raise ConfigError(f"the mesh has {dp * ep} ranks; the ep view draws at most {EP_MAX_WORLD}")
    check_expert_parallel(EP_MODEL, ep)
    sizes = ParallelConfig({"dp": dp, "ep": ep}).sizes
    kept = moe.drawn_kept(EP_MODEL, dp * ep, TrainConfig().seq_len, ep)
    return moe.step_rows(EP_MODEL, sizes, kept), moe.traffic_matrix(EP_MODEL, sizes, kept)


st.title("Communication")
st.markdown(
    "Bytes one training step of refpar's tiny GPT-2 or tiny Llama moves, from the closed forms the "
    "tests check every trace against. Drag the slider under the matrix to light up the links each collective "
    "uses, in program order: a ring sends everything to the next rank of its group, so a tp group's "
    "traffic stays on the diagonal band of neighbours while dp's jumps across it."
)
lesson_link(1)
a, b, c, d = st.columns(4)
strategy = a.selectbox("strategy", (*expected.STRATEGIES, "ep"), index=expected.STRATEGIES.index("tp"))
n = b.number_input("ranks on its axis", min_value=1, value=2,
                   help="dp for DP, ZeRO and FSDP; tp for TP and SP; cp for CP; pp for PP; ep for EP")
dp = c.number_input("dp replicas", min_value=1, value=2,
                    disabled=strategy != "ep" and expected.AXIS[strategy] == "dp",
                    help="tp, sp, cp, pp and ep can be replicated over dp")
m = d.number_input("microbatches", min_value=1, value=2, disabled=strategy == "ep",
                   help="pp: m per step; dp strategies: gradient accumulation")
model = family_picker() if strategy != "ep" else "tiny"
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
    sizes, rows, calls = closed_form(*key)
except ConfigError as err:
    st.error(str(err))
    st.stop()
run = st.session_state.get("run")
measured = None
if run is not None and run["key"] == key:
    per_step = run["summary"]["steps"]
    measured = [{**r, "bytes_sent": r["bytes_sent"] // per_step, "bytes_recv": r["bytes_recv"] // per_step}
                for r in run["summary"]["comm_bytes"]]
    st.success("The measured bars come from the run launched on the Run for real page (per step).")
else:
    st.info("Launch this mesh on the Run for real page to see measured bytes beside the closed form.")
st.plotly_chart(comm.bytes_figure(rows, measured, "bytes per step by axis and op"), width="stretch")
left, right = st.columns(2)
if calls:
    left.plotly_chart(comm.calls_figure(calls, sizes, "who sends to whom: "), width="stretch")
    right.plotly_chart(comm.timeline_figure(calls, "the step's collectives, in order"), width="stretch")
else:
    left.plotly_chart(comm.traffic_figure(rows, sizes, "who sends to whom, one step"), width="stretch")
    right.markdown("The pipeline's messages are per microbatch: the Pipeline page draws when each "
                   "one is sent.")
if measured is not None:
    st.plotly_chart(comm.traffic_figure(measured, sizes, "measured: who sends to whom"), width="stretch")
    if run.get("trace"):
        title = "measured: every call of the traced run, rank by rank"
        st.plotly_chart(comm.trace_figure(run["trace"], title), width="stretch")
