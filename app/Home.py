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


# The five-minute tour: each step a page, and what to do there.
TOUR = [
    ("views/lessons.py", "Lesson 0", {"lesson": "0"}, ":material/school:",
     "your first `mpiexec`, and how refpar's ranks split a batch (or `refpar lesson show 0` in a terminal)."),
    ("views/sharding.py", "Sharding", None, ":material/grid_on:",
     "step ZeRO-3 through a training step with the arrows: block 0's weights are gathered for its forward "
     "and backward only. Which share of them does rank 0 hold between?"),
    ("views/pipeline.py", "Pipeline", None, ":material/view_timeline:",
     "1F1B on 4 stages and 8 microbatches: where each stage idles (the red), and the bubble's formula."),
    ("views/mesh.py", "Whole mesh", None, ":material/apps:",
     "click a rank of a pp x dp x tp mesh: what it holds, gathers, frees and sends."),
    ("views/run.py", "Run for real", None, ":material/play_arrow:",
     "press Start: real MPI ranks train, then Communication and Memory show their measured bytes and "
     "peaks beside the closed forms."),
]


@st.cache_data
def picture():
    """1F1B on 4 stages of 8 microbatches, the picture the papers draw: each bar an action, red idle."""
    from refpar.schedules.builders import build
    from refpar.schedules.simulate import simulate
    from refpar.viz.pipeline import gantt_figure

    timeline = simulate(build("1f1b", 4, 8))
    figure = gantt_figure(timeline, f"1F1B, 4 stages, 8 microbatches: bubble {timeline.bubble_fraction:.0%}",
                          animated=False)
    figure.update_layout(height=300, margin={"b": 40, "t": 60})
    return figure


def home() -> None:
    st.title("refpar: parallel training, step by step")
    left, right = st.columns([1, 1])
    with left:
        st.subheader("Start here: a five-minute tour")
        for n, (page, label, query, icon, what) in enumerate(TOUR, 1):
            st.page_link(page, label=f"{n}. {label}", icon=icon, query_params=query)
            st.caption(what)
    right.plotly_chart(picture(), width="stretch")
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
