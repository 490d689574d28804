import math
import sys
import time

import streamlit as st
from executed import show_timeline, show_upload
from family import family_picker
from last_run import last_run
from launcher import MAX_STEPS, TIME_LIMIT_S, Launcher, mpiexec, shared
from lesson_link import lesson_link
from page_words import axis_in_page_words, mesh_in_page_words

from refpar.config import MESH_AXES, ConfigError, Plan, TrainConfig, model_preset
from refpar.viz import expected, mesh_grid
from refpar.viz.moe import expert_load_figure

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "dualpipev")
DEMO = {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2}  # make demo's mesh


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
        # One line of our own; MPI's output (a stopped mpiexec prints a BAD TERMINATION banner whose
        # "=====" lines markdown would render as headings) only as code, folded away.
        ended, _, output = run.error.partition("\n")
        if run.stopped:
            st.info(f"{run.label}: stopped ({ended}); the last finished run, if any, is still below.")
        else:
            st.error(f"{run.label}: {ended.rstrip('.')}; its output is below.")
        with st.expander("its output (the last lines)"):
            st.code(output, language=None)
    if run.last() is not None:
        result = run.last()
        summary = result["summary"]
        st.success(f"{result['label']}: {summary['steps']} steps, last loss {summary['losses'][-1]:.4f}, "
                   f"{summary['step_time_s'] * 1e3:.1f} ms per step. Its bytes and memory are now on the "
                   "Communication and Memory pages.")
        if summary.get("max_loss_rel_diff") is not None:
            st.success(f"matches one device: max difference {summary['max_loss_rel_diff']:.1e} in the loss, "
                       f"{summary['max_param_rel_diff']:.1e} in the parameters (relative, "
                       f"{summary['dtype']}, after {summary['steps']} steps; refpar's contract in float64 "
                       "is 1e-10)")
        steps = summary["steps"]
        st.caption(f"Bytes each rank sent and received by axis and op: over all {steps} steps of the run, "
                   "then per step (what the Communication page draws).")
        st.dataframe([{**r, "sent per step": r["bytes_sent"] // steps,
                       "received per step": r["bytes_recv"] // steps} for r in summary["comm_bytes"]],
                     hide_index=True)
        if summary.get("moe"):  # an MoE run: each expert's load per step
            st.plotly_chart(expert_load_figure({result["label"]: summary["moe"]}))
        if result.get("timeline"):
            show_timeline(result["timeline"], result["label"], "last-run")


st.title("Run for real")
st.markdown(
    "Launch `mpiexec` with the chosen mesh on this machine: real ranks train refpar's tiny GPT-2 (or "
    "its tiny Llama) and "
    "print a JSON summary of the bytes each rank sent and the memory it peaked at. Compare those "
    "with the closed forms on the Communication and Memory pages, which pick the run up once it ends."
)
lesson_link(11)
whole = st.toggle("any mesh: every axis at once", key="run_whole",
                  help="pp, dp (ZeRO or FSDP), ep, cp and tp (sp) together, as the Whole mesh page "
                       "draws them")
run = shared()
last_run()  # after a reload, or a new start of the app: the kept result
trace = run.trace_path()
argv, key, label = None, None, ""
if whole:
    # No limits on the boxes: a typed value reaches the page, which refuses it by its box's label.
    cols = st.columns(5)
    sizes = {a: int(col.number_input(a, value=DEMO[a], key=f"run_{a}", help=f"1 to {mesh_grid.MAX_RANKS}"))
             for a, col in zip(MESH_AXES, cols, strict=True)}
    a, b, c, d, e, f, g = st.columns(7)
    strategy = a.selectbox("data parallelism", expected.DP_STRATEGIES, key="run_strategy")
    schedule = b.selectbox("schedule", SCHEDULES, disabled=sizes["pp"] == 1, key="run_schedule")
    m = int(c.number_input("microbatches", value=4, key="run_m", help="1 or more"))
    batch = int(d.number_input("batch size", value=TrainConfig().batch_size, key="run_batch",
                               help="sequences in a step"))
    seq = int(e.number_input("sequence length", value=TrainConfig().seq_len, key="run_seq",
                             help="tokens in a sequence, up to the model's positions"))
    steps = int(f.number_input("steps", value=3, help=f"1 to {MAX_STEPS}", key="run_steps"))
    sp = g.checkbox("sp", disabled=sizes["tp"] == 1, key="run_sp")
    model = family_picker()
    try:
        for label, value, high in (*((a, n, mesh_grid.MAX_RANKS) for a, n in sizes.items()),
                                   ("microbatches", m, None), ("batch size", batch, None),
                                   ("sequence length", seq, None), ("steps", steps, MAX_STEPS)):
            if value < 1 or (high is not None and value > high):
                raise ConfigError(f"{label} = {value:,}: choose 1 to {high}" if high is not None else
                                  f"{label} = {value:,}: choose 1 or more")
        plan = Plan(schedule=schedule if sizes["pp"] > 1 else None, microbatches=m, sp=sp and sizes["tp"] > 1,
                    zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp",
                    chunks=2 if schedule == "interleaved-1f1b" and sizes["pp"] > 1 else None)
        cfg = TrainConfig(steps=steps, batch_size=batch, seq_len=seq)
        full = mesh_grid.check_mesh(mesh_grid.mesh_model(model, sizes["ep"]), cfg, sizes, plan)
        launch = mpiexec()
        if launch is None:
            raise ConfigError("mpiexec is not installed; pip install mpich (the mpich extra) and reload")
        world = math.prod(full.values())
        args = mesh_grid.train_args(full, plan, model, steps, moe=full["ep"] > 1, cfg=cfg)
        argv = [launch, "-n", str(world), sys.executable, "-m", "refpar", "train", *args, "--json", "--trace",
                trace]
        key = ("mesh", *args)
        mesh = " x ".join(f"{k}={v}" for k, v in full.items() if v > 1) or "one rank"
        label = f"{mesh} {strategy} ({model})"
    except ConfigError as err:
        st.error(mesh_in_page_words(str(err), strategy))
else:
    a, b, c, d, e = st.columns(5)
    strategy = a.selectbox("strategy", expected.STRATEGIES, index=0)
    n = b.number_input("ranks on its axis", min_value=1, value=2)
    dp = c.number_input("dp replicas", min_value=1, value=1, disabled=strategy in expected.DP_STRATEGIES)
    m = d.number_input("microbatches", min_value=1, value=2,
                       help="pp: m per step; dp strategies: gradient accumulation")
    steps = e.number_input("steps", min_value=1, value=3, help=f"at most {MAX_STEPS}")
    model = family_picker()
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
        argv = [launch, "-n", str(w.world), sys.executable, "-m", "refpar", "train",
                *expected.train_args(w, trace), "--check"]
        label = f"{' '.join(f'{k}={v}' for k, v in w.sizes.items() if v > 1)} {strategy} ({model})"
    except ConfigError as err:
        st.error(axis_in_page_words(str(err), strategy, int(n), TrainConfig().seq_len))
        argv = None
st.code(" ".join(argv) if argv else "", language="bash", wrap_lines=True)
if st.button("Start", type="primary", disabled=argv is None or run.running()):
    try:
        run.start(argv, label, key, int(steps), trace)
    except ConfigError as err:
        st.error(str(err))
progress(run)
with st.expander("open the trace of another run (refpar train --trace PATH writes it)"):
    uploaded = st.file_uploader("its Chrome trace PATH (.json), or PATH.jsonl, every message",
                                type=["json", "jsonl"])
    if uploaded is not None:
        show_upload(uploaded.name, uploaded.getvalue())
