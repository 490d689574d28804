"""Serving on 4 ranks under several meshes, one MPI job (tests/test_serving.py runs it):

    mpiexec -n 4 python tests/jobs/serving_job.py              # GPT-2 tiny
    mpiexec -n 4 python tests/jobs/serving_job.py llama-tiny   # Llama: 4 heads, 2 kv heads
    mpiexec -n 2 python tests/jobs/serving_job.py deepseek-tiny   # MLA's latent cache: pp, cp, tp

Rank 0 prints one JSON line per mesh with what the test asserts, then the paged runs: the same
requests on tp x cp and pp x tp with blocks of 4 slots (Llama's pp x tp pool too small, so it
preempts), and (GPT-2) requests sharing a 10-token system prompt with prefix sharing on tp x cp."""

from __future__ import annotations

import json
import sys

from refpar.comm.communicator import abort_on_error, world
from refpar.config import model_preset
from refpar.serving.paged import Paging
from refpar.serving.requests import make_requests
from refpar.serving.runner import ServeOptions, run_serving
from refpar.serving.sampling import parse_sampling

RUNS = [  # mesh, sampling: every axis, alone and combined, greedy and sampled
    ({"tp": 2, "cp": 2}, "greedy"),
    ({"pp": 2, "tp": 2}, "temperature=0.8,top_k=12"),
    ({"cp": 4}, "temperature=1.3"),
    ({"pp": 4}, "greedy"),
]
LLAMA_RUNS = [  # tp below, at and past n_kv_head = 2 (each kv head then on two ranks), with cp and pp
    ({"tp": 4}, "greedy"),
    ({"tp": 2, "cp": 2}, "greedy"),
    ({"pp": 2, "tp": 2}, "temperature=0.8,top_k=12"),
]

PAGED_RUNS = [  # mesh, sampling, blocks per rank (None: room for every request at once)
    ({"tp": 2, "cp": 2}, "greedy", None),
    ({"pp": 2, "tp": 2}, "temperature=0.8,top_k=12", None),
]
# DeepSeek-V3 (tests/test_serving_mla.py), on 2 ranks: pp and cp, each contiguous and paged
DEEPSEEK_RUNS = [({"pp": 2}, "greedy"), ({"cp": 2}, "temperature=0.8,top_k=12"), ({"tp": 2}, "greedy")]
DEEPSEEK_PAGED_RUNS = [({"cp": 2}, "greedy", None), ({"pp": 2}, "greedy", 3)]  # 3 blocks: preempts
LLAMA_PAGED_RUNS = [
    ({"tp": 2, "cp": 2}, "greedy", None),
    ({"pp": 2, "tp": 2}, "temperature=0.8,top_k=12", 6),  # the longest request alone takes 6: preempts
]


def main() -> None:
    comm = world()
    name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    config = model_preset(name)
    # Different lengths arriving at different steps, more requests than slots: continuous batching.
    requests = make_requests(config, [13, 4, 22, 7, 9], [5, 8, 3, 6, 2], [0, 0, 1, 2, 4], seed=5)
    if config.arch == "deepseek-v3":
        requests = make_requests(config, [6, 3, 9], [4, 5, 3], [0, 0, 1], seed=5)
    runs, paged = {"llama": (LLAMA_RUNS, LLAMA_PAGED_RUNS),
                   "deepseek-v3": (DEEPSEEK_RUNS, DEEPSEEK_PAGED_RUNS)}.get(config.arch, (RUNS, PAGED_RUNS))
    for sizes, sampling in runs:
        s = run_serving(comm, sizes, config, requests, parse_sampling(sampling, seed=11),
                        ServeOptions(max_batch=3, seed=3, check=True))
        if s is not None:
            print(json.dumps(s), flush=True)
    for sizes, sampling, blocks in paged:
        s = run_serving(comm, sizes, config, requests, parse_sampling(sampling, seed=11),
                        ServeOptions(max_batch=3, seed=3, check=True, paging=Paging(4, blocks)))
        if s is not None:
            print(json.dumps(s), flush=True)
    if config.arch != "gpt2":
        return
    # Request 0 arrives alone and is never the newest running, so it outlives every preemption and
    # every request holds the system prompt's blocks with it. 5 blocks a rank: some must wait.
    chat = make_requests(config, [3, 5, 2, 6], [8, 4, 5, 3], [0, 1, 2, 2], seed=5, system_prompt=10)
    s = run_serving(comm, {"tp": 2, "cp": 2}, config, chat, parse_sampling("greedy", seed=11),
                    ServeOptions(max_batch=3, seed=3, check=True, paging=Paging(4, 5, True)))
    if s is not None:
        print(json.dumps(s), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
