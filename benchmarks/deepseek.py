"""DeepSeek-V3's training step on this machine next to Llama's of about the same parameter count:
deepseek-tiny (multi-head latent attention, a dense block, then fine-grained experts with a shared
one) on one process and on ep=2, and a llama-tiny widened to deepseek-tiny's parameters on one
process and on dp=2 (a dense model's two-rank counterpart).

    python benchmarks/deepseek.py [--steps 4] [--seq-len 32] [--timeout 600]

Each run is `mpiexec -n N python <this file> --worker MESH MODEL ...`: refpar/engine on the same
global batch (8 sequences in 4 microbatches), one BLAS thread per rank, float64. Times are the mean of
the steps after the first; the shares are the mean over ranks of the last step's split
(refpar.engine.run.time_split, as benchmarks/engine.py reports them). The parameter counts are
refpar.model.param_shapes' (every routed expert counted); "active" counts what one token runs
through (k routed experts of each MoE block, the shared ones, everything outside the experts).
Prints a table, then the step-time ratio of the two families on each rank count; not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one thread per rank

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, ranks, mesh, model): each family on one process, then on two ranks
RUNS = [
    ("deepseek-tiny", 1, "pp=1", "deepseek-tiny"),
    ("deepseek-tiny", 2, "ep=2", "deepseek-tiny"),
    ("llama-tiny-wide", 1, "pp=1", "llama-tiny-wide"),
    ("llama-tiny-wide", 2, "dp=2", "llama-tiny-wide"),
]


def model_config(name: str):
    """deepseek-tiny, or llama-tiny with its SwiGLU widened from 176 to 296: 289,344 parameters
    against deepseek-tiny's 288,128."""
    from refpar.config import model_preset

    if name == "llama-tiny-wide":
        return replace(model_preset("llama-tiny"), intermediate_size=296)
    return model_preset(name)


def param_counts(config) -> tuple[int, int]:
    """(every parameter, those one token runs through): a routed expert's count times k / E."""
    from refpar.holdings import is_expert
    from refpar.model import param_shapes

    sizes = {name: int(np.prod(shape)) for name, shape in param_shapes(config).items()}
    routed = sum(n for name, n in sizes.items() if is_expert(name))
    active = sum(sizes.values()) - routed
    if config.moe_experts:
        active += routed * config.moe_top_k // config.moe_experts
    return sum(sizes.values()), active


def worker(mesh_text: str, model_name: str, steps: int, seq_len: int) -> None:
    """One rank: benchmarks/engine.py's timed run, of this file's models."""
    from benchmarks.engine import worker as engine_worker

    engine_worker(mesh_text, model_name, steps, seq_len, model_of=model_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MESH", "MODEL"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.steps, args.seq_len)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    for name in dict.fromkeys(model for *_, model in RUNS):
        total, active = param_counts(model_config(name))
        print(f"{name}: {total:,} parameters, {active:,} active per token", flush=True)
    print(f"{'model':<16} {'mesh':<6} {'ranks':>5} {'step ms':>9} {'tokens/s':>9} {'compute':>8} "
          f"{'comm':>6} {'idle':>6}", flush=True)
    step_s: dict = {}
    for label, n, mesh, model in RUNS:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, __file__, "--worker", mesh, model,
               "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{label:<16} {mesh:<6} {n:>5}  timed out after {args.timeout:.0f} s", flush=True)
            continue
        if proc.returncode != 0:
            why = proc.stderr.strip().splitlines()[-1:]
            print(f"{label:<16} {mesh:<6} {n:>5}  failed: {why}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        step_s[(model, n)] = r["step_s"]
        print(f"{label:<16} {mesh:<6} {n:>5} {r['step_s'] * 1e3:>9.1f} {r['tokens'] / r['step_s']:>9,.0f} "
              f"{r['compute']:>8.0%} {r['communication']:>6.0%} {r['idle']:>6.0%}", flush=True)
    for n, how in ((1, "one process"), (2, "two ranks (ep=2 against dp=2)")):
        pair = step_s.get(("deepseek-tiny", n)), step_s.get(("llama-tiny-wide", n))
        if None not in pair:
            print(f"deepseek-tiny / llama-tiny-wide step time on {how}: {pair[0] / pair[1]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
