import streamlit as st
from family import family_picker
from lesson_link import lesson_link

from refpar.config import ConfigError
from refpar.viz import mesh_sharding, sharding

NAMES = {"dp": "DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP",
         "tp": "TP (column/row split)", "sp": "SP (sequence parallel)", "ep": "EP (experts)"}
LESSON = {"dp": 3, "zero1": 4, "zero2": 4, "zero3": 4, "fsdp": 4, "tp": 6, "sp": 7, "ep": 10}


@st.cache_data(max_entries=64)
def steps_of(strategy: str, n: int):
    return sharding.steps_for(strategy, n)


@st.cache_data(max_entries=128)
def figure(strategy: str, n: int, at: int = 0):
    return sharding.sharding_figure(steps_of(strategy, n), n, f"{NAMES[strategy]}, {n} ranks. ", at)


MODELS = {"tiny": sharding.DEMO_MODEL, "llama-tiny": sharding.DEMO_LLAMA}  # the family's demo model


@st.cache_data(max_entries=64)
def mix_steps(dp: int, tp: int, zero: int, sp: bool, model: str = "tiny"):
    return mesh_sharding.mix_steps(dp, tp, zero, sp, MODELS[model])


@st.cache_data(max_entries=128)
def mix_figure(dp: int, tp: int, zero: int, sp: bool, model: str = "tiny", at: int = 0):
    title = f"dp={dp} x tp={tp}{' with SP' if sp else ''}, ZeRO-{zero} over dp. "
    return mesh_sharding.mix_figure(mix_steps(dp, tp, zero, sp, model), title, at)


@st.cache_data(max_entries=16)
def pp_tp_steps(pp: int, tp: int, model: str = "tiny"):
    return mesh_sharding.pp_tp_steps(pp, tp, MODELS[model])


@st.cache_data(max_entries=64)
def pp_tp_figure(pp: int, tp: int, model: str = "tiny", at: int = 0):
    return mesh_sharding.mix_figure(pp_tp_steps(pp, tp, model), f"pp={pp} x tp={tp}. ", at)


def stepper(steps: list) -> int:
    """The moment of the step the page shows: a slider over the moments with a step back and a step
    forward beside it, and the moment's narration as text above the figure. It starts at the first
    moment (before the step), and stays where the learner left it while they change the mesh."""
    last = len(steps) - 1
    st.session_state["moment"] = min(st.session_state.get("moment", 0), last)

    def move(by: int) -> None:
        st.session_state["moment"] = min(max(st.session_state["moment"] + by, 0), last)

    back, slider, forward = st.columns([1, 12, 1], vertical_alignment="bottom")
    back.button("◀", on_click=move, args=(-1,), disabled=st.session_state["moment"] == 0,
                help="the moment before", key="moment_back")
    at = slider.select_slider("moment of the training step", options=range(last + 1), key="moment",
                              format_func=lambda i: f"{i + 1}. {steps[i].label}")
    forward.button("▶", on_click=move, args=(1,), disabled=at == last, help="the next moment",
                   key="moment_forward")
    st.info(f"**{at + 1} of {last + 1}, {steps[at].label}**: {steps[at].moves}")
    return at


def pp_tp(model: str) -> None:
    st.markdown(
        "Pipeline stages times tensor parallelism, ranks numbered as refpar's mesh numbers them (tp "
        "fastest): each stage holds only its own blocks (stage_layers), and within a stage TP cuts "
        "each weight into tp slices."
    )
    a, b = st.columns(2)
    pp = a.number_input("pp", min_value=1, value=2, key="mix_pp",
                        help=f"at most {sharding.DEMO_MODEL.n_layer}: one block per stage or more")
    tp = b.number_input("tp", min_value=1, value=2, key="mix_pp_tp")
    lesson_link(8)
    try:
        at = stepper(pp_tp_steps(int(pp), int(tp), model))
        st.plotly_chart(pp_tp_figure(int(pp), int(tp), model, at), width="stretch")
    except ConfigError as err:
        st.error(str(err))


def mix(model: str) -> None:
    st.markdown(
        "Two axes at once, on dp x tp ranks numbered as refpar's mesh numbers them (tp fastest). Each "
        "cell's colour is the set of ranks that hold it: TP cuts each weight into tp slices, every dp "
        "replica of a tp rank holds the same slice, and ZeRO cuts that slice once more over dp "
        "(ZeRO-1: the gradients and optimizer state; ZeRO-3: the parameters too). With SP each tp "
        "rank keeps only its rows of the residual stream. Step through the moments of the step: "
        "with ZeRO-3, block 0's slices are gathered over dp for its forward and backward only."
    )
    a, b, c, d = st.columns(4)
    dp = a.number_input("dp", min_value=1, value=2, key="mix_dp")
    tp = b.number_input("tp", min_value=1, value=2, key="mix_tp")
    zero = c.selectbox("ZeRO stage over dp", mesh_sharding.ZERO_STAGES, index=2, key="mix_zero")
    sp = d.checkbox("sequence parallel (SP) on tp", key="mix_sp")
    lesson_link(7 if sp else 4 if zero else 6)
    try:
        at = stepper(mix_steps(int(dp), int(tp), zero, sp, model))
        st.plotly_chart(mix_figure(int(dp), int(tp), zero, sp, model, at), width="stretch")
    except ConfigError as err:
        st.error(str(err))


st.title("Sharding layouts")
st.markdown(
    "Each cell is one element of a tensor of block 0 (the pp x tp mix draws every block), coloured by the "
    "rank that holds it (grey: "
    "every rank has a copy; white: nobody holds it at that moment). Step through the moments with "
    "the arrows, or press Play under the figure (a moment a second; Play x3 is faster): watch ZeRO-3 "
    "gather block 0's weights only around its forward and backward, "
    "TP split c_attn and c_fc by columns and the c_proj's by rows, SP shard the sequence outside "
    "attention and the MLP, and EP send each token to the rank that owns its expert."
)
if st.toggle("mix two axes (dp x tp with ZeRO, tp x sp, pp x tp)"):
    axes = st.radio("axes", ("dp x tp", "pp x tp"), horizontal=True, key="mix_axes")
    st.caption("Llama's 8 query heads share 2 kv heads: from tp = 4 on, each kv head's k_proj rows "
               "are held whole by several ranks (one colour for the set).")
    model = family_picker()
    if axes == "pp x tp":
        pp_tp(model)
    else:
        mix(model)
else:
    left, right = st.columns(2)
    strategy = left.selectbox("strategy", list(NAMES), format_func=NAMES.get, index=3)
    n = right.number_input("ranks", min_value=1, value=4, step=1,
                           help=f"1 to {sharding.MAX_RANKS}: more colours cannot be told apart")
    lesson_link(LESSON[strategy])
    try:
        at = stepper(steps_of(strategy, int(n)))
        st.plotly_chart(figure(strategy, int(n), at), width="stretch")
    except ConfigError as err:
        st.error(str(err))
st.caption(f"Model: {sharding.DEMO_MODEL.n_layer} blocks, C={sharding.DEMO_MODEL.n_embd}, "
           f"{sharding.DEMO_MODEL.n_head} heads, T={sharding.DEMO_SEQ} (EP: "
           f"{sharding.DEMO_MOE_MODEL.moe_experts} experts, top-1), small enough to draw every element. "
           "Biases and LayerNorms are left out of the picture.")
