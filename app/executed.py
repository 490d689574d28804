"""The executed timeline of a traced run (refpar.viz.timeline) next to its simulated schedule
(refpar.viz.pipeline), for the Run for real page: its last run's trace, or an uploaded --trace file."""

import streamlit as st

from refpar.config import ConfigError
from refpar.viz import pipeline, timeline

EXECUTED = "executed, last step"  # the figures' titles are short: they share a half-width column


def show_timeline(trace: dict, label: str, key: str) -> None:
    """`key` names this page's figures: the same trace may be drawn twice (the last run's, uploaded)."""
    st.markdown(f"**{label}**: what its ranks did in its last step")
    compute, _ = timeline.spans(trace)
    if not compute:
        st.plotly_chart(timeline.executed_figure(trace, EXECUTED), width="stretch", key=f"{key}-executed")
        st.caption("Without a pipeline the run traces its messages only: the time between them is its "
                   "forward, backward and optimizer.")
        return
    try:
        _, simulated = timeline.simulated_from_trace(trace)
    except (ConfigError, KeyError, ValueError) as err:
        st.plotly_chart(timeline.executed_figure(trace, EXECUTED), width="stretch", key=f"{key}-executed")
        st.warning(f"the trace's actions do not make a schedule to simulate: {err}")
        return
    left, right = st.columns(2)
    left.plotly_chart(timeline.executed_figure(trace, EXECUTED), width="stretch", key=f"{key}-executed")
    simulated_figure = pipeline.gantt_figure(simulated, f"simulated: bubble {simulated.bubble_fraction:.1%}")
    simulated_figure.update_xaxes(title="seconds (each action as long as it ran)")
    right.plotly_chart(simulated_figure, width="stretch", key=f"{key}-simulated")
