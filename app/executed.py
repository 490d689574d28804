"""The executed timeline of a traced run (refpar.viz.timeline) next to its simulated schedule
(refpar.viz.pipeline), for the Run for real page: its last run's trace, or an uploaded --trace file."""

import streamlit as st

from refpar.config import ConfigError
from refpar.viz import timeline


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


def show_upload(name: str, data: bytes) -> None:
    """An uploaded trace's figures, or one st.error sentence saying what the file is instead."""
    try:
        trace = timeline.read_trace_upload(name, data)
        show_timeline(trace, name, "uploaded")
    except ConfigError as err:
        st.error(str(err))
