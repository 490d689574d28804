"""The ring all-reduce step by step, for the Communication page: one slider (with step buttons) moves
the figure and its narration together; the bytes are refpar.comm.cost's (refpar/viz/ring.py)."""

import streamlit as st

from refpar.viz.ring import bytes_per_rank, ring_figure, ring_steps

ELEMENTS, ITEMSIZE = 1_000_000, 4  # a 4 MB float32 gradient bucket: its chunks' bytes read at a glance


def move(key: str, by: int, last: int) -> None:
    st.session_state[key] = min(max(st.session_state.get(key, 0) + by, 0), last)


def show_ring(p: int) -> None:
    st.subheader("The ring all-reduce, step by step")
    if not 2 <= p <= 8:
        st.caption(f"Set ranks on its axis to 2 to 8 to step through a ring of that many ranks (now {p}).")
        return
    steps = ring_steps(p, ELEMENTS, ITEMSIZE)
    last, key = len(steps) - 1, "ring_step"
    if st.session_state.get(key, 0) > last:
        st.session_state[key] = 0
    back, slider, forward = st.columns([1, 10, 1])
    back.button("◀", on_click=move, args=(key, -1, last), key="ring_back", help="the step before")
    at = slider.select_slider("ring step", options=range(last + 1), key=key,
                              format_func=lambda i: f"{i}. {steps[i].phase}")
    forward.button("▶", on_click=move, args=(key, 1, last), key="ring_forward", help="the next step")
    left, right = st.columns([3, 2])
    left.plotly_chart(ring_figure(steps, at, f"{p} ranks, {ELEMENTS:,} float32 elements in {p} chunks"),
                      width="stretch", key="ring_figure")
    right.info(steps[at].text)
    sent = bytes_per_rank(steps)
    right.caption(f"Over the {last} steps rank 0 sends {sent[0]:,} bytes, 2(p - 1)/p of the "
                  f"{ELEMENTS * ITEMSIZE:,}-byte tensor: refpar.comm.cost.all_reduce_bytes, whatever p.")
