"""`refpar schedule KIND --stages P --microbatches M [--chunks V] [--json]`

Prints a pipeline schedule as a ranks x ticks grid and its simulated bubble, e.g.

    refpar schedule 1f1b --stages 4 --microbatches 8
    refpar schedule interleaved-1f1b --stages 4 --microbatches 8 --chunks 2 --json
"""

from __future__ import annotations

import json
import math

from refpar.config import ConfigError, check_output_path
from refpar.parallel.pipeline import schedules as S

HELP = "print a pipeline schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2) and its bubble"
# The largest schedule the command builds: its summary walks every (rank, tick) cell several times,
# and 64 stages x 256 microbatches (p x m = 16,384; measured about 7 s for zb-h2 and 1f1b on this
# project's 2-core machine) is already wider than a terminal can show.
MAX_STAGES, MAX_CELLS = 256, 1 << 14


def add_arguments(parser) -> None:
    parser.add_argument("kind", metavar="KIND", help=f"one of {', '.join(S.BUILDERS)}")
    parser.add_argument("--stages", "-p", type=int, required=True, help="pipeline ranks p")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches m")
    parser.add_argument("--chunks", "-v", type=int, default=None,
                        help="model chunks per rank v (interleaved-1f1b; default 2)")
    parser.add_argument("--cost-f", type=float, default=1.0, help="duration of a forward (1)")
    parser.add_argument("--cost-b", type=float, default=1.0,
                        help="duration of an input-gradient backward (1); a full backward costs B + W")
    parser.add_argument("--cost-w", type=float, default=1.0, help="duration of a weight gradient (1)")
    parser.add_argument("--cost-p2p", type=float, default=0.0, help="duration of one transfer (0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--figure", metavar="PATH", default=None,
                        help="also write the simulated timeline as an HTML figure")


def summary(kind: str, p: int, m: int, v: int, costs: S.Costs) -> dict:
    """Everything the command prints, as data (the app uses it too)."""
    schedule = S.build(kind, p, m, v)
    timeline = S.simulate(schedule, costs)
    peaks = S.peak_inflight_microbatches(schedule)  # {rank: count}, for every rank at once
    return {
        "kind": kind, "stages": p, "microbatches": m, "chunks": v,
        "costs": {"F": costs.F, "B": costs.B, "W": costs.W, "p2p": costs.p2p},
        "grid": [[None if a is None else str(a) for a in schedule[r]] for r in sorted(schedule)],
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "bubble_over_ideal": timeline.bubble_over_ideal,
        # what remains when steps run back to back: idle between each rank's first and last action
        "steady_bubble_fraction": sum(map(timeline.inner_idle_time, schedule))
        / (len(schedule) * timeline.makespan),
        "published_bubble_fraction": S.published_bubble_fraction(kind, p, m, v),
        "peak_inflight_microbatches": [peaks[r] for r in sorted(schedule)],
    }


def run(args) -> int:
    costs = S.Costs(args.cost_f, args.cost_b, args.cost_w, args.cost_p2p)
    for name, value in (("--cost-f", costs.F), ("--cost-b", costs.B), ("--cost-w", costs.W)):
        if not 0 < value < math.inf:  # nan too
            raise ConfigError(f"{name} {value:g} must be positive and finite; give a duration, e.g. {name} 1")
    if not 0 <= costs.p2p < math.inf:
        raise ConfigError(f"--cost-p2p {costs.p2p:g} must be a finite duration of 0 or more")
    v = args.chunks if args.chunks is not None else (2 if args.kind == "interleaved-1f1b" else 1)
    p, m = args.stages, args.microbatches
    # Only sizes the builders would take: a wrong kind, size or chunk count gets their own sentence.
    buildable = args.kind in S.BUILDERS and min(p, m, v) >= 1 and (v == 1 or args.kind == "interleaved-1f1b")
    if buildable and (p > MAX_STAGES or p * m * v > MAX_CELLS):
        raise ConfigError(f"p={p} stages x m={m} microbatches x v={v} chunks "
                          f"is more than a grid can show (simulating it takes minutes); keep p <= "
                          f"{MAX_STAGES} and p x m x v <= {MAX_CELLS:,}, e.g. -p 64 -m 256")
    if args.figure is not None:
        check_output_path("--figure", args.figure)
    out = summary(args.kind, args.stages, args.microbatches, v, costs)
    if args.figure:
        from refpar.viz.pipeline import gantt_figure

        title = f"{args.kind}, p={args.stages}, m={args.microbatches}" + (f", v={v}" if v > 1 else "")
        timeline = S.simulate(S.build(args.kind, args.stages, args.microbatches, v), costs)
        gantt_figure(timeline, title).write_html(args.figure, include_plotlyjs=True)
    if args.json:
        print(json.dumps(out), flush=True)
        return 0
    schedule = S.build(args.kind, args.stages, args.microbatches, v)
    print(f"{args.kind}: p={args.stages} ranks, m={args.microbatches} microbatches, v={v} chunks "
          "per rank; each column is one tick when every action takes one", flush=True)
    print(S.format_grid(schedule))
    print(f"simulated with F={costs.F:g} B={costs.B:g} W={costs.W:g} p2p={costs.p2p:g} (a full "
          f"backward costs B+W): makespan {out['makespan']:g}")
    print(f"bubble: {out['bubble_fraction']:.2%} of all rank-time, "
          f"{out['bubble_over_ideal']:.2%} of compute time, "
          f"{out['steady_bubble_fraction']:.2%} in steady state (between each rank's first and "
          "last action)")
    if out["published_bubble_fraction"] is not None:
        print(f"published closed form (uniform costs F=B=W): "
              f"{out['published_bubble_fraction']:.2%} of all rank-time")
    print("peak in-flight microbatches per rank: "
          + " ".join(map(str, out["peak_inflight_microbatches"])), flush=True)
    return 0
