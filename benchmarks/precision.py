"""What precision does to data parallelism: fp64, fp32, bf16-mixed and fp16-mixed side by side, for
DP and ZeRO-3 on the same global batch: step time, bytes each rank sends per step, and the model
states each rank holds (parameters, gradients, fp32 master weights, moments).

    mpiexec -n 2 python benchmarks/precision.py [--model small] [--steps 4] [--batch-size 8] [--seq-len 64]

Prints a table, not pass/fail. Step time is the fastest timed step (the first is warm-up; the
fastest is the least disturbed on a shared machine). Bytes are rank 0's traced bytes per step;
model states are rank 0's ledger between steps. On a CPU the 16-bit runs are not faster: NumPy has
no bf16 arithmetic, so every op upcasts to fp32 and rounds back (refpar/precision.py); what the
16-bit dtype buys here is the memory and the bytes, as on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one BLAS thread per rank

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from refpar.comm.communicator import abort_on_error, world  # noqa: E402
from refpar.comm.trace import Tracer  # noqa: E402
from refpar.config import Plan, TrainConfig, model_preset  # noqa: E402
from refpar.engine import parallelize, train  # noqa: E402
from refpar.engine.run import STATES  # noqa: E402
from refpar.mesh import DeviceMesh  # noqa: E402
from refpar.precision import PRECISIONS  # noqa: E402

STRATEGIES = {"DP": Plan(), "ZeRO-3": Plan(zero=3)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    comm = world(Tracer())
    rows = []
    for precision, dtype in PRECISIONS.items():
        model = model_preset(args.model, dtype=dtype)
        config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
        for label, plan in STRATEGIES.items():
            comm.tracer.clear()
            par = parallelize(model, config, DeviceMesh(comm, {"dp": comm.size}), plan)
            run = train(par)
            sent = sum(e.bytes_sent for e in comm.tracer.events if e.step == 1)
            rows.append((label, precision, min(run.step_times[1:]), sent,
                         {c: par.ledger.current[c] for c in STATES}, run.losses[-1]))
    if comm.rank != 0:
        return
    print(f"GPT-2 {args.model}, dp={comm.size}, batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps - 1} timed steps, one BLAS thread per rank", flush=True)
    print(f"{'':<7} {'precision':<11} {'ms/step':>8} {'sent/step':>12} {'params':>11} {'grads':>11} "
          f"{'master':>11} {'moments':>11} {'states':>11} {'B/param':>8} {'last loss':>10}")
    psi = None
    for label, precision, step_s, sent, states, loss in rows:
        if label == "DP" and precision == "fp64":
            psi = states["params"] // 8
        total = sum(states.values())
        print(f"{label:<7} {precision:<11} {step_s * 1e3:>8.1f} {sent:>12,} "
              + " ".join(f"{states[c]:>11,}" for c in STATES)
              + f" {total:>11,} {total / psi:>8.2f} {loss:>10.5f}", flush=True)


if __name__ == "__main__":
    with abort_on_error(), np.errstate(over="ignore", invalid="ignore"):
        main()
