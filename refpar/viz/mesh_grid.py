"""The whole mesh: every rank of a run on up to 16 ranks over pp, dp (ZeRO 0-3, FSDP), ep, cp and tp
(sp), what each one holds, and what it gathers, frees and sends through one training step.

Everything is read off the functions a run itself places data with, for the run's own model and
plan (nothing re-derived here):

    ranks        arange(world).reshape(pp, dp, ep, cp, tp): refpar/mesh.py's grid (tp fastest)
    stages       the schedule's stage map (schedules.stage_map(of_plan(plan, pp))): the stages a pp rank
                 runs, their part of the model, its blocks (holdings.stage_layers)
    heads, vocab holdings.tp_param_slices and kv_heads of the rank's tp coordinate
    samples      holdings.microbatch_samples of each microbatch (its dp, and ep in a MoE model, share)
    tokens       context_parallel.cp_positions of its cp rank, cut by sp's shard_range over tp
                 (refpar/engine/parallelize.layout_for: a layout's resid_pos)
    experts      expert_parallel.owned_experts of its ep rank
    ZeRO shard   shard_range of each unit (holdings.units) over the unit's replica group
                 (refpar.analysis.closed_forms.rank_units, as parallel/units.py lays the flat buffers)
    bytes        refpar.analysis.closed_forms's closed forms, which a run's ledger and trace match byte for
                 byte (tests/test_viz.py holds them against a real run's --json summary)
    routing      a MoE block's all-to-alls and what its cache keeps follow from its kept counts, the
                 (D c, E) assignments each data rank (x cp rank) keeps per expert in each microbatch,
                 and its pair counts, the (D c, ep) tokens each sends to each ep rank
                 (refpar.analysis.moe): a real run's own (its --json summary's microbatch_kept_counts
                 and microbatch_pair_counts, `run_routing`), or, before any run, `balanced_routing`'s

`step_moments` groups one step's collectives of a rank (refpar.analysis.closed_forms.rank_calls) by the
moment of the step they belong to: the forward and backward passes of every microbatch, the sums
made once every backward is done, and the optimizer's update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from refpar.analysis import closed_forms as closed
from refpar.analysis.moe import pair_counts_upper_bound
from refpar.config import MESH_AXES, ConfigError, ModelConfig, ParallelConfig, Plan, TrainConfig
from refpar.holdings import embed_param_names, kv_heads, stage_layers, tp_param_slices
from refpar.model.routing import capacity, kept_counts
from refpar.parallel.context_parallel import cp_positions
from refpar.parallel.expert_parallel import owned_experts
from refpar.sharding import shard_range, shard_sizes

MAX_RANKS = 16  # a grid larger than this does not fit the screen (nor this machine's runs)
STAGE_COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]
GATHERS = ("all_gather",)  # the calls that bring a whole unit (or sequence) onto the rank


def check_mesh(model: ModelConfig, cfg: TrainConfig, sizes: dict, plan: Plan) -> dict[str, int]:
    """Every axis of `sizes`, checked as `refpar train` checks the run (ConfigError with the fix)."""
    from refpar.engine.validate import validate

    full = ParallelConfig(dict(sizes)).sizes
    world = math.prod(full[a] for a in MESH_AXES)
    if world > MAX_RANKS:
        raise ConfigError(f"pp x dp x ep x cp x tp = {world} ranks; choose sizes that multiply to at most "
                          f"{MAX_RANKS}")
    validate(model, cfg, full, plan)
    return full


def mesh_ranks(sizes: dict) -> np.ndarray:
    shape = [sizes[a] for a in MESH_AXES]
    return np.arange(math.prod(shape)).reshape(shape)  # (pp, dp, ep, cp, tp)


def groups(sizes: dict, rank: int) -> dict[str, list[int]]:
    """The world ranks of each axis's group through `rank` (DeviceMesh's Split by the other
    coordinates), for every axis of size > 1."""
    grid, co = mesh_ranks(sizes), closed.rank_coords(sizes, rank)
    out = {}
    for i, a in enumerate(MESH_AXES):
        if sizes[a] > 1:
            index = tuple(slice(None) if j == i else co[b] for j, b in enumerate(MESH_AXES))
            out[a] = grid[index].tolist()
    return out


@dataclass(frozen=True)
class Routing:
    """The counts a MoE mesh is priced with: per step, per microbatch, MoE block -> its (kept (D c, E),
    pairs (D c, ep)) counts (refpar.analysis.closed_forms's `kept_by_step`), and where they come from."""

    kept_by_step: list[list[dict[int, tuple]]]
    source: str  # "balanced" (assumed) or a real run's label


def balanced_routing(model: ModelConfig, cfg: TrainConfig, sizes: dict, plan: Plan) -> Routing:
    """One step of balanced routing: in microbatch j (T_j tokens of the global batch, routed
    together), every expert receives its share T_j k / E of the T_j k assignments, from each member
    of the exchange (data rank d x cp rank q, in the exchange's order (d c + q)) in proportion to the
    N_g tokens it routes: member g's N_g k assignments spread over the E experts as evenly as whole
    numbers allow (shard_sizes: the first experts take the remainder). Each expert keeps up to the
    capacity the run computes (refpar.model.routing.capacity of T_j), earlier members' first, as the
    run's queue does (`kept_counts`, every slot in one queue). Pairs: one per kept assignment, as
    if a token's experts lay on different ep ranks (analysis.moe.pair_counts_upper_bound; exact for
    top-1, an upper bound otherwise)."""
    E, k, c = model.moe_experts, model.moe_top_k, sizes["cp"]
    D = sizes["dp"] * sizes["ep"]
    microbatches = []
    for j in range(plan.microbatches):
        tokens = []  # N_g of each member g = d c + q
        for d in range(D):
            co = {**closed.rank_coords(sizes, 0), "dp": d // sizes["ep"], "ep": d % sizes["ep"]}
            rows = len(closed.samples(model, cfg, sizes, co, plan, j))
            tokens += [rows * len(cp_positions(cfg.seq_len, c, q, plan.cp_algo)) for q in range(c)]
        chosen = np.array([[shard_sizes(n * k, E)] for n in tokens], dtype=np.int64)  # (D c, 1, E)
        kept = kept_counts(chosen, capacity(sum(tokens), model))  # (D c, E); sum(tokens) = T_j
        pairs = pair_counts_upper_bound(kept, sizes["ep"])  # (D c, ep)
        microbatches.append({layer: (kept, pairs) for layer in model.moe_blocks})
    return Routing([microbatches], "balanced")


def run_routing(moe: dict, label: str) -> Routing:
    """A run's own kept and pair counts, from its --json summary's "moe" field."""
    blocks = moe["blocks"]
    return Routing([[{blocks[i]: (np.asarray(kept, dtype=np.int64), np.asarray(pairs, dtype=np.int64))
                      for i, (kept, pairs) in enumerate(zip(kept_mb, pairs_mb, strict=True))}
                     for kept_mb, pairs_mb in zip(kept_step, pairs_step, strict=True)]
                    for kept_step, pairs_step in zip(moe["microbatch_kept_counts"],
                                                     moe["microbatch_pair_counts"], strict=True)], label)


def _rank_kept(model: ModelConfig, sizes: dict, plan: Plan, rank: int, step: list[dict]) -> list[dict]:
    """One step's counts cut to the MoE blocks of `rank`'s stages (what that rank routes)."""
    lay = closed.pipeline(sizes, plan)[1]
    mine = {i for s in lay.stages_of(closed.rank_coords(sizes, rank)["pp"])
            for i in stage_layers(model.n_layer, lay.stages_per_copy, lay.part(s))}
    return [{layer: kept for layer, kept in microbatch.items() if layer in mine} for microbatch in step]


@dataclass(frozen=True)
class RankFacts:
    """What one rank holds (module docstring: where each fact comes from)."""

    rank: int
    coords: dict[str, int]
    groups: dict[str, list[int]]  # axis -> the world ranks of this rank's group on it
    stages: list[dict]  # {"stage", "part", "blocks", "embedding", "head"} of each stage the rank runs
    heads: tuple[int, int]  # [h0, h1) query heads
    kv_heads: tuple[int, int]  # [k0, k1) kv heads (GPT-2: its query heads)
    vocab_rows: tuple[int, int]  # [v0, v1) of the embedding (and tied head)
    samples: list[list[int]]  # the global sample ids of each microbatch
    positions: list[int]  # the sequence positions its residual stream holds
    experts: list[int] | None  # the experts it holds, None without MoE
    parameters: int  # elements of its (tp-sliced) parameters
    zero_shards: list[dict]  # per unit {"unit", "elements", "shard": [a, b), "group", "group_size"}
    memory: dict[str, int]  # peak bytes by category (the ledger's), a MoE mesh's for its routing


def rank_facts(model: ModelConfig, cfg: TrainConfig, sizes: dict, plan: Plan, rank: int,
               routing: Routing | None = None) -> RankFacts:
    """`routing`: a MoE mesh's kept and pair counts (default: `balanced_routing`)."""
    co = closed.rank_coords(sizes, rank)
    if model.moe_experts and routing is None:
        routing = balanced_routing(model, cfg, sizes, plan)
    kept_by_step = [_rank_kept(model, sizes, plan, rank, step) for step in routing.kept_by_step] if routing \
        else None
    t, k = sizes["tp"], co["tp"]
    lay = closed.pipeline(sizes, plan)[1]
    P = lay.stages_per_copy
    stages = [{"stage": s, "part": lay.part(s), "blocks": list(stage_layers(model.n_layer, P, lay.part(s))),
               "embedding": lay.part(s) == 0, "head": lay.part(s) == P - 1} for s in lay.stages_of(co["pp"])]
    vocab = tp_param_slices(model, t, k).get(embed_param_names(model)[0])
    rows = (0, model.vocab_size) if vocab is None else (int(vocab[1][0]), int(vocab[1][-1]) + 1)
    heads = shard_range(model.n_head, t, k)
    kv = kv_heads(model, t, k)  # GPT-2's kv heads are its query heads
    positions = cp_positions(cfg.seq_len, sizes["cp"], co["cp"], plan.cp_algo)  # (Ta,)
    if plan.sp:  # the residual stream's sp shard of this cp rank's tokens (sequence_parallel.sp_cp_layout)
        positions = positions[slice(*shard_range(len(positions), t, k))]  # (Tl,)
    units = closed.rank_units(model, sizes, co, plan).units
    shards = [{"unit": name, "elements": u.size, "group": u.axis, "group_size": len(u.counts),
               "shard": [sum(u.counts[:u.rank]), sum(u.counts[:u.rank + 1])]}  # shard_range's [a, b)
              for name, u in units.items()] if plan.stage else []
    return RankFacts(
        rank, co, groups(sizes, rank), stages, heads, kv, rows,
        [list(closed.samples(model, cfg, sizes, co, plan, j)) for j in range(plan.microbatches)],
        [int(x) for x in positions],
        list(owned_experts(model.moe_experts, sizes["ep"], co["ep"])) if model.moe_experts else None,
        sum(closed.rank_param_numels(model, sizes, co, plan).values()), shards,
        {r["category"]: r["bytes"]
         for r in closed.rank_memory_rows(model, cfg, sizes, co, plan, kept_by_step)})


def holdings_rows(facts: RankFacts) -> list[dict]:
    """The rank's facts as (what, held) rows for a table."""
    def span(a, b, what):
        return f"{what} {a}-{b - 1}" if b - a > 1 else f"{what} {a}"

    stages = "; ".join(f"stage {s['stage']}: " + ("embedding + " if s["embedding"] else "")
                       + span(s["blocks"][0], s["blocks"][-1] + 1,
                              "blocks" if len(s["blocks"]) > 1 else "block")
                       + (" + head" if s["head"] else "") for s in facts.stages)
    rows = [("mesh coordinates", " ".join(f"{a}={c}" for a, c in facts.coords.items())),
            ("groups", "; ".join(f"{a}: ranks {', '.join(map(str, g))}" for a, g in facts.groups.items())
             or "none (one device)"),
            ("stages and layers", stages),
            ("attention heads", span(*facts.heads, "heads") + f" (kv {span(*facts.kv_heads, 'heads')})"),
            ("vocabulary rows", span(*facts.vocab_rows, "rows")),
            ("samples", "; ".join(f"microbatch {j}: {', '.join(map(str, s))}"
                                  for j, s in enumerate(facts.samples))),
            ("sequence positions", _ranges(facts.positions)),
            ("experts", "none (no MoE blocks)" if facts.experts is None
             else ", ".join(map(str, facts.experts))),
            ("parameters", f"{facts.parameters:,} elements")]
    rows += [(f"ZeRO shard of {z['unit']}", f"elements {z['shard'][0]:,}-{z['shard'][1] - 1:,} of "
              f"{z['elements']:,} (1/{z['group_size']} over {z['group']})") for z in facts.zero_shards]
    rows += [(f"peak {cat} bytes", f"{b:,}") for cat, b in facts.memory.items()]
    return [{"what": w, "held": h} for w, h in rows]


def _ranges(ids: list[int]) -> str:
    """0-3, 12-15 for [0, 1, 2, 3, 12, 13, 14, 15]: zig-zag chunks stay readable."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(out)


@dataclass(frozen=True)
class Moment:
    """What one rank does at one moment of the step."""

    label: str  # one of refpar.analysis.closed_forms.MOMENTS
    computes: str
    calls: list[dict]  # {"axis", "op", "what", "calls", "bytes_sent", "bytes_recv"}, each row times its calls
    gathers: list[str]  # the units (or sequences) it all-gathers
    frees: str  # what it lets go of afterwards


def step_moments(model: ModelConfig, cfg: TrainConfig, sizes: dict, plan: Plan, rank: int,
                 routing: Routing | None = None) -> list[Moment]:
    """Each moment of one training step on `rank` (refpar.analysis.closed_forms.MOMENTS): the pipeline
    actions it runs, every collective it makes (summed over its calls), what it gathers and frees.
    A MoE mesh's routing messages are its last step's under `routing` (default: `balanced_routing`),
    one total for both passes in the forward's moment (refpar.analysis.closed_forms.rank_calls)."""
    co = closed.rank_coords(sizes, rank)
    if model.moe_experts and routing is None:
        routing = balanced_routing(model, cfg, sizes, plan)
    kept = _rank_kept(model, sizes, plan, rank, routing.kept_by_step[-1]) if routing else None
    schedule, lay = closed.pipeline(sizes, plan)
    head = any(lay.part(s) == lay.stages_per_copy - 1 for s in lay.stages_of(co["pp"]))
    actions = [c for a in schedule[co["pp"]] if a is not None for c in a.computations()]
    calls = closed.rank_calls(model, cfg, sizes, co, plan, kept)
    stage3, strategy = plan.stage == 3, plan.strategy
    computes = {
        "forward": ", ".join(str(a) for a in actions if a.kind == "F"),
        "backward": ", ".join(str(a) for a in actions if a.kind in "BW"),
        "after the backward": "nothing: the sums every backward has to finish first",
        "optimizer step": f"{cfg.optimizer} on "
                          + ("its shard of each unit" if plan.stage else "every parameter it holds"),
    }
    frees = {
        "forward": ("each gathered unit once its forward is done"
                    + (" (the head's wte and root kept for its backward)" if head else "")
                    if stage3 and plan.reshard_after_forward else
                    "nothing: the gathered units stay for the backward" if stage3 else "nothing"),
        "backward": ("each gathered unit after its backward, and each unit's whole gradient once it is "
                     "reduce-scattered (its 1/N shard kept)" if stage3 else
                     "each unit's whole gradient once reduce-scattered (its 1/N shard kept)"
                     if strategy == "zero2" else "each microbatch's activations after its backward"),
        "after the backward": "nothing",
        "optimizer step": ("the gathered copy of each updated shard stays: the next step's weights"
                           if strategy in ("zero1", "zero2") else "nothing"),
    }
    out = []
    for label in closed.MOMENTS:
        rows: dict[tuple, list[int]] = {}
        for moment, axis, op, what, b, times in calls:
            if moment == label:
                row = rows.setdefault((axis, op, what), [0, 0, 0])
                row[0] += times
                row[1] += times * b.sent
                row[2] += times * b.recv
        mine = [{"axis": a, "op": o, "what": w, "calls": n, "bytes_sent": s, "bytes_recv": r}
                for (a, o, w), (n, s, r) in rows.items()]
        gathered = list(dict.fromkeys(c["what"].split(":")[0] for c in mine if c["op"] in GATHERS
                                      and ":params:" in c["what"]))
        out.append(Moment(label, computes[label] or "nothing", mine, gathered, frees[label]))
    return out


def sent_by_axis(moment: Moment) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in moment.calls:
        out[c["axis"]] = out.get(c["axis"], 0) + c["bytes_sent"]
    return out


def _grid_axes(sizes: dict) -> tuple[list[str], list[str]]:
    """Rows of the grid: pp then dp (the slow axes); columns: ep, cp, tp (tp fastest, as in the mesh)."""
    return ["pp", "dp"], ["ep", "cp", "tp"]


def _cell(sizes: dict, rank: int) -> tuple[int, int]:
    """(column, row) of a rank in the grid."""
    co = closed.rank_coords(sizes, rank)
    rows, cols = _grid_axes(sizes)
    y = int(np.ravel_multi_index([co[a] for a in rows], [sizes[a] for a in rows]))
    x = int(np.ravel_multi_index([co[a] for a in cols], [sizes[a] for a in cols]))
    return x, y


def _tick(sizes: dict, axes: list[str], flat: int) -> str:
    coords = np.unravel_index(flat, [sizes[a] for a in axes])
    return " ".join(f"{a}={int(c)}" for a, c in zip(axes, coords, strict=True) if sizes[a] > 1) or " "


def mesh_figure(sizes: dict, labels: dict[int, str], selected: int | None = None, title: str = "",
                stage_of: dict[int, int] | None = None) -> go.Figure:
    """The ranks as a grid, pp x dp rows by ep x cp x tp columns (refpar/mesh.py's order), each a
    square coloured by its pipeline rank, labelled `labels[rank]`, its rank in customdata (a click
    selects it); the `selected` rank is outlined and its groups' ranks ringed, the others faded
    (LEGEND says so in words)."""
    world = math.prod(sizes[a] for a in MESH_AXES)
    rows, cols = _grid_axes(sizes)
    n_rows, n_cols = math.prod(sizes[a] for a in rows), math.prod(sizes[a] for a in cols)
    cells = [_cell(sizes, r) for r in range(world)]
    stage_of = stage_of or {r: closed.rank_coords(sizes, r)["pp"] for r in range(world)}
    peers = {p for g in groups(sizes, selected).values() for p in g} if selected is not None else set()
    shown = [selected is None or r == selected or r in peers for r in range(world)]
    fig = go.Figure(go.Scatter(
        x=[x for x, _ in cells], y=[y for _, y in cells], mode="markers+text", customdata=list(range(world)),
        # white on a full colour, near black on a faded one: readable on both
        text=[labels[r] for r in range(world)],
        textfont={"size": 12, "color": ["white" if s else "#222222" for s in shown]},
        marker={"symbol": "square", "size": 74 if n_cols <= 8 else 56,
                "color": [STAGE_COLOURS[stage_of[r] % len(STAGE_COLOURS)] for r in range(world)],
                "opacity": [1.0 if s else 0.45 for s in shown],
                "line": {"width": [5 if r == selected else 2 if r in peers else 0 for r in range(world)],
                         "color": "#222222"}},
        hovertemplate="%{text}<extra></extra>", showlegend=False))
    fig.update_xaxes(tickvals=list(range(n_cols)), ticktext=[_tick(sizes, cols, i) for i in range(n_cols)],
                     range=[-0.6, n_cols - 0.4], showgrid=False, zeroline=False, side="top")
    fig.update_yaxes(tickvals=list(range(n_rows)), ticktext=[_tick(sizes, rows, i) for i in range(n_rows)],
                     range=[n_rows - 0.4, -0.6], showgrid=False, zeroline=False, automargin=True)
    fig.update_layout(title=title, height=140 + 90 * n_rows, margin={"l": 10, "r": 10, "t": 90, "b": 10},
                      plot_bgcolor="white", clickmode="event+select", meta={"cells": cells})
    return fig


def mesh_model(preset: str, ep: int) -> ModelConfig:
    """The model the Whole mesh and Run for real pages draw and run: the preset, its every block a
    Mixture-of-Experts layer of 4 experts, top-2 (Mixtral's routing needs two), when ep > 1."""
    from refpar.config import model_preset

    return model_preset(preset, **MOE) if ep > 1 else model_preset(preset)


MOE = {"moe_experts": 4, "moe_top_k": 2}
LEGEND = ("Colour: the rank's pipeline stage. Thick outline: the rank shown; thin outline, full colour: "
          "the ranks of its groups (the ranks it talks to); faded: every other rank.")


def train_args(sizes: dict, plan: Plan, preset: str, steps: int, moe: bool = False,
               check: bool = True, cfg: TrainConfig | None = None) -> list[str]:
    """The `refpar train` arguments that run this mesh and plan (after `mpiexec -n world`): the
    model's preset, with `mesh_model`'s experts when `moe`; `check`: against one device; `cfg`'s batch
    size and sequence length where they are not refpar's defaults."""
    mesh = ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes[a] > 1) or "dp=1"
    args = ["--mesh", mesh, "--steps", str(steps), "--model", preset,
            "--microbatches", str(plan.microbatches)]
    if plan.fsdp:
        args.append("--fsdp")
    elif plan.zero:
        args += ["--zero", str(plan.zero)]
    if plan.sp:
        args.append("--sp")
    if plan.cp_algo is not None:
        args += ["--cp-algo", plan.cp_algo]
    if plan.schedule is not None:
        args += ["--schedule", plan.schedule]
    if plan.chunks is not None:
        args += ["--chunks", str(plan.chunks)]
    if moe:
        args += ["--moe-experts", str(MOE["moe_experts"]), "--moe-topk", str(MOE["moe_top_k"])]
    if cfg is not None and cfg.batch_size != TrainConfig().batch_size:
        args += ["--batch-size", str(cfg.batch_size)]
    if cfg is not None and cfg.seq_len != TrainConfig().seq_len:
        args += ["--seq-len", str(cfg.seq_len)]
    return args + ["--check"] * check
