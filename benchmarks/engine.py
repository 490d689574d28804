"""The engine's step time on this machine: the tiny and small presets on 1, 2, 4 and 8 ranks over
several meshes, with each step's share of compute, communication and idle from the trace.

    python benchmarks/engine.py [--models tiny,small] [--steps 3] [--seq-len 64] [--timeout 600]

Each mesh runs as `mpiexec -n N python <this file> --worker MESH MODEL ...`: refpar/engine on
the same global batch (8 sequences in 4 microbatches; a mesh without pp accumulates them), one
BLAS thread per rank. Times are the mean of the steps after the first; the shares are the mean
over ranks of the last step's split (refpar.engine.run.time_split): compute = pipeline
actions minus the collectives inside them, communication = blocking collectives (including the
wait for the group's slowest rank), idle = the rest (pipeline waits, optimizer, bookkeeping).
Prints a table, not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one thread per rank

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MESHES = ["pp=1", "dp=2", "tp=2", "pp=2", "dp=2,tp=2", "tp=2,pp=2", "dp=2,pp=2", "dp=2,tp=2,pp=2"]


def worker(mesh_text: str, model_name: str, steps: int, seq_len: int, model_of=None) -> None:
    """One rank of the run: `model_of(model_name)` (default: the preset) on the mesh, timed."""
    from refpar.comm.communicator import abort_on_error, world
    from refpar.comm.trace import Tracer
    from refpar.config import ParallelConfig, Plan, TrainConfig, model_preset, parse_mesh
    from refpar.engine import parallelize, train
    from refpar.engine.run import time_split
    from refpar.mesh import DeviceMesh

    with abort_on_error():
        sizes = ParallelConfig(parse_mesh(mesh_text)).sizes
        model = (model_of or model_preset)(model_name)
        config = TrainConfig(steps=steps, batch_size=8, seq_len=min(seq_len, model.n_positions))
        comm, plain = world(Tracer()), world()
        par = parallelize(model, config, DeviceMesh(comm, sizes), Plan(microbatches=4))
        run = train(par)
        last = [e for e in comm.tracer.events if e.step == steps - 1]
        split = plain.gather_object(time_split(par.executor.slots, last, run.windows[-1]))
        if plain.rank == 0:
            shares = {k: float(np.mean([s[k] / s["wall"] for s in split]))
                      for k in ("compute", "communication", "idle")}
            print(json.dumps({"step_s": float(np.mean(run.step_times[1:] or run.step_times)),
                              "tokens": config.batch_size * config.seq_len, **shares}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MESH", "MODEL"))
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--meshes", default=";".join(MESHES), help="semicolon-separated meshes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.steps, args.seq_len)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    print(f"{'model':<6} {'mesh':<16} {'ranks':>5} {'step ms':>9} {'tokens/s':>9} {'vs 1 rank':>9} "
          f"{'compute':>8} {'comm':>6} {'idle':>6}", flush=True)
    for model in args.models.split(","):
        base = None
        for mesh in args.meshes.split(";"):
            n = int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))
            cmd = [str(mpiexec), "-n", str(n), sys.executable, __file__, "--worker", mesh, model,
                   "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{model:<6} {mesh:<16} {n:>5}  timed out after {args.timeout:.0f} s", flush=True)
                continue
            if proc.returncode != 0:
                print(f"{model:<6} {mesh:<16} {n:>5}  failed: {proc.stderr.strip().splitlines()[-1:]}",
                      flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            base = r["step_s"] if base is None else base
            rate = r["tokens"] / r["step_s"]
            print(f"{model:<6} {mesh:<16} {n:>5} {r['step_s'] * 1e3:>9.1f} {rate:>9,.0f} "
                  f"{r['step_s'] / base:>8.2f}x {r['compute']:>8.0%} {r['communication']:>6.0%} "
                  f"{r['idle']:>6.0%}", flush=True)


if __name__ == "__main__":
    main()
