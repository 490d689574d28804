"""refpar's app: what each parallel training strategy does, step by step.

    make app          # or: refpar app; then open the printed localhost address

Streamlit layout only: the figures come from refpar.viz, the numbers from refpar itself.
"""

import sys
from pathlib import Path

# Draw the refpar of this checkout, whatever refpar the environment has installed.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# pandas before any page runs: Plotly and st.dataframe import it on first use, and when a page's
# script thread and the next page's both do so at once, one of them sees the module half initialised
# ("partially initialized module 'pandas' has no attribute 'Series'", seen leaving Whole mesh for
# Communication in Chromium).
import pandas  # noqa: E402, F401
import streamlit as st  # noqa: E402

st.set_page_config(page_title="refpar", layout="wide")


def home() -> None:
    st.title("refpar: parallel training, step by step")
    st.subheader("Start here")
    st.markdown(
        "1. **Lesson 0** (the Lessons page, or `refpar lesson show 0` in a terminal): your first "
        "`mpiexec`, and how refpar's ranks split a batch.\n"
        "2. **Sharding** (Sharding layouts): which rank holds which slice of each tensor, step by step.\n"
        "3. **Pipeline** (Pipeline schedules): where each schedule idles.\n"
        "4. **Whole mesh**: every rank of a mesh of up to 16, what it holds, gathers, frees and sends.\n"
        "5. **Run for real**: launch real MPI ranks on this machine and compare them with the closed "
        "forms."
    )
    st.subheader("Every page")
    st.markdown(
        "Every view draws refpar's own objects: the sharding grids come from the functions the "
        "strategies use to place data, the pipeline timelines from `simulate`, the bytes from the "
        "same closed forms the tests check traces against, byte for byte.\n\n"
        "- **Sharding layouts**: which rank holds which slice of a block's weights, gradients, "
        "optimizer state and activations, moment by moment through a training step.\n"
        "- **Pipeline schedules**: where each stage idles, and how much it holds for backward.\n"
        "- **Communication**: bytes by axis and op, who sends to whom, each collective in turn.\n"
        "- **Memory**: peak bytes per rank by category across strategies.\n"
        "- **Plan**: the fastest meshes for a published model on N GPUs.\n"
        "- **Serving**: each rank's KV cache token by token, and tp against pp latency at scale.\n"
        "- **Run for real**: launch `mpiexec` on this machine and lay the measured numbers next to "
        "the closed forms.\n"
        "- **Lessons**: the course in lessons/, from a first `mpiexec` to 3D parallelism and mixed "
        "precision, with exercises that `refpar lesson check N` grades."
    )


pages = [
    st.Page(home, title="Home", icon=":material/home:", default=True),
    st.Page("views/sharding.py", title="Sharding layouts", icon=":material/grid_on:"),
    st.Page("views/pipeline.py", title="Pipeline schedules", icon=":material/view_timeline:"),
    st.Page("views/mesh.py", title="Whole mesh", icon=":material/apps:"),
    st.Page("views/communication.py", title="Communication", icon=":material/swap_horiz:"),
    st.Page("views/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("views/plan.py", title="Plan", icon=":material/calculate:"),
    st.Page("views/run.py", title="Run for real", icon=":material/play_arrow:"),
    st.Page("views/serving.py", title="Serving", icon=":material/chat:"),
    st.Page("views/lessons.py", title="Lessons", icon=":material/school:"),
]
st.navigation(pages).run()
