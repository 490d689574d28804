import os
import sys
import tempfile
import time
from pathlib import Path

import streamlit as st
from family import family_picker
from launcher import MAX_STEPS, TIME_LIMIT_S, Launcher, mpiexec, shared
from lesson_link import lesson_link

from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.viz import expected
from refpar.viz.moe import expert_load_figure


@st.fragment(run_every=1.0)
def progress(run: Launcher) -> None:
    """Redrawn every second while the run goes; the rest of the page stays usable."""
    if run.running():
        elapsed = time.monotonic() - run.started
        if elapsed > TIME_LIMIT_S:
            run.stop()
        done = sum(1 for x in run.lines if x.split()[:1] and x.split()[0].isdigit())
        st.progress(min(done / max(run.steps, 1), 1.0), text=f"{run.label}: {elapsed:.0f} s")
        st.code("\n".join(run.lines[-12:]) or "starting mpiexec ...", language=None)
        if st.button("Stop", type="secondary"):
            run.stop()
        return
    if run.proc is not None and st.session_state.get("ended") != run.proc.pid:
        # The run ended since this page last looked: redraw the whole page once, so that Start is
        # enabled again and the result is taken up.
        st.session_state["ended"] = run.proc.pid
        if run.error is None and run.result is not None and run.kind == "train":
            st.session_state["run"] = run.result
        st.rerun()
    if run.kind != "train":
        return  # the Serving page's run, which that page shows
    if run.error is not None:
        st.error(run.error)
    elif run.result is not None:
        summary = run.result["summary"]
        st.success(f"{run.result['label']}: {summary['steps']} steps, last loss {summary['losses'][-1]:.4f}, "
                   f"{summary['step_time_s'] * 1e3:.1f} ms per step. Its bytes and memory are now on the "
                   "Communication and Memory pages.")
        st.dataframe(summary["comm_bytes"], hide_index=True)
        if summary.get("moe"):  # an MoE run: each expert's load per step
            st.plotly_chart(expert_load_figure({run.result["label"]: summary["moe"]}))


st.title("Run for real")
st.markdown(
    "Launch `mpiexec` with the chosen mesh on this machine: real ranks train refpar's tiny GPT-2 (or "
    "its tiny Llama) and "
    "print a JSON summary of the bytes each rank sent and the memory it peaked at. Compare those "
    "with the closed forms on the Communication and Memory pages, which pick the run up once it ends."
)
lesson_link(8)
a, b, c, d, e = st.columns(5)
strategy = a.selectbox("strategy", expected.STRATEGIES, index=0)
n = b.number_input("ranks on its axis", min_value=1, value=2)
dp = c.number_input("dp replicas", min_value=1, value=1, disabled=strategy in expected.DP_STRATEGIES)
m = d.number_input("microbatches", min_value=1, value=2,
                   help="pp: m per step; dp strategies: gradient accumulation")
steps = e.number_input("steps", min_value=1, value=3, help=f"at most {MAX_STEPS}")
model = family_picker()
run = shared()
try:
    if steps > MAX_STEPS:
        raise ConfigError(f"{steps} steps: choose 1 to {MAX_STEPS}, this is a demonstration")
    key = (strategy, int(n), 1 if strategy in expected.DP_STRATEGIES else int(dp), int(m), model)
    w = expected.workload(strategy, key[1], model_preset(model), TrainConfig(steps=int(steps)), dp=key[2],
                          microbatches=key[3])
    expected.closed_form_rows(w)  # refuses a mesh refpar cannot run, with the reason, before launching
    launch = mpiexec()
    if launch is None:
        raise ConfigError("mpiexec is not installed; pip install mpich (the mpich extra) and reload")
    trace = str(Path(tempfile.gettempdir()) / f"refpar-app-trace-{os.getpid()}.json")
    argv = [launch, "-n", str(w.world), sys.executable, "-m", "refpar", "train",
            *expected.train_args(w, trace)]
except ConfigError as err:
    st.error(str(err))
    argv = None
st.code(" ".join(argv) if argv else "", language="bash")
if st.button("Start", type="primary", disabled=argv is None or run.running()):
    try:
        mesh = " ".join(f"{k}={v}" for k, v in w.sizes.items() if v > 1)
        run.start(argv, f"{mesh} {strategy} ({model})", key, w.train.steps, trace)
    except ConfigError as err:
        st.error(str(err))
progress(run)
