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

With --profile (and --steps of at least 3), a table instead: where rank 0's step goes, in ms per
step, in one half-batch process of the ceiling (run with its twin) and in each strategy. Every
process of a run wraps the functions behind the rows below (StepProfiler.install) and profiles the
even timed steps only; a profiled call adds its time to its row, and only the outermost such call
counts (an allocation inside the optimizer or a collective is theirs). Rows, means over the steps:
    step, unprofiled         the odd timed steps, which run the wrappers but time nothing
    step, profiled           the even timed steps, which the rows below divide
    GEMMs                    refpar/model/gemm.py's matmul: the `a @ b` of every layer
    optimizer                the functions of refpar/model/optim.py (the AdamW or SGD update)
    collectives              the public methods of the Communicator and its Request: each
                             collective, message and wait, with its copies, reductions and tracing,
                             and the time waiting for the other rank
    allocation and copies    the functions zeros, empty, concat, stack, copy, asarray, astype, ...
                             (ALLOCATING) of NumPy and array-api-compat outside the rows above;
                             the arrays that arithmetic returns, and ndarray methods (x.copy()),
                             count in the next row
    elementwise and Python   the profiled step less the rows above: LayerNorm, softmax, GELU and
                             the rest of every layer's arithmetic, and the interpreter's time
"""

from __future__ import annotations

import argparse
import functools
import inspect
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
    parser.add_argument("--profile", action="store_true",
                        help="print where rank 0's step goes (module docstring) instead of the times")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--half", action="store_true", help=argparse.SUPPRESS)  # one ceiling process
    return parser.parse_args(argv)


def configs(args):
    return model_preset(args.model), TrainConfig(steps=args.steps, batch_size=args.batch_size,
                                                 seq_len=args.seq_len)


PROFILE_ROWS = ("step, unprofiled", "step, profiled", "GEMMs", "optimizer", "collectives",
                "allocation and copies", "elementwise and Python")
TIMED = ("GEMMs", "optimizer", "collectives", "allocation and copies")  # the rows timed by wrappers
# NumPy's and array-api-compat's functions that return a new array or copy into one
ALLOCATING = ("zeros", "empty", "ones", "full", "zeros_like", "empty_like", "ones_like", "full_like",
              "concatenate", "concat", "stack", "copy", "ascontiguousarray", "array", "asarray",
              "copyto", "astype")


class StepProfiler:
    """Where a process's timed steps go (module docstring): `install` wraps the functions of each
    timed row so a call made while profiling adds its time to its row (the outermost call only, so
    an allocation inside the optimizer is the optimizer's); `on_step`, called after each step,
    profiles the even steps after the first and leaves the odd ones unprofiled."""

    def __init__(self, steps: int):
        self.steps = steps
        self.step_times: dict[bool, list[float]] = {False: [], True: []}  # profiled? -> seconds
        self.spent = dict.fromkeys(TIMED, 0.0)
        self.profiling = False
        self.inside = False  # within a timed call: nested timed calls are part of it

    def timed(self, function, row: str):
        """`function`, adding the time of its outermost calls to `row` while profiling."""
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if self.inside or not self.profiling:
                return function(*args, **kwargs)
            self.inside, start = True, time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[row] += time.perf_counter() - start
                self.inside = False

        return wrapper

    def install(self) -> None:
        """Wraps, for this process: refpar/model/gemm.py's matmul, every function of
        refpar/model/optim.py, the public methods of refpar/comm/communicator.py's Communicator and
        Request (each collective, point-to-point message and wait), and ALLOCATING in numpy and
        array_api_compat.numpy (the namespace the model code gets from array_namespace); in the
        modules that define them and in every loaded refpar module that imported them by name."""
        import array_api_compat.numpy as xp

        from refpar.comm import communicator
        from refpar.model import gemm, optim

        for cls in (communicator.Communicator, communicator.Request):
            for name, method in list(vars(cls).items()):
                if inspect.isfunction(method) and not name.startswith("_"):
                    setattr(cls, name, self.timed(method, "collectives"))
        targets = [(gemm, "matmul", "GEMMs")]
        targets += [(optim, name, "optimizer") for name, f in vars(optim).items()
                    if inspect.isfunction(f) and f.__module__ == optim.__name__]
        targets += [(module, name, "allocation and copies") for module in (np, xp) for name in ALLOCATING
                    if callable(getattr(module, name, None))]
        wrappers = {id(getattr(module, name)): self.timed(getattr(module, name), row)
                    for module, name, row in targets}
        refpar_modules = [m for n, m in sys.modules.items() if n == "refpar" or n.startswith("refpar.")]
        for module in [np, xp, *refpar_modules]:
            for name, value in list(vars(module).items()):
                if id(value) in wrappers:
                    setattr(module, name, wrappers[id(value)])

    def on_step(self, step: int, seconds: float) -> None:
        if step > 0:
            self.step_times[self.profiling].append(seconds)
        self.profiling = step + 1 < self.steps and (step + 1) % 2 == 0

    def rows(self) -> dict:
        """{row: ms per step}: the step rows the means of the unprofiled and the profiled timed
        steps, the others the profiled steps' means; "elementwise and Python" what the profiled
        step leaves."""
        unprofiled, profiled = self.step_times[False], self.step_times[True]
        rows = {row: 1e3 * self.spent[row] / len(profiled) for row in TIMED}
        rows["step, unprofiled"] = 1e3 * sum(unprofiled) / len(unprofiled)
        rows["step, profiled"] = 1e3 * sum(profiled) / len(profiled)
        rows["elementwise and Python"] = rows["step, profiled"] - sum(rows[row] for row in TIMED)
        return rows


def single_process(args) -> float:
    from refpar.trainer import train_single_device

    model, train = configs(args)
    return min(train_single_device(model, train).step_times[1:])


def two_process_ceiling(args) -> dict:
    """The step of --ranks (two by default) independent single processes on their share of the
    batch each, run at the same time, and the first process's profile with --profile."""
    cmd = [sys.executable, __file__, "--half", "--model", args.model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--ranks", str(args.ranks)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(cmd + (["--profile"] if args.profile else []), env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(args.ranks)]
    texts = [proc.communicate(timeout=900)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        sys.exit("a two-process ceiling process failed")
    outs = [json.loads(text.strip().splitlines()[-1]) for text in texts]
    return {"step_time_s": max(out["step_time_s"] for out in outs), "profile": outs[0].get("profile")}


def half_batch(args) -> None:
    """One process of the ceiling: the single-process run on its share of the global batch."""
    half = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size // args.ranks})
    if not args.profile:
        print(json.dumps({"step_time_s": single_process(half)}), flush=True)
        return
    from refpar.trainer import train_single_device

    profiler = StepProfiler(args.steps)
    profiler.install()
    model, train = configs(half)
    train_single_device(model, train, on_step=lambda r: profiler.on_step(r.step, r.time_s))
    print(json.dumps({"step_time_s": min(profiler.step_times[False]), "profile": profiler.rows()}),
          flush=True)


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
    profiler = StepProfiler(train.steps) if args.profile else None
    if profiler is not None:
        profiler.install()
    on_step = None if profiler is None else (
        lambda step, loss, seconds, *_, **__: profiler.on_step(step, seconds))
    start = time.perf_counter()
    run = train_engine(parallelize(model, train, DeviceMesh(comm, {"dp": comm.size}), plan), on_step)
    elapsed = time.perf_counter() - start
    profile = None if profiler is None else profiler.rows()
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
        print(json.dumps({"step_time_s": best[0], "comm_s_per_step": best[1], "wall_s": elapsed,
                          "profile": profile}), flush=True)


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
    if args.profile and args.steps < 3:
        sys.exit("--profile needs --steps of at least 3: a warm-up step, then unprofiled and profiled "
                 "steps in turn")
    model, train = configs(args)
    print(f"GPT-2 {args.model} ({model.dtype}), batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps - 1} timed steps, one BLAS thread per process, {os.cpu_count()} cores", flush=True)
    if args.profile:
        print_profile(args)
        return
    one = single_process(args)
    print(f"{'single process':<28} {one * 1e3:8.1f} ms/step", flush=True)
    ceiling = two_process_ceiling(args)["step_time_s"]
    print(f"{'two-process ceiling':<28} {ceiling * 1e3:8.1f} ms/step  {one / ceiling:5.2f}x the single "
          f"process ({args.ranks} processes of batch {args.batch_size // args.ranks}, no communication)",
          flush=True)
    results = {}
    for label in STRATEGIES:
        r = results[label] = run_strategy(args, label)
        print(f"{label + f' dp={args.ranks}':<28} {r['step_time_s'] * 1e3:8.1f} ms/step  "
              f"{one / r['step_time_s']:5.2f}x the single process (ideal {args.ranks})  "
              f"{ceiling / r['step_time_s']:5.2f} of the ceiling  "
              f"messages in flight {100 * r['comm_s_per_step'] / r['step_time_s']:4.1f}% of the step",
              flush=True)
    dp = results["DP"]["step_time_s"]
    print(f"ZeRO-3 / DP step time: {results['ZeRO-3']['step_time_s'] / dp:.2f}; "
          f"FSDP / DP: {results['FSDP (prefetch)']['step_time_s'] / dp:.2f}", flush=True)


def run_strategy(args, label: str) -> dict:
    """One strategy as `mpiexec -n RANKS python <this file> --worker LABEL`: rank 0's JSON line."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, __file__, "--worker", label,
           "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len)] + (["--profile"] if args.profile else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{label} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_profile(args) -> None:
    """The --profile table: rows PROFILE_ROWS, columns the half-batch process and each strategy."""
    columns = {"half-batch process": two_process_ceiling(args)["profile"]}
    columns.update({label: run_strategy(args, label)["profile"] for label in STRATEGIES})
    print("| rank 0, ms per step | " + " | ".join(columns) + " |", flush=True)
    print("|---" * (len(columns) + 1) + "|")
    for row in PROFILE_ROWS:
        print(f"| {row} | " + " | ".join(f"{c[row]:.1f}" for c in columns.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
