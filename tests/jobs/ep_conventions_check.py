"""The routing conventions under expert parallelism against the single device, run under mpiexec by
tests/test_moe_conventions.py.

    mpiexec -n 2 python tests/jobs/ep_conventions_check.py

For each case below: 3 AdamW steps on ep=2 and on one device (float64); rank 0 prints one JSON line
with the largest loss and parameter differences, whether the routing statistics are the single
device's, and how far the single device's losses move when the group score takes the other
convention (so that a run ignoring the option would show).
"""

import json
from dataclasses import replace

import numpy as np

from refpar.comm.communicator import abort_on_error, world
from refpar.config import ModelConfig, TrainConfig, parse_mesh
from refpar.engine import Plan, parallelize
from refpar.engine import train as train_engine
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

BASE = dict(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=2, moe_experts=8, moe_top_k=3,
            moe_groups=4, moe_group_limit=2, moe_routed_scaling_factor=2.5)
CASES = {
    # Llama's SwiGLU shared experts, DeepSeek-V3's sigmoid gates unnormalised and scaled, the aux-free
    # bias (a large rate, so that it moves choices within 3 steps), Megatron's group score
    # (floor(3/2) = 1 per group), dropless
    "llama_megatron_unnormalised": dict(arch="llama", intermediate_size=24, dropout=0.0, moe_shared_experts=2,
                                        moe_gate="sigmoid", moe_balance="aux-free", moe_bias_rate=0.05,
                                        moe_norm_topk_prob=False, moe_group_score="megatron",
                                        moe_dropless=True),
    # GPT-2, softmax gates normalised and scaled, DeepSeek's group score (the best 2), drops by score
    "gpt2_deepseek_drops": dict(moe_shared_experts=1, moe_group_score="deepseek", moe_capacity_factor=0.8,
                                moe_drop_policy="probs"),
}
OTHER = {"megatron": "deepseek", "deepseek": "megatron"}


def check(case: str, comm) -> dict:
    model = ModelConfig(**(BASE | CASES[case]))
    train = TrainConfig(steps=3, batch_size=8, seq_len=8, lr=1e-2, seed=11)
    mesh = DeviceMesh(comm, parse_mesh("ep=2"))
    par = parallelize(model, train, mesh, Plan())
    run = train_engine(par)
    params = par.states.full_params()
    ref = train_single_device(model, train)
    other = train_single_device(replace(model, moe_group_score=OTHER[model.moe_group_score]), train)
    param_diff = max(rel_diff(p, ref.params[n]) for n, p in params.items())
    param_diff = float(comm.all_reduce(np.array([param_diff]), op="max")[0])
    return {
        "case": case,
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
        "param_diff": param_diff,
        "same_dropped": [s.dropped for s in run.moe_steps] == [s.dropped for s in ref.moe_steps],
        "dropped": sum(sum(s.dropped.values()) for s in run.moe_steps),
        "same_tokens_per_expert": [s.tokens_per_expert for s in run.moe_steps]
        == [s.tokens_per_expert for s in ref.moe_steps],
        "same_bias": [s.expert_bias for s in run.moe_steps] == [s.expert_bias for s in ref.moe_steps],
        "bias_moved": any(b for s in run.moe_steps for b in s.expert_bias.values()),
        "other_convention_loss_diff": max(abs(a - b) / abs(b)
                                          for a, b in zip(other.losses, ref.losses, strict=True)),
    }


def main():
    comm = world()
    for case in CASES:
        result = check(case, comm)
        if comm.rank == 0:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
