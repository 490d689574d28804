"""The schedules of the papers on p ranks, one stage per rank (interleaved: v), each returned as a
grid (simulate.unit_grid): each action at the tick where it can start when every action takes one
tick and transfers are free, so formats.format_grid draws the unit-cost picture of the papers.

    gpipe(p, m)                 Huang et al. 2019: all forwards, then all backwards.
    one_f_one_b(p, m)           Narayanan et al. 2019 (PipeDream-flush): p-rank-1 warm-up forwards,
                                then one forward, one backward.
    interleaved_1f1b(p, m, v)   Narayanan et al. 2021: v chunks per rank, Megatron-LM's order.
    zb_h1(p, m), zb_h2(p, m)    Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.
    zbv, v-half, v-min, dualpipev, dualpipe   two stages per rank: builders_v.py.

`build(kind, p, m, v)` builds any of them by the name `refpar schedule KIND` takes (`BUILDERS`);
`of_plan(plan, p)` gives the schedule a run's plan asks for. `refpar schedule 1f1b -p 3 -m 4` prints:

    tick    0   1   2   3   4   5   6   7   8   9   10  11
    rank 0  0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3
    rank 1  .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .
    rank 2  .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .
"""

from __future__ import annotations

from collections.abc import Callable

from refpar.config import ConfigError
from refpar.schedules import Action, Schedule, StageMap, check_sizes
from refpar.schedules.builders_v import dualpipe, dualpipev, v_half, v_min, zbv
from refpar.schedules.formats import from_csv
from refpar.schedules.simulate import unit_grid

ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1", "zb-h2")  # the others hold 2 (or v) stages per rank


def gpipe(p: int, m: int) -> Schedule:
    check_sizes(p, m)
    return unit_grid({r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                      for r in range(p)})


def one_f_one_b(p: int, m: int) -> Schedule:
    """Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and one backward,
    so it holds at most min(p-r, m) microbatches' activations (GPipe holds m)."""
    check_sizes(p, m)
    orders = {}
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Action(r, "F", i) for i in range(warm)]
        for k in range(m - warm):
            order += [Action(r, "F", warm + k), Action(r, "B", k)]
        orders[r] = order + [Action(r, "B", k) for k in range(m - warm, m)]
    return unit_grid(orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved order (schedules.py, forward_backward_pipelining_with_interleaving):
    microbatches go through a rank's chunks in groups of p; rank r warms up with
    2(p-r-1) + (v-1)p forwards (all of them when m == p), then alternates."""
    check_sizes(p, m)
    if v < 2:
        raise ConfigError(f"interleaved 1F1B needs at least 2 chunks per rank, got v={v}; use "
                          "--chunks 2 or more, or the 1f1b schedule")
    if m % p:
        raise ConfigError(f"interleaved 1F1B needs the microbatches divisible by the stages (m={m}, "
                          f"p={p}); use m in {{{p}, {2 * p}, {3 * p}}}")
    total = m * v

    def action(k: int, kind: str, rank: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        return Action(chunk * p + rank, kind, group * p + within % p)

    orders = {}
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [action(k, "F", r) for k in range(warm)]
        for k in range(total - warm):
            order += [action(warm + k, "F", r), action(k, "B", r)]
        orders[r] = order + [action(k, "B", r) for k in range(total - warm, total)]
    return unit_grid(orders)


def zb_h1(p: int, m: int) -> Schedule:
    """1F1B with the backward split: rank r runs B as soon as it can and delays each W by r
    microbatches, so the W's fill the cool-down. Rank r holds full activations for at most p-r
    microbatches, as in 1F1B, and W inputs for up to r more: p in flight on every rank, 1F1B's
    peak (Qi et al., Table 2: p M_B). Bubble (p-1)(F+B-W) per rank instead of 1F1B's (p-1)(F+B+W).
    """
    check_sizes(p, m)
    orders = {}
    for r in range(p):
        warm, lag = min(p - r, m), r
        order = [Action(r, "F", i) for i in range(warm)]
        for k in range(m):
            order.append(Action(r, "B", k))
            if k >= lag:
                order.append(Action(r, "W", k - lag))
            if warm + k < m:
                order.append(Action(r, "F", warm + k))
        orders[r] = order + [Action(r, "W", i) for i in range(max(0, m - lag), m)]
    return unit_grid(orders)


def zb_h2(p: int, m: int) -> Schedule:
    """Qi et al.'s ZB-H2 by their greedy rule (section 3): rank r may hold 2(p-r)-1 forwards
    awaiting B and 2p-1 awaiting W; each tick it runs a ready B, else a ready allowed F, else the
    oldest pending W. With m >= 2p-1 and F = B = W no rank idles between its first and last
    action, so back-to-back steps have no bubble."""
    check_sizes(p, m)
    smap = StageMap({r: r for r in range(p)}, m, frozenset((r, i) for r in range(p) for i in range(m)))
    grid: Schedule = {r: [] for r in range(p)}
    finished: dict[Action, int] = {}
    n_f, n_b, n_w = [0] * p, [0] * p, [0] * p
    tick = 0

    def ready(a: Action) -> bool:  # inputs finished at an earlier tick
        return all(finished.get(n, tick) < tick for n in smap.inputs(a))

    while sum(n_w) < p * m:
        chosen: list[Action | None] = []
        for r in range(p):
            b, f, w = Action(r, "B", n_b[r]), Action(r, "F", n_f[r]), Action(r, "W", n_w[r])
            if n_b[r] < m and ready(b):
                chosen.append(b)
            elif (n_f[r] < m and ready(f) and n_f[r] - n_b[r] < 2 * (p - r) - 1
                  and n_f[r] - n_w[r] < 2 * p - 1):
                chosen.append(f)
            elif n_w[r] < n_b[r]:
                chosen.append(w)
            else:
                chosen.append(None)
        for r, a in enumerate(chosen):
            grid[r].append(a)
            if a is not None:
                finished[a] = tick
                counter = {"F": n_f, "B": n_b, "W": n_w}[a.kind]
                counter[r] += 1
        tick += 1
    return grid


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "v-half": v_half,
    "v-min": v_min,
    "dualpipev": dualpipev,
    "dualpipe": dualpipe,
}


def default_chunks(kind: str) -> int:
    """Stages per rank when none is asked for: 2 for interleaved 1F1B (any v >= 2 works) and for
    the V-shaped and bidirectional schedules (always 2), 1 for the others."""
    return 1 if kind in ONE_STAGE_PER_RANK else 2


def model_parts(kind: str, p: int, v: int | None = None) -> int:
    """How many parts a schedule cuts the model into: its p x v stages (v free for interleaved
    1F1B only), or DualPipe's p (each of its two copies runs the whole model over the p ranks)."""
    if kind == "dualpipe":
        return p
    return p * (v if kind == "interleaved-1f1b" and v is not None else default_chunks(kind))


def of_plan(plan, p: int) -> Schedule:
    """The schedule a refpar.config.Plan runs on p pipeline ranks: read from its CSV (torch's
    format, `from_csv`), or built by its kind."""
    if plan.schedule_csv is not None:
        return from_csv(plan.schedule_csv)
    return build(plan.kind, p, plan.microbatches, plan.chunks)


def build(kind: str, p: int, m: int, v: int | None = None) -> Schedule:
    """`build("1f1b", 4, 8)`; `v`, the stages per rank, is free for interleaved-1f1b only (default
    2); the others have default_chunks(kind)."""
    if kind not in BUILDERS:
        raise ConfigError(f"unknown schedule {kind!r}; choose one of {', '.join(BUILDERS)}")
    v = default_chunks(kind) if v is None else v
    if kind == "interleaved-1f1b":
        return interleaved_1f1b(p, m, v)
    if v != default_chunks(kind):
        if default_chunks(kind) == 1:
            raise ConfigError(f"--chunks {v} applies to interleaved-1f1b only; drop it for {kind}")
        raise ConfigError(f"{kind} places two stages on every rank (stages r and 2p-1-r), not {v}; "
                          "drop --chunks or give --chunks 2")
    return BUILDERS[kind](p, m)
