"""Expert parallelism against the single device, run under mpiexec by tests/test_expert_parallel.py.

    mpiexec -n 4 python tests/jobs/ep_check.py "ep=4" "dp=2,ep=2"

For every mesh given and every routing case below: train a few AdamW steps with expert parallelism
and on one device (float64), and print one JSON line per run from rank 0 with the largest loss and
parameter differences, whether the routing statistics are the single device's, and whether every
step's traced bytes equal the closed forms from its routing counts.
"""

import json
import sys

import numpy as np

from refpar.analysis import moe as moe_analysis
from refpar.analysis.closed_forms import rank_comm_bytes
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig, parse_mesh
from refpar.engine import Plan, parallelize
from refpar.engine import train as train_engine
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

CASES = {
    "top1_drops": dict(moe_top_k=1, moe_capacity_factor=0.8),
    "top2_drops": dict(moe_top_k=2, moe_capacity_factor=0.8),
    "top1_dropless": dict(moe_top_k=1, moe_dropless=True),
    "top2_dropless": dict(moe_top_k=2, moe_dropless=True),
    # DeepSeek-V3's routing at once, under ZeRO-1: a shared expert, sigmoid gates, the aux-free bias
    # (a large rate, so that it changes choices within 3 steps), the sequence-wise loss, and each
    # token's experts in one of 2 groups; capacity drops by position
    "deepseek_drops": dict(moe_top_k=2, moe_capacity_factor=0.8, moe_shared_experts=1, moe_gate="sigmoid",
                           moe_balance="aux-free", moe_bias_rate=0.05, moe_seq_aux_weight=0.01,
                           moe_groups=2, moe_group_limit=1),
    # node-limited routing where it pays (DeepSeek-V3 §2.1.2): 8 experts in 4 groups of 2, top-4
    # within at most M = 2 groups; on ep=4 a group is an ep rank, so a token crosses to at most 2
    # ranks however many of its 4 experts lie there
    "group_limited": dict(moe_experts=8, moe_top_k=4, moe_dropless=True, moe_groups=4, moe_group_limit=2),
}


def pair_rows(comm, step: int) -> tuple[int, int]:
    """This rank's pairs in one step from its traced dispatches: (remote, all). A dispatch row is
    C + 2m elements (refpar/analysis/moe.py), so bytes / row bytes counts the pairs sent to the
    other ep ranks; the event's shape, its input (P, C + 2m), counts its own ep rank's pairs too."""
    events = [e for e in comm.tracer.events if e.step == step and e.tag.endswith(":dispatch")]
    remote = sum(e.bytes_sent // (e.shape[1] * np.dtype(e.dtype).itemsize) for e in events)
    return remote, sum(e.shape[0] for e in events)


def check(mesh_text: str, case: str, comm) -> dict:
    model = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=2, dropout=0.1,
                        moe_layers=(0, 1), **({"moe_experts": 4} | CASES[case]))
    train = TrainConfig(steps=3, batch_size=8, seq_len=8, lr=1e-2, seed=11)
    comm.tracer.clear()
    mesh = DeviceMesh(comm, parse_mesh(mesh_text))
    plan = Plan(zero=1 if model.moe_shared_experts else 0)
    par = parallelize(model, train, mesh, plan)
    run = train_engine(par)
    params = par.states.full_params()
    ref = train_single_device(model, train)  # the routing of every step too
    param_diff = max(rel_diff(p, ref.params[n]) for n, p in params.items())
    param_diff = float(comm.all_reduce(np.array([param_diff]), op="max")[0])
    # group-limited routing: every token's experts lie in at most M groups (from the expert ids)
    per_group = model.moe_experts // model.moe_groups
    limited = all(len(set(row)) <= (model.moe_group_limit or model.moe_groups)
                  for r in par.moe.last_routing.values() for row in np.asarray(r["experts"]) // per_group)
    bytes_ok = True
    for s in run.moe_steps:
        traced = {k: b for k, b in comm.tracer.totals(step=s.step).items() if b != (0, 0)}
        expected = rank_comm_bytes(model, train, mesh.sizes, mesh.coords, plan, s.microbatch_counts)
        bytes_ok &= traced == {key: tuple(b) for key, b in expected.items() if tuple(b) != (0, 0)}
        # rows cross ep on every rank, but where a group limit and the capacity let a rank's last
        # tokens in the queue lose every remote assignment
        bytes_ok &= traced.get(("ep", "all_to_all"), (0, 0))[0] > 0 or model.moe_group_limit is not None
        # the group limit from the trace: the rows this rank dispatched are the closed form's
        # pairs, at most M per token (M ep ranks when a group is an ep rank), and fewer than its kept
        # assignments wherever a token keeps two experts of one rank
        counts = s.microbatch_counts[0].values()  # one microbatch
        remote, rows = pair_rows(comm, s.step)
        group = mesh.axis("data").rank
        bytes_ok &= remote == sum(moe_analysis.all_to_all_rows(p, mesh.sizes["ep"], group)[0]
                                  for _, p in counts)
        bytes_ok &= rows == sum(int(p[group].sum()) for _, p in counts)
        tokens = train.batch_size * train.seq_len // mesh.sizes["dp"] // mesh.sizes["ep"]  # per MoE layer
        if model.moe_group_limit is not None:  # M groups a token, each on ep / G ranks (or one)
            ep = mesh.sizes["ep"]
            reach = min(ep, model.moe_group_limit * max(1, ep // model.moe_groups))
            limited &= rows <= reach * tokens * len(counts)
        if case == "group_limited" and mesh.sizes["ep"] == model.moe_groups:
            limited &= rows < sum(int(k[group].sum()) for k, _ in counts)  # the saving is real
    held = sum(p.nbytes for n, p in params.items() if ".mlp.experts." in n)
    bytes_ok &= held == moe_analysis.expert_param_bytes_per_rank(model, mesh.sizes["ep"],
                                                                 mesh.coords["ep"])
    bytes_ok = bool(comm.all_reduce(np.array([int(bytes_ok)]), op="min")[0])
    return {
        "mesh": mesh_text, "case": case,
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
        "param_diff": param_diff,
        "dropped": [sum(s.dropped.values()) for s in run.moe_steps],
        "same_dropped": [s.dropped for s in run.moe_steps] == [s.dropped for s in ref.moe_steps],
        "same_tokens_per_expert": [s.tokens_per_expert for s in run.moe_steps]
        == [s.tokens_per_expert for s in ref.moe_steps],
        "same_aux": max(abs(a.aux_loss - b.aux_loss) / b.aux_loss
                        for a, b in zip(run.moe_steps, ref.moe_steps, strict=True)),
        "bytes_match": bytes_ok,  # traced comm and held expert bytes == closed forms
        "same_bias": [s.expert_bias for s in run.moe_steps] == [s.expert_bias for s in ref.moe_steps],
        "bias_moved": any(b for s in run.moe_steps for b in s.expert_bias.values()),
        # expert ids in at most M groups; from the trace, at most the ranks of M groups a token,
        # and fewer rows than kept assignments (group_limited on ep=4)
        "group_limited": bool(comm.all_reduce(np.array([int(limited)]), op="min")[0]),
    }


def main():
    comm = world(Tracer(rank=None))
    for mesh_text in sys.argv[1:]:
        for case in CASES:
            result = check(mesh_text, case, comm)
            if comm.rank == 0:
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
