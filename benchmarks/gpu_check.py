"""The GPU check: refpar's strategies on a real NVIDIA GPU, exact against NumPy, then how fast.

    python benchmarks/gpu_check.py [--ranks 2] [--batch-size 8] [--seq-len 1024] [--steps 5]

1. The equivalence matrix (tests/jobs/backend_job.py): ZeRO-3, tp+sp, the 1F1B pipeline and expert
   parallelism on 2 ranks, the dp=2, tp=2, pp=2 engine on 8, all sharing the one GPU, with
   `--backend torch --device cuda` and `--backend cupy` (when CuPy is installed); float64, each
   against the NumPy single-device run (<= 1e-10). Communication is staged through host buffers,
   then once more with the torch.distributed transport (NCCL) for torch where there is a GPU per
   rank (NCCL refuses two ranks of a group on one GPU).
2. The device's measured matmul rate (an 8192^3 matmul) in float32 and bf16.
3. One training step (forward, backward, AdamW) of a larger GPT-2 on one GPU in float32 and bf16,
   with the achieved TFLOP/s (refpar.analysis.flops, no recomputation) next to that matmul rate.

Prints ratios and tables, not pass/fail; exits 1 if an equivalence run differs or fails. On a
machine without an NVIDIA GPU it says so in one sentence and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOL = 1e-10
MATRIX = [(2, ["zero3", "tp_sp", "pp_1f1b", "ep"]), (8, ["3d"])]


def gpu_name() -> str | None:
    """The first NVIDIA GPU's name as torch or CuPy sees it, or None."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - no CuPy, or no driver: either way no GPU through CuPy
        pass
    return None


def has_cupy() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - see gpu_name
        return False


def equivalence(spec: str, transport: str = "mpi", matrix=MATRIX) -> bool:
    """Runs `matrix` on backend `spec` over `transport`; prints one row per strategy; True when
    all match."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ok = True
    for n, names in matrix:
        proc = subprocess.run([str(mpiexec), "-n", str(n), sys.executable, "tests/jobs/backend_job.py", spec,
                               json.dumps(names), transport], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or len(rows) != len(names):
            print(f"  {spec:10s} {n} ranks {names}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            ok = False
            continue
        for r in rows:
            loss = max(x["loss_rel_diff"] for x in r["ranks"])
            param = max(x["param_rel_diff"] for x in r["ranks"])
            held = sorted({ns for x in r["ranks"] for ns in x["namespaces"]})
            algos = sorted({a for x in r["ranks"] for a in x["algos"]})
            staged = any(True in x["staged"] for x in r["ranks"])
            good = loss <= TOL and param <= TOL
            ok &= good
            print(f"  {spec:10s} {r['strategy']:8s} {n} ranks  loss {loss:.1e}  params {param:.1e}  "
                  f"arrays {','.join(held)}  staged {staged}  algos {','.join(algos)}  "
                  f"{'ok' if good else 'DIFFERS'}", flush=True)
    return ok


def matmul_tflops(torch, dtype, n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def step_seconds(torch, model, params, batch: int, seq: int, steps: int, dtype) -> float:
    """Median seconds of one forward + backward + AdamW step of refpar's model on torch CUDA."""
    from refpar.config import TrainConfig
    from refpar.model.data import MarkovCorpus
    from refpar.model.gpt import loss_and_grads
    from refpar.model.optim import optimizer_init, optimizer_step

    train = TrainConfig(batch_size=batch, seq_len=seq)
    params = {n: p.to(dtype) for n, p in params.items()}
    state = optimizer_init(params, train)
    corpus = MarkovCorpus(model.vocab_size, 0)
    times = []
    for step in range(steps + 1):  # the first step warms up the kernels and the allocator
        tokens, targets = corpus.batch(step, range(batch), seq)
        tokens, targets = torch.asarray(tokens, device="cuda"), torch.asarray(targets, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        _, grads = loss_and_grads(params, tokens, targets, model, step=step, training=False)
        params, state = optimizer_step(params, grads, state, train, lr=train.lr)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def speed(args) -> None:
    import torch

    from refpar import backend
    from refpar.analysis.flops import model_flops
    from refpar.analysis.presets import from_model_config
    from refpar.config import ModelConfig
    from refpar.model.gpt import init_params

    model = ModelConfig(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.n_embd,
                        n_head=args.n_head, n_layer=args.n_layer, dropout=0.0, dtype="float32")
    host = backend.use("torch", "cuda").from_host(init_params(model, 0))
    flops = float(model_flops(from_model_config(model), args.batch_size, args.seq_len))
    print(f"GPT-2 L={model.n_layer} C={model.n_embd} nh={model.n_head} V={model.vocab_size}, batch "
          f"{args.batch_size} x {args.seq_len}: {flops / 1e12:.2f} TFLOP per step (no recomputation)")
    print(f"  {'dtype':9s} {'matmul TFLOP/s':>15s} {'step ms':>9s} {'step TFLOP/s':>13s} {'of matmul':>10s}")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        try:
            peak = matmul_tflops(torch, dtype)
            seconds = step_seconds(torch, model, host, args.batch_size, args.seq_len, args.steps, dtype)
        except (RuntimeError, TypeError) as err:  # a dtype this GPU or the model code cannot run
            print(f"  {name:9s} not supported here: {str(err).splitlines()[0]}")
            continue
        achieved = flops / seconds / 1e12
        print(f"  {name:9s} {peak:>15.1f} {seconds * 1e3:>9.1f} {achieved:>13.1f} {achieved / peak:>10.0%}",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    parser.add_argument("--skip-matrix", action="store_true", help="only the speed table")
    args = parser.parse_args()
    name = gpu_name()
    if name is None:
        print("gpu_check: no NVIDIA GPU is present on this machine (neither torch.cuda nor CuPy "
              "sees one), so there is nothing to check here.", file=sys.stderr)
        return 1
    print(f"GPU: {name}", flush=True)
    ok = True
    if not args.skip_matrix:
        print("equivalence with the NumPy single device (float64, ranks sharing the GPU):")
        ok &= equivalence("torch:cuda")
        import torch

        gpus = torch.cuda.device_count()
        fits = [(n, names) for n, names in MATRIX if n <= gpus]  # NCCL: one GPU per rank
        if fits:
            print("the same with torch.distributed (NCCL) carrying the collectives it can:")
            ok &= equivalence("torch:cuda", "torch.distributed", fits)
        else:
            print(f"  torch.distributed (NCCL) needs a GPU per rank and this machine has {gpus}, "
                  "so the NCCL transport is not run")
        if has_cupy():
            ok &= equivalence("cupy")
        else:
            print("  cupy: not installed here, so the CuPy column is not run")
    speed(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
