"""`refpar plan`: the fastest meshes that fit, one given plan priced, or the model held against
published measured runs; closed forms, no MPI.

    refpar plan --model llama3-70b --gpus 512 --hardware h100 --top 3
    refpar plan --model megatron-1t --gpus 3072 --hardware a100 --mesh tp=8,pp=64,dp=6 \\
        --schedule interleaved-1f1b --chunks 2 --recompute full --software megatron-2021
    refpar plan --model-spec layers=70,hidden=14336,heads=112,vocab=250680,seq=2048 --gpus 384 \\
        --hardware a100
    refpar plan --validate --json
    refpar plan --validate --held-out
"""

from __future__ import annotations

import json
import time

HELP = "rank every mesh of a model on N GPUs by predicted step time, price one plan, or --validate"


def add_arguments(parser) -> None:
    from refpar.analysis.efficiency import SOFTWARE
    from refpar.analysis.hardware import HARDWARE
    from refpar.analysis.presets import PRESETS
    from refpar.analysis.scale import PRECISIONS

    parser.add_argument("--model", default=None, help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--model-spec", default=None, metavar="SPEC",
                        help="a model without a preset: layers=L,hidden=H,heads=A,vocab=V,seq=S"
                             "[,kv_heads=K][,ffn=F][,experts=E,topk=k][,arch=gpt2|llama]")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs in the job")
    parser.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--hardware-spec", default=None, metavar="SPEC",
                        help="your own accelerator instead of --hardware: memory=GB,flops=TFLOP/s (dense "
                             "bf16),hbm=GB/s,nvlink=GB/s,ib=GB/s (per GPU, each way),gpus_per_node=N"
                             "[,mamf=TFLOP/s,flash=F,sms=N] (refpar/analysis/hardware.py)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: the model's published batch)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default: the model's training context)")
    parser.add_argument("--top", type=int, default=5, help="how many plans to print")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the matmuls' dtype, whose peak FLOP/s the hardware preset lists")
    parser.add_argument("--software", default="modern",
                        help=f"what the framework overlaps and which attention kernel: one of "
                             f"{', '.join(SOFTWARE)}")
    price = parser.add_argument_group("pricing one plan (--mesh)")
    price.add_argument("--mesh", default=None, help="e.g. tp=8,pp=64,dp=6 (a missing dp takes the rest)")
    price.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    price.add_argument("--schedule", default=None,
                       help="none | gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-h2 "
                            "(default: 1f1b with pp > 1, none without)")
    price.add_argument("--chunks", type=int, default=2, help="model chunks per stage for interleaved-1f1b")
    price.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    price.add_argument("--recompute", default="none", help="none | selective | full")
    price.add_argument("--sp", action="store_true", help="sequence parallelism with tp > 1")
    parser.add_argument("--validate", action="store_true",
                        help="hold the model against published measured runs")
    parser.add_argument("--held-out", action="store_true",
                        help="with --validate: the held-out runs (refpar/analysis/held_out_runs.py), never "
                             "fitted, with their median and worst error, whole and by source")
    parser.add_argument("--cross-validate", action="store_true",
                        help="with --validate: leave one source out (fit without it, predict it); "
                             "about a minute")
    parser.add_argument("--figure", metavar="PATH", default=None,
                        help="also write the plans' memory and time as an HTML figure")
    from refpar.config import add_overwrite_argument

    add_overwrite_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_plan(rank: int | str, p: dict) -> list[str]:
    mesh = ",".join(f"{k}={v}" for k, v in p["mesh"].items())
    chunks = f" v={p['chunks']}" if p["chunks"] > 1 else ""
    sp = " sp" if p.get("sp") and p["mesh"]["tp"] > 1 else ""
    mem, t = p["memory_bytes"], p["time_s"]
    return [
        f"{rank}. {mesh} zero={p['zero']} micro-batch={p['micro_batch']} x "
        f"{p['microbatches']} schedule={p['schedule']}{chunks} recompute={p['recompute']}{sp}",
        f"   step {p['step_time_s']:.3f} s   MFU {p['mfu'] * 100:.1f}%   "
        f"{p['tokens_per_s']:,.0f} tokens/s",
        "   memory GB: " + "  ".join(f"{k} {_gb(v)}" for k, v in mem.items())
        + f"  total {_gb(sum(mem.values()))}",
        "   time s:    " + "  ".join(f"{k} {v:.3f}" for k, v in t.items() if v > 0),
        "   collectives: " + "; ".join(
            f"{c['name']} {c['bytes'] / 1e6:.1f} MB x {c['calls_per_step']:.0f} over "
            f"{c['ranks']} ({c['algo']}, {c['seconds_per_call'] * 1e3:.2f} ms)"
            for c in p["collectives"]) if p["collectives"] else "   collectives: none",
    ] + ([f"   note: {p['above_published']}"] if p.get("above_published") else [])


def format_plans(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['gpus']} {result['hardware']} GPUs, global batch "
        f"{result['global_batch']} x {result['seq']} tokens, software {result['software']}: "
        f"{result['fitting']} of {result['candidates']} plans fit ({result['search_s'] * 1e3:.0f} ms)",
    ]
    for rank, p in enumerate(result["plans"], 1):
        lines += format_plan(rank, p)
    return "\n".join(lines)


def format_priced(result: dict) -> str:
    p = result["plan"]
    return "\n".join([
        f"{result['model']} on {result['gpus']} {result['hardware']} GPUs, global batch "
        f"{result['global_batch']} x {result['seq']} tokens, software {result['software']}: the plan "
        f"ranks {result['rank']} of {result['fitting']} that fit (priced in "
        f"{result['price_s'] * 1e3:.0f} ms, searched in {result['search_s'] * 1e3:.0f} ms)",
        *format_plan("priced", p),
        *format_plan("fastest", result["fastest"]),
    ])


def _short(p: dict) -> str:
    """`tp=8 pp=64 dp=6 interleaved-1f1b v=2 mb=1 full`: a plan in one cell."""
    mesh = " ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1) or "one GPU"
    chunks = f" v={p['chunks']}" if p["chunks"] > 1 else ""
    extras = "".join([" sp" if p["sp"] else "", f" zero={p['zero']}" if p["zero"] else ""])
    return f"{mesh} {p['schedule']}{chunks} mb={p['micro_batch']} {p['recompute']}{extras}"


def format_validation(result: dict) -> str:
    rows = result["rows"]
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'run':{width}s}  {'predicted':>10s}  {'published':>10s}  {'error':>7s}  role",
             *(f"{r['name']:{width}s}  {r['predicted']:10.3f}  {r['published']:10.3f}  "
               f"{r['relative_error'] * 100:+6.1f}%  {'held out' if r['held_out'] else 'fit'}" for r in rows)]
    eff = result["efficiency"]
    lines += [f"largest error {result['largest_error'] * 100:.1f}% (fit rows "
              f"{result['largest_fit_error'] * 100:.1f}%, held-out rows "
              f"{result['largest_held_out_error'] * 100:.1f}%); fitted: matmul {eff['matmul']:.4g} of "
              f"MAMF, memory {eff['memory']:.4g} of HBM, network {eff['network']:.4g} of link bandwidth"]
    lines += [f"{r['name']}: {r['outside']}" for r in rows if r["outside"]]
    compared = [r for r in rows if "search" in r]
    if compared:
        lines += ["", "each published plan against the search's fastest (same model, batch, GPUs, software):"]
        for r in compared:
            c = r["search"]
            gains = sorted(c["difference_s"].items(), key=lambda kv: -abs(kv[1]))[:3]
            lines += [f"{r['name']}: rank {c['rank']} of {c['fitting']}",
                      f"   published {_short(c['published'])}: {c['published']['step_time_s']:.2f} s",
                      f"   fastest   {_short(c['fastest'])}: {c['fastest']['step_time_s']:.2f} s",
                      "   published - fastest: " + ", ".join(f"{k} {v:+.2f} s" for k, v in gains),
                      *(f"   may be missing: {m}" for m in c["missing"])]
    lines.append("sources: " + "; ".join(sorted({r["source"].split(", Table")[0].split(", Section")[0]
                                                 .split(", abstract")[0] for r in rows})))
    return "\n".join(lines)


def format_held_out(result: dict) -> str:
    rows, s = result["rows"], result["summary"]
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'held-out run':{width}s}  {'predicted':>10s}  {'published':>10s}  {'error':>7s}  fits",
             *(f"{r['name']:{width}s}  {r['predicted']:10.3f}  {r['published']:10.3f}  "
               f"{r['relative_error'] * 100:+6.1f}%  {'yes' if r['fits'] else 'NO'}" for r in rows), ""]

    def line(name: str, g: dict) -> str:
        return (f"{name}: {g['rows']} runs, median |error| {g['median_abs_error'] * 100:.1f}%, worst "
                f"{g['worst_abs_error'] * 100:.1f}%, {g['within']} within {s['within_bound'] * 100:.0f}%, "
                f"{g['fitting']} accepted as fitting")

    lines += [line("held out", s), *(line(f"  {k}", g) for k, g in s["by_source"].items())]
    lines += sorted({f"{r['source_group']}: {r['outside']}" for r in rows if r["outside"]})
    lines += ["sources: " + "; ".join(sorted({r["source"] for r in rows}))]
    return "\n".join(lines)


def format_cross_validation(cv: dict) -> str:
    lines = ["leave one source out (fitted without it where it has fit rows, else the calibrated fractions):"]
    for group, f in cv["folds"].items():
        e = f["efficiency"]
        lines.append(f"  {group}: {f['rows']} runs, median |error| {f['median_abs_error'] * 100:.1f}%, "
                     f"worst {f['worst_abs_error'] * 100:.1f}% (matmul {e['matmul']:.4g}, memory "
                     f"{e['memory']:.4g}, network {e['network']:.4g})")
    lines.append(f"  all: median |error| {cv['median_abs_error'] * 100:.1f}%, "
                 f"worst {cv['worst_abs_error'] * 100:.1f}%")
    return "\n".join(lines)


def run(args) -> int:
    from refpar.analysis.efficiency import SOFTWARE
    from refpar.analysis.hardware import hardware
    from refpar.analysis.planner import parse_mesh, plan, price
    from refpar.analysis.presets import parse_model_spec, preset
    from refpar.config import ConfigError, check_output_path

    if (args.held_out or args.cross_validate) and not args.validate:
        flag = "--held-out" if args.held_out else "--cross-validate"
        raise ConfigError(f"{flag} goes with --validate: refpar plan --validate {flag}")
    if args.validate and args.held_out:
        from refpar.analysis.calibration import summary, validate
        from refpar.analysis.held_out_runs import HELD_OUT

        result = validate(runs=HELD_OUT)
        result["summary"] = summary(result["rows"])
        text = format_held_out(result)
    elif args.validate:
        from refpar.analysis.calibration import validate

        result = validate(search=True)
        text = format_validation(result)
    if args.validate:
        if args.cross_validate:
            from refpar.analysis.calibration import cross_validate
            from refpar.analysis.held_out_runs import HELD_OUT

            result["cross_validation"] = cross_validate(held_out=HELD_OUT)
            text += "\n" + format_cross_validation(result["cross_validation"])
        print(json.dumps(result) if args.json else text, flush=True)
        return 0
    if (args.model is None) == (args.model_spec is None):
        raise ConfigError("give one of --model NAME or --model-spec SPEC (or --validate)")
    if args.gpus is None:
        raise ConfigError("--gpus N is required: how many GPUs the job has")
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    if args.software not in SOFTWARE:
        raise ConfigError(f"unknown --software {args.software!r}; choose one of {', '.join(SOFTWARE)}")
    if args.figure is not None:
        check_output_path("--figure", args.figure, overwrite=args.overwrite)
    spec = preset(args.model) if args.model is not None else parse_model_spec(args.model_spec)
    if args.hardware_spec is not None:
        from refpar.analysis.hardware import parse_hardware_spec

        hw = parse_hardware_spec(args.hardware_spec)
    else:
        hw = hardware(args.hardware)
    software = SOFTWARE[args.software]
    common = dict(global_batch=args.global_batch, seq=args.seq, precision=args.precision,
                  dtype=args.dtype, software=software)
    start = time.perf_counter()
    if args.mesh is not None:
        priced = price(spec, hw, args.gpus, parse_mesh(args.mesh, args.gpus), zero=args.zero,
                       schedule=args.schedule, chunks=args.chunks, micro_batch=args.micro_batch,
                       recompute=args.recompute, sp=args.sp, **common)
        priced_s = time.perf_counter() - start
        result = plan(spec, hw, args.gpus, top=1, priced=priced, **common)
        result.update(software=args.software, plan=priced, fastest=result["plans"][0], price_s=priced_s,
                      search_s=time.perf_counter() - start - priced_s, plans=[priced, result["plans"][0]])
        text = format_priced(result)
    else:
        result = plan(spec, hw, args.gpus, top=args.top, **common)
        result.update(software=args.software, search_s=time.perf_counter() - start)
        text = format_plans(result)
    if args.figure:
        from refpar.files import write_atomically
        from refpar.viz.plan import plan_figure

        figure = plan_figure(result)
        write_atomically(args.figure, lambda f: f.write(figure.to_html(include_plotlyjs=True).encode()))
    print(json.dumps(result) if args.json else text, flush=True)
    return 0
