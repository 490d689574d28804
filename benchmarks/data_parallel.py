"""Data parallelism's cost on this machine: DP=2 against one process on the same global batch and
against the two-process ceiling, the share of the step spent communicating (from the trace), and
ZeRO-3 / FSDP against DP.

    python benchmarks/data_parallel.py [--model small] [--steps 5] [--batch-size 8] [--seq-len 64]

Every process runs one BLAS thread, so DP=2 uses two cores where the single process uses one: the
ideal DP=2 step is half the single-process step plus the communication. What two cores can do at
best is the two-process ceiling: two independent processes started together, each training on its
half of the batch with its own (replicated) optimizer and no communication, sharing memory bandwidth
and caches as the ranks do; its step is the slower of the two processes' fastest steps, and each
strategy's "of the ceiling" is that step over the strategy's (1.0 = communication and sharding
cost nothing). The script runs the
single-process reference itself and each parallel strategy as `mpiexec -n 2 python <this file>
--worker STRATEGY`, then prints times and ratios, not pass/fail. Each figure is the fastest timed
step (the least disturbed on a shared machine). "Messages in flight" is the union of rank 0's
traced communication intervals: for blocking collectives the time spent communicating, for the
overlapped rings (DP buckets, FSDP prefetch) also the compute they overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one thread per rank, and for the single process

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from refpar.config import TrainConfig, model_preset  # noqa: E402

STRATEGIES = {  # label -> (strategy, options)
    "DP": ("dp", {}),
    "DP, 4 buckets, overlapped": ("dp", {"overlap": True, "buckets": 4}),
    "ZeRO-1": ("zero1", {}),
    "ZeRO-2": ("zero2", {}),
    "ZeRO-3": ("zero3", {}),
    "FSDP (prefetch)": ("fsdp", {"prefetch": True}),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (default small, float32)")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps; the first is warm-up, the fastest of the others is reported")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--half", action="store_true", help=argparse.SUPPRESS)  # one ceiling process
    return parser.parse_args(argv)


def configs(args):
    return model_preset(args.model), TrainConfig(steps=args.steps, batch_size=args.batch_size,
                                                 seq_len=args.seq_len)


def single_process(args) -> float:
    from refpar.trainer import train_single_device

    model, train = configs(args)
    return min(train_single_device(model, train).step_times_s[1:])


def two_process_ceiling(args) -> float:
    """The step of --ranks (two by default) independent single processes on their share of the
    batch each, run at the same time."""
    cmd = [sys.executable, __file__, "--half", "--model", args.model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--ranks", str(args.ranks)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(args.ranks)]
    outs = [proc.communicate(timeout=900)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        sys.exit("a two-process ceiling process failed")
    return max(json.loads(out.strip().splitlines()[-1])["step_time_s"] for out in outs)


def half_batch(args) -> None:
    """One process of the ceiling: the single-process run on its share of the global batch."""
    half = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size // args.ranks})
    print(json.dumps({"step_time_s": single_process(half)}), flush=True)


def worker(args) -> None:
    """Under mpiexec: one strategy's mean step time and the time its rank 0 spent in communication."""
    from refpar.analysis.memory import bucket_sizes
    from refpar.comm.communicator import world
    from refpar.comm.trace import Tracer
    from refpar.config import Plan
    from refpar.engine import parallelize
    from refpar.engine import train as train_engine
    from refpar.mesh import DeviceMesh

    model, train = configs(args)
    strategy, extra = STRATEGIES[args.worker]
    extra = dict(extra)
    bucket = 1 << 62
    if "buckets" in extra:
        total = sum(bucket_sizes(model, 1 << 62))
        bucket = -(-total // extra.pop("buckets"))
    comm = world(Tracer())
    plan = Plan(zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp",
                bucket_elems=bucket, **extra)
    start = time.perf_counter()
    run = train_engine(parallelize(model, train, DeviceMesh(comm, {"dp": comm.size}), plan))
    elapsed = time.perf_counter() - start
    # Each timed step's communication time, its events' intervals merged on rank 0 (overlapping
    # messages of several buckets count once); the fastest step is reported, the one least
    # disturbed by other processes on a shared machine.
    best = None
    for step in range(1, train.steps):
        spans = sorted((e.t_start, e.t_end) for e in comm.tracer.events if e.step == step)
        busy, end = 0.0, -np.inf
        for a, b in spans:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        if best is None or run.step_times[step] < best[0]:
            best = (run.step_times[step], busy)
    if comm.rank == 0:
        print(json.dumps({"step_time_s": best[0], "comm_s_per_step": best[1], "wall_s": elapsed}),
              flush=True)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.half:
        half_batch(args)
        return
    if args.steps < 2:
        sys.exit("--steps must be at least 2: the first step is warm-up")
    model, train = configs(args)
    print(f"GPT-2 {args.model} ({model.dtype}), batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps - 1} timed steps, one BLAS thread per process, {os.cpu_count()} cores", flush=True)
    one = single_process(args)
    print(f"{'single process':<28} {one * 1e3:8.1f} ms/step", flush=True)
    ceiling = two_process_ceiling(args)
    print(f"{'two-process ceiling':<28} {ceiling * 1e3:8.1f} ms/step  {one / ceiling:5.2f}x the single "
          f"process ({args.ranks} processes of batch {args.batch_size // args.ranks}, no communication)",
          flush=True)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONPATH=str(ROOT))
    results = {}
    for label in STRATEGIES:
        cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, __file__, "--worker", label,
               "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            sys.exit(f"{label} failed:\n{proc.stderr[-2000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[label] = r
        print(f"{label + f' dp={args.ranks}':<28} {r['step_time_s'] * 1e3:8.1f} ms/step  "
              f"{one / r['step_time_s']:5.2f}x the single process (ideal {args.ranks})  "
              f"{ceiling / r['step_time_s']:5.2f} of the ceiling  "
              f"messages in flight {100 * r['comm_s_per_step'] / r['step_time_s']:4.1f}% of the step",
              flush=True)
    dp = results["DP"]["step_time_s"]
    print(f"ZeRO-3 / DP step time: {results['ZeRO-3']['step_time_s'] / dp:.2f}; "
          f"FSDP / DP: {results['FSDP (prefetch)']['step_time_s'] / dp:.2f}", flush=True)


if __name__ == "__main__":
    main()
