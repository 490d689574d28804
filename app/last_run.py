"""The last real run, for every page that lays it beside the closed forms: this session's, else this
app's, else the one kept on disk (app/launcher.py), so that a reload, a new tab or a direct URL finds
it; a kept file that cannot be shown gets one st.error sentence saying what to do."""

import launcher
import streamlit as st


def last_run() -> dict | None:
    run = st.session_state.get("run")
    if run is None:
        run = launcher.shared().last()  # looked up at each call: tests replace it
        if run is not None:
            st.session_state["run"] = run
        elif (problem := launcher.cache_problem(launcher.cache_file())) is not None:
            st.error(problem)
    return run
