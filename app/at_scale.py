"""A published model at real scale on the Memory, Communication and Whole mesh pages: a planner preset
(llama3-8b/70b, deepseek-v3, GPT-3 175B, ...) on real GPUs, on a mesh and options of the user's,
priced by the closed forms `refpar plan` uses (refpar.analysis.planner.price): no run, no MPI. The
figures are refpar.viz.scale's; errors are said with this section's boxes (app/page_words.py)."""

import streamlit as st
from page_words import planner_in_page_words, within

from refpar.analysis.hardware import HARDWARE, hardware
from refpar.analysis.planner import RECOMPUTE, SCHEDULES, ZERO_STAGES, price
from refpar.analysis.presets import PRESETS, preset
from refpar.config import ConfigError
from refpar.viz import scale

MAX_GPUS = 1 << 16
# (model, GPUs, tp, pp, cp, ep, ZeRO stage, schedule, recompute): a plan that fits 80 GB H100s
DEFAULTS = {"llama3-8b": (8, 1, 1, 1, 1, 3, "none", "selective"),
            "llama3-70b": (64, 8, 4, 1, 1, 1, "1f1b", "selective"),
            "deepseek-v3": (2048, 1, 16, 1, 64, 1, "1f1b", "full")}


@st.cache_data(max_entries=32)
def priced(model: str, hw: str, gpus: int, mesh: tuple, options: tuple) -> dict:
    return price(preset(model), hardware(hw), gpus, dict(mesh), **dict(options))


def scale_section(key: str, default: str = "llama3-70b") -> tuple[dict, float] | None:
    """The section's boxes and its priced plan (with the GPU's memory in bytes), or None after one
    st.error sentence saying what to change."""
    names = list(PRESETS)
    a, b, c = st.columns(3)
    model = a.selectbox("published model", names, index=names.index(default), key=f"{key}_model",
                        help="any preset of refpar plan (refpar.analysis.presets)")
    hw = b.selectbox("GPU", list(HARDWARE), index=list(HARDWARE).index("h100"), key=f"{key}_hw")
    gpus0, tp0, pp0, cp0, ep0, zero0, schedule0, recompute0 = DEFAULTS.get(model, DEFAULTS["llama3-70b"])
    gpus = c.number_input("GPUs", value=gpus0, step=8, key=f"{key}_gpus_{model}", help=f"1 to {MAX_GPUS:,}")
    cols = st.columns(4)
    sizes = {axis: col.number_input(axis, value=v, key=f"{key}_{axis}_{model}", help="1 to the GPUs; dp "
                                    "takes the GPUs the others leave")
             for col, axis, v in zip(cols, ("tp", "pp", "cp", "ep"), (tp0, pp0, cp0, ep0), strict=True)}
    d, e, f, g = st.columns(4)
    zero = d.selectbox("ZeRO stage", ZERO_STAGES, index=ZERO_STAGES.index(zero0), key=f"{key}_zero_{model}")
    schedule = e.selectbox("schedule", SCHEDULES, index=SCHEDULES.index(schedule0),
                           key=f"{key}_schedule_{model}", help="none for pp = 1")
    micro_batch = f.number_input("micro-batch", value=1, key=f"{key}_micro_{model}", help="1 or more")
    recompute = g.selectbox("recompute", RECOMPUTE, index=RECOMPUTE.index(recompute0),
                            key=f"{key}_recompute_{model}")
    try:
        gpus = within("GPUs", gpus, 1, MAX_GPUS)
        sizes = {axis: within(axis, n, 1, gpus) for axis, n in sizes.items()}
        micro_batch = within("micro-batch", micro_batch, 1)
        replica = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["ep"]
        if gpus % replica:
            raise ConfigError(f"tp x pp x cp x ep = {replica} does not divide {gpus:,} GPUs; choose sizes "
                              "whose product divides it")
        mesh = {"dp": gpus // replica, **sizes}
        options = (("zero", zero), ("schedule", schedule), ("micro_batch", micro_batch),
                   ("recompute", recompute), ("sp", sizes["tp"] > 1))
        row = priced(model, hw, gpus, tuple(mesh.items()), options)
    except ConfigError as err:
        st.error(planner_in_page_words(str(err)))
        return None
    plan = " x ".join(f"{axis}={n}" for axis, n in mesh.items() if n > 1) or "one GPU"
    st.caption(f"{model} on {gpus:,} {hw} GPUs, {plan}, ZeRO-{zero}, {schedule}, micro-batch {micro_batch}, "
               f"{recompute} recompute, bf16 with fp32 master weights and Adam moments: priced by the "
               f"closed forms `refpar plan` uses; sequence parallelism on tp > 1."
               + (f" Not priced here: {', '.join(row['unpriced'])}." if row["unpriced"] else ""))
    return row, hardware(hw).memory_bytes


def show_at_scale(key: str, default: str, memory: bool = True, comm: bool = True) -> None:
    """The section under its own subheader: its boxes, then memory per GPU against the GPU's capacity
    and/or the bytes each axis moves, in readable units."""
    st.subheader("At real scale: a published model, priced by the closed forms")
    out = scale_section(key, default)
    if out is None:
        return
    row, capacity = out
    if memory:
        total = sum(row["memory_bytes"].values())
        title = f"memory per GPU: {scale.readable(total)} of {scale.readable(capacity)}"
        st.plotly_chart(scale.memory_figure(row, capacity, title), width="stretch", key=f"{key}_memory")
    if comm:
        st.plotly_chart(scale.comm_figure(row, "bytes each axis moves per GPU, one step"), width="stretch",
                        key=f"{key}_comm")
        st.dataframe(scale.collectives_rows(row), hide_index=True, width="stretch")
