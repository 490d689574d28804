from pathlib import Path

import streamlit as st

LESSONS = Path(__file__).resolve().parents[2] / "lessons"


def title(path: Path) -> str:
    """The lesson's first `# ` heading, or its file name where it has none."""
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.name


st.title("Lessons")
st.markdown(
    "The course in `lessons/`, one numbered lesson a file, in order. Each lesson runs as written: "
    "copy its `mpiexec` lines into a terminal at the repository root, and compare what the ranks print "
    "with what the lesson says you will see; its exercises come with a checker."
)
paths = sorted(LESSONS.glob("*.md"))
if not paths:
    st.info("The lessons have not landed in this checkout yet: there is no lessons/*.md to show.")
    st.stop()
chosen = st.selectbox("lesson", paths, format_func=title)
st.caption(f"lessons/{chosen.name}")
st.markdown(chosen.read_text())
