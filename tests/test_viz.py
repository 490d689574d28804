"""refpar.viz figure builders: what each figure draws is what refpar's own functions say."""

from __future__ import annotations

import numpy as np
import pytest

from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.model.gpt import init_params
from refpar.parallel.expert_parallel import owned_experts
from refpar.parallel.tensor_parallel import shard_params_tp
from refpar.parallel.units import Units
from refpar.schedules import stage_map
from refpar.schedules.builders import build
from refpar.schedules.formats import to_csv
from refpar.schedules.simulate import Costs, peak_inflight_microbatches, simulate
from refpar.sharding import shard_range
from refpar.viz import comm as cv
from refpar.viz import expected as ex
from refpar.viz import sharding as sh
from refpar.viz.pipeline import (
    COLOURS,
    SECOND,
    SHADES,
    gantt_figure,
    grid_figure,
    idle_total,
    inflight_figure,
)

SCHEDULES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("interleaved-1f1b", 2, 4, 2),
             ("zb-h1", 4, 8, 1), ("zb-h2", 3, 6, 1), ("1f1b", 1, 1, 1), ("zbv", 3, 6, 2), ("v-half", 4, 8, 2),
             ("v-min", 3, 5, 2), ("dualpipev", 2, 4, 2), ("dualpipe", 4, 8, 2)]


@pytest.mark.parametrize("kind,p,m,v", SCHEDULES)
def test_gantt_idle_time_equals_the_simulated_bubble(kind, p, m, v):
    timeline = simulate(build(kind, p, m, v), Costs(F=1, B=2, W=1))
    fig = gantt_figure(timeline)
    idle = idle_total(fig)
    assert idle == pytest.approx(sum(timeline.idle_time(r) for r in timeline.slots))
    assert idle / (p * timeline.makespan) == pytest.approx(timeline.bubble_fraction)
    for kind_ in ("F", "B", "W", "F&B"):  # a kind's bars, the second stage of a rank's in a 2nd trace
        slots = [s for row in timeline.slots.values() for s in row if s.action.kind == kind_]
        drawn = [bar for t in fig.data if t.name in (kind_, kind_ + SECOND)
                 for bar in zip(t.y, t.base, t.x, t.text, strict=True)]
        assert sorted(drawn) == sorted((s.rank, s.start, s.end - s.start, str(s.action)) for s in slots)
    # The animation ends on the whole timeline, with fixed axes so frames do not jump.
    last = fig.frames[-1].data
    assert [list(t.x) for t in last] == [list(t.x) for t in fig.data]
    assert fig.layout.xaxis.range == (0, timeline.makespan)
    assert list(fig.layout.sliders[0].steps[-1].args[0]) == [fig.frames[-1].name]


def test_gantt_frames_grow_with_time():
    timeline = simulate(build("1f1b", 4, 8))
    busy = [sum(sum(t.x) for t in f.data if t.name in "FBW") for f in gantt_figure(timeline).frames]
    assert busy == sorted(busy) and busy[-1] == sum(map(timeline.busy_time, timeline.slots))


@pytest.mark.parametrize("kind,p,m,v", SCHEDULES)
def test_inflight_peak_is_the_schedules_peak(kind, p, m, v):
    schedule = build(kind, p, m, v)
    fig = inflight_figure(schedule, simulate(schedule))
    peaks = {int(t.name.split()[1]): max(t.y) for t in fig.data}
    assert peaks == peak_inflight_microbatches(schedule)


def test_grid_cells_are_the_schedules_actions():
    schedule = build("zb-h1", 3, 4)
    heat = grid_figure(schedule).data[0]
    csv_rows = to_csv(schedule).splitlines()  # torch's names: I an input-only backward, "" an idle tick
    for rank, row in schedule.items():
        assert heat.text[rank] == csv_rows[rank].split(",")
        assert list(heat.z[rank]) == [0 if a is None else " FBW".index(a.kind) for a in row]


@pytest.mark.parametrize("kind, p, m", [("zbv", 3, 6), ("v-min", 4, 8), ("dualpipev", 3, 6),
                                        ("dualpipe", 4, 8)])
def test_a_ranks_two_stages_are_drawn_in_two_shades(kind, p, m):
    # rank r holds stages r and 2p-1-r: r's actions in the kind's colour, 2p-1-r's lighter, in the
    # Gantt and in the grid (an F&B pair takes its forward's stage)
    schedule = build(kind, p, m)
    lay = stage_map(schedule)
    action = {str(a): a for row in schedule.values() for a in row if a is not None}
    fig = gantt_figure(simulate(schedule))
    for t in fig.data[:-1]:  # the last trace is idle time
        second = t.name.endswith(SECOND)
        assert t.marker.color == (SHADES if second else COLOURS)[t.name.removesuffix(SECOND)]
        assert {lay.chunk(action[text].computations()[0].stage) for text in t.text} <= {int(second)}
    assert {t.name for t in fig.data if len(t.x)} >= {"F", "F" + SECOND, "B", "B" + SECOND}
    heat = grid_figure(schedule).data[0]
    for rank, row in schedule.items():
        for tick, a in enumerate(row):
            if a is not None:
                base = ("F", "B", "W", "F&B").index(a.kind) + 1
                assert heat.z[rank][tick] == base + 4 * lay.chunk(a.computations()[0].stage)


def runtime_units(config, n: int, rank: int) -> Units:
    """The units ZeRO shards on dp rank `rank` of n holding the whole model (refpar/parallel/units.py)."""
    from types import SimpleNamespace

    from refpar.model.gpt import param_shapes

    shapes = param_shapes(config)
    return Units({0: list(shapes)}, shapes, lambda expert: SimpleNamespace(size=n, rank=rank), {0: 1})


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_zero_grids_are_the_runtimes_unit_shards(n):
    config = sh.DEMO_MODEL
    lay = runtime_units(config, n, 0)
    for name in sh.block_weights(0):
        grid = sh.flat_owner_grid(config, n, name).ravel()
        unit, start, _ = lay.offsets[name]
        for rank in range(n):
            a, b = runtime_units(config, n, rank).owned[unit]
            held = np.flatnonzero(grid == rank) + start  # positions in the unit's flat buffer
            assert set(held) == set(range(a, b)) & set(range(start, start + grid.size))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_grids_are_the_slices_shard_params_tp_takes(t):
    config = sh.DEMO_MODEL
    full = init_params(config, 0)
    for name in sh.block_weights(0):
        grid = sh.tp_owner_grid(config, t, name)
        for rank in range(t):
            local = shard_params_tp(full, config, t, rank)[name]
            if (grid == sh.EVERY).all():
                np.testing.assert_array_equal(local, full[name])
            else:
                np.testing.assert_array_equal(full[name][grid == rank], local.ravel())


def test_zero3_gathers_block_0_only_around_its_forward_and_backward():
    steps = sh.weight_steps("zero3", 4)
    owner = sh.flat_owner_grid(sh.DEMO_MODEL, 4, sh.block_weights(0)[0])
    for s in steps:
        params = s.grids["params"][sh.block_weights(0)[0]]
        if s.label in ("forward h.0", "backward h.0"):
            assert (params == sh.EVERY).all()
        else:
            np.testing.assert_array_equal(params, owner)
        np.testing.assert_array_equal(s.grids["optimizer"][sh.block_weights(0)[0]], owner)


def test_dp_replicates_everything_and_zero2_shards_gradients_at_backward():
    name = sh.block_weights(0)[2]
    for s in sh.weight_steps("dp", 2):
        assert (s.grids["params"][name] == sh.EVERY).all() and (s.grids["optimizer"][name] == sh.EVERY).all()
    zero2 = {s.label: s.grids["grads"][name] for s in sh.weight_steps("zero2", 2)}
    assert (zero2["backward h.1"] == sh.NOBODY).all()
    np.testing.assert_array_equal(zero2["backward h.0"], sh.flat_owner_grid(sh.DEMO_MODEL, 2, name))


def test_sp_rows_are_shard_ranges_and_regions_are_whole():
    t, T = 4, sh.DEMO_SEQ
    steps = sh.sp_steps(t)
    grid = next(iter(steps[0].grids["activations"].values()))
    for rank in range(t):
        assert set(np.flatnonzero(grid[:, 0] == rank)) == set(range(*shard_range(T, t, rank)))
    assert (next(iter(steps[1].grids["activations"].values())) == sh.EVERY).all()


def test_ep_tokens_travel_to_the_rank_that_owns_their_expert():
    ep = 4
    steps = sh.ep_steps(ep)
    home = next(iter(steps[0].grids["tokens"].values()))
    away = next(iter(steps[1].grids["tokens"].values()))
    assert (home == np.arange(ep)[:, None]).all()
    owners = sh.expert_owners(ep)
    assert all(owners[e] == r for r in range(ep) for e in owned_experts(sh.DEMO_MOE_MODEL.moe_experts, ep, r))
    assert list(steps[0].grids["experts"]["experts (owner)"][0]) == owners
    assert set(np.unique(away)) <= set(range(ep)) and (away != home).any()


def test_sharding_figure_frames_carry_the_steps_grids():
    steps = sh.steps_for("zero3", 4)
    fig = sh.sharding_figure(steps, 4)
    for frame, step in zip(fig.frames, steps, strict=True):
        grids = [g for row in step.grids.values() for g in row.values()]
        assert len(frame.data) == len(grids)
        for trace, grid in zip(frame.data, grids, strict=True):
            np.testing.assert_array_equal(np.asarray(trace.z), grid)
    assert [s.label for s in fig.layout.sliders[0].steps] == [s.label for s in steps]
    # each frame's title says what moves, in lines short enough for the figure (Plotly never wraps)
    titles = [f.layout.title.text for f in fig.frames]
    assert all(t.replace("<br>", " ").endswith(s.moves) for t, s in zip(titles, steps, strict=True))
    assert all(len(line) <= 80 for t in titles for line in t.split("<br>"))


@pytest.mark.parametrize("strategy,n", [("tp", 3), ("dp", 9), ("sp", 1), ("ep", 9)])
def test_bad_sharding_inputs_are_one_sentence(strategy, n):
    with pytest.raises(ConfigError):
        sh.steps_for(strategy, n)


# ---------------------------------------------------------------- communication and memory

TINY, ONE_STEP = model_preset("tiny"), TrainConfig(steps=1)


@pytest.mark.parametrize("strategy", ex.STRATEGIES)
def test_traffic_matrix_rows_add_up_to_each_ranks_bytes_sent(strategy):
    w = ex.workload(strategy, 2, TINY, ONE_STEP, dp=2)
    rows, _ = ex.closed_form_rows(w)
    matrix = cv.traffic_matrix(rows, w.sizes)
    sent = [sum(r["bytes_sent"] for r in rows if r["rank"] == k) for k in range(w.world)]
    np.testing.assert_allclose(matrix.sum(axis=1), sent)
    assert np.trace(matrix) == 0  # nobody sends to itself
    # Every byte goes to a rank of the sender's group on that axis.
    for r in rows:
        for dst, _ in cv.destinations(w.sizes, r["rank"], r["axis"], r["op"]):
            assert dst in cv.axis_group(w.sizes, r["rank"], r["axis"])


@pytest.mark.parametrize("strategy", [s for s in ex.STRATEGIES if s != "pp"])
def test_the_steps_calls_add_up_to_the_closed_form_rows(strategy):
    w = ex.workload(strategy, 2, TINY, ONE_STEP, dp=2)
    rows, _ = ex.closed_form_rows(w)
    calls = ex.calls(w)
    for k in range(w.world):
        assert sum(c["bytes_sent"][k] for c in calls) == sum(r["bytes_sent"] for r in rows if r["rank"] == k)
    fig = cv.calls_figure(calls, w.sizes)
    assert len(fig.frames) == len(calls) + 1
    np.testing.assert_allclose(np.asarray(fig.frames[-1].data[0].z), cv.traffic_matrix(rows, w.sizes))
    timeline = cv.timeline_figure(calls)
    assert sum(len(t.x) for t in timeline.data) == len(calls)


def test_axis_groups_follow_the_device_mesh_layout():
    sizes = ex.workload("tp", 2, TINY, ONE_STEP, dp=2).sizes  # ranks (dp, tp) = [[0, 1], [2, 3]]
    assert cv.axis_group(sizes, 3, "tp") == [2, 3] and cv.axis_group(sizes, 3, "dp") == [1, 3]
    assert cv.axis_group(sizes, 0, "world") == [0, 1, 2, 3]


def test_bytes_and_memory_figures_show_the_rows():
    w = ex.workload("zero3", 4, TINY, ONE_STEP)
    comm, memory = ex.closed_form_rows(w)
    fig = cv.bytes_figure(comm, comm)
    assert list(fig.data[0].y) == list(fig.data[1].y) == list(cv.by_axis_op(comm).values())
    mem = cv.memory_figure({"zero3": cv.memory_by_rank(memory)[0]})
    assert {t.name: t.y[0] for t in mem.data} == {r["category"]: r["bytes"] for r in memory if r["rank"] == 0}


@pytest.mark.parametrize("args", [("tp", 3, 1), ("dp", 17, 1), ("pp", 4, 8), ("nope", 2, 1)])
def test_bad_workloads_are_config_errors(args):
    strategy, n, dp = args
    with pytest.raises(ConfigError):
        w = ex.workload(strategy, n, TINY, ONE_STEP, dp=dp)
        ex.closed_form_rows(w)


def test_trace_figure_draws_every_traced_call():
    from refpar.comm.trace import CommEvent, chrome_trace

    events = [CommEvent(rank=r, op="all_reduce", axis=axis, group=(0, 1), algo="native(ring)", peer=None,
                        dtype="float64", shape=(4,), bytes_sent=32 * (k + 1), bytes_recv=32, tag="g",
                        step=0, microbatch=None, phase=None, t_start=k * 1e-3, t_end=k * 1e-3 + 5e-4)
              for k, (r, axis) in enumerate([(0, "dp"), (1, "dp"), (0, "tp"), (1, "tp"), (1, "tp")])]
    fig = cv.trace_figure(chrome_trace(events))
    bars = {t.name: t for t in fig.data}
    assert list(bars["dp"].y) == [0, 1] and list(bars["tp"].y) == [0, 1, 1]
    np.testing.assert_allclose(bars["tp"].base, [2.0, 3.0, 4.0])  # ms since the first call
    np.testing.assert_allclose(bars["dp"].x, [0.5, 0.5])
    assert "160 bytes sent" in bars["tp"].text[2]


def engine_holders(dp: int, tp: int, zero: int) -> dict[int, set]:
    """Element id (unique over the whole model) -> the ranks whose parameters hold it, read off the
    engine's own placement: shard_params_tp of the full model, then ZeRO-3's dp shards of its units."""
    from types import SimpleNamespace

    from refpar.memory import MemoryLedger
    from refpar.model.gpt import param_shapes
    from refpar.parallel.zero import Zero3

    shapes = param_shapes(sh.DEMO_MODEL)
    starts = np.cumsum([0] + [int(np.prod(s)) for s in shapes.values()])
    full = {n: (a + np.arange(int(np.prod(s)))).reshape(s).astype(float)
            for (n, s), a in zip(shapes.items(), starts, strict=False)}
    holders: dict[int, set] = {}
    for d in range(dp):
        for t in range(tp):
            local = shard_params_tp(full, sh.DEMO_MODEL, tp, t)
            if zero == 3:
                units = Units({0: list(local)}, {n: w.shape for n, w in local.items()},
                              lambda expert, d=d: SimpleNamespace(size=dp, rank=d), {0: 1})
                held = np.concatenate(list(Zero3(units, sh.DEMO_MODEL, TrainConfig(), MemoryLedger(),
                                                 local).shards.values()))
            else:
                held = np.concatenate([w.ravel() for w in local.values()])
            for i in held.astype(int):
                holders.setdefault(int(i), set()).add(d * tp + t)  # refpar/mesh.py: tp fastest
    return holders, dict(zip(shapes, starts, strict=False))


@pytest.mark.parametrize("zero", [0, 3])
def test_mix_colours_are_the_ranks_whose_engine_shards_hold_each_element(zero):
    from refpar.viz import mesh_sharding as ms

    holders, starts = engine_holders(2, 2, zero)
    fig = ms.mix_figure(ms.mix_steps(2, 2, zero))
    sets = fig.layout.meta["holders"]
    for i, name in enumerate(sh.block_weights(0)):  # the params row
        z = np.asarray(fig.data[i].z)
        drawn = [set(sets[k]) for k in z.ravel()]
        assert drawn == [holders[starts[name] + j] for j in range(z.size)], name
        colours = {fig.data[-len(sets) + k].marker.color for k in np.unique(z)}  # the legend's squares
        assert len(colours) == len(np.unique(z))  # one colour per holder set


def test_mix_colours_of_sets_of_ranks_stand_apart_from_every_single_ranks_on_dp2_tp4():
    """dp=2 x tp=4 uses all 8 rank colours and 5 sets: each set's colour is at least 100 apart in RGB
    (0-255 a channel) from every rank's, white's and every other set's, so a set is never taken for a
    rank (Pastel1's first was 25 from rank 6's pink)."""
    import itertools
    import math

    import plotly.graph_objects as go
    from plotly.colors import hex_to_rgb

    from refpar.viz import mesh_sharding as ms

    fig = ms.mix_figure(ms.mix_steps(2, 4, 1))  # ZeRO-1: optimizer shards on single ranks, pairs elsewhere
    shown = [t.marker.color for t in fig.data if isinstance(t, go.Scatter)]  # the legend's squares
    assert len(shown) == len(fig.layout.meta["holders"]) == 1 + 8 + 4 + 1  # nobody, ranks, pairs, a tp group
    singles = [c for c, s in zip(shown, fig.layout.meta["holders"], strict=True) if len(s) == 1]
    sets = [c for c, s in zip(shown, fig.layout.meta["holders"], strict=True) if len(s) > 1]
    assert min(math.dist(hex_to_rgb(a), hex_to_rgb(b)) for a in sets for b in singles + ["#ffffff"]) >= 100
    assert min(math.dist(hex_to_rgb(a), hex_to_rgb(b)) for a, b in itertools.combinations(sets, 2)) >= 100


def test_mix_sp_rows_are_shard_ranges_and_bad_mixes_are_one_sentence():
    from refpar.viz import mesh_sharding as ms

    act = ms.mix_grids(1, 4, 0, sp=True)["activations"]["residual (T, C)"]
    for t in range(4):
        a, b = shard_range(sh.DEMO_SEQ, 4, t)
        assert all(cell == (t,) for cell in act[a:b].ravel())
    for dp, tp, zero in ((3, 3, 0), (1, 3, 0), (2, 2, 2)):
        with pytest.raises(ConfigError):
            ms.mix_grids(dp, tp, zero)


def test_ep_traffic_matrix_rows_and_columns_are_the_closed_form_bytes():
    from refpar.analysis import moe as closed
    from refpar.analysis.closed_forms import rank_comm_bytes
    from refpar.config import ParallelConfig, Plan
    from refpar.viz import moe as mv

    config = model_preset("tiny", moe_experts=8)
    sizes = ParallelConfig({"dp": 2, "ep": 4}).sizes
    kept = mv.drawn_kept(config, 8, 16, 4)
    itemsize = np.dtype(config.dtype).itemsize
    m = closed.record_slots(config.moe_experts, config.moe_top_k, 4)
    assert all(k.shape == (8, 8) and p.shape == (8, 4) for k, p in kept)
    assert len(kept) == len(config.moe_blocks)
    a2a = sum(mv.all_to_all_matrix(k, 4, config.n_embd, itemsize, m) for k in kept)
    for d in range(8):
        exact = [closed.all_to_all_bytes(p, 4, d, config.n_embd, itemsize, m) for _, p in kept]
        assert a2a[d].sum() == sum(b.sent for b in exact) and a2a[:, d].sum() == sum(b.recv for b in exact)
        assert not a2a[d, [r for r in range(8) if r // 4 != d // 4]].any()  # no all-to-all across dp
    rows = mv.step_rows(config, sizes, kept)
    matrix = mv.traffic_matrix(config, sizes, kept)
    for d in range(8):
        coords = {"pp": 0, "dp": d // 4, "ep": d % 4, "cp": 0, "tp": 0}
        per_op = rank_comm_bytes(config, TrainConfig(batch_size=8), sizes, coords, Plan(),
                                 [dict(zip(config.moe_blocks, kept, strict=True))])
        assert matrix[d].sum() == sum(b[0] for b in per_op.values())
        assert sum(r["bytes_sent"] for r in rows if r["rank"] == d) == matrix[d].sum()


def test_mix_frames_show_zero3_gather_block0_over_dp_then_free_it_as_the_engine_places_it():
    from refpar.viz import mesh_sharding as ms

    gathered, _ = engine_holders(2, 2, 0)  # every dp replica holds its tp rank's whole shard
    sharded, starts = engine_holders(2, 2, 3)
    fig = ms.mix_figure(ms.mix_steps(2, 2, 3))
    sets = fig.layout.meta["holders"]
    frames = {f.name: f for f in fig.frames}
    names = sh.block_weights(0)

    def drawn(frame: str, row: int, i: int) -> list[set]:
        return [set(sets[k]) for k in np.asarray(frames[frame].data[row * len(names) + i].z).ravel()]

    for i, name in enumerate(names):
        size = np.asarray(fig.data[i].z).size
        want = {f: [h[starts[name] + j] for j in range(size)] for f, h in (("g", gathered), ("s", sharded))}
        assert drawn("forward h.0", 0, i) == want["g"] and drawn("backward h.0", 0, i) == want["g"], name
        assert drawn("forward h.1", 0, i) == want["s"] and drawn("after the step", 0, i) == want["s"], name
        assert drawn("forward h.0", 1, i) == [set()] * size  # no gradient before block 0's backward
        assert drawn("backward h.0", 1, i) == want["s"]  # reduce-scattered as its backward ends
    assert all(s["args"][1]["frame"]["redraw"] for s in fig.layout.sliders[0].steps)
    assert fig.layout.xaxis.autorange is False and fig.layout.yaxis.autorange is False


def test_pp_tp_mix_puts_each_block_on_its_stage_ranks_cut_by_tp():
    from refpar.holdings import stage_layers
    from refpar.viz import mesh_sharding as ms

    tp_holders, starts = engine_holders(1, 2, 0)  # tp rank t holds what shard_params_tp gives it
    fig = ms.mix_figure(ms.pp_tp_steps(2, 2))
    sets = fig.layout.meta["holders"]
    traces = iter(fig.data)
    for stage in range(2):
        for block in stage_layers(sh.DEMO_MODEL.n_layer, 2, stage):
            for name in sh.block_weights(block):
                z = np.asarray(next(traces).z)
                want = [{stage * 2 + t for t in tp_holders[starts[name] + j]} for j in range(z.size)]
                assert [set(sets[k]) for k in z.ravel()] == want, name
    with pytest.raises(ConfigError):
        ms.pp_tp_steps(3, 1)  # more stages than blocks


def test_llama_mix_draws_each_kv_head_on_the_tp_ranks_whose_query_heads_read_it():
    from refpar.viz import mesh_sharding as ms
    from refpar.viz import sharding as sh

    config = sh.DEMO_LLAMA  # 8 query heads over 2 kv heads, head size 2
    hs, g = config.head_size, config.n_head // config.n_kv_head
    for dp, tp in ((1, 2), (1, 4), (2, 4), (1, 8)):
        params = ms.mix_grids(dp, tp, 0, config=config)["params"]
        k = params["model.layers.0.self_attn.k_proj.weight"]  # (2 hs, C) rows of kv heads 0, 1
        for head in range(config.n_kv_head):
            # tp rank r holds query heads [r nh/tp, (r+1) nh/tp), which read kv head (r nh/tp) // g
            readers = [r for r in range(tp) if (r * config.n_head // tp) // g == head
                       or ((r + 1) * config.n_head // tp - 1) // g == head]
            held = tuple(sorted(d * tp + r for d in range(dp) for r in readers))
            assert all(cell == held for cell in k[head * hs:(head + 1) * hs].ravel()), (dp, tp, head)
    # Llama with sequence parallelism, which the engine runs (refpar/engine/validate.py): each tp rank
    # holds its shard_range of the residual stream's rows, as for GPT-2
    act = ms.mix_grids(1, 2, 0, sp=True, config=config)["activations"]["residual (T, C)"]
    for t in range(2):
        a, b = shard_range(sh.DEMO_SEQ, 2, t)
        assert all(cell == (t,) for cell in act[a:b].ravel())


def test_mesh_grid_labels_are_dark_on_faded_ranks_and_white_on_full_ones():
    """The Whole mesh grid (issue 44's legibility list): white text only where its cell is in full colour."""
    from refpar.viz.mesh_grid import groups, mesh_figure

    sizes = {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2}
    fig = mesh_figure(sizes, {r: f"rank {r}" for r in range(8)}, selected=5)
    marker, font = fig.data[0].marker, fig.data[0].textfont
    peers = {p for g in groups(sizes, 5).values() for p in g}
    assert [o == 1.0 for o in marker.opacity] == [r == 5 or r in peers for r in range(8)]
    assert list(font.color) == ["white" if o == 1.0 else "#222222" for o in marker.opacity]
