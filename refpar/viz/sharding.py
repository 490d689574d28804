"""Which rank holds which slice of which tensor, step by step through one training step.

Every grid here is computed with the function the strategy itself uses to place data, so the
colours are refpar's layout, not a drawing of it:

    DP, ZeRO-1/2/3, FSDP   the parameter's unit (`holdings.units`) cut by `shard_range(Ψ_u, n, rank)`
    TP                     `tp_param_slices(config, t, rank)` (refpar/holdings.py)
    SP                     `sp_layout`'s residual rows: `shard_range(T, t, rank)`
    EP                     `owned_experts(E, ep, rank)` and the model's own `router_forward`

A cell's value is the rank that holds it, EVERY when every rank holds a copy, NOBODY when no rank
holds it at that moment (a gradient not computed yet, a gathered copy already freed).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from refpar.config import ConfigError, ModelConfig
from refpar.holdings import names, tp_param_slices, units
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import MOE, init_params, param_shapes
from refpar.model.routing import router_forward
from refpar.parallel.expert_parallel import owned_experts
from refpar.parallel.sequence_parallel import check_sp
from refpar.parallel.tensor_parallel import check_tp
from refpar.sharding import shard_range
from refpar.viz.pipeline import CONTROLS_MARGIN, play_controls

EVERY, NOBODY = -1, -2
MAX_RANKS = 8  # more colours than this cannot be told apart on screen
RANK_COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]

# Small enough to draw every element, with 8 heads and 8 experts so tp and ep go up to 8.
DEMO_MODEL = ModelConfig(vocab_size=32, n_positions=16, n_embd=16, n_head=8, n_layer=2, dropout=0.0)
DEMO_MOE_MODEL = replace(DEMO_MODEL, moe_experts=8)
# Its Llama twin: 8 query heads over 2 kv heads, so from tp = 4 on each kv head is on tp / 2 ranks.
DEMO_LLAMA = ModelConfig(arch="llama", vocab_size=32, n_positions=16, n_embd=16, n_head=8, n_kv_head=2,
                         n_layer=2, intermediate_size=32, dropout=0.0)
DEMO_SEQ = 16


def block_weights(layer: int = 0, config: ModelConfig = DEMO_MODEL) -> list[str]:
    """The four weight matrices of a block the sharding view draws (holdings.Names.drawn): GPT-2's, or
    Llama's q_proj and k_proj (v_proj is laid out as k_proj), gate_proj (up_proj alike) and down_proj."""
    fam = names(config)
    if not fam.drawn:
        raise ConfigError(f"the sharding view draws no {fam.title} block yet; choose a GPT-2 or Llama model")
    return [f"{fam.block_prefix}{layer}.{w}" for w in fam.drawn]


def flat_owner_grid(config: ModelConfig, n: int, name: str) -> np.ndarray:
    """The dp rank whose flat shard of the parameter's unit holds each element (ZeRO and FSDP)."""
    shapes = param_shapes(config)
    names = next(names for names in units(list(shapes)).values() if name in names)
    start = sum(int(np.prod(shapes[n])) for n in names[:names.index(name)])  # where it sits in the unit
    size = sum(int(np.prod(shapes[n])) for n in names)
    bounds = [shard_range(size, n, r)[1] for r in range(n)]  # shard r is [bounds[r-1], bounds[r])
    owners = np.searchsorted(bounds, np.arange(start, start + int(np.prod(shapes[name]))), side="right")
    return owners.reshape(shapes[name])


def tp_owner_grid(config: ModelConfig, t: int, name: str) -> np.ndarray:
    """The tp rank holding each element of the full parameter; EVERY where it is replicated."""
    grid = np.full(param_shapes(config)[name], EVERY)
    for rank in range(t):
        slices = tp_param_slices(config, t, rank)
        if name in slices:
            axis, index = slices[name]
            grid[(slice(None),) * axis + (index,)] = rank
    return grid


@dataclass(frozen=True)
class Step:
    """One moment of the training step: a label, what moves now, and the grids (name -> ranks)."""

    label: str
    moves: str
    grids: dict[str, dict[str, np.ndarray]]  # panel row -> tensor name -> holder grid


def check_ranks(n: int) -> None:
    if not 1 <= n <= MAX_RANKS:
        raise ConfigError(f"{n} ranks cannot be told apart on screen; choose 1 to {MAX_RANKS}")


def weight_steps(strategy: str, n: int, config: ModelConfig = DEMO_MODEL) -> list[Step]:
    """Params, grads and optimizer state of block 0's weights at each moment of one step, for DP,
    ZeRO-1/2/3, FSDP (over n dp ranks) or TP (over n tp ranks)."""
    check_ranks(n)
    names = block_weights(0)
    if strategy == "tp":
        check_tp(config, n)
        owner = {w: tp_owner_grid(config, n, w) for w in names}
    elif strategy in ("dp", "zero1", "zero2", "zero3", "fsdp"):
        owner = {w: flat_owner_grid(config, n, w) for w in names}
    else:
        raise ConfigError(f"no weight layout for {strategy!r}; choose one of dp, zero1, zero2, zero3, "
                          "fsdp, tp")
    every = {w: np.full(g.shape, EVERY) for w, g in owner.items()}
    nobody = {w: np.full(g.shape, NOBODY) for w, g in owner.items()}
    rest = every if strategy == "dp" else owner  # optimizer state
    moments = [("before the step", "idle", None), ("forward h.0", "fwd", 0), ("forward h.1", "fwd", 1),
               ("backward h.1", "bwd", 1), ("backward h.0", "bwd", 0), ("gradient sync", "sync", None),
               ("optimizer step", "opt", None), ("after the step", "after", None)]
    sharded = "each rank updates the optimizer state and parameters of its own shard"
    quiet = {"idle": "nothing moves", "fwd": "compute only, no communication",
             "bwd": "compute only, no communication", "sync": "nothing to sync", "opt": sharded,
             "after": "nothing moves: ready for the next step"}
    moves = {
        "dp": {"sync": "all-reduce of every gradient over dp: 2(N-1)/N·Ψ bytes per rank",
               "opt": "every rank applies the same update to its whole copy"},
        "zero1": {"sync": "reduce-scatter of the gradients: each rank keeps the sum over ranks of its "
                          "shard", "after": "all-gather of the updated parameter shards"},
        "zero2": {"bwd": "the unit's gradient is reduce-scattered as soon as its backward ends",
                  "sync": "nothing left: each unit was reduce-scattered after its backward",
                  "after": "all-gather of the updated parameter shards"},
        "zero3": {"fwd": "all-gather the block's parameters, compute, free them",
                  "bwd": "all-gather again, compute, reduce-scatter the gradient, free",
                  "sync": "nothing left: each unit was reduce-scattered after its backward"},
        "tp": {"fwd": "column split (c_attn, c_fc) needs no communication; the row split (c_proj) "
                      "ends in an all-reduce of the activations",
               "bwd": "the backward all-reduces the input gradient before each column-split layer",
               "sync": "nothing to sync: each rank holds the whole gradient of its own slice"},
    }
    moves["fsdp"] = moves["zero3"]
    steps = []
    for label, phase, layer in moments:
        gathered = phase in ("fwd", "bwd") and layer == 0
        if strategy in ("zero3", "fsdp"):
            params = every if gathered else owner
        elif strategy in ("zero1", "zero2") and phase == "opt":
            params = owner  # only the owner has updated its shard until the all-gather
        else:
            params = owner if strategy == "tp" else every
        if phase in ("idle", "fwd") or (phase == "bwd" and layer == 1):
            grads = nobody  # block 0's gradient is computed by its own backward, last
        elif phase == "bwd" and strategy in ("dp", "zero1"):
            grads = every  # each rank's own full gradient, not yet summed over ranks
        else:
            grads = every if strategy == "dp" else owner
        text = moves[strategy].get(phase, quiet[phase])
        steps.append(Step(label, text, {"params": params, "grads": grads, "optimizer": rest}))
    return steps


def sp_steps(t: int, seq_len: int = DEMO_SEQ, config: ModelConfig = DEMO_MODEL) -> list[Step]:
    """The activations (T, C) of one block under sequence parallelism over t tp ranks: the residual
    stream holds `shard_range(T, t, rank)` rows (sp_layout's resid_pos), regions the whole sequence."""
    check_ranks(t)
    check_sp(config, seq_len, t)
    rows = np.zeros(seq_len, dtype=int)
    for rank in range(t):
        rows[slice(*shard_range(seq_len, t, rank))] = rank
    sharded = np.repeat(rows[:, None], config.n_embd, axis=1)  # (T, C)
    full = np.full(sharded.shape, EVERY)
    x = "activation (T, C)"
    return [
        Step("ln_1 (residual stream)", "LayerNorm and dropout run on each rank's rows of the sequence",
             {"activations": {x: sharded}}),
        Step("attention region", "all-gather along the sequence: every rank sees all T tokens "
             "(its own heads)", {"activations": {x: full}}),
        Step("attention out", "reduce-scatter along the sequence: sum the heads' partial outputs, "
             "keep one's rows", {"activations": {x: sharded}}),
        Step("MLP region", "all-gather along the sequence again for c_fc's input",
             {"activations": {x: full}}),
        Step("MLP out", "reduce-scatter: back to sequence shards", {"activations": {x: sharded}}),
    ]


def ep_steps(ep: int, tokens_per_rank: int = 8, config: ModelConfig = DEMO_MOE_MODEL,
             seed: int = 0) -> list[Step]:
    """Tokens (rows: the data rank they start on, columns: token) and where each one is: the
    router (refpar's `router_forward`, top-1) picks an expert, and the all-to-all takes the token
    to the ep rank that owns that expert (`owned_experts`), then back."""
    check_ranks(ep)
    E = config.moe_experts
    if E < ep:
        raise ConfigError(f"{E} experts cannot be spread over ep={ep} ranks; use ep <= {E}")
    owner_of = np.zeros(E, dtype=int)
    for rank in range(ep):
        owner_of[list(owned_experts(E, ep, rank))] = rank
    # The router sees the embedded tokens of refpar's own corpus, one sequence per data rank.
    params = init_params(config, seed)
    tokens, _ = MarkovCorpus(config.vocab_size, seed).batch(0, np.arange(ep), tokens_per_rank)  # (ep, T)
    x = (params["wte.weight"][tokens] + params["wpe.weight"][:tokens_per_rank]).reshape(-1, config.n_embd)
    w = params[MOE.router_name(0)]  # (C, E)
    experts = np.asarray(router_forward(x, w, 1)[2])[:, 0].reshape(ep, tokens_per_rank)
    home = np.repeat(np.arange(ep)[:, None], tokens_per_rank, axis=1)  # (ep, tokens)
    away = owner_of[experts]
    t = "tokens (source rank x token)"
    experts_row = {"experts (owner)": owner_of[None, :]}  # (1, E): which rank holds each expert

    def step(label: str, moves: str, where: np.ndarray) -> Step:
        return Step(label, moves, {"tokens": {t: where}, "experts": experts_row})

    return [
        step("tokens on their rank", "each rank routes its own tokens", home),
        step("dispatch (all-to-all)", "each token goes to the rank that owns its expert", away),
        step("experts compute", "every rank runs only the experts it owns", away),
        step("combine (all-to-all)", "outputs return to the token's own rank", home),
    ]


def expert_owners(ep: int, config: ModelConfig = DEMO_MOE_MODEL) -> list[int]:
    """The ep rank that owns each expert (the legend of the EP view)."""
    return [r for e in range(config.moe_experts) for r in range(ep)
            if e in owned_experts(config.moe_experts, ep, r)]


def steps_for(strategy: str, n: int) -> list[Step]:
    if strategy == "sp":
        return sp_steps(n)
    if strategy == "ep":
        return ep_steps(n)
    return weight_steps(strategy, n)


def _colorscale(n: int) -> list:
    """Discrete colours for NOBODY (white), EVERY (grey) and ranks 0..n-1, on zmin=-2, zmax=n-1."""
    colours = ["#ffffff", "#9e9e9e"] + RANK_COLOURS[:n]
    k = len(colours)
    return [[edge, c] for i, c in enumerate(colours) for edge in (i / k, (i + 1) / k)]


def _heatmaps(step: Step, n: int) -> list[go.Heatmap]:
    traces = []
    for row in step.grids.values():
        for name, grid in row.items():
            traces.append(go.Heatmap(z=grid, zmin=-2.5, zmax=n - 0.5, colorscale=_colorscale(n),
                                     showscale=False, xgap=0.5, ygap=0.5, name=name,
                                     hovertemplate=f"{name}[%{{y}}, %{{x}}]: %{{z}}<extra></extra>"))
    return traces


FRAME_MS = 1000  # a frame a second: each moment's narration is a sentence to read


def wrapped(text: str, width: int = 80) -> str:
    """A figure title broken into lines of at most `width` characters (Plotly never wraps one, and
    cuts it at the figure's right edge)."""
    return "<br>".join(textwrap.wrap(text, width))


def panels_figure(steps: list[Step], heatmaps, legend: list[tuple[str, str]], title: str, spacing: float,
                height: tuple[int, int], at: int = 0, **layout) -> go.Figure:
    """One heatmap per (panel row, tensor), a frame per step with a slider and Play, opening on step
    `at` (the first: a learner starts before the step, as the narration does) and playing a frame a
    second, slow enough to read what moves; `heatmaps(step)` gives a step's traces in panel order,
    `legend` the (label, colour) squares, `height` the pixels per panel row and around them."""
    grids = steps[-1].grids
    rows = list(grids)
    cols = max(len(r) for r in grids.values())
    # On two lines ("optimizer:" over "attn.c_attn"): one line is wider than a narrow panel, and
    # the first panel's title then runs off the figure's left edge.
    titles = [f"{row}:<br>{'.'.join(n.split('.')[2:]) if n.startswith('h.') else n.removeprefix('model.')}"
              for row in rows for n in grids[row]]
    # Rows as tall as their tallest tensor (at least a quarter of the tallest row) so cells stay square-ish.
    tall = [max(np.shape(g)[0] for g in grids[row].values()) for row in rows]
    fig = make_subplots(rows=len(rows), cols=cols, subplot_titles=titles, horizontal_spacing=0.04,
                        vertical_spacing=spacing, row_heights=[max(h, max(tall) / 4) for h in tall])
    cells = [(r, c, np.shape(g)) for r, row in enumerate(rows) for c, g in enumerate(grids[row].values())]
    for (r, c, shape), trace in zip(cells, heatmaps(steps[at]), strict=True):
        fig.add_trace(trace, row=r + 1, col=c + 1)
        axis = "" if r == c == 0 else str(r * cols + c + 1)
        fig.layout[f"xaxis{axis}"].update(range=[-0.5, shape[1] - 0.5], autorange=False, showticklabels=False)
        fig.layout[f"yaxis{axis}"].update(range=[shape[0] - 0.5, -0.5], autorange=False, showticklabels=False)
    fig.frames = [go.Frame(name=s.label, data=heatmaps(s), traces=list(range(len(cells))),
                           layout={"title": {"text": wrapped(f"{title}{s.label}: {s.moves}")}})
                  for s in steps]
    for label, colour in legend:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label, showlegend=True,
                                 marker={"symbol": "square", "size": 12, "color": colour,
                                         "line": {"color": "#666", "width": 1}}), row=1, col=1)
    fig.update_annotations(font_size=12)  # the panel titles
    fig.update_layout(title=wrapped(f"{title}{steps[at].label}: {steps[at].moves}"),
                      height=height[0] * len(rows) + height[1] + 35, margin={"b": CONTROLS_MARGIN, "t": 110},
                      **play_controls([s.label for s in steps], "", active=at, frame_ms=FRAME_MS), **layout)
    return fig


def sharding_figure(steps: list[Step], n: int, title: str = "", at: int = 0) -> go.Figure:
    """Colour = the rank that holds the element; grey = every rank holds a copy; white = nobody
    holds it now."""
    legend = zip(["nobody", "every rank"] + [f"rank {r}" for r in range(n)],
                 ["#ffffff", "#9e9e9e"] + RANK_COLOURS[:n], strict=True)
    return panels_figure(steps, lambda s: _heatmaps(s, n), list(legend), title, 0.12, (260, 120), at)
