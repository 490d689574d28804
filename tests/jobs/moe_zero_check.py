"""ZeRO-1/2/3 and FSDP in MoE runs (refpar/parallel/zero.py and fsdp.py over each unit's replica
group), run under mpiexec -n 4 by tests/test_moe_zero.py.

    mpiexec -n 4 python tests/jobs/moe_zero_check.py /tmp/checkpoints

Prints one JSON line per run from rank 0. Training runs: the largest loss and parameter
differences from the single device with the same microbatches, whether the routing is the
reference's, whether every step's traced bytes per (axis, op) and every memory peak equal
refpar/analysis/closed_forms.py's closed forms, and the optimizer peak next to the unsharded run's.
Checkpoint runs: 4 steps saved after step 2 under ZeRO, resumed from there under the same mesh and
ZeRO stage (compared exactly) and under other meshes, stages and one process.
"""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from refpar.analysis.closed_forms import rank_comm_bytes, rank_memory_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import parse_mesh
from refpar.engine import Plan, parallelize
from refpar.engine import train as train_engine
from refpar.engine.run import full_params
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.jobs.moe_pipeline_check import MODEL, TRAIN, all_ranks, emit, reassembles_exactly, resume_row
from tests.numerics import rel_diff

# (mesh, zero, fsdp, schedule, chunks, precision[, cp_algo[, sp]]): every run 2 microbatches
RUNS = [
    ("dp=2,ep=2", 1, False, "1f1b", 1, None),
    ("dp=2,ep=2", 2, False, "1f1b", 1, None),
    ("dp=2,ep=2", 3, False, "1f1b", 1, None),
    ("dp=2,ep=2", 3, True, "1f1b", 1, None),
    ("pp=2,ep=2", 3, True, "1f1b", 1, None),  # dp=1: each ep rank keeps its experts' state whole
    ("pp=2,dp=2", 2, False, "interleaved-1f1b", 2, None),  # ep=1: data = dp; wte one unit per rank
    # fp16 with fp32 gradients: 16-bit gathers, float32 reduce-scatters, the overflow flag over data
    ("dp=2,ep=2", 2, False, "1f1b", 1, "float16"),
    # cp: dense weights over dp x cp, experts over dp x cp (axis dp_cp), Ulysses attention
    ("dp=2,cp=2", 3, False, "1f1b", 1, None, "ulysses"),
    # tp: ZeRO shards each rank's tp shards; under sp the sequence-sharded gradients summed over tp
    # before ZeRO-1's reduce-scatter, on the shards under FSDP
    ("ep=2,tp=2", 1, False, "1f1b", 1, None, None, True),
    ("ep=2,tp=2", 3, True, "1f1b", 1, None, None, True),
    # ZeRO-3's stage-wide gather (MoEZeroThreeStage) and ZeRO-2 of tp shards; ZeRO x cp x tp with sp
    # inside each cp rank's tokens; fp16 with tp: the overflow flag agreed over tp too
    ("dp=2,tp=2", 3, False, "1f1b", 1, None),
    ("dp=2,tp=2", 2, False, "1f1b", 1, None),
    ("cp=2,tp=2", 2, False, "1f1b", 1, None, "ring", True),
    ("ep=2,tp=2", 2, False, "1f1b", 1, "float16", None, True),
]
M = 2


def traced_by_step(comm, step) -> dict:
    return {k: v for k, v in comm.tracer.totals(step=step).items()
            if v != (0, 0)}  # a one-rank group's calls move nothing


def plan_of(mesh, zero, fsdp, schedule="1f1b", chunks=1, cp_algo=None, sp=False) -> Plan:
    piped = mesh.sizes["pp"] > 1
    return Plan(schedule=schedule if piped else None, microbatches=M, chunks=chunks if piped else None,
                cp_algo=cp_algo, zero=0 if fsdp else zero, fsdp=fsdp, sp=sp)


def check_run(comm, mesh_text, zero, fsdp, schedule, chunks, dtype, cp_algo=None, sp=False) -> dict:
    model = MODEL if dtype is None else replace(MODEL, dtype=dtype)
    train_cfg = TRAIN if dtype is None else replace(TRAIN, fp32_grads=True)
    comm.tracer.clear()
    mesh = DeviceMesh(comm, parse_mesh(mesh_text))
    plan = plan_of(mesh, zero, fsdp, schedule, chunks, cp_algo, sp)
    par = parallelize(model, train_cfg, mesh, plan)
    run = train_engine(par)
    events = list(comm.tracer.events)
    ref = train_single_device(model, train_cfg, microbatches=M)
    param_diff = float(comm.all_reduce(np.array([max(rel_diff(p, ref.params[n]) for n, p in
                                                    full_params(par).items())]), op="max")[0])
    routing_same = all(s.dropped == {i: r.dropped[i] for i in s.dropped}
                       for s, r in zip(run.moe_steps, ref.moe_steps, strict=True))
    bytes_ok = True
    for s in run.moe_steps:
        expected = rank_comm_bytes(model, train_cfg, mesh.sizes, mesh.coords, plan, s.microbatch_counts)
        bytes_ok &= traced_by_step(comm, s.step) == {
            key: tuple(b) for key, b in expected.items() if tuple(b) != (0, 0)}
    kept = [s.microbatch_counts for s in run.moe_steps]

    def peaks(p):
        return {r["category"]: r["bytes"]
                for r in rank_memory_rows(model, train_cfg, mesh.sizes, mesh.coords, p, kept)}

    states, unsharded = peaks(plan), peaks(plan_of(mesh, 0, False, schedule, chunks, cp_algo, sp))
    axes = sorted({f"{e.axis}:{e.op}" for e in events if e.step is not None and e.bytes_sent})
    return {
        "run": f"{mesh_text} {'fsdp' if fsdp else f'zero {zero}'} {schedule} v={chunks} {model.dtype}"
               + (f" {cp_algo}" if cp_algo else "") + (" sp" if sp else ""),
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
        "param_diff": param_diff,
        "routing_same": all_ranks(comm, routing_same),
        "bytes_ok": all_ranks(comm, bytes_ok),
        "memory_ok": all_ranks(comm, dict(par.ledger.peak) == states),
        "master_peaks": comm.gather_object([par.ledger.peak["master"], unsharded["master"]]),
        "optimizer_peaks": comm.gather_object([par.ledger.peak["optimizer"], unsharded["optimizer"]]),
        "axes": comm.gather_object(axes),
    }


def train(mesh, spec: str, train_cfg, **saving):
    """spec: "zero K", "fsdp" or "plain" (no ZeRO); (the run, its Parallel, its parameters whole)."""
    zero, fsdp = (3, True) if spec == "fsdp" else (0, False) if spec == "plain" else (int(spec[-1]), False)
    par = parallelize(MODEL, train_cfg, mesh, plan_of(mesh, zero, fsdp))
    run = train_engine(par, **saving)
    return run, par, full_params(par)


def check_resumes(comm, saved_on: tuple, resumed_on: list, root: Path) -> list[dict]:
    """Trains 4 steps on `saved_on` (mesh, spec), saving after steps 2 and 4; resumes from step 2
    on each of `resumed_on` ("1": one process, rank 0 alone; "ep=2": ranks 0 and 1) up to step 4."""
    train4 = replace(TRAIN, steps=4)
    mesh_a, spec_a = saved_on
    path = root / f"{mesh_a}_{spec_a}".replace(",", "_").replace(" ", "")
    full = train(DeviceMesh(comm, parse_mesh(mesh_a)), spec_a, train4, save=str(path), save_every=2)
    step2 = path / "step-00000002"
    out = []
    for mesh_b, spec_b in resumed_on:
        sizes = parse_mesh(mesh_b) if mesh_b != "1" else {}
        n = int(np.prod(list(sizes.values()))) if sizes else 1
        group = comm if n == comm.size else comm.split(0 if comm.rank < n else None, key=comm.rank,
                                                          axis="world")
        if group is not None:
            mesh = DeviceMesh(group, sizes)
            # a run without ZeRO loads whole tensors: check them against the global ones
            slices = spec_b != "plain" or reassembles_exactly(mesh, "1f1b", step2, train4)
            resumed = train(mesh, spec_b, train4, resume=str(step2))
            out.append(resume_row(group, f"{mesh_a} {spec_a} -> {mesh_b} {spec_b}", resumed, full,
                                  (mesh_b, spec_b) == saved_on, slices))
        comm.barrier()
    return out


def main():
    comm = world(Tracer(rank=None))
    emit(comm, [check_run(comm, *run) for run in RUNS])
    root = Path(sys.argv[1])  # an empty directory every rank sees
    for saved_on, resumed_on in [
        (("dp=2,ep=2", "zero 1"), [("dp=2,ep=2", "zero 1"), ("ep=2", "plain"), ("1", "plain")]),
        (("pp=2,ep=2", "fsdp"), [("pp=2,ep=2", "fsdp"), ("dp=2,ep=2", "zero 2")]),
        (("ep=2,cp=2", "zero 2"), [("ep=2,cp=2", "zero 2"), ("ep=2", "plain")]),
        (("ep=2,tp=2", "zero 1"), [("ep=2,tp=2", "zero 1"), ("ep=2", "plain")]),
    ]:
        emit(comm, check_resumes(comm, saved_on, resumed_on, root))
    comm.barrier()


if __name__ == "__main__":
    with abort_on_error():
        main()
