"""The executed timeline of a traced run (refpar.viz.timeline) next to its simulated schedule
(refpar.viz.pipeline), for the Run for real page: its last run's trace, or an uploaded --trace file."""

import streamlit as st

from refpar.config import ConfigError
from refpar.viz import pipeline, timeline


def show_timeline(trace: dict, label: str) -> None:
    compute, _ = timeline.spans(trace)
    if not compute:
        st.plotly_chart(timeline.executed_figure(trace, f"{label}: executed, last step"), width="stretch")
        st.caption("Without a pipeline the run traces its messages only: the time between them is its "
                   "forward, backward and optimizer.")
        return
    try:
        _, simulated = timeline.simulated_from_trace(trace)
    except (ConfigError, KeyError, ValueError) as err:
        st.plotly_chart(timeline.executed_figure(trace, f"{label}: executed, last step"), width="stretch")
        st.warning(f"the trace's actions do not make a schedule to simulate: {err}")
        return
    left, right = st.columns(2)
    left.plotly_chart(timeline.executed_figure(trace, f"{label}: executed, last step"), width="stretch")
    title = f"simulated with the measured action times (bubble {simulated.bubble_fraction:.1%})"
    simulated_figure = pipeline.gantt_figure(simulated, title)
    simulated_figure.update_xaxes(title="seconds (each action as long as it ran)")
    right.plotly_chart(simulated_figure, width="stretch")
