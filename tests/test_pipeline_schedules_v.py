"""The V-shaped and bidirectional schedules (builders_v.py) as data: their placement, their peak
activations against the published multiples of 1F1B's, their simulated bubbles against the
published closed forms, and the schedule CSV of torch.distributed.pipelining read and written by
refpar (torch itself reads and writes it in tests/test_schedule_csv.py)."""

from fractions import Fraction

import pytest

from refpar.cli import main
from refpar.parallel.pipeline.stage import stage_layers
from refpar.schedules import Action, ScheduleError, overlapped, stage_map
from refpar.schedules.builders import build, one_f_one_b
from refpar.schedules.builders_v import v_placement
from refpar.schedules.formats import format_grid, from_csv, to_csv
from refpar.schedules.published import expected_v_bubble, published_peak
from refpar.schedules.simulate import Costs, simulate, stored, validate

V_KINDS = ["zbv", "v-half", "v-min", "dualpipev"]
SHAPES = {"zbv": [(1, 1), (2, 1), (2, 3), (3, 2), (4, 8), (5, 12)],
          "v-half": [(1, 2), (2, 3), (3, 6), (4, 8), (5, 7), (6, 12)],
          "v-min": [(1, 2), (2, 3), (3, 6), (4, 8), (5, 7), (6, 12)],
          "dualpipev": [(1, 2), (2, 4), (3, 6), (4, 8), (5, 11)],
          "dualpipe": [(2, 4), (2, 6), (4, 8), (4, 10), (6, 12)]}
EVERY = [(kind, p, m) for kind, shapes in SHAPES.items() for p, m in shapes]


@pytest.mark.parametrize("kind, p, m", EVERY)
def test_every_grid_is_valid_with_f_before_b_before_w_on_two_stages_per_rank(kind, p, m):
    schedule = build(kind, p, m)
    lay = validate(schedule, ticks=True)
    tick = {c: t for row in schedule.values() for t, a in enumerate(row) if a is not None
            for c in a.computations()}
    for s in range(2 * p):
        for i in lay.microbatches(s):
            f, b, w = (Action(s, k, i) for k in "FBW")
            assert tick[f] < tick[b] and (w not in tick or tick[b] < tick[w])
    assert all(sorted(r for r in lay.stage_rank.values()).count(rank) == 2 for rank in range(p))


@pytest.mark.parametrize("kind, p, m", EVERY)
def test_the_v_placement_puts_stages_r_and_2p_minus_1_minus_r_on_rank_r(kind, p, m):
    lay = stage_map(build(kind, p, m))
    assert lay.stage_rank == {s: min(s, 2 * p - 1 - s) for s in range(2 * p)} == v_placement(p)
    assert {lay.chunk(r) for r in range(p)} == {0} and {lay.chunk(2 * p - 1 - r) for r in range(p)} == {1}
    if kind == "dualpipe":
        # two copies of the model, each cut in p parts: copy 0's part k is stage k on rank k,
        # copy 1's part k is stage p+k on rank p-1-k, and copy 1 takes the second half of the
        # microbatches (it enters at rank p-1)
        assert lay.copies == 2 and lay.stages_per_copy == p
        assert [lay.part(s) for s in range(2 * p)] == [*range(p), *range(p)]
        assert lay.microbatches(0) == range(m // 2) and lay.microbatches(p) == range(m // 2, m)
    else:
        # one chain down and back up: the first and the last stage (embedding, tied head) on rank 0
        assert lay.copies == 1 and lay.stage_rank[0] == lay.stage_rank[2 * p - 1] == 0


def _peak_in_microbatch_units(schedule, stage_share: Fraction) -> Fraction:
    """The busiest rank's stored activations, in units of M_B, the activations one microbatch
    leaves on a 1F1B rank (1/p of the model), when each stage is `stage_share` of a 1F1B rank's
    layers. Stored from F to W (or to the full B): the papers' count."""
    traces = stored(schedule, lambda a: stage_share, lambda a: stage_share)
    return max(max(trace) for trace in traces.values())


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_peak_activations_are_the_published_multiples_of_1f1bs_p_m_b(p):
    m = 3 * p  # enough to fill every pipeline (ZB-V needs 2p-1, DualPipe 2p)
    ofob = _peak_in_microbatch_units(one_f_one_b(p, m), Fraction(1))
    assert ofob == p  # 1F1B's rank 0: p microbatches (Narayanan et al. 2019)
    half = Fraction(1, 2)  # a V's 2p stages each hold half a 1F1B rank's layers
    # zero-bubble README, "Activation Memory (Compared to 1F1B)": ZBV 1x
    assert _peak_in_microbatch_units(build("zbv", p, m), half) == ofob
    # V-Half 1/2x and V-Min 1/3x as p grows; the playground of Qi et al. 2024b states them per p,
    # "by #micro-batch": (p+2)//2 and (p+4)//3
    assert _peak_in_microbatch_units(build("v-half", p, m), half) == (p + 2) // 2
    assert _peak_in_microbatch_units(build("v-min", p, m), half) == (p + 4) // 3
    # DualPipe README, "Activation Per Device": PP+1, with PP stages of the same size as 1F1B's
    # on PP devices (DualPipeV: PP = 2p stages of half that size on p devices)
    assert _peak_in_microbatch_units(build("dualpipev", p, 2 * m), half) == Fraction(2 * p + 1, 2)
    if p % 2 == 0:
        assert _peak_in_microbatch_units(build("dualpipe", p, 2 * m), Fraction(1)) == p + 1
    for kind in ("zbv", "v-half", "v-min", "dualpipev") + (("dualpipe",) if p % 2 == 0 else ()):
        counted = max(max(t) for t in stored(build(kind, p, 2 * m)).values())
        assert counted == published_peak(kind, p), kind


@pytest.mark.parametrize("p", [2, 4, 6])
def test_dualpipe_holds_two_copies_of_the_parameters(p):
    # DualPipe README, "Parameter Per Device": 2x. Each rank runs one part of each copy of a model
    # cut in p parts (r and p-1-r), where a 1F1B rank runs one part and a V rank two halves.
    n_layer = 3 * p
    lay = stage_map(build("dualpipe", p, 2 * p))
    v = stage_map(build("zbv", p, 2 * p))
    for rank in range(p):
        mine = [s for s, r in lay.stage_rank.items() if r == rank]
        blocks = sum(len(stage_layers(n_layer, lay.stages_per_copy, lay.part(s))) for s in mine)
        halves = sum(len(stage_layers(n_layer, v.n_stages, s)) for s, r in v.stage_rank.items() if r == rank)
        assert sorted(lay.part(s) for s in mine) == sorted({rank, p - 1 - rank})
        assert blocks == 2 * len(stage_layers(n_layer, p, rank)) == 2 * halves == 6


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (3, 5), (4, 7), (4, 12), (5, 9), (6, 11)])
def test_zbv_has_no_bubble_between_a_ranks_first_and_last_action(p, m):
    # zero-bubble README, Bubble Rate: ZBV 0, with T_F = T_B = T_W; Qi et al. 2024, section 6: the
    # schedule is zero-bubble from m >= 2p-1 microbatches. A rank still waits r ticks for its
    # first input and finishes p-1-r early, which back-to-back steps overlap (as for ZB-H2).
    timeline = simulate(build("zbv", p, m), Costs(1, 1, 1))
    for rank in range(p):
        assert timeline.inner_idle_time(rank) == 0
        assert timeline.idle_time(rank) == p - 1 and timeline.busy_time(rank) == 6 * m


def _steady_idle(schedule, costs: Costs | None = None) -> float:
    timeline = simulate(schedule, costs or Costs(1, 1, 1))
    return max(map(timeline.inner_idle_time, timeline.slots))


@pytest.mark.parametrize("p", [3, 4, 5, 6, 7, 8, 9, 10])
@pytest.mark.parametrize("extra", [0, 5])
def test_v_half_and_v_min_bubbles_against_the_published_ones(p, extra):
    # The zero-bubble README's Bubble Rate with T_F = T_B = T_W, B = (p-1)/(m+p-1) the 1F1B bubble:
    # V-Half B/2, V-Min 2B/3 + O(n) overhead. These are shares of 1F1B's bubble time, which for
    # the same model on 2p half-stages is 6(p-1) ticks of one pass (1F1B simulated with each pass
    # 2 ticks). Qi et al.'s expected bubble for a peak of M stage activations (expected_v_bubble,
    # from their v_auto_schedule.py) is exact: 6p - 1 - 3M, whose leading terms are those shares.
    m = p + extra  # from m = p microbatches on the bubble no longer depends on m
    ofob = _steady_idle(one_f_one_b(p, m), Costs(2, 2, 2))
    assert ofob == 6 * (p - 1)
    half, third = _steady_idle(build("v-half", p, m)), _steady_idle(build("v-min", p, m))
    assert half <= ofob / 2 and third <= 2 * ofob / 3
    assert half == expected_v_bubble(p, published_peak("v-half", p))
    if p % 3 != 2:
        assert third == expected_v_bubble(p, published_peak("v-min", p))
    # Where p = 2 mod 3, V-Min's repeated block leaves 2 ticks more than the expected bubble
    # (4 more in Qi et al.'s own zbv_greedy.py): the README's O(n) overhead; it stays under 2B/3.


DUALPIPE_COSTS = [Costs(1, 1, 1), Costs(2, 2, 1), Costs(1, 1, 0.5), Costs(3, 3, 2),
                  Costs(1, 1, 1, overlap="max"), Costs(2, 2, 1, overlap="max"), Costs(3, 3, 2, overlap="max")]


@pytest.mark.parametrize("costs", DUALPIPE_COSTS, ids=str)
@pytest.mark.parametrize("kind, p, m",
                         [("dualpipev", p, m) for p in (1, 2, 3, 4, 5) for m in (2 * p, 2 * p + 3)]
                         + [("dualpipe", p, m) for p in (2, 4, 6, 8) for m in (2 * p, 2 * p + 4)])
def test_dualpipe_bubble_is_the_readmes_closed_form(kind, p, m, costs):
    # DualPipe README: bubble (PP/2-1)(F&B + B - 3W) per device, PP the stages (p for DualPipe, 2p
    # for DualPipeV), B the full backward (refpar's B + W), F&B the overlapped pair: F + B when the
    # two run one after the other ("sum"), max(F, B) when each hides the other ("max"). The README
    # draws its cells with a backward for inputs as long as a forward, so B = F here; the bubble
    # is the idle time of the rank that idles most over one step, and does not depend on m.
    PP = p if kind == "dualpipe" else 2 * p
    full = costs.B + costs.W
    pair = costs.F + full if costs.overlap == "sum" else max(costs.F, full)
    timeline = simulate(build(kind, p, m), costs)
    readme = (PP / 2 - 1) * (pair + full - 3 * costs.W)
    assert max(map(timeline.idle_time, timeline.slots)) == pytest.approx(readme)


def test_an_overlapped_pair_is_one_slot_of_the_sum_or_the_max_of_its_parts():
    # rank 0 holds stages 0 and 3; the pair runs 0F1 and 3B0 (a full backward: B + W) as one action
    schedule = {0: [Action(0, "F", 0), Action(3, "F", 0), overlapped(Action(0, "F", 1), Action(3, "B", 0)),
                    Action(3, "F", 1), Action(3, "B", 1), Action(0, "B", 0), Action(0, "B", 1)],
                1: [Action(1, "F", 0), Action(2, "F", 0), Action(1, "F", 1), Action(2, "B", 0),
                    Action(2, "F", 1), Action(1, "B", 0), Action(2, "B", 1), Action(1, "B", 1)]}
    for overlap, length in (("sum", 1 + (2 + 0.5)), ("max", 2 + 0.5)):
        timeline = simulate(schedule, Costs(F=1, B=2, W=0.5, overlap=overlap))
        pair = timeline.slots[0][2]
        assert str(pair.action) == "0F1&3B0" and pair.end - pair.start == length
        # both parts finish when the slot does: 1F1 waits for it
        one_f_one = next(s for s in timeline.slots[1] if s.action == Action(1, "F", 1))
        assert one_f_one.start >= pair.end
    # the pair stores 0F1's activations, then frees 3F0's: during its tick it holds 3 (the executor
    # runs the parts in that order, and a run's ledger measures that peak)
    assert stored(schedule)[0][:4] == [1, 2, 3, 3]
    with pytest.raises(ScheduleError, match="an overlapped action is one F and then one B"):
        validate({0: [overlapped(Action(0, "B", 0), Action(0, "F", 0))]})


@pytest.mark.parametrize("kind, p, m", EVERY + [("1f1b", 3, 4), ("zb-h1", 3, 4), ("interleaved-1f1b", 2, 4)])
def test_csv_round_trip_gives_the_same_schedule(kind, p, m):
    schedule = build(kind, p, m)
    text = to_csv(schedule)
    assert from_csv(text) == schedule
    # torch's kinds: I where a W follows, B for the full backward
    lay = stage_map(schedule)
    cells = [c for line in text.splitlines() for c in line.split(",") if c]
    names = {n for c in cells for n in (c[1:c.index(")")].split(";") if c.startswith("(") else [c])}
    for s, i in [(stage, i) for stage in range(lay.n_stages) for i in lay.microbatches(stage)]:
        assert (f"{s}I{i}" in names, f"{s}B{i}" in names) == ((s, i) in lay.split, (s, i) not in lay.split)


def test_csv_is_torchs_format_one_row_per_rank_empty_cells_idle():
    text = to_csv(build("zb-h1", 2, 2))
    assert text == "0F0,0F1,,0I0,0W0,0I1,0W1\r\n,1F0,1I0,1F1,1I1,1W0,1W1\r\n"
    pair = to_csv({0: [Action(0, "F", 0), Action(1, "F", 0), overlapped(Action(0, "F", 1), Action(1, "B", 0)),
                       Action(1, "F", 1), Action(1, "B", 1), Action(0, "B", 0), Action(0, "B", 1)]})
    assert pair == "0F0,1F0,(0F1;1B0)OVERLAP_F_B,1F1,1B1,0B0,0B1\r\n"


@pytest.mark.parametrize("text, words", [
    ("0F0,0I0\r\n", "rank 0 tick 1: 0I0 computes the input gradient only, and no 0W0"),
    ("0F0,0B0,0W0\r\n", "rank 0 tick 2: 0W0 computes the weight gradient that the full backward 0B0"),
    ("0F0,0X0\r\n", "rank 0 tick 1: '0X0' is not a computation;"),
    ("0F0,0SEND_F0\r\n", "(torch's compute_comms format: dump with format='compute_only')"),
])
def test_csv_mistakes_are_named_in_one_sentence(text, words):
    with pytest.raises(ScheduleError) as err:
        from_csv(text)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_schedule_command_writes_the_csv_and_reads_it_back(tmp_path, capsys):
    assert main(["schedule", "zbv", "-p", "2", "-m", "3", "--csv"]) == 0
    text = capsys.readouterr().out
    assert text == to_csv(build("zbv", 2, 3))
    path = tmp_path / "zbv.csv"
    path.write_text(text)
    assert main(["schedule", "--from-csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: p=2 ranks, m=3 microbatches, v=2 stages per rank, read from torch's CSV")
    assert format_grid(build("zbv", 2, 3)) in out and "0.00% in steady state" in out


def test_schedule_command_marks_the_first_broken_dependency_of_a_csv(tmp_path, capsys):
    # rank 0 runs 0B0 before the 0F0 whose activations it needs
    path = tmp_path / "broken.csv"
    path.write_text("0B0,0F0\r\n1F0,1B0\r\n")
    assert main(["schedule", "--from-csv", str(path)]) == 2  # bad input: a refusal (issue 43, item 6)
    out, err = capsys.readouterr()
    assert err == f"refpar schedule: error: {path} does not run: rank 0 tick 0: 0B0 needs 0F0, which rank 0 "\
                  "runs later at tick 1\n"
    assert "rank 0  !0B0 0F0" in out and "rank 1  1F0  1B0" in out
    assert out.strip().endswith("error: rank 0 tick 0: 0B0 needs 0F0, which rank 0 runs later at tick 1")


def test_schedule_command_prints_the_published_figures_for_the_new_kinds(capsys):
    import json

    for kind, p, m, line in (("zbv", 4, 8, "between its first and last action: simulated 0, published 0"),
                             ("v-half", 4, 8, "between its first and last action: simulated 5, published 5"),
                             ("dualpipe", 4, 8, "over the step: simulated 2, published 2")):
        assert main(["schedule", kind, "-p", str(p), "-m", str(m)]) == 0
        assert line in capsys.readouterr().out
    assert main(["schedule", "dualpipev", "-p", "4", "-m", "8", "--cost-overlap", "max", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["published_idle"]["idle"] == out["max_idle"] == 3  # (8/2 - 1)(2 + 2 - 3)
    assert out["chunks"] == 2 and out["published_peak"] == 9 == max(out["peak_inflight_microbatches"])


@pytest.mark.parametrize("argv, words", [
    (["zbv", "-p", "4", "-m", "8", "-v", "3"], "zbv places two stages on every rank (stages r and 2p-1-r)"),
    (["dualpipe", "-p", "3", "-m", "6"], "needs an even number of ranks"),
    (["dualpipe", "-p", "4", "-m", "7"], "m even and at least 2p = 8"),
    (["dualpipev", "-p", "4", "-m", "7"], "dualpipev needs at least 2p = 8 microbatches"),
    (["zbv"], "refpar schedule zbv needs --stages P and --microbatches M"),
    ([], "give a schedule KIND"),
    (["zbv", "-p", "2", "--from-csv", "x.csv"], "--from-csv FILE reads the whole schedule"),
    (["--from-csv", "no/such.csv"], "no such file"),
])
def test_schedule_command_bad_input_for_the_new_kinds_is_one_sentence(argv, words, capsys):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith("refpar schedule: error:")
