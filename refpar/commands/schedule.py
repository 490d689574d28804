"""`refpar schedule KIND --stages P --microbatches M [--chunks V] [--json] [--csv]`,
`refpar schedule --from-csv FILE`

Prints a pipeline schedule as a ranks x ticks grid and its simulated bubble, e.g.

    refpar schedule 1f1b --stages 4 --microbatches 8
    refpar schedule interleaved-1f1b --stages 4 --microbatches 8 --chunks 2 --json
    refpar schedule zbv -p 4 -m 8 --csv > zbv.csv      # torch.distributed.pipelining's CSV
    refpar schedule --from-csv zbv.csv                  # validate, simulate and draw a CSV schedule
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from refpar.config import ConfigError, add_overwrite_argument, check_output_path
from refpar.reading import read_bounded, shown
from refpar.schedules import Schedule, ScheduleError
from refpar.schedules.builders import BUILDERS, build, default_chunks
from refpar.schedules.formats import MAX_CSV_CHARS, format_grid, from_csv, to_csv
from refpar.schedules.published import published_bubble_fraction, published_idle, published_peak
from refpar.schedules.simulate import (
    OVERLAP_COSTS,
    Costs,
    peak_inflight_microbatches,
    simulate,
    validate,
)

HELP = ("print a pipeline schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv, v-half, v-min, "
        "dualpipev, dualpipe, or one read from torch's CSV) and its bubble")
# The largest schedule the command builds: its summary walks every (rank, tick) cell several times,
# and 64 stages x 256 microbatches (p x m = 16,384; measured about 7 s for zb-h2 and 1f1b on this
# project's 2-core machine) is already wider than a terminal can show.
MAX_STAGES, MAX_CELLS = 256, 1 << 14


def add_arguments(parser) -> None:
    parser.add_argument("kind", metavar="KIND", nargs="?", default=None,
                        help=f"one of {', '.join(BUILDERS)} (or give --from-csv)")
    parser.add_argument("--stages", "-p", type=int, default=None, help="pipeline ranks p")
    parser.add_argument("--microbatches", "-m", type=int, default=None, help="microbatches m")
    parser.add_argument("--chunks", "-v", type=int, default=None,
                        help="stages per rank v (interleaved-1f1b: default 2; the V schedules hold 2)")
    parser.add_argument("--cost-f", type=float, default=1.0, help="duration of a forward (1)")
    parser.add_argument("--cost-b", type=float, default=1.0,
                        help="duration of an input-gradient backward (1); a full backward costs B + W")
    parser.add_argument("--cost-w", type=float, default=1.0, help="duration of a weight gradient (1)")
    parser.add_argument("--cost-p2p", type=float, default=0.0, help="duration of one transfer (0)")
    parser.add_argument("--cost-overlap", choices=OVERLAP_COSTS, default="sum",
                        help="an overlapped F&B (dualpipe, dualpipev) costs F + B (sum, the default: "
                             "run one after the other) or max(F, B) (max: each hides the other)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--csv", action="store_true",
                        help="print the schedule as torch.distributed.pipelining's CSV instead "
                             "(one row per rank, cells like 0F0, empty for an idle tick)")
    parser.add_argument("--from-csv", metavar="FILE", default=None,
                        help="read the schedule from torch's CSV instead of building KIND")
    parser.add_argument("--figure", metavar="PATH", default=None,
                        help="also write the simulated timeline as an HTML figure")
    add_overwrite_argument(parser)


def summary(kind: str, p: int, m: int, v: int, costs: Costs) -> dict:
    """Everything the command prints for a built schedule, as data (the app uses it too)."""
    return describe(build(kind, p, m, v), costs, kind)


def describe(schedule: Schedule, costs: Costs, kind: str | None = None) -> dict:
    """What the command prints about a valid schedule: `kind` names its builder, None for one
    read from a file (which then has no published closed form to compare with)."""
    lay = validate(schedule)
    timeline = simulate(schedule, costs)
    p, m = len(schedule), lay.n_microbatches
    v = lay.n_stages // p
    published = None if kind is None else published_idle(kind, p, m, costs)
    peaks = peak_inflight_microbatches(schedule)  # {rank: count}, for every rank at once
    return {
        "kind": kind, "stages": p, "microbatches": m, "chunks": v,
        "costs": {"F": costs.F, "B": costs.B, "W": costs.W, "p2p": costs.p2p, "overlap": costs.overlap},
        "grid": [[None if a is None else str(a) for a in schedule[r]] for r in sorted(schedule)],
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "bubble_over_ideal": timeline.bubble_over_ideal,
        # what remains when steps run back to back: idle between each rank's first and last action
        "steady_bubble_fraction": sum(map(timeline.inner_idle_time, schedule))
        / (len(schedule) * timeline.makespan),
        # the rank that idles most, over the step and between its own first and last action
        "max_idle": max(map(timeline.idle_time, schedule)),
        "max_steady_idle": max(map(timeline.inner_idle_time, schedule)),
        "published_bubble_fraction": None if kind is None else published_bubble_fraction(kind, p, m, v),
        "published_idle": None if published is None else
        {"idle": published.idle, "steady": published.steady, "source": published.source},
        "peak_inflight_microbatches": [peaks[r] for r in sorted(schedule)],
        "published_peak": None if kind is None else published_peak(kind, p),
    }


def _costs(args) -> Costs:
    costs = Costs(args.cost_f, args.cost_b, args.cost_w, args.cost_p2p, args.cost_overlap)
    for name, value in (("--cost-f", costs.F), ("--cost-b", costs.B), ("--cost-w", costs.W)):
        if not 0 < value < math.inf:  # nan too
            raise ConfigError(f"{name} {value:g} must be positive and finite; give a duration, e.g. {name} 1")
    if not 0 <= costs.p2p < math.inf:
        raise ConfigError(f"--cost-p2p {costs.p2p:g} must be a finite duration of 0 or more")
    return costs


def _check_size(p: int, m: int, v: int) -> None:
    if p > MAX_STAGES or p * m * v > MAX_CELLS:
        raise ConfigError(f"p={p} stages x m={m} microbatches x v={v} chunks "
                          f"is more than a grid can show (simulating it takes minutes); keep p <= "
                          f"{MAX_STAGES} and p x m x v <= {MAX_CELLS:,}, e.g. -p 64 -m 256")


def _schedule(args) -> tuple[Schedule, str | None, str]:
    """(schedule, the builder's name or None, a title) from KIND or --from-csv."""
    if args.from_csv is not None:
        if args.kind is not None or args.stages is not None or args.microbatches is not None \
                or args.chunks is not None:
            raise ConfigError("--from-csv FILE reads the whole schedule; drop KIND, --stages, "
                              "--microbatches and --chunks")
        path = Path(args.from_csv)
        if not path.exists():
            raise ConfigError(f"--from-csv {shown(path)}: no such file; give the path of a schedule CSV")
        try:
            schedule = from_csv(read_bounded(path, "--from-csv", MAX_CSV_CHARS * 4, ConfigError).decode())
        except UnicodeDecodeError:
            raise ConfigError(f"--from-csv {path} is not text; give a schedule CSV (refpar schedule KIND "
                              "--csv writes one)") from None
        # one forward per stage and microbatch: p x m x v of them in a schedule of p ranks
        forwards = sum(c.kind == "F" for row in schedule.values() for a in row if a is not None
                       for c in a.computations())
        _check_size(len(schedule), 1, forwards // max(len(schedule), 1))
        return schedule, None, path.name
    if args.kind is None:
        raise ConfigError(f"give a schedule KIND ({', '.join(BUILDERS)}) or --from-csv FILE")
    if args.stages is None or args.microbatches is None:
        raise ConfigError(f"refpar schedule {args.kind} needs --stages P and --microbatches M, e.g. "
                          "-p 4 -m 8")
    p, m = args.stages, args.microbatches
    v = args.chunks if args.chunks is not None else default_chunks(args.kind)
    # Only sizes the builders would take: a wrong kind, size or chunk count gets their own sentence.
    buildable = args.kind in BUILDERS and min(p, m, v) >= 1 \
        and (v == default_chunks(args.kind) or args.kind == "interleaved-1f1b")
    if buildable:
        _check_size(p, m, v)
    title = f"{args.kind}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    return build(args.kind, p, m, v), args.kind, title


def run(args) -> int:
    costs = _costs(args)
    if args.figure is not None:
        check_output_path("--figure", args.figure, overwrite=args.overwrite)
    schedule, kind, title = _schedule(args)
    try:
        out = describe(schedule, costs, kind)
    except ScheduleError as err:  # only a schedule read from a file can be broken: the grid shows where
        print(format_grid(schedule, err), flush=True)
        raise ConfigError(f"{shown(args.from_csv)} does not run: {err}") from None
    if args.figure:
        from refpar.files import write_atomically
        from refpar.viz.pipeline import gantt_figure

        figure = gantt_figure(simulate(schedule, costs), title)
        write_atomically(args.figure, lambda f: f.write(figure.to_html(include_plotlyjs=True).encode()))
    if args.csv:
        print(to_csv(schedule), end="", flush=True)
        return 0
    if args.json:
        print(json.dumps(out), flush=True)
        return 0
    p, m, v = out["stages"], out["microbatches"], out["chunks"]
    if kind is not None:
        print(f"{kind}: p={p} ranks, m={m} microbatches, v={v} chunks per rank; each column is one "
              "tick when every action takes one", flush=True)
    else:
        print(f"{args.from_csv}: p={p} ranks, m={m} microbatches, v={v} stages per rank, read from "
              "torch's CSV; each column is one cell of the file", flush=True)
    print(format_grid(schedule))
    overlap = f" F&B={costs.overlap}" if any(a is not None and a.parts for row in schedule.values()
                                              for a in row) else ""
    print(f"simulated with F={costs.F:g} B={costs.B:g} W={costs.W:g} p2p={costs.p2p:g}{overlap} (a full "
          f"backward costs B+W): makespan {out['makespan']:g}")
    print(f"bubble: {out['bubble_fraction']:.2%} of all rank-time, "
          f"{out['bubble_over_ideal']:.2%} of compute time, "
          f"{out['steady_bubble_fraction']:.2%} in steady state (between each rank's first and "
          "last action)")
    if out["published_bubble_fraction"] is not None:
        print(f"published closed form (uniform costs F=B=W): "
              f"{out['published_bubble_fraction']:.2%} of all rank-time")
    published = out["published_idle"]
    if published is not None:
        where, simulated = (("between its first and last action", out["max_steady_idle"])
                            if published["steady"] else ("over the step", out["max_idle"]))
        print(f"the rank that idles most, {where}: simulated {simulated:g}, published "
              f"{published['idle']:g} ({published['source']})")
    print("peak in-flight microbatches per rank: "
          + " ".join(map(str, out["peak_inflight_microbatches"]))
          + ("" if out["published_peak"] is None or v == 1 else
             f" (stage-microbatches; published peak {out['published_peak']})"), flush=True)
    return 0
