"""`refpar plan --model NAME --gpus N --hardware NAME`: the fastest meshes that fit, from closed forms.

    refpar plan --model llama3-70b --gpus 512 --hardware h100 --top 3
    refpar plan --model megatron-1t --gpus 4096 --hardware a100 --json
"""

from __future__ import annotations

import json
import time

HELP = "rank every mesh of a model on N GPUs by predicted step time (closed forms, no MPI)"


def add_arguments(parser) -> None:
    from refpar.analysis.hardware import HARDWARE
    from refpar.analysis.presets import PRESETS
    from refpar.analysis.scale import PRECISIONS

    parser.add_argument("--model", required=True, help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: the model's published batch)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default: the model's training context)")
    parser.add_argument("--top", type=int, default=5, help="how many plans to print")
    parser.add_argument("--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the matmuls' dtype, whose peak FLOP/s the hardware preset lists")
    parser.add_argument("--efficiency", type=float, default=0.75,
                        help="fraction of peak FLOP/s the matmuls reach (an assumption)")
    parser.add_argument("--figure", metavar="PATH", default=None,
                        help="also write the plans' memory and time as an HTML figure")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _gb(x: float) -> str:
    return f"{x / 1e9:6.1f}"


def format_plans(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['gpus']} {result['hardware']} GPUs, global batch "
        f"{result['global_batch']} x {result['seq']} tokens: {result['fitting']} of "
        f"{result['candidates']} plans fit ({result['search_s'] * 1e3:.0f} ms)",
    ]
    for rank, p in enumerate(result["plans"], 1):
        mesh = ",".join(f"{k}={v}" for k, v in p["mesh"].items())
        chunks = f" v={p['chunks']}" if p["chunks"] > 1 else ""
        mem, t = p["memory_bytes"], p["time_s"]
        lines += [
            f"{rank}. {mesh} zero={p['zero']} micro-batch={p['micro_batch']} x "
            f"{p['microbatches']} schedule={p['schedule']}{chunks} recompute={p['recompute']}",
            f"   step {p['step_time_s']:.3f} s   MFU {p['mfu'] * 100:.1f}%   "
            f"{p['tokens_per_s']:,.0f} tokens/s",
            "   memory GB: " + "  ".join(f"{k} {_gb(v).strip()}" for k, v in mem.items())
            + f"  total {_gb(sum(mem.values())).strip()}",
            "   time s:    " + "  ".join(f"{k} {v:.3f}" for k, v in t.items() if v > 0),
            "   collectives: " + "; ".join(
                f"{c['name']} {c['bytes'] / 1e6:.1f} MB x {c['calls_per_step']:.0f} over "
                f"{c['ranks']} ({c['algo']}, {c['seconds_per_call'] * 1e3:.2f} ms)"
                for c in p["collectives"]) if p["collectives"] else "   collectives: none",
        ]
    return "\n".join(lines)


def run(args) -> int:
    from refpar.analysis.hardware import hardware
    from refpar.analysis.planner import plan
    from refpar.analysis.presets import preset
    from refpar.config import ConfigError, check_output_path

    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency {args.efficiency} must be in (0, 1]")
    if args.figure is not None:
        check_output_path("--figure", args.figure)
    spec, hw = preset(args.model), hardware(args.hardware)
    start = time.perf_counter()
    result = plan(spec, hw, args.gpus, args.global_batch, args.seq, top=args.top,
                  precision=args.precision, dtype=args.dtype, efficiency=args.efficiency)
    result["search_s"] = time.perf_counter() - start
    if args.figure:
        from refpar.viz.plan import plan_figure

        plan_figure(result).write_html(args.figure, include_plotlyjs=True)
    print(json.dumps(result) if args.json else format_plans(result), flush=True)
    return 0
