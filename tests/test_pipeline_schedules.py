"""Pipeline schedules as data: the simulated bubbles equal the published closed forms, the peak
in-flight microbatches equal the papers' counts, every builder's grid is valid, and validate()
names what is broken."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refpar.cli import main
from refpar.schedules import Action, ScheduleError
from refpar.schedules.builders import build, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2
from refpar.schedules.formats import format_grid, to_csv
from refpar.schedules.simulate import Costs, peak_inflight_microbatches, simulate, stored, validate

SHAPES = [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (5, 12)]


@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(F=1, B=1, W=1e-9), Costs(F=1, B=2, W=0.5)])
def test_gpipe_and_1f1b_idle_is_p_minus_1_over_m_plus_p_minus_1_of_total(p, m, costs):
    # Huang et al. 2019 / Narayanan et al. 2019: with the same cost for every microbatch each rank
    # idles (p-1) forward+backward times while working m of them: (p-1)/(m+p-1) of total time.
    for builder in (gpipe, one_f_one_b):
        timeline = simulate(builder(p, m), costs)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
        assert timeline.bubble_over_ideal == pytest.approx((p - 1) / m, rel=1e-12)


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 4)])
def test_interleaved_idle_is_p_minus_1_over_v_m_of_ideal(p, m, v):
    # Narayanan et al. 2021, section 2.2: chunks of 1/v of a stage shrink the warm-up and
    # cool-down by v, so the bubble is (p-1)/(v*m) of the ideal (compute) time. Each action is
    # one chunk, so uniform per-action costs are the paper's assumption.
    timeline = simulate(interleaved_1f1b(p, m, v), Costs(F=1, B=2, W=0.5))
    assert timeline.bubble_over_ideal == pytest.approx((p - 1) / (v * m), rel=1e-12)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 3), (3, 7), (4, 8), (5, 10)])
def test_zb_h1_idle_is_a_third_of_1f1b_when_f_b_w_are_equal(p, m):
    # Qi et al. 2023, Table 2, per-rank bubble: 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W). With
    # F = B = W that is 3(p-1) against (p-1): a third, the zero-bubble README's "ZB1P B/3" (a
    # share of the bubble time; as a rate of the step, (p-1)/(3m+p-1), it is B/3 for large m).
    # Holds for m >= p (ZB-H1 needs p microbatches to fill its cool-down with W passes).
    unit = Costs(1, 1, 1)
    ours, theirs = simulate(zb_h1(p, m), unit), simulate(one_f_one_b(p, m), unit)
    for rank in range(p):
        assert ours.idle_time(rank) == p - 1
        assert theirs.idle_time(rank) == 3 * (p - 1)


@pytest.mark.parametrize("p, m", [(2, 3), (3, 5), (4, 7), (4, 12), (5, 9)])
def test_zb_h2_has_no_bubble_in_steady_state_when_f_b_w_are_equal(p, m):
    # Qi et al. 2023, Table 2: ZB-H2's bubble (p-1)(F+B-2W) is 0 for F = B = W. Within one step
    # the grid is a parallelogram: rank r idles r ticks before its first action and p-1-r after
    # its last, which the next step's first actions fill when steps run back to back (the paper
    # replaces the optimizer's synchronisation to allow that). So the steady-state bubble is the
    # idle time between each rank's first and last action, and it is 0. Needs m >= 2p-1.
    timeline = simulate(zb_h2(p, m), Costs(1, 1, 1))
    for rank in range(p):
        assert timeline.inner_idle_time(rank) == 0
        assert timeline.busy_time(rank) == 3 * m


@pytest.mark.parametrize("p, m", SHAPES + [(4, 2), (6, 3)])
def test_peak_inflight_microbatches_match_the_papers(p, m):
    # GPipe keeps all m; 1F1B's rank r keeps its p-r-1 warm-up forwards plus one (Narayanan et al.
    # 2019); ZB-H1 keeps 1F1B's peak of p (Qi et al., Table 2: p M_B), ZB-H2 2p-1 ((2p-1) M_B).
    # A microbatch is in flight on a rank from its F until its W (or its full B).
    assert peak_inflight_microbatches(gpipe(p, m)) == dict.fromkeys(range(p), m)
    assert peak_inflight_microbatches(one_f_one_b(p, m)) == {r: min(p - r, m) for r in range(p)}
    assert peak_inflight_microbatches(zb_h1(p, m)) == dict.fromkeys(range(p), min(p, m))
    # ... of which full activations (F until B) on ZB-H1's rank r: 1F1B's min(p - r, m)
    full = stored(zb_h1(p, m), lambda a: 1, lambda a: 0)
    assert {r: max(full[r]) for r in range(p)} == {r: min(p - r, m) for r in range(p)}
    assert peak_inflight_microbatches(zb_h2(p, m)) == dict.fromkeys(range(p), min(2 * p - 1, m))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]),
       p=st.integers(1, 6), groups=st.integers(1, 4), extra=st.integers(0, 5), v=st.integers(2, 3))
def test_every_builder_grid_is_valid_and_orders_f_before_b_before_w(kind, p, groups, extra, v):
    interleaved = kind == "interleaved-1f1b"
    m = groups * p if interleaved else groups + extra
    schedule = build(kind, p, m, v if interleaved else 1)
    validate(schedule, ticks=True)
    tick = {a: t for row in schedule.values() for t, a in enumerate(row) if a is not None}
    n_stages = p * (v if interleaved else 1)
    for stage in range(n_stages):
        for i in range(m):
            f, b, w = (Action(stage, k, i) for k in "FBW")
            assert tick[f] < tick[b]
            assert w not in tick or tick[b] < tick[w]
            assert (w in tick) == kind.startswith("zb")
    slots = [s for row in simulate(schedule, Costs(1, 2, 0.5, p2p=0.25)).slots.values() for s in row]
    start = {s.action: s.start for s in slots}
    assert all(start[Action(s, "F", i)] < start[Action(s, "B", i)]
               for s in range(n_stages) for i in range(m))


def _swap(schedule, rank, t1, t2):
    row = list(schedule[rank])
    row[t1], row[t2] = row[t2], row[t1]
    return {**schedule, rank: row}


def test_validate_names_a_backward_placed_before_its_forward():
    schedule = one_f_one_b(2, 2)  # rank 0: 0F0 0F1 . 0B0 . 0B1
    broken = _swap(schedule, 0, 0, 3)
    with pytest.raises(ScheduleError) as err:
        validate(broken)
    assert str(err.value) == "rank 0 tick 0: 0B0 needs 0F0, which rank 0 runs later at tick 3"
    grid = format_grid(broken, err.value)
    assert "!0B0" in grid and grid.endswith(f"error: {err.value}")


def test_validate_names_the_first_action_of_a_deadlock():
    # A cycle: rank 1 starts with 1F1, which needs 0F1; rank 0 runs 0F1 only after 0B0, which
    # needs 1B0, which rank 1 runs only after 1F1.
    schedule = {0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                1: [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]}
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    assert str(err.value) == ("rank 1 tick 0: 1F1 would deadlock: it waits for 0F1 on rank 0, "
                              "which is stuck at tick 1 on 0B0")
    assert (err.value.rank, err.value.tick) == (1, 0)


def test_validate_with_ticks_names_an_action_drawn_before_its_input_arrives():
    schedule = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    validate(schedule)  # runs in order: fine
    with pytest.raises(ScheduleError, match=r"rank 1 tick 0: 1F0 is placed before its input 0F0"):
        validate(schedule, ticks=True)


@pytest.mark.parametrize("schedule, words", [
    ({0: [Action(0, "F", 0)]}, "never runs 0B0"),
    ({0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "B", 0)]}, "0B0 appears twice"),
    ({0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(0, "W", 0)]}, "a stage lives on one rank"),
    ({1: [Action(0, "F", 0), Action(0, "B", 0)]}, "must be 0..p-1"),
])
def test_validate_rejects_malformed_schedules_in_one_sentence(schedule, words):
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_schedule_command_json_reports_grid_bubble_and_inflight(capsys):
    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["grid"][0][:4] == ["0F0", "0F1", "0F2", "0F3"] and len(out["grid"]) == 4
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["bubble_over_ideal"] == pytest.approx(3 / 8)
    assert out["peak_inflight_microbatches"] == [4, 3, 2, 1]
    assert out["makespan"] == 33.0  # (m + p - 1) * (F + B + W) with the default unit costs


def test_schedule_command_prints_grid_and_bubble_and_writes_the_figure(capsys, tmp_path):
    figure = tmp_path / "zb.html"
    assert main(["schedule", "interleaved-1f1b", "-p", "2", "-m", "4", "--figure", str(figure)]) == 0
    text = capsys.readouterr().out
    assert "rank 1" in text and "2F0" in text and "bubble: " in text and "v=2" in text
    assert "interleaved-1f1b, p=2, m=4, v=2" in figure.read_text()


@pytest.mark.parametrize("argv, words", [
    (["zb-h3", "-p", "2", "-m", "2"], "unknown schedule 'zb-h3'; choose one of"),
    (["interleaved-1f1b", "-p", "4", "-m", "6"], "use m in {4, 8, 12}"),
    (["interleaved-1f1b", "-p", "2", "-m", "2", "-v", "1"], "at least 2 chunks"),
    (["1f1b", "-p", "2", "-m", "4", "-v", "2"], "applies to interleaved-1f1b only"),
    (["gpipe", "-p", "0", "-m", "2"], "at least one stage"),
    (["gpipe", "-p", "2", "-m", "0"], "at least one microbatch"),
    (["gpipe", "-p", "2", "-m", "2", "--cost-b", "0"], "--cost-b 0 must be positive"),
])
def test_schedule_command_bad_input_is_one_sentence(argv, words, capsys):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith("refpar schedule: error:")


def test_gantt_figure_draws_every_action_at_its_simulated_time_and_shades_the_bubble():
    from refpar.viz.pipeline import gantt_figure, idle_total

    timeline = simulate(zb_h1(3, 4), Costs(1, 1, 1))
    fig = gantt_figure(timeline, "ZB-H1")
    drawn = {(y, t, b, x) for trace in fig.data if trace.name in "FBW"
             for y, t, b, x in zip(trace.y, trace.text, trace.base, trace.x, strict=True)}
    expected = {(s.rank, str(s.action), s.start, s.end - s.start)
                for row in timeline.slots.values() for s in row}
    assert drawn == expected and len(drawn) == 3 * 4 * 3
    # (p-1)/(3m+p-1) = 2/14 of rank-time idle
    assert idle_total(fig) == sum(map(timeline.idle_time, timeline.slots))
    assert idle_total(fig) / (3 * timeline.makespan) == 2 / 14


@pytest.mark.parametrize("kind, p, m", [("1f1b", 3, 4), ("zb-h1", 3, 4), ("zb-h2", 2, 4), ("zbv", 2, 3),
                                        ("dualpipev", 2, 4)])
def test_the_grid_names_each_action_as_torchs_csv_does(kind, p, m):
    """An input-only backward shows as I, a full backward as B (torch's names, read by torch itself in
    tests/test_schedule_csv.py): every grid cell is the CSV's cell, an overlapped pair joined by &."""
    schedule = build(kind, p, m)
    rows = [line.split()[2:] for line in format_grid(schedule).splitlines()[1:]]
    csv_rows = [row.split(",") for row in to_csv(schedule).splitlines()]
    for grid_row, csv_row in zip(rows, csv_rows, strict=True):
        cells = [c for c in csv_row if c]
        shown = [c for c in grid_row if c != "."]
        assert shown == [c.removeprefix("(").removesuffix(")OVERLAP_F_B").replace(";", "&") for c in cells]
    split_kinds = {"zb-h1", "zb-h2", "zbv", "dualpipev"}
    assert ("I" in format_grid(schedule)) == (kind in split_kinds)


def test_a_pipe_closed_early_ends_the_command_without_a_traceback():
    """`refpar schedule ... | head -1`: a grid far larger than a pipe's buffer, its reader gone."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "refpar", "schedule", "1f1b", "-p", "64", "-m", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"1f1b: p=64")
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141 and proc.stderr.read() == b""
