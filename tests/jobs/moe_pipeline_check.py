"""MoE in pipeline stages and MoE checkpoints, run under mpiexec by tests/test_moe_pipeline.py.

    mpiexec -n 4 python tests/jobs/moe_pipeline_check.py /tmp/checkpoints

Prints one JSON line per run from rank 0. Training runs (pp x dp x ep meshes and schedules, and a
dp x ep mesh without a pipeline, with microbatches): the largest loss and parameter differences from the
single-device reference with the same microbatches, whether the routing statistics (dropped
assignments, tokens per expert, per block) and the aux losses are the reference's, whether every
step's traced bytes per (axis, op) and the params/grads/optimizer peaks (and in the pipelines the
activation peak, with every rank's measured and closed-form peak) equal the closed forms.
Checkpoint runs: 4 steps under one mesh, saved after step 2; resumed from there under the same mesh
(losses and parameters compared exactly), under others and on one process (each rank's loaded
slices compared exactly with the global tensors, the losses compared).
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from refpar import checkpoint
from refpar.analysis.closed_forms import rank_comm_bytes, rank_memory_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig, parse_mesh
from refpar.engine import Plan, parallelize
from refpar.engine import train as train_engine
from refpar.engine.run import full_params
from refpar.engine.sharded_state import resume_from
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

MODEL = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=4, dropout=0.1,
                    moe_experts=4, moe_top_k=2, moe_capacity_factor=0.8, moe_layers=(1, 2, 3))
TRAIN = TrainConfig(steps=3, batch_size=8, seq_len=8, lr=1e-2, seed=11)
# DeepSeek-V3's routing (refpar/model/routing.py): a shared expert, sigmoid gates, the aux-free bias (a
# rate large enough to change choices within 3 steps), the sequence-wise loss, 2 groups, 1 per token
DEEPSEEK = {"moe_shared_experts": 1, "moe_gate": "sigmoid", "moe_balance": "aux-free", "moe_bias_rate": 0.05,
            "moe_seq_aux_weight": 0.01, "moe_groups": 2, "moe_group_limit": 1}
# (mesh, schedule, microbatches, chunks, model changes); schedule None: a mesh without pp
RUNS = [
    ("pp=2,ep=2", "1f1b", 2, 1, DEEPSEEK),
    ("pp=2,ep=2", "1f1b", 2, 1, {}),
    ("pp=2,ep=2", "gpipe", 4, 1, {"moe_top_k": 1}),
    ("pp=2,ep=2", "interleaved-1f1b", 2, 2, {"moe_dropless": True}),
    ("pp=2,dp=2", "zb-h1", 2, 1, {}),
    ("pp=4", "1f1b", 4, 1, {"moe_layers": (2, 3)}),  # stages 0 and 1 hold no MoE block
    ("dp=2,ep=2", None, 2, 1, {}),
    # Megatron-Core's drop policy "probs" over 4 data ranks: every rank ranks the gathered scores
    ("dp=2,ep=2", None, 2, 1, {"moe_drop_policy": "probs"}),
    # 16-bit activations, router losses kept in fp32: the closed forms in bf16, against a bf16 device
    ("pp=2,ep=2", "zb-h1", 2, 1, {"dtype": "bfloat16"}),
]


def plan_of(schedule, m, v, cp_algo=None, sp=False) -> Plan:
    return Plan(schedule=schedule, microbatches=m, chunks=v if schedule else None, cp_algo=cp_algo, sp=sp)


def train(model, train_cfg, mesh, schedule, m, v, cp_algo=None, sp=False, **saving):
    """(the run, its Parallel, this rank's parameters whole after it)."""
    schedule = schedule if mesh.sizes["pp"] > 1 else None
    par = parallelize(model, train_cfg, mesh, plan_of(schedule, m, v, cp_algo, sp))
    run = train_engine(par, **saving)
    return run, par, full_params(par)


def all_ranks(comm, ok: bool) -> bool:
    return bool(comm.all_reduce(np.array([int(ok)]), op="min")[0])


def resume_row(group, label: str, resumed, full, same_mesh: bool, slices: bool) -> dict:
    """One resume's JSON row: its losses next to the uninterrupted run's (resumed after step 2),
    whether it is that run bit for bit (only asked of a resume on the mesh it was saved on), and
    whether every rank of `group` reassembled its tensors exactly."""
    (run, _, params), (full_run, _, full_params) = resumed, full
    same = same_mesh and run.losses == full_run.losses[2:] and all(
        np.array_equal(p, full_params[n]) for n, p in params.items())
    return {"resume": label, "first_step": run.first_step, "losses": run.losses,
            "uninterrupted": full_run.losses[2:], "exact": all_ranks(group, same),
            "reassembled": all_ranks(group, slices)}


def emit(comm, rows) -> None:
    """Each row as one JSON line on rank 0's stdout, for the test to read."""
    for row in rows:
        if comm.rank == 0:
            print(json.dumps(row), flush=True)


def check_run(comm, mesh_text, schedule, m, v, changes, cp_algo=None) -> dict:
    model = replace(MODEL, **changes)
    comm.tracer.clear()
    mesh = DeviceMesh(comm, parse_mesh(mesh_text))
    run, par, params = train(model, TRAIN, mesh, schedule, m, v, cp_algo)
    plan = par.plan
    events = [e for e in comm.tracer.events if e.step is not None]
    ref = train_single_device(model, TRAIN, microbatches=m)
    param_diff = float(comm.all_reduce(np.array([max(rel_diff(p, ref.params[n]) for n, p in params.items())]),
                                       op="max")[0])
    routing_same = all(s.dropped == {i: r.dropped[i] for i in s.dropped}
                       and s.tokens_per_expert == {i: r.tokens_per_expert[i] for i in s.tokens_per_expert}
                       and s.expert_bias == {i: r.expert_bias[i] for i in s.expert_bias}
                       for s, r in zip(run.moe_steps, ref.moe_steps, strict=True))
    bytes_ok = True
    for s in run.moe_steps:
        traced = {k: b for k, b in comm.tracer.totals(step=s.step).items() if b != (0, 0)}
        expected = rank_comm_bytes(model, TRAIN, mesh.sizes, mesh.coords, plan, s.microbatch_counts)
        bytes_ok &= traced == {key: tuple(b) for key, b in expected.items() if tuple(b) != (0, 0)}
    # what the F's caches keep until their B, replayed over the schedule, among the rest
    states = {r["category"]: r["bytes"] for r in rank_memory_rows(
        model, TRAIN, mesh.sizes, mesh.coords, plan, [s.microbatch_counts for s in run.moe_steps])}
    memory_ok = dict(par.ledger.peak) == states
    a2a = sum(e.bytes_sent for e in events if e.op == "all_to_all")

    def moved(suffix):  # (sent, received) of this rank's messages tagged h.*.mlp.router<suffix>
        tagged = [e for e in events if e.tag.endswith(suffix)]
        return np.array([[sum(e.bytes_sent for e in tagged), sum(e.bytes_recv for e in tagged)]])
    return {
        "run": f"{mesh_text} {schedule or 'without pp'} m={m} v={v} {changes}"
               + (f" {cp_algo}" if cp_algo else ""),
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
        "param_diff": param_diff,
        # relative, or absolute where the reference has no balance loss (aux-free without seq aux)
        "aux_diff": max(abs(a.aux_loss - b.aux_loss) / (abs(b.aux_loss) or 1.0)
                        for a, b in zip(run.moe_steps, ref.moe_steps, strict=True)),
        "routing_same": all_ranks(comm, routing_same),
        "dropped": [sum(s.dropped.values()) for s in ref.moe_steps],
        # aux-free balancing: the bias that routing_same compares has left zero
        "bias_moved": any(np.any(b) for s in ref.moe_steps for b in s.expert_bias.values()),
        "bytes_ok": all_ranks(comm, bytes_ok),
        "memory_ok": all_ranks(comm, memory_ok),
        "activation_peaks": comm.all_gather(np.array([[par.ledger.peak["activations"],
                                                        states["activations"]]])).tolist(),
        "all_to_all_bytes": float(comm.all_reduce(np.array([float(a2a)]))[0]),
        # every rank's (sent, received): the sequence-wise loss's counts summed over cp, and the
        # scores gathered to drop by score
        "seq_counts_bytes": comm.all_gather(moved(":seq_counts")).tolist(),
        "scores_bytes": comm.all_gather(moved(":scores")).tolist(),
    }


def reassembles_exactly(mesh, schedule, path: Path, train_cfg) -> bool:
    """Whether loading gives this rank of `mesh` (plain DP, as every run here) exactly its slices of
    the checkpoint's global tensors (read whole on one process): parameters and AdamW's m and v."""
    par = parallelize(MODEL, train_cfg, mesh, plan_of(schedule if mesh.sizes["pp"] > 1 else None, 2, 1))
    resume_from(par, str(path))
    states, u = par.states, par.states.units
    _, whole, moments = checkpoint.load_whole(str(path), MODEL, train_cfg)
    held = {"params": whole, "m": moments["m"], "v": moments["v"]}
    mine = {"params": states.params, "m": states.state["m"], "v": states.state["v"]}
    return all(np.array_equal(v, held[kind][n]) for kind, flat in mine.items() for k in u.names
               for n, v in u.views(k, u.slice(k, flat)).items())


def check_resumes(comm, saved_on, resumed_on: list, root: Path) -> list[dict]:
    """Trains 4 steps on `saved_on`, saving after steps 2 and 4; resumes from step 2 on each mesh
    of `resumed_on` ("1": one process, rank 0 alone on its own communicator) up to step 4."""
    train4 = replace(TRAIN, steps=4)
    mesh_a, sched_a = saved_on
    path = root / mesh_a.replace(",", "_")
    mesh = DeviceMesh(comm, parse_mesh(mesh_a))
    full = train(MODEL, train4, mesh, sched_a if mesh.sizes["pp"] > 1 else None, 2, 1, save=str(path),
                 save_every=2)
    out = []
    for mesh_b, sched_b in resumed_on:
        group = comm if mesh_b != "1" else comm.split(0 if comm.rank == 0 else None, key=0, axis="world")
        if group is not None:
            mesh = DeviceMesh(group, parse_mesh(mesh_b) if mesh_b != "1" else {})
            sched_b = sched_b if mesh.sizes["pp"] > 1 else None
            exact_slices = reassembles_exactly(mesh, sched_b, path / "step-00000002", train4)
            resumed = train(MODEL, train4, mesh, sched_b, 2, 1, resume=str(path / "step-00000002"))
            out.append(resume_row(group, f"{mesh_a} -> {mesh_b}", resumed, full, mesh_b == mesh_a,
                                  exact_slices))
        comm.barrier()
    return out


def main():
    comm = world(Tracer(rank=None))
    emit(comm, [check_run(comm, *run) for run in RUNS])
    root = Path(sys.argv[1])  # an empty directory every rank sees
    for saved_on, resumed_on in [(("dp=2,ep=2", None), [("dp=2,ep=2", None), ("pp=2,ep=2", "1f1b")]),
                                 (("pp=2,ep=2", "1f1b"), [("pp=2,ep=2", "1f1b"), ("ep=4", None),
                                                          ("1", None)])]:
        emit(comm, check_resumes(comm, saved_on, resumed_on, root))
    comm.barrier()


if __name__ == "__main__":
    with abort_on_error():
        main()
