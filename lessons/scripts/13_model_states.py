"""Lesson 13: the model states per rank of DP and ZeRO-1/2/3 in bf16-mixed, measured, next to the
ZeRO paper's 2Ψ + 2Ψ + 12Ψ and its partitioned forms; the bytes each rank sends per step.

    mpiexec -n 3 python lessons/scripts/13_model_states.py

Each row trains the tiny GPT-2 for one AdamW step with one strategy on 3 ranks. The memory ledger
(refpar/memory.py) counts every array a rank holds by category; what it holds between steps are
the model states. 3 ranks do not divide the model's pieces evenly, so the shards differ by a few
elements: the paper's Ψ/N is an average, the ledger counts each rank's own shard.
"""

from dataclasses import replace

import numpy as np

from refpar.analysis.memory import paper_model_state_bytes, unit_sizes
from refpar.comm.communicator import world
from refpar.comm.trace import Tracer
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh

STATES = ("params", "grads", "master", "optimizer")  # the model states: the ZeRO paper's categories

comm = world(Tracer())
n = comm.size
ROWS = (  # label, --precision, --zero, --fp32-grads, the paper's stage (None: not a paper form)
    ("DP fp32", "float32", 0, False, None),
    ("DP bf16-mixed", "bfloat16", 0, False, 0),
    ("ZeRO-1 (Pos)", "bfloat16", 1, False, 1),
    ("ZeRO-2 (Pos+g)", "bfloat16", 2, False, 2),
    ("ZeRO-3 (Pos+g+p)", "bfloat16", 3, False, 3),
    ("DP --fp32-grads", "bfloat16", 0, True, None),
)
config = TrainConfig(steps=1)
lines = []
for label, dtype, zero, fp32_grads, stage in ROWS:
    model = model_preset("tiny", dtype=dtype)
    first = len(comm.tracer.events)
    par = parallelize(model, replace(config, fp32_grads=fp32_grads), DeviceMesh(comm, {"dp": n}),
                      Plan(zero=zero))
    train(par)
    sent = sum(e.bytes_sent for e in comm.tracer.events[first:])
    states = comm.gather_object([par.ledger.current[c] for c in STATES] + [sent])
    if comm.rank == 0:
        psi = sum(unit_sizes(model).values())
        ranks = np.array(states)  # (n, 5): params, grads, master, optimizer, sent per rank
        paper = "" if stage is None else f"{paper_model_state_bytes(psi, n, stage):,.0f}"
        lines.append(f"{label:17}" + "".join(f"{v:>10,}" for v in ranks[0, :4])
                     + f"{ranks[0, :4].sum():>11,}{paper:>10}{ranks[0, 4]:>10,}   "
                     + ", ".join(f"{t:,}" for t in ranks[:, :4].sum(axis=1)))
if comm.rank == 0:
    print(f"Ψ = {psi:,} parameters on {n} ranks, AdamW, one step; rank 0's bytes held between steps, "
          "and sent in the step:")
    print(f"{'':17}{'params':>10}{'grads':>10}{'master':>10}{'optimizer':>10}{'total':>11}"
          f"{'paper':>10}{'sent':>10}   {'total on every rank'}")
    print("\n".join(lines))
    print(f"paper: 2Ψ + 2Ψ + 12Ψ = {16 * psi:,} for DP; ZeRO-1 2Ψ + 2Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, "
          f"ZeRO-3 16Ψ/N, with Ψ/N = {psi / n:,.1f}")
