"""mpiexec -n 2 python -m refpar.conformance [--dtype float64] [--batch-size 8] CASE[@DTYPE] ...

    mpiexec -n 2 python -m refpar.conformance llama-tp     # Llama's GQA under DTensor TP

Runs each case (in --dtype, or in DTYPE when the name ends in "@float32" or "@float64") on every
rank of the job and prints, from rank 0, one JSON line per case:
{"case", "ranks", "dtype", "batch_size", "steps": [per-step worst-rank differences], "max",
"orders": per-rank action orders of a pipeline case, torch's and refpar's, else null}.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

from refpar.comm.communicator import abort_on_error, world
from refpar.conformance import cases, pipeline
from refpar.conformance.compare import diff_keys, merge_ranks, worst_key
from refpar.conformance.dist import process_group

# "-mean": the case with PyTorch's habit of a per-rank mean loss (cases.py, "Conventions").
# "-accum": 2 microbatches accumulated per step.
CASES = {"ddp": cases.ddp, "ddp-mean": partial(cases.ddp, convention="mean"),
         "ddp-accum": partial(cases.ddp, microbatches=2),
         "ddp-accum-mean": partial(cases.ddp, microbatches=2, convention="mean"), "fsdp2": cases.fsdp2,
         "tp": cases.tp, "tp-sp": partial(cases.tp, sp=True), "llama-tp": cases.llama_tp}
# DeepSpeed (refpar/conformance/deepspeed_cases.py; the `deepspeed` extra): ZeRO-S at DeepSpeed's
# default clipping (1.0) next to refpar's --clip-grad-norm 1.0; "-noclip" both unclipped; "-default"
# DeepSpeed's default next to refpar unclipped (the convention mismatch). Imported when run.
DEEPSPEED = {f"deepspeed-zero{s}{suffix}": (s, clip) for s in (1, 2, 3)
             for suffix, clip in (("", "both"), ("-noclip", "none"), ("-default", "default"))}


# Megatron-Core (refpar/conformance/megatron_cases.py; the `megatron` extra): GPTModel at TP = world,
# "-sp" with sequence parallelism; "-ce64" its cross-entropy kept in float64 (a diagnostic).
MEGATRON = {f"megatron-tp{sp}{ce}": (bool(sp), bool(ce)) for sp in ("", "-sp") for ce in ("", "-ce64")}


def run_case(comm, name: str, dtype: str, batch_size: int) -> list[dict]:
    if name in MEGATRON:
        from refpar.conformance.megatron_cases import tp_case

        sp, ce64 = MEGATRON[name]
        return tp_case(comm, dtype, batch_size=batch_size, sp=sp, ce64=ce64)
    if name in DEEPSPEED:
        from refpar.conformance.deepspeed_cases import zero

        stage, clip = DEEPSPEED[name]
        return zero(comm, dtype, batch_size=batch_size, stage=stage, clip=clip)
    return CASES[name](comm, dtype, batch_size=batch_size)


def table(row: dict) -> str:
    """The case's differences per step, one line each (the --table view of a JSON line)."""
    keys = diff_keys(row["steps"][0])
    head = f"{row['case']} ({row['ranks']} ranks, {row['dtype']})"
    lines = [head, "step  " + "".join(f"{k:>10}" for k in keys) + "  loss (refpar)  worst tensor"]
    for i, s in enumerate(row["steps"]):
        worst = max(keys[1:], key=lambda k, s=s: s[k])
        name = s.get(worst_key(worst))
        lines.append(f"{i:>4}  " + "".join(f"{s[k]:10.2e}" for k in keys)
                     + f"  {s['loss_refpar']:13.10f}  {worst}: {name}")
    return "\n".join(lines)
# "pp-NAME": torch.distributed.pipelining's ScheduleNAME (refpar/conformance/pipeline.py).
PIPELINES = {f"pp-{name}": name for name in pipeline.SCHEDULES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refpar.conformance")
    parser.add_argument("cases", nargs="+", metavar="CASE",
                        help=f"one of {', '.join(sorted([*CASES, *PIPELINES, *DEEPSPEED, *MEGATRON]))}, "
                        "optionally @float32")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--batch-size", type=int, default=8, help="all but the pipeline cases")
    parser.add_argument("--table", action="store_true", help="print a table per case, not JSON")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="pipeline cases only, each of 2 sequences")
    args = parser.parse_args(argv)
    runs = []
    for spec in args.cases:
        name, _, dtype = spec.partition("@")
        if name not in CASES and name not in PIPELINES and name not in DEEPSPEED and name not in MEGATRON \
                or dtype not in ("", "float64", "float32"):
            parser.error(f"unknown case {spec!r}")
        if name in DEEPSPEED and DEEPSPEED[name][0] == 3:  # DeepSpeed's ZeRO-3 refuses float64
            if dtype == "float64":
                parser.error(f"{spec}: DeepSpeed's ZeRO-3 refuses float64 (partition_parameters.py); "
                             f"use {name}@float32 or just {name}")
            dtype = "float32"
        runs.append((spec, name, dtype or args.dtype))
    with abort_on_error():
        comm = world()
        with process_group(comm):
            for spec, name, dtype in runs:
                orders = None
                if name in PIPELINES:
                    rows, orders = pipeline.pipelining(comm, PIPELINES[name], dtype,
                                                       microbatches=args.microbatches)
                else:
                    rows = run_case(comm, name, dtype, args.batch_size)
                every = comm.gather_object(rows)
                if comm.rank == 0:
                    steps = merge_ranks(every)
                    top = max(max(s[k] for k in diff_keys(s)) for s in steps)
                    row = {"case": spec, "ranks": comm.size, "dtype": dtype, "batch_size": args.batch_size,
                           "steps": steps, "max": top, "orders": orders}
                    print(table(row) if args.table else json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
