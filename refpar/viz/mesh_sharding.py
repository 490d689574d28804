"""Which ranks hold each slice of block 0's tensors under a two-axis mix: dp x tp with ZeRO stage 0,
1 or 3 over dp, optionally with sequence parallelism on the tp axis (tp x sp).

The placement is composed from refpar's own functions, in the order the engine applies them:

    tp split    shard_params_tp(full, config, tp, tp_rank) (refpar/parallel/tensor_parallel.py)
    dp split    ZeRO-1 and ZeRO-3: shard_range(Ψ_u, dp, dp_rank) of each unit of the rank's tp
                shards (holdings.units: wte alone, the root, one per block; refpar/parallel/
                zero.py); ZeRO-0: nothing split
    sp rows     shard_range(T, tp, tp_rank) of the residual stream (sp_layout's resid_pos)
    ranks       arange(dp * tp).reshape(dp, tp): refpar/mesh.py's order with pp = ep = cp = 1

`pp_tp_steps` draws the other mix, pp x tp: every block's weights on the ranks of the stage that
owns the block (refpar/parallel/pipeline/stage.py's `stage_layers`), cut by tp within the stage,
ranks arange(pp * tp).reshape(pp, tp).

The tp split is taken of a "model" whose every element is its own index, so what a rank ends up
holding is read off as element ids, not re-derived. A cell's value is an index into the figure's
list of holder sets (`layout.meta["holders"]`); its colour is that set's, white for nobody.

`mix_steps` walks one training step as the single-strategy views do (refpar.viz.sharding's
`weight_steps`): ZeRO-3 gathers block 0's tp shards over dp around its forward and backward and frees
them after; gradients appear with block 0's backward and are cut over dp by ZeRO's reduce-scatter.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from refpar.config import ConfigError, ModelConfig
from refpar.holdings import names as family_names
from refpar.holdings import stage_layers, tied_embedding, units
from refpar.model import param_shapes
from refpar.parallel.sequence_parallel import check_sp
from refpar.parallel.tensor_parallel import check_tp, shard_params_tp
from refpar.sharding import shard_range
from refpar.viz.sharding import (
    DEMO_MODEL,
    DEMO_SEQ,
    MAX_RANKS,
    RANK_COLOURS,
    Step,
    block_weights,
    panels_figure,
)

ZERO_STAGES = (0, 1, 3)
# Sets of two or more ranks; one rank keeps its RANK_COLOURS. Chosen greedily, each as far as it can be
# from the ranks' colours, white (nobody) and the sets before it: at least 108 apart in RGB (0-255 a
# channel), where Pastel1's first was 25 from rank 6's pink and could not be told from it.
GROUP_COLOURS = ["#000000", "#fe00fa", "#0df9ff", "#00fe35", "#ffff33", "#511cfb", "#750d86", "#0d2a63"]


def mesh_ranks(dp: int, tp: int) -> np.ndarray:
    return np.arange(dp * tp).reshape(dp, tp)  # (dp, tp)


def check_mix(config: ModelConfig, dp: int, tp: int, zero: int, sp: bool, seq_len: int) -> None:
    if zero not in ZERO_STAGES:
        raise ConfigError(f"ZeRO stage {zero} is not drawn here; choose one of 0, 1, 3")
    if not (dp >= 1 and tp >= 1 and dp * tp <= MAX_RANKS):
        raise ConfigError(f"dp={dp} x tp={tp} is {dp * tp} ranks; choose at most {MAX_RANKS} on screen")
    check_tp(config, tp)
    if sp:
        check_sp(config, seq_len, tp)


def ids_held(config: ModelConfig, dp: int, tp: int, zero: int, dp_rank: int, tp_rank: int,
             split_over_dp: bool) -> dict[str, np.ndarray]:
    """The element ids (flat indices into each full parameter) rank (dp_rank, tp_rank) holds: its tp
    shard, cut once more over dp as ZeRO `zero` cuts it when `split_over_dp`."""
    ids = {n: np.arange(int(np.prod(s))).reshape(s) for n, s in param_shapes(config).items()}
    local = shard_params_tp(ids, config, tp, tp_rank)  # (the ids of) this rank's tp shards
    if not (split_over_dp and zero > 0):
        return {n: w.ravel() for n, w in local.items()}
    held = {}
    for names in units(list(local), tied_embedding(config)).values():
        start, stop = shard_range(sum(local[n].size for n in names), dp, dp_rank)
        offset = 0
        for n in names:
            size = local[n].size
            held[n] = local[n].ravel()[max(start - offset, 0):max(min(stop - offset, size), 0)]
            offset += size
    return held


def holder_sets(config: ModelConfig, dp: int, tp: int, zero: int, split_over_dp: bool,
                names: list[str]) -> dict[str, np.ndarray]:
    """name -> (shape) array of tuples: the global ranks that hold each element."""
    ranks = mesh_ranks(dp, tp)
    holds = {n: np.zeros((dp * tp, int(np.prod(param_shapes(config)[n]))), dtype=bool) for n in names}
    for d in range(dp):
        for t in range(tp):
            held = ids_held(config, dp, tp, zero, d, t, split_over_dp)
            for n in names:
                holds[n][ranks[d, t], held[n]] = True
    out = {}
    for n, mask in holds.items():
        cells = np.empty(mask.shape[1], dtype=object)
        cells[:] = [tuple(np.flatnonzero(mask[:, i]).tolist()) for i in range(mask.shape[1])]
        out[n] = cells.reshape(param_shapes(config)[n])
    return out


def activation_sets(config: ModelConfig, dp: int, tp: int, sp: bool, seq_len: int) -> np.ndarray:
    """(T, C) tuples: who holds dp rank 0's residual stream (the same for every dp rank's own sample)."""
    group = mesh_ranks(dp, tp)[0]
    rows = np.empty(seq_len, dtype=object)
    for t in range(tp):
        a, b = shard_range(seq_len, tp, t) if sp else (0, seq_len)
        for i in range(a, b):
            rows[i] = (int(group[t]),) if sp else tuple(group.tolist())
    return np.repeat(rows[:, None], config.n_embd, axis=1)


def _nobody(shape: tuple) -> np.ndarray:
    grid = np.empty(shape, dtype=object)
    for i in range(grid.size):
        grid.flat[i] = ()  # the empty set of holders
    return grid


def mix_steps(dp: int, tp: int, zero: int, sp: bool = False, config: ModelConfig = DEMO_MODEL,
              seq_len: int = DEMO_SEQ) -> list[Step]:
    """Panel row -> tensor -> holder sets of block 0 at each moment of one training step."""
    check_mix(config, dp, tp, zero, sp, seq_len)
    names = block_weights(0, config)
    whole = holder_sets(config, dp, tp, zero, False, names)  # every dp replica holds its tp shard
    cut = holder_sets(config, dp, tp, zero, True, names)  # ZeRO's dp shard of it
    nobody = {n: _nobody(g.shape) for n, g in whole.items()}
    activations = {"residual (T, C)": activation_sets(config, dp, tp, sp, seq_len)}
    moments = [("before the step", "idle", None), ("forward h.0", "fwd", 0), ("forward h.1", "fwd", 1),
               ("backward h.1", "bwd", 1), ("backward h.0", "bwd", 0), ("gradient sync", "sync", None),
               ("optimizer step", "opt", None), ("after the step", "after", None)]
    row_split = " and ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in family_names(config).row_parallel))
    tp_note = f" (tp: an all-reduce of the activations after each row-split {row_split})" if tp > 1 else ""
    if config.n_kv_head is not None and tp > config.n_kv_head:  # Llama's grouped-query attention
        tp_note += (f"; each kv head's k_proj and v_proj rows are whole on {tp // config.n_kv_head} tp "
                    "ranks, whose gradients are summed over them")
    moves = {
        0: {"sync": "all-reduce of each tp shard's gradient over dp",
            "opt": "every dp replica applies the same update to its tp shard"},
        1: {"sync": "reduce-scatter of each tp shard's gradient over dp",
            "opt": "each rank updates its dp shard of its tp shard",
            "after": "all-gather of the updated shards over dp"},
        3: {"fwd": "all-gather the block's tp shards over dp, compute, free them",
            "bwd": "all-gather again, compute, reduce-scatter the block's gradient over dp, free",
            "sync": "nothing left: each unit was reduce-scattered after its backward",
            "opt": "each rank updates its dp shard of its tp shard"},
    }[zero]
    quiet = {"idle": "nothing moves", "fwd": f"compute{tp_note}", "bwd": f"compute{tp_note}",
             "sync": "nothing to sync", "opt": "", "after": "nothing moves: ready for the next step"}
    steps = []
    for label, phase, layer in moments:
        if zero == 3:
            params = whole if phase in ("fwd", "bwd") and layer == 0 else cut
        else:
            params = cut if zero == 1 and phase == "opt" else whole  # the owner's update, not yet gathered
        if phase in ("idle", "fwd") or (phase == "bwd" and layer == 1):
            grads = nobody  # block 0's gradient is computed by its own backward, last
        elif phase == "bwd" and zero < 3:
            grads = whole  # each rank's own gradient of its tp shard, not yet summed over dp
        else:
            grads = cut if zero else whole
        text = moves.get(phase, quiet[phase])
        steps.append(Step(label, text, {"params": params, "grads": grads, "optimizer": cut if zero else whole,
                                        "activations": activations}))
    return steps


def mix_grids(dp: int, tp: int, zero: int, sp: bool = False, config: ModelConfig = DEMO_MODEL,
              seq_len: int = DEMO_SEQ) -> dict[str, dict[str, np.ndarray]]:
    """Panel row -> tensor -> holder sets, at rest between steps: parameters (gathered copies
    freed), gradients and AdamW moments (after the gradient sync) and, under tp, the activations."""
    return mix_steps(dp, tp, zero, sp, config, seq_len)[-1].grids


def pp_tp_steps(pp: int, tp: int, config: ModelConfig = DEMO_MODEL) -> list[Step]:
    """One moment (at rest): panel row per block -> its weights -> holder sets on pp x tp ranks."""
    if not (pp >= 1 and tp >= 1 and pp * tp <= MAX_RANKS):
        raise ConfigError(f"pp={pp} x tp={tp} is {pp * tp} ranks; choose at most {MAX_RANKS} on screen")
    check_tp(config, tp)
    grids = {}
    for stage in range(pp):
        for block in stage_layers(config.n_layer, pp, stage):
            within = holder_sets(config, 1, tp, 0, False, block_weights(block, config))  # a stage's tp ranks
            grids[f"stage {stage}, h.{block}"] = {
                n: np.vectorize(lambda ts, s=stage: tuple(s * tp + t for t in ts), otypes=[object])(g)
                for n, g in within.items()}
    moves = "each stage holds only its blocks, split by tp; activations go stage to stage"
    return [Step("the model's blocks by stage", moves, grids)]


def _label(ranks: tuple) -> str:
    if not ranks:
        return "nobody"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _colour(ranks: tuple, k: int) -> str:
    if not ranks:
        return "#ffffff"
    return RANK_COLOURS[ranks[0]] if len(ranks) == 1 else GROUP_COLOURS[k % len(GROUP_COLOURS)]


def _heatmaps(grids: dict[str, dict[str, np.ndarray]], index: dict, scale: list) -> list[go.Heatmap]:
    traces = []
    for row in grids.values():
        for name, grid in row.items():
            z = np.vectorize(index.get, otypes=[int])(grid)
            text = np.vectorize(_label, otypes=[object])(grid)
            traces.append(go.Heatmap(z=z, zmin=-0.5, zmax=len(index) - 0.5, colorscale=scale, showscale=False,
                                     xgap=0.5, ygap=0.5, name=name, text=text,
                                     hovertemplate=f"{name}[%{{y}}, %{{x}}]: %{{text}}<extra></extra>"))
    return traces


def mix_figure(steps: list[Step], title: str = "", at: int = 0) -> go.Figure:
    """One heatmap per (panel row, tensor), a frame per step with a slider and Play, opening on step
    `at` (panels_figure); z indexes `layout.meta["holders"]`, coloured per set."""
    grids_seen = [g for step in steps for row in step.grids.values() for g in row.values()]
    sets = sorted({s for g in grids_seen for s in g.ravel()}, key=lambda s: (len(s), s))
    index = {s: i for i, s in enumerate(sets)}
    multi = {s: k for k, s in enumerate(s for s in sets if len(s) > 1)}
    colours = [_colour(s, multi.get(s, 0)) for s in sets]
    k = len(sets)
    scale = [[edge, c] for i, c in enumerate(colours) for edge in (i / k, (i + 1) / k)]
    legend = [(_label(s), colour) for s, colour in zip(sets, colours, strict=True)]
    return panels_figure(steps, lambda s: _heatmaps(s.grids, index, scale), legend, title, 0.08, (240, 160),
                         at, meta={"holders": [list(s) for s in sets]})
