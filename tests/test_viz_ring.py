"""The ring all-reduce the Communication page steps through (refpar/viz/ring.py): its steps move, rank by
rank, the bytes of refpar.comm.cost's closed form, sent and received, and hold what the algorithm's
two phases promise (chunk r summed on rank r after the reduce-scatter, every chunk everywhere after the
all-gather)."""

import pytest

from refpar.comm.cost import all_reduce_bytes
from refpar.viz.ring import bytes_per_rank, ring_figure, ring_steps


@pytest.mark.parametrize("p, n", [(2, 8), (3, 10), (4, 4), (4, 10), (5, 3), (8, 1000)])
def test_ring_steps_move_the_closed_forms_bytes_and_finish_summed(p, n):
    steps = ring_steps(p, n, itemsize=8)
    assert len(steps) == 1 + 2 * (p - 1)
    sent = bytes_per_rank(steps)
    received = [sum(s.sent[(r - 1) % p][1] for s in steps[1:]) for r in range(p)]  # from the left
    assert [tuple(all_reduce_bytes(n, p, r, 8)) for r in range(p)] == list(zip(sent, received, strict=True))
    everyone = frozenset(range(p))
    assert all(steps[p - 1].holds[r][r] == everyone for r in range(p))  # after the reduce-scatter
    assert all(h == everyone for row in steps[-1].holds for h in row)  # after the all-gather
    assert all(steps[0].holds[r][c] == {r} for r in range(p) for c in range(p))


def test_ring_figure_shades_each_cell_by_the_ranks_it_sums():
    steps = ring_steps(3, 9, itemsize=4)
    fig = ring_figure(steps, 2)
    assert fig.data[0].z.tolist() == [[len(h) for h in row] for row in steps[2].holds]
    assert len(fig.layout.shapes) == 3  # the chunk each rank sent in the step, outlined


@pytest.mark.timeout(300)
def test_communication_page_steps_the_ring_with_one_cursor():
    """The ▶ button and the slider are one cursor: the figure and the narration follow it."""
    import json

    from streamlit.testing.v1 import AppTest

    from tests.test_app import HOME, TIMEOUT, decode

    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page("views/communication.py")
    at.run()
    at.number_input(key="comm_n").set_value(4).run()
    assert at.select_slider(key="ring_step").value == 0  # opens before the first step
    for _ in range(3):
        at.button(key="ring_forward").click().run()
    steps = ring_steps(4, 1_000_000, 4)
    figure = next(decode(json.loads(c.proto.spec)) for c in at.get("plotly_chart") if c.key == "ring_figure")
    assert at.select_slider(key="ring_step").value == 3
    assert figure["data"][0]["z"].tolist() == [[len(h) for h in row] for row in steps[3].holds]
    assert steps[3].text in [i.value for i in at.info]
