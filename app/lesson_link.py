"""Each view's link to the lesson that teaches what it draws; the Lessons page opens on that lesson."""

import streamlit as st

from lessons import course as lessons

LESSONS_PAGE = "views/lessons.py"
PARAM = "lesson"  # the query parameter the Lessons page reads to choose its lesson


def lesson_link(n: int) -> None:
    """A link to lesson n on the Lessons page; nothing when lessons/ holds no lesson n."""
    path = next((p for p in lessons.lesson_files() if int(p.name[:2]) == n), None)
    if path is not None:
        st.page_link(LESSONS_PAGE, label=lessons.title(path), icon=":material/school:",
                     query_params={PARAM: str(n)})
