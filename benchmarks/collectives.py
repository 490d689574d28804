"""Each written-out collective next to MPI's own: time, ratio, bus bandwidth, and tracing overhead.

    python benchmarks/collectives.py                         # launches 2, 4 and 8 ranks itself
    python benchmarks/collectives.py --ranks 4 --sizes 8M,64M
    mpiexec -n 4 python benchmarks/collectives.py --worker   # one job, JSON lines on rank 0

Prints ratios, not pass/fail. Bus bandwidth follows nccl-tests: algorithm bandwidth (tensor bytes /
time) times 2(p-1)/p for all-reduce, (p-1)/p for reduce-scatter, all-gather and all-to-all, 1 for
broadcast, so it compares with the memcpy bandwidth of the machine whatever p is; the "/ memcpy"
columns divide it by the memcpy bandwidth of one core measured at the start of the same run, and a
second table puts each size's ring reduce-scatter next to its ring all-reduce. "size" is the
full tensor: the all-reduce input, the all-gather output, what one rank sends in an all-to-all.
On a machine with fewer cores than ranks the ranks share cores and times say more about the
scheduler than about the algorithms; the table header prints the core count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from refpar.comm.cost import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent

# What a ring reduce-scatter can cost next to the ring all-reduce that contains it, from the bytes
# each touches in memory per element of a chunk it moves (algorithms.py counts the messages and
# reductions): a message through MPICH's shared memory is two copies, read and write each (4); the
# in-place sum reads two operands and writes one (3). Reduce-scatter 4 + 3, all-reduce that plus the
# all-gather's 4: 7/11 whatever p is. Even a reduction reading its peer's chunk straight from shared
# memory (no message) gives 3 / (3 + 2) = 0.6, so the time of the sum keeps the ratio above 1/2.
RS_OVER_AR = 7 / 11


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def bus_factor(op: str, p: int) -> float:
    return {"all_reduce": 2 * (p - 1) / p, "broadcast": 1.0}.get(op, (p - 1) / p)


def call(comm, op: str, algo: str, x: np.ndarray, chunks: list[np.ndarray]):
    if op == "all_to_all":
        return comm.all_to_all(chunks, algo=algo, recv_counts=[c.shape[0] for c in chunks])
    if op == "all_gather":
        return comm.all_gather(chunks[comm.rank], algo=algo, counts=[c.shape[0] for c in chunks])
    if op == "broadcast":
        return comm.broadcast(x, root=0, algo=algo)
    return getattr(comm, op)(x, algo=algo)


def seconds_per_call(comm, reps: int, fn, *args) -> float:
    """Median of fn(*args) over reps on each rank, then the slowest rank: a collective ends when its
    last rank does."""
    fn(*args)  # warm up: first-touch page faults, MPI connection setup
    times = []
    for _ in range(reps):
        comm.barrier()
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return float(comm.all_reduce(np.array([np.median(times)]), op="max")[0])


def worker(sizes: list[int]) -> None:
    from refpar.allocator import keep_freed_memory
    from refpar.comm.communicator import abort_on_error, world
    from refpar.comm.trace import Tracer
    from refpar.sharding import shard_range

    # As training runs (refpar/allocator.py): each call's output reuses the pages the one before
    # freed; else every call's fresh mmap faults its pages in zeroed, 0.3 ms of an 8 MB call here.
    keep_freed_memory()
    with abort_on_error():
        comm = world()
        p = comm.size
        for size in sizes:
            n = size // 8
            x = np.random.default_rng(comm.rank).standard_normal(n)  # (n,) float64
            chunks = [x[slice(*shard_range(n, p, i))].copy() for i in range(p)]  # (n/p,) each
            reps = int(min(20, max(7, (64 << 20) // max(size, 1) // 4)))  # a median of 7 at least
            for op, algos in ALGORITHMS.items():
                native = seconds_per_call(comm, reps, call, comm, op, "native", x, chunks)
                for algo in algos:
                    t = seconds_per_call(comm, reps, call, comm, op, algo, x, chunks)
                    if comm.rank == 0:
                        print(json.dumps({"ranks": p, "op": op, "algo": algo, "size": size,
                                          "native_s": native, "algo_s": t}), flush=True)
        # Tracing overhead: the same native all-reduce with and without a tracer, alternating in
        # rounds so that the load of a shared machine falls on both alike; the best round of each.
        traced = world(Tracer())
        for size in (1 << 10, 8 << 20):
            x = np.ones(size // 8)
            reps = 100 if size < (1 << 20) else 5
            off = on = float("inf")
            for _ in range(5):
                off = min(off, seconds_per_call(comm, reps, comm.all_reduce, x))
                on = min(on, seconds_per_call(traced, reps, traced.all_reduce, x))
            record = recording_cost(comm)  # every rank: split is collective
            if comm.rank == 0:
                print(json.dumps({"ranks": p, "tracing": True, "size": size, "off_s": off, "on_s": on,
                                  "record_s": record}), flush=True)


def recording_cost(comm, calls: int = 20000) -> float:
    """Seconds a tracer adds to one call, measured on a one-rank group (where the collective is a
    copy), so the noise of other ranks on a shared machine does not drown it."""
    from refpar.comm.trace import Tracer

    plain = comm.split(comm.rank, axis="self")
    traced = comm.split(comm.rank, axis="self")
    traced.tracer = Tracer(rank=comm.rank)
    x = np.ones(128)
    best = {}
    for _ in range(3):
        for name, c in (("plain", plain), ("traced", traced)):
            start = time.perf_counter()
            for _ in range(calls):
                c.all_reduce(x)
            best[name] = min(best.get(name, np.inf), (time.perf_counter() - start) / calls)
        traced.tracer.clear()
    return best["traced"] - best["plain"]


def memcpy_bandwidth(size: int = 64 << 20) -> float:
    """Bytes copied per second by one core (np.copyto of a warm buffer), the ceiling for bus bandwidth."""
    src, dst = np.ones(size // 8), np.empty(size // 8)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return size / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def human(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated job sizes")
    parser.add_argument("--sizes", default="1K,64K,1M,8M,64M", help="tensor sizes, e.g. 1K,8M")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per MPI job")
    parser.add_argument("--worker", action="store_true", help="run as one rank of an mpiexec job")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes)
        return
    memcpy = memcpy_bandwidth()
    print(f"# {os.cpu_count()} cores; memcpy (np.copyto, 64 MB, one core): {memcpy / 1e9:.2f} GB/s",
          flush=True)
    print("| ranks | op | algo | size | native ms | algo ms | algo/native throughput | native busbw GB/s "
          "| algo busbw GB/s | native / memcpy | algo / memcpy |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    overhead, ring_ms = [], {}
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for ranks in (int(r) for r in args.ranks.split(",")):
        cmd = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker", "--sizes", args.sizes]
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired as err:
            out = err.stdout or b""  # bytes even with text=True (Python's TimeoutExpired)
            lines = (out.decode() if isinstance(out, bytes) else out).splitlines()
            print(f"# {ranks} ranks: stopped after {args.timeout:g} s; rows so far below", flush=True)
        else:
            lines = proc.stdout.splitlines()
            if proc.returncode != 0:
                print(f"# {ranks} ranks failed: {proc.stderr.strip()[-500:]}", flush=True)
        for row in map(json.loads, filter(None, lines)):
            if row.get("tracing"):
                overhead.append(row)
                continue
            p, size = row["ranks"], row["size"]
            busbw = size * bus_factor(row["op"], p)  # bytes/s at 1 s per call
            print(f"| {p} | {row['op']} | {row['algo']} | {human(size)} | {row['native_s'] * 1e3:.3f} "
                  f"| {row['algo_s'] * 1e3:.3f} | {row['native_s'] / row['algo_s']:.2f} "
                  f"| {busbw / row['native_s'] / 1e9:.2f} | {busbw / row['algo_s'] / 1e9:.2f} "
                  f"| {busbw / row['native_s'] / memcpy:.2f} | {busbw / row['algo_s'] / memcpy:.2f} |",
                  flush=True)
            if row["algo"] == "ring" and row["op"] in ("all_reduce", "reduce_scatter"):
                ring_ms.setdefault((p, size), {})[row["op"]] = row["algo_s"] * 1e3
    print("\n| ranks | size | ring all_reduce ms | ring reduce_scatter ms | reduce_scatter / all_reduce "
          "| memory-traffic bound |")
    print("|---|---|---|---|---|---|")
    for (p, size), ms in ring_ms.items():
        if len(ms) == 2:
            print(f"| {p} | {human(size)} | {ms['all_reduce']:.3f} | {ms['reduce_scatter']:.3f} "
                  f"| {ms['reduce_scatter'] / ms['all_reduce']:.2f} | {RS_OVER_AR:.2f} |", flush=True)
    print("\n| ranks | all_reduce size | untraced ms | traced ms | measured overhead | recording us/call "
          "| recording / untraced |")
    print("|---|---|---|---|---|---|---|")
    for row in overhead:
        print(f"| {row['ranks']} | {human(row['size'])} | {row['off_s'] * 1e3:.4f} | {row['on_s'] * 1e3:.4f} "
              f"| {(row['on_s'] / row['off_s'] - 1) * 100:+.1f}% | {row['record_s'] * 1e6:.1f} "
              f"| {row['record_s'] / row['off_s'] * 100:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
