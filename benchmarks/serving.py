"""The paged KV cache against the contiguous one, on a request mix of mixed lengths that share
system prompts: KV memory per rank, the largest batch a memory holds, tokens per second.

    python benchmarks/serving.py [--model small] [--memory-mib 6] [--block-size 16]
    mpiexec -n 2 python benchmarks/serving.py --mesh tp=2

The mix: 16 requests, every other one after one of two system prompts (64 and 32 tokens), user
parts of 8 to 96 tokens, 8 to 32 new tokens, two arriving per engine step. Each cache serves it
with at most 8 requests at once (its KV peak per rank, from the MemoryLedger, and tokens per
second over the passes' wall time); then each paged cache gets a pool of --memory-mib per rank and
no limit on the batch, and the table gives the most requests it ran at once. The contiguous cache
of refpar keeps exactly the cached positions (it concatenates on each append, a copy a real
allocator avoids by reserving); a preallocated contiguous cache reserves n_positions per request,
so its batch in that memory is memory / (n_positions x bytes per position), a closed form.
Prints a table, not pass/fail.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one thread per rank

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

USER_PARTS = (8, 40, 16, 96, 24, 56, 12, 72)  # tokens after the system prompt, cycled
NEW_TOKENS = (16, 32, 8, 24)
SYSTEM_PROMPTS = (64, 32)
RANK0 = {"tp": 0, "cp": 0, "pp": 0}  # holds the most: the first of uneven splits, cp's first stripe


def request_mix(config, seed: int):
    from refpar.model.data import MarkovCorpus
    from refpar.serving.requests import Request, check_requests

    corpus = MarkovCorpus(config.vocab_size, seed)

    def sample(index, length):
        return tuple(int(t) for t in corpus.batch(0, [index], length)[0][0])

    systems = [sample(100 + i, n) for i, n in enumerate(SYSTEM_PROMPTS)]
    mix = [Request(i, systems[i % 2] + sample(i, USER_PARTS[i % len(USER_PARTS)]),
                   NEW_TOKENS[i % len(NEW_TOKENS)], i // 2) for i in range(16)]
    check_requests(config, mix)
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default=None, help="tp=T,cp=C,pp=P (default: one device)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--memory-mib", type=float, default=6.0,
                        help="KV memory per rank for the batch column (6)")
    args = parser.parse_args()

    from refpar.analysis.serving import block_bytes, kv_bytes_per_rank
    from refpar.comm.communicator import abort_on_error, world
    from refpar.config import ParallelConfig, model_preset, parse_mesh
    from refpar.serving.paged import Paging
    from refpar.serving.runner import ServeOptions, run_serving
    from refpar.serving.sampling import parse_sampling

    with abort_on_error():
        comm = world()
        sizes = ParallelConfig(parse_mesh(args.mesh) if args.mesh else {}).sizes
        config = model_preset(args.model)
        mix = request_mix(config, seed=7)
        greedy = parse_sampling("greedy", seed=7)
        memory = int(args.memory_mib * 2**20)
        caches = [("contiguous", None), ("paged", Paging(args.block_size)),
                  ("paged + prefix sharing", Paging(args.block_size, prefix_sharing=True))]
        run_serving(comm, sizes, config, mix[:4], greedy, ServeOptions(max_batch=8))  # warm-up, not timed
        rows = []
        for name, paging in caches:
            s = run_serving(comm, sizes, config, mix, greedy, ServeOptions(max_batch=8, paging=paging))
            fit = None
            if paging is not None:  # the same mix in a pool of `memory` bytes, the batch unlimited
                blocks = memory // block_bytes(config, args.block_size, sizes, RANK0)
                big = run_serving(comm, sizes, config, mix, greedy, ServeOptions(
                    max_batch=len(mix), paging=Paging(args.block_size, blocks, paging.prefix_sharing)))
                if big is not None:
                    fit = max(len(held) for held in big["paged"]["pool"][0]["reserved"])
            if s is None:
                continue
            seconds = s["latency"]["prefill"]["seconds"] + s["latency"]["decode"]["seconds"]
            rows.append((name, max(k["peak_bytes"] for k in s["kv_cache"]), fit,
                         s["tokens_generated"] / seconds, s["tokens_generated"]))
        if comm.rank != 0:
            return
        # a preallocated contiguous cache: n_positions per request, whatever its length
        slab = kv_bytes_per_rank(config, [config.n_positions], sizes, RANK0)
        print(f"{args.model} ({config.dtype}) on {args.mesh or 'one device'}: {len(mix)} requests, "
              f"system prompts of {SYSTEM_PROMPTS} tokens, blocks of {args.block_size}, at most 8 at once")
        print(f"{'cache':32} {'KV peak/rank':>13} {'batch in ' + f'{args.memory_mib:g} MiB':>15} "
              f"{'tokens/s':>9}")
        print(f"{'contiguous, reserved n_positions':32} {'':>13} {memory // slab:>15} {'':>9}")
        for name, peak, fit, rate, _ in rows:
            print(f"{name:32} {peak / 2**10:>9.0f} KiB {'' if fit is None else fit:>15} {rate:>9.0f}")
        print("(the batch column of refpar's contiguous cache is not measured: it allocates exactly its "
              "positions by copying the whole cache at each append, which no server does)", flush=True)


if __name__ == "__main__":
    main()
