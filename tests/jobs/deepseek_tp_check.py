"""DeepSeek-V3 with its latent attention split over tp (refpar/parallel/mla_tensor_parallel.py) and cp
(refpar/parallel/context_parallel.py's ring and Ulysses), run under mpiexec by
tests/test_deepseek_engine.py.

    mpiexec -n 2 python tests/jobs/deepseek_tp_check.py

Prints one JSON line per run from rank 0: the largest loss and parameter (gathered over tp)
differences from the single-device reference with the same microbatches, and whether every step's
traced bytes per (axis, op) and every memory peak (activations included) equal the closed forms.
"""

from dataclasses import replace

import numpy as np

from refpar.analysis.closed_forms import rank_comm_bytes, rank_memory_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import MODEL_PRESETS, TrainConfig, parse_mesh
from refpar.engine import Plan, parallelize, validate
from refpar.engine import train as train_engine
from refpar.engine.run import full_params
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.jobs.moe_pipeline_check import all_ranks, emit
from tests.numerics import rel_diff

# deepseek-tiny cut to a dense block and a MoE block (8 routed experts, one shared)
MODEL = replace(MODEL_PRESETS["deepseek-tiny"], n_layer=2)
TRAIN = TrainConfig(steps=2, batch_size=4, seq_len=8, lr=1e-2, seed=5)
DENSE = {"moe_experts": 0, "moe_shared_experts": 0, "q_lora_rank": None}  # q_proj reads the hidden state
# (mesh, sp, schedule, microbatches, model changes, recompute, cp algorithm)
RUNS = [
    ("tp=2", False, None, 1, {}, "none", None),
    ("tp=2", True, None, 2, {}, "selective", None),
    ("tp=2", True, None, 1, DENSE, "full", None),
    ("pp=2", False, "zb-h1", 2, DENSE, "none", None),  # the weight halves B keeps for W
    # RoPE by each rank's global positions (zig-zag chunks under ring); k and v of their own widths
    ("cp=2", False, None, 2, {}, "none", "ring"),
    ("cp=2", False, None, 1, {}, "selective", "ulysses"),
]


def check_run(comm, mesh_text, sp, schedule, m, changes, recompute, cp_algo) -> dict:
    model = replace(MODEL, **changes)
    comm.tracer.clear()
    mesh = DeviceMesh(comm, parse_mesh(mesh_text))
    plan = Plan(schedule=schedule, microbatches=m, sp=sp, recompute=recompute, cp_algo=cp_algo)
    validate(model, TRAIN, mesh.sizes, plan)
    par = parallelize(model, TRAIN, mesh, plan)
    run = train_engine(par)
    whole = full_params(par)
    ref = train_single_device(model, TRAIN, microbatches=m)
    param_diff = float(comm.all_reduce(np.array([max(rel_diff(p, ref.params[n]) for n, p in whole.items())]),
                                       op="max")[0])
    kept = [s.microbatch_counts for s in run.moe_steps] if model.moe_experts else [None] * TRAIN.steps
    bytes_ok = True
    for step, counts in enumerate(kept):
        traced = {k: b for k, b in comm.tracer.totals(step=step).items() if b != (0, 0)}
        expected = rank_comm_bytes(model, TRAIN, mesh.sizes, mesh.coords, par.plan, counts)
        bytes_ok &= traced == {key: tuple(b) for key, b in expected.items() if tuple(b) != (0, 0)}
    closed = {r["category"]: r["bytes"] for r in rank_memory_rows(
        model, TRAIN, mesh.sizes, mesh.coords, par.plan, kept if model.moe_experts else None)}
    return {"run": f"{mesh_text}{' --sp' if sp else ''} {cp_algo} {schedule} m={m} {changes} {recompute}",
            "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
            "param_diff": param_diff, "bytes_ok": all_ranks(comm, bytes_ok),
            "memory_ok": all_ranks(comm, dict(par.ledger.peak) == closed)}


def main() -> None:
    comm = world(Tracer(rank=None))
    emit(comm, [check_run(comm, *run) for run in RUNS])
    comm.barrier()


if __name__ == "__main__":
    with abort_on_error():
        main()
