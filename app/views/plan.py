import streamlit as st
from lesson_link import lesson_link
from page_words import planner_in_page_words, within

from refpar.analysis.calibration import validate
from refpar.analysis.efficiency import SOFTWARE
from refpar.analysis.hardware import HARDWARE, hardware
from refpar.analysis.planner import AXES, RECOMPUTE, SCHEDULES, ZERO_STAGES, plan, price
from refpar.analysis.presets import PRESETS, preset
from refpar.config import ConfigError
from refpar.viz.plan import plan_figure, plan_label, validation_figure

MAX_GPUS, MAX_TOP = 1 << 16, 10


@st.cache_data(max_entries=32)
def plans(model: str, hw: str, gpus: int, top: int, software: str) -> dict:
    return plan(preset(model), hardware(hw), gpus, top=top, software=SOFTWARE[software])


@st.cache_data(max_entries=32)
def priced(model: str, hw: str, gpus: int, mesh: tuple, options: tuple, software: str) -> dict:
    """One plan priced, with its rank among the plans the search finds for the same job."""
    spec, device, sw = preset(model), hardware(hw), SOFTWARE[software]
    row = price(spec, device, gpus, dict(mesh), software=sw, **dict(options))
    searched = plan(spec, device, gpus, top=1, software=sw, priced=row)
    return {**searched, "plans": [row, searched["plans"][0]], "software": software}


@st.cache_data
def validation() -> dict:
    return validate()


def table(rows: list[dict]) -> list[dict]:
    return [{"plan": plan_label(p), "step (s)": round(p["step_time_s"], 3), "MFU": round(p["mfu"], 3),
             "tokens/s": round(p["tokens_per_s"]), "micro-batch": p["micro_batch"],
             "microbatches": p["microbatches"]} for p in rows]


st.title("Plan")
st.markdown(
    "The planner prices every mesh of a published model on N GPUs with closed forms (no MPI) and "
    "keeps the fastest that fit. Its step time is one model, calibrated against published measured "
    "runs (bottom of the page): GEMMs by shape, the attention kernel, memory-bound kernels, NVLink "
    "inside a node and InfiniBand across, what overlaps what, and the pipeline's bubble. Look at "
    "what each plan spends its memory on against the GPU's capacity (dashed line), and where its step "
    "time goes."
)
lesson_link(11)
names = list(PRESETS)
a, b, c, d = st.columns(4)
model = a.selectbox("model", names, index=names.index("gpt3-175b") if "gpt3-175b" in names else 0)
hw = b.selectbox("hardware", list(HARDWARE), index=list(HARDWARE).index("h100") if "h100" in HARDWARE else 0)
gpus = c.number_input("GPUs", value=1024, step=8, key="plan_gpus", help=f"1 to {MAX_GPUS:,}")
top = d.number_input("plans shown", value=5, key="plan_top", help=f"1 to {MAX_TOP}")
software = st.selectbox("software", list(SOFTWARE), help="which attention kernel, and what overlaps what")
try:
    gpus, top = within("GPUs", gpus, 1, MAX_GPUS), within("plans shown", top, 1, MAX_TOP)
    result = plans(model, hw, gpus, top, software)
except ConfigError as err:
    st.error(planner_in_page_words(str(err)))
    st.stop()
st.plotly_chart(plan_figure(result), width="stretch")
st.dataframe(table(result["plans"]), hide_index=True)

st.subheader("Price your own plan")
st.markdown("Give a mesh (dp takes the GPUs the others leave) and the options; the plan is priced "
            "as a search row and ranked among the plans the search finds.")
sizes = {}
for column, axis in zip(st.columns(4), [a for a in AXES if a != "dp"], strict=True):
    sizes[axis] = column.number_input(axis, value={"tp": 8, "pp": 8}.get(axis, 1), key=f"price-{axis}",
                                      help="1 to the GPUs")
e, f, g, h = st.columns(4)
zero = e.selectbox("ZeRO stage", ZERO_STAGES, key="price-zero")
schedule = f.selectbox("schedule", SCHEDULES, index=SCHEDULES.index("1f1b"), key="price-schedule")
chunks = g.number_input("chunks (interleaved)", value=2, key="price-chunks", help="2 or more")
micro_batch = h.number_input("micro-batch", value=1, key="price-micro", help="1 or more")
i, j = st.columns(2)
recompute = i.selectbox("recompute", RECOMPUTE, index=RECOMPUTE.index("selective"), key="price-recompute")
sp = j.checkbox("sequence parallelism", value=True, key="price-sp")
try:
    sizes = {axis: within(axis, size, 1, gpus) for axis, size in sizes.items()}
    chunks, micro_batch = within("chunks (interleaved)", chunks, 2), within("micro-batch", micro_batch, 1)
    replica = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["ep"]
    if int(gpus) % replica:
        raise ConfigError(f"tp x pp x cp x ep = {replica} does not divide {int(gpus)} GPUs; choose sizes "
                          f"whose product divides it")
    mesh = {"dp": int(gpus) // replica, **{k: int(v) for k, v in sizes.items()}}
    options = (("zero", int(zero)), ("schedule", schedule), ("chunks", int(chunks)),
               ("micro_batch", int(micro_batch)), ("recompute", recompute),
               ("sp", bool(sp and mesh["tp"] > 1)))
    mine = priced(model, hw, int(gpus), tuple(mesh.items()), options, software)
except ConfigError as err:
    st.error(planner_in_page_words(str(err)))
else:
    row = mine["plans"][0]
    st.markdown(f"**{plan_label(row)}**: step {row['step_time_s']:.3f} s, MFU {100 * row['mfu']:.1f}%; "
                f"rank {mine['rank']} of the {mine['fitting']:,} plans that fit "
                f"(the fastest: {mine['plans'][1]['step_time_s']:.3f} s).")
    st.plotly_chart(plan_figure(mine), width="stretch", key="priced-figure")
    st.dataframe(table(mine["plans"]), hide_index=True)

st.subheader("Against published measured runs")
checked = validation()
eff = checked["efficiency"]
st.markdown(
    f"Every run priced by the same model at the published mesh and options (what a paper leaves open, "
    f"the planner's best). Fitted on the rows marked fit: matmul {eff['matmul']:.3g} of the measured "
    f"maximum achievable matmul rate, memory-bound kernels {eff['memory']:.3g} of HBM bandwidth, "
    f"collectives {eff['network']:.3g} of the link's. Largest error {100 * checked['largest_error']:.1f}%, "
    f"on held-out rows {100 * checked['largest_held_out_error']:.1f}%, on fit rows "
    f"{100 * checked['largest_fit_error']:.1f}%."
)
st.plotly_chart(validation_figure(checked), width="stretch", key="validation-figure")
st.dataframe([{"run": r["name"], "predicted": round(r["predicted"], 3), "published": r["published"],
               "error %": round(100 * r["relative_error"], 1), "role": "held out" if r["held_out"] else "fit",
               "metric": r["metric"], "source": r["source"]} for r in checked["rows"]], hide_index=True)
for r in checked["rows"]:
    if r["outside"]:
        st.info(f"{r['name']}: {r['outside']}")
