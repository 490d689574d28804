"""Lesson 10: aux-loss-free balancing (DeepSeek-V3 §2.1.2) evens the experts' load with no loss term.

    mpiexec -n 2 python lessons/scripts/10_aux_free.py

Two 20-step runs of the tiny GPT-2 with 8 experts, top-2 sigmoid gates, dropless, on ep=2: one
with no balancing at all (no Switch loss, no z-loss), one with the aux-free bias (gamma 0.01). The
bias is added to the router's scores only to choose the experts; after each step it moves by
gamma * sign(mean load - load) from the global counts every rank already has, so it costs no
message and is the same on both ranks. Printed: every fifth step's load imbalance (max / mean
of the tokens per expert, averaged over the 4 MoE blocks) of each run, and block 0's bias.
"""

import numpy as np

from refpar.analysis.moe import load_imbalance
from refpar.comm.communicator import world
from refpar.comm.trace import Tracer
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh

comm = world(Tracer())
config = TrainConfig(steps=20)
results = {}
for balance in ("none", "aux-free"):
    model = model_preset("tiny", moe_experts=8, moe_top_k=2, moe_dropless=True, moe_gate="sigmoid",
                         moe_balance=balance, moe_bias_rate=0.01, moe_z_loss_weight=0.0)
    par = parallelize(model, config, DeviceMesh(comm, {"ep": comm.size}), Plan())
    steps = train(par).moe_steps
    results[balance] = steps
    biases = comm.comm.allgather([s.expert_bias for s in steps])  # every rank's, to compare
    same = all(b == biases[0] for b in biases)
blocks = model.moe_blocks


def imbalance(s) -> float:
    return float(np.mean([load_imbalance(s.tokens_per_expert[i]) for i in blocks]))


if comm.rank == 0:
    print(f"8 experts, top-2, {len(blocks)} MoE blocks, ep={comm.size}; load imbalance max/mean (1 is even):")
    print("step   no balancing   aux-free   block 0's bias (aux-free, used at that step)")
    for i in range(0, config.steps, 5):
        bias = results["aux-free"][i].expert_bias.get(blocks[0], [0.0] * 8)
        none, free = imbalance(results["none"][i]), imbalance(results["aux-free"][i])
        print(f"{i + 1:4d}   {none:12.3f}   {free:8.3f}   " + " ".join(f"{b:+.2f}" for b in bias))
    last = {k: np.mean([imbalance(s) for s in v[-10:]]) for k, v in results.items()}
    print(f"last 10 steps: no balancing {last['none']:.3f}, aux-free {last['aux-free']:.3f}; "
          f"the bias is the same on every rank: {same}")
