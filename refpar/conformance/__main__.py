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
from refpar.conformance.compare import merge_ranks
from refpar.conformance.dist import process_group

# "-mean": the case with PyTorch's habit of a per-rank mean loss (cases.py, "Conventions").
# "-accum": 2 microbatches accumulated per step.
CASES = {"ddp": cases.ddp, "ddp-mean": partial(cases.ddp, convention="mean"),
         "ddp-accum": partial(cases.ddp, microbatches=2),
         "ddp-accum-mean": partial(cases.ddp, microbatches=2, convention="mean"), "fsdp2": cases.fsdp2,
         "tp": cases.tp, "tp-sp": partial(cases.tp, sp=True), "llama-tp": cases.llama_tp}
# "pp-NAME": torch.distributed.pipelining's ScheduleNAME (refpar/conformance/pipeline.py).
PIPELINES = {f"pp-{name}": name for name in pipeline.SCHEDULES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refpar.conformance")
    parser.add_argument("cases", nargs="+", metavar="CASE",
                        help=f"one of {', '.join(sorted(CASES) + sorted(PIPELINES))}, optionally @float32")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--batch-size", type=int, default=8, help="all but the pipeline cases")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="pipeline cases only, each of 2 sequences")
    args = parser.parse_args(argv)
    runs = []
    for spec in args.cases:
        name, _, dtype = spec.partition("@")
        if name not in CASES and name not in PIPELINES or dtype not in ("", "float64", "float32"):
            parser.error(f"unknown case {spec!r}")
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
                    rows = CASES[name](comm, dtype, batch_size=args.batch_size)
                every = comm.gather_object(rows)
                if comm.rank == 0:
                    steps = merge_ranks(every)
                    top = max(max(s["loss"], s["grads"], s["params"]) for s in steps)
                    print(json.dumps({"case": spec, "ranks": comm.size, "dtype": dtype,
                                      "batch_size": args.batch_size,
                                      "steps": steps, "max": top, "orders": orders}), flush=True)


if __name__ == "__main__":
    main()
