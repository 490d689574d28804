"""MoE with context parallelism (refpar/engine on pp x dp x ep x cp), run under mpiexec by
tests/test_moe_cp.py.

    mpiexec -n 4 python tests/jobs/moe_cp_check.py /tmp/checkpoints

Prints one JSON line per run from rank 0. Training runs (ep x cp ring, with Switch's and with
DeepSeek-V3's routing and dropping by score, dp x cp Ulysses, pp x cp ring, each with 2 microbatches):
tests/jobs/moe_pipeline_check.check_run's comparison with the single device (losses, parameters,
aux losses, the routing and expert bias of every block) and its closed-form
checks of every step's bytes and the params/grads/optimizer peaks. Checkpoint runs: 4 steps under
ep=2,cp=2 (ring), saved after step 2; resumed from there under the same mesh (losses and
parameters compared exactly) and under dp=2,ep=2, a mesh without cp (each rank's loaded tensors
compared exactly with the global ones, the losses compared).
"""

import sys
from dataclasses import replace
from pathlib import Path

from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import parse_mesh
from refpar.mesh import DeviceMesh
from tests.jobs.moe_pipeline_check import (
    DEEPSEEK,
    MODEL,
    TRAIN,
    check_run,
    emit,
    reassembles_exactly,
    resume_row,
    train,
)

# (mesh, schedule, microbatches, chunks, model changes, cp algorithm)
RUNS = [
    ("ep=2,cp=2", "1f1b", 2, 1, {}, "ring"),
    # DeepSeek-V3's routing over ring cp: shared expert, sigmoid gates, aux-free bias, sequence-wise
    # loss (its counts summed over cp), 2 groups, 1 per token, capacity dropping by position
    # (moe_pipeline_check.DEEPSEEK)
    ("ep=2,cp=2", "1f1b", 2, 1, DEEPSEEK, "ring"),
    # Megatron-Core's drop policy "probs": the scores gathered over the dp x ep x cp data ranks
    ("ep=2,cp=2", "1f1b", 2, 1, {"moe_drop_policy": "probs"}, "ring"),
    ("dp=2,cp=2", "1f1b", 2, 1, {"moe_top_k": 1}, "ulysses"),
    ("pp=2,cp=2", "1f1b", 2, 1, {}, "ring"),
]
SAVED_ON = ("ep=2,cp=2", "1f1b", "ring")
RESUMED_ON = [("ep=2,cp=2", "1f1b", "ring"), ("dp=2,ep=2", None, None)]


def check_resumes(comm, root: Path) -> list[dict]:
    train4 = replace(TRAIN, steps=4)
    mesh_a, sched_a, algo_a = SAVED_ON
    path = root / "ep_cp"
    full = train(MODEL, train4, DeviceMesh(comm, parse_mesh(mesh_a)), sched_a, 2, 1, algo_a,
                 save=str(path), save_every=2)
    out = []
    for mesh_b, sched_b, algo_b in RESUMED_ON:
        mesh = DeviceMesh(comm, parse_mesh(mesh_b))
        exact_slices = reassembles_exactly(mesh, sched_b, path / "step-00000002", train4)
        resumed = train(MODEL, train4, mesh, sched_b, 2, 1, algo_b, resume=str(path / "step-00000002"))
        out.append(resume_row(comm, f"{mesh_a} -> {mesh_b}", resumed, full, mesh_b == mesh_a,
                              exact_slices))
    return out


def main():
    comm = world(Tracer(rank=None))
    emit(comm, [check_run(comm, *run) for run in RUNS])
    emit(comm, check_resumes(comm, Path(sys.argv[1])))
    comm.barrier()


if __name__ == "__main__":
    with abort_on_error():
        main()
