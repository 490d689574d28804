import streamlit as st
from lesson_link import lesson_link

from refpar.analysis.hardware import HARDWARE, hardware
from refpar.analysis.planner import plan
from refpar.analysis.presets import PRESETS, preset
from refpar.config import ConfigError
from refpar.viz.plan import plan_figure, plan_label

MAX_GPUS = 1 << 16


@st.cache_data(max_entries=32)
def plans(model: str, hw: str, gpus: int, top: int) -> dict:
    return plan(preset(model), hardware(hw), gpus, top=top)


st.title("Plan")
st.markdown(
    "The planner prices every mesh of a published model on N GPUs with closed forms (no MPI) and "
    "keeps the fastest that fit. Look at what each plan spends its memory on against the GPU's "
    "capacity (dashed line), and where its step time goes: compute, exposed communication, and the "
    "pipeline bubble."
)
lesson_link(8)
names = list(PRESETS)
a, b, c, d = st.columns(4)
model = a.selectbox("model", names, index=names.index("gpt3-175b") if "gpt3-175b" in names else 0)
hw = b.selectbox("hardware", list(HARDWARE), index=list(HARDWARE).index("h100") if "h100" in HARDWARE else 0)
gpus = c.number_input("GPUs", min_value=1, value=1024, step=8)
top = d.number_input("plans shown", min_value=1, max_value=10, value=5)
try:
    if gpus > MAX_GPUS:
        raise ConfigError(f"{gpus:,} GPUs: choose at most {MAX_GPUS:,}")
    result = plans(model, hw, int(gpus), int(top))
except ConfigError as err:
    st.error(str(err))
    st.stop()
st.plotly_chart(plan_figure(result), width="stretch")
st.dataframe([{"plan": plan_label(p), "step (s)": round(p["step_time_s"], 3), "MFU": round(p["mfu"], 3),
               "tokens/s": round(p["tokens_per_s"]), "micro-batch": p["micro_batch"],
               "microbatches": p["microbatches"]} for p in result["plans"]], hide_index=True)
