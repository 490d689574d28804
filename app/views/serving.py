import sys
import time

import streamlit as st
from family import family_picker
from launcher import TIME_LIMIT_S, Launcher, mpiexec, shared
from lesson_link import lesson_link

from refpar.analysis.hardware import HARDWARE, hardware
from refpar.analysis.presets import PRESETS, preset
from refpar.analysis.serving import serving_table
from refpar.config import ConfigError
from refpar.viz.serving import block_pool_figure, comm_per_token_figure, kv_cache_figure

MESHES = ("tp=2", "cp=2", "pp=2", "tp=4", "cp=4", "pp=4", "tp=2,cp=2", "tp=2,pp=2", "cp=2,pp=2")
PROMPTS, ARRIVALS = (12, 5, 20, 8, 9, 15), (0, 0, 1, 3, 4, 6)  # request i's prompt length and arrival step
MAX_NEW_TOKENS, MAX_BATCH = 8, 3  # the tiny models hold 32 positions: 20 + 8 fit
MAX_CONTEXT = 1 << 20
MAX_DECODED = 1024  # requests decoded together at scale


@st.cache_data(max_entries=32)
def at_scale(model: str, hw: str, batch: int, context: int) -> list[dict]:
    return serving_table(preset(model), hardware(hw), batch=batch, context=context)


@st.fragment(run_every=1.0)
def progress(run: Launcher) -> None:
    """Redrawn every second while the app's one run goes (this page's, or the Run page's training run);
    the page takes a generate summary up once its run ends."""
    if run.running():
        elapsed = time.monotonic() - run.started
        if elapsed > TIME_LIMIT_S:
            run.stop()
        st.caption(f"{run.label}: {elapsed:.0f} s")
        st.code("\n".join(run.lines[-12:]) or "starting mpiexec ...", language=None)
        return
    if run.proc is not None and st.session_state.get("serving_ended") != run.proc.pid:
        st.session_state["serving_ended"] = run.proc.pid
        if run.error is None and run.result is not None and run.kind == "generate":
            st.session_state["serving"] = run.result
        st.rerun()
    if run.error is not None and run.kind == "generate":
        st.error(run.error)


st.title("Serving")
st.markdown(
    "Real ranks serve refpar's tiny GPT-2 or tiny Llama with a KV cache and continuous batching "
    "(`refpar generate`). Watch each rank's cache grow by one token per decode pass and shrink as "
    "requests finish (tp splits the kv heads, pp the layers, cp the positions; Llama's 2 kv heads "
    "make its cache half of GPT-2's, and at tp=4 each kv head is kept whole on 2 ranks), and the "
    "bytes each token costs per axis; "
    "below, the same closed forms price a large model on real GPUs, where tp cuts latency and pp does not."
)
lesson_link(15)
a, b, c = st.columns(3)
mesh = a.selectbox("mesh", MESHES, index=0)
# No limits on the boxes: a typed value reaches the page, which refuses it by the box's label.
n = b.number_input("requests", value=4, key="serve_n", help=f"1 to {len(PROMPTS)}")
new = c.number_input("new tokens per request", value=4, key="serve_new", help=f"1 to {MAX_NEW_TOKENS}")
model = family_picker()
a, b, c = st.columns(3)
paged = a.checkbox("paged KV cache", help="fixed-size blocks from a pool, a block table per request (vLLM)")
block = b.radio("block size", (4, 8, 16), horizontal=True, disabled=not paged)
blocks = c.slider("blocks per rank (0: room for all)", min_value=0, max_value=32, value=0, disabled=not paged,
                  help="a small pool preempts requests and recomputes them")
run = shared()
try:
    if not 1 <= n <= len(PROMPTS):
        raise ConfigError(f"requests = {n:,}: choose 1 to {len(PROMPTS)}, this is a demonstration")
    if not 1 <= new <= MAX_NEW_TOKENS:
        raise ConfigError(f"new tokens per request = {new:,}: choose 1 to {MAX_NEW_TOKENS}, the tiny models "
                          "hold 32 positions")
    launch = mpiexec()
    if launch is None:
        raise ConfigError("mpiexec is not installed; pip install mpich (the mpich extra) and reload")
    world = 1
    for part in mesh.split(","):
        world *= int(part.split("=")[1])
    argv = [launch, "-n", str(world), sys.executable, "-m", "refpar", "generate", "--model", model,
            "--mesh", mesh,
            "--prompt-lens", ",".join(map(str, PROMPTS[:n])), "--arrivals", ",".join(map(str, ARRIVALS[:n])),
            "--new-tokens", str(new), "--max-batch", str(MAX_BATCH), "--json"]
    if paged:
        argv += ["--paged", "--block-size", str(block)] + (["--kv-blocks", str(blocks)] if blocks else [])
except ConfigError as err:
    st.error(str(err))
    argv = None
st.code(" ".join(argv) if argv else "", language="bash")
if st.button("Generate", type="primary", disabled=argv is None or run.running()):
    try:
        key = (mesh, int(n), int(new), model) + ((("paged", block, int(blocks)),) if paged else ())
        run.start(argv, f"{model} generate on {mesh}", key, 1, kind="generate")
    except ConfigError as err:
        st.error(str(err))
progress(run)
served = st.session_state.get("serving")
if served is not None:
    summary = served["summary"]
    st.subheader(f"The last run: {served['label']}, {summary['tokens_generated']} tokens")
    st.plotly_chart(kv_cache_figure(summary), width="stretch")
    st.plotly_chart(comm_per_token_figure(summary), width="stretch")
    if summary.get("paged") is not None:
        pool = summary["paged"]["pool"][0]
        st.plotly_chart(block_pool_figure(summary, rank=0), width="stretch")
        moment = st.select_slider("block tables of rank 0 after", summary["kv_moments"])
        i = summary["kv_moments"].index(moment)
        st.dataframe([{"request": rid, "blocks": " ".join(map(str, table)),
                       "positions": pool["reserved"][i][rid]} for rid, table in pool["tables"][i].items()],
                     hide_index=True)
else:
    st.info("Press Generate to serve the requests on real ranks (a few seconds) and draw their KV caches.")

st.subheader("At scale: tp against pp, closed forms")
names = list(PRESETS)
a, b, c, d = st.columns(4)
model = a.selectbox("model", names, index=names.index("llama2-70b") if "llama2-70b" in names else 0)
hw = b.selectbox("hardware", list(HARDWARE), index=list(HARDWARE).index("h100") if "h100" in HARDWARE else 0)
batch = c.number_input("requests decoded together", value=1, key="serve_batch", help=f"1 to {MAX_DECODED:,}")
context = d.number_input("cached tokens per request", value=4096, key="serve_context",
                         help=f"1 to {MAX_CONTEXT:,}")
try:
    if not 1 <= batch <= MAX_DECODED:
        raise ConfigError(f"requests decoded together = {batch:,}: choose 1 to {MAX_DECODED:,}")
    if not 1 <= context <= MAX_CONTEXT:
        raise ConfigError(f"cached tokens per request = {context:,}: choose 1 to {MAX_CONTEXT:,}")
    rows = at_scale(model, hw, int(batch), int(context))
except ConfigError as err:
    st.error(str(err))
    st.stop()
tp, pp = rows[0], rows[1]
m1, m2 = st.columns(2)
m1.metric(f"decode ms per token, tp={tp['gpus']}", f"{1e3 * tp['decode_s_per_token']:.3f}")
m2.metric(f"decode ms per token, pp={pp['gpus']}", f"{1e3 * pp['decode_s_per_token']:.3f}")
st.dataframe([{"layout": r["layout"], "GPUs": r["gpus"], "tp link": r["tp_link"],
               "weights GB/GPU": r["weights_bytes_per_gpu"] / 1e9, "KV GB/GPU": r["kv_bytes_per_gpu"] / 1e9,
               "prefill ms/token": 1e3 * r["prefill_s_per_token"],
               "decode ms/token": 1e3 * r["decode_s_per_token"],
               "tokens/s": r["decode_tokens_per_s"]} for r in rows], hide_index=True)
