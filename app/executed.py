"""The executed timeline of a traced run (refpar.viz.timeline) next to its simulated schedule
(refpar.viz.pipeline), for the Run for real page: its last run's trace, or an uploaded --trace file;
an uploaded PATH.jsonl (every message of the run) as the Communication page draws a run's calls."""

import streamlit as st

from refpar.config import ConfigError
from refpar.viz import comm, timeline


def show_timeline(trace: dict, label: str, key: str) -> None:
    """`key` names this page's figures: the same trace may be drawn twice (the last run's, uploaded).
    A trace whose actions make no schedule gets the executed figure and one sentence saying why."""
    st.markdown(f"**{label}**: what its ranks did in its last step")
    executed, simulated, note = timeline.trace_figures(trace)
    if simulated is None:
        st.plotly_chart(executed, width="stretch", key=f"{key}-executed")
    else:
        left, right = st.columns(2)
        left.plotly_chart(executed, width="stretch", key=f"{key}-executed")
        right.plotly_chart(simulated, width="stretch", key=f"{key}-simulated")
    st.caption(note)


def show_upload(name: str, data: bytes, key: str = "uploaded") -> None:
    """An uploaded trace's figures (PATH: the executed timeline; PATH.jsonl: every call, rank by rank),
    or one st.error sentence saying what the file is instead."""
    try:
        if name.endswith(".jsonl"):
            trace = timeline.read_jsonl_upload(name, data)
            st.plotly_chart(comm.trace_figure(trace, f"{name}: every call of the run"), width="stretch",
                            key=f"{key}-calls")
            st.caption("PATH.jsonl holds the run's messages only; its actions (F, B, W) are in PATH.")
        else:
            show_timeline(timeline.read_trace_upload(name, data), name, key)
    except ConfigError as err:
        st.error(str(err))
