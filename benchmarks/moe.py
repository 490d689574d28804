"""Mixture-of-Experts runs on this machine: step time, bytes and model-state memory per rank of
every way refpar spreads an MoE GPT-2, next to the single process.

    python benchmarks/moe.py [--model tiny] [--experts 4] [--topk 2] [--steps 4] [--timeout 600]

Each configuration runs as `mpiexec -n N python -m refpar train ... --json` (one BLAS thread per
rank) on the same global batch, routed in 2 microbatches, so every run routes exactly the single
device's tokens. Reported per configuration: the mean step time after the first step, tokens/s,
the step time relative to one process, the bytes a rank sends per step (mean over ranks, every
axis), and the largest params + grads + optimizer (+ masters) peak of any rank, relative to one
process. Prints a table, not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # one thread per rank

ROOT = Path(__file__).resolve().parent.parent
STATES = ("params", "grads", "master", "optimizer")

# (label, ranks, options): 1, 2 and 4 ranks; every option of `refpar train` an MoE run takes
RUNS = [
    ("1 process", 1, ()),
    ("ep=2", 2, ("--mesh", "ep=2")),
    ("ep=4", 4, ("--mesh", "ep=4")),
    ("dp=2,ep=2", 4, ("--mesh", "dp=2,ep=2")),
    ("dp=2,ep=2 zero-1", 4, ("--mesh", "dp=2,ep=2", "--zero", "1")),
    ("dp=2,ep=2 zero-3", 4, ("--mesh", "dp=2,ep=2", "--zero", "3")),
    ("dp=2,ep=2 fsdp", 4, ("--mesh", "dp=2,ep=2", "--fsdp")),
    ("pp=2,ep=2 1f1b", 4, ("--mesh", "pp=2,ep=2")),
    ("ep=2,tp=2", 4, ("--mesh", "ep=2,tp=2")),
    ("ep=2,tp=2 sp", 4, ("--mesh", "ep=2,tp=2", "--sp")),
    ("ep=2,cp=2 ring", 4, ("--mesh", "ep=2,cp=2")),
    ("ep=2,cp=2 ulysses", 4, ("--mesh", "ep=2,cp=2", "--cp-algo", "ulysses")),
    ("cp=2,tp=2 ring", 4, ("--mesh", "cp=2,tp=2")),
    ("cp=2,tp=2 sp ulysses", 4, ("--mesh", "cp=2,tp=2", "--sp", "--cp-algo", "ulysses")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    common = ("--model", args.model, "--moe-experts", str(args.experts), "--moe-topk", str(args.topk),
              "--microbatches", "2", "--steps", str(args.steps), "--json")
    print(f"{'run':<20} {'ranks':>5} {'step ms':>8} {'tokens/s':>9} {'vs 1':>6} {'sent/rank/step':>15} "
          f"{'states/rank':>12} {'vs 1':>6}", flush=True)
    base = None
    for label, n, options in RUNS:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, "-m", "refpar", "train", *options, *common]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"{label:<20} {n:>5}  timed out after {args.timeout:.0f} s", flush=True)
            continue
        if proc.returncode != 0:
            print(f"{label:<20} {n:>5}  failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        step_s = r["step_time_s"]
        tokens = r["config"]["train"]["batch_size"] * r["config"]["train"]["seq_len"]
        sent = sum(row["bytes_sent"] for row in r["comm_bytes"]) / (n * r["steps"])
        by_rank: dict[int, int] = {}
        for row in r["memory_peak_bytes"]:
            if row["category"] in STATES:
                by_rank[row["rank"]] = by_rank.get(row["rank"], 0) + row["bytes"]
        states = max(by_rank.values())
        base = (step_s, states) if base is None else base
        print(f"{label:<20} {n:>5} {step_s * 1e3:>8.1f} {tokens / step_s:>9,.0f} {step_s / base[0]:>5.2f}x "
              f"{sent:>15,.0f} {states:>12,} {states / base[1]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
