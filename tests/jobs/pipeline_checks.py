"""Run by tests/test_pipeline_executor.py under `mpiexec -n P python tests/jobs/pipeline_checks.py CASES`:
trains with every schedule in CASES on a pp=P mesh and prints, on rank 0, one JSON line per case
with the differences from the single-device run, the activation peaks next to the closed form (the
replay of the schedule, refpar/analysis/closed_forms.py), and the measured, simulated and bounding times
of the last step.

CASES is a JSON list of [kind, microbatches, chunks]."""

import json
import sys

import numpy as np

from refpar.analysis.closed_forms import activation_peak, microbatch_activation_bytes, rank_comm_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig
from refpar.engine import Plan, parallelize, train
from refpar.mesh import DeviceMesh
from refpar.schedules.simulate import critical_path_gap
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

# 8 blocks so that p=4 ranks x v=2 chunks get one block per stage; dropout on, so every mask must
# be drawn by global sample id and global layer to match.
MODEL = ModelConfig(n_layer=8, dropout=0.1, dtype="float64")
TRAIN = TrainConfig(steps=3, batch_size=8, seq_len=8, seed=7)


def main(cases) -> None:
    comm = world(Tracer())
    mesh = DeviceMesh(comm, {"pp": comm.size})
    reference = train_single_device(MODEL, TRAIN)
    for kind, m, v in cases:
        comm.tracer.clear()  # each case's bytes alone
        plan = Plan(schedule=kind, microbatches=m, chunks=v)
        par = parallelize(MODEL, TRAIN, mesh, plan)
        run = train(par)
        whole = par.states.full_params()
        diff = max(rel_diff(p, reference.params[n]) for n, p in whole.items())
        ex = par.executor
        first = min(ex.stages)
        # the closed forms: what one microbatch of the rank's first stage keeps after F, and the
        # schedule's replay of every microbatch's
        per_mb = microbatch_activation_bytes(MODEL, TRAIN, mesh.sizes, mesh.coords, first, ex.layout.n_stages,
                                             len(par.samples[0]), plan)
        mine = np.array([[diff, par.ledger.peak["activations"],
                          activation_peak(MODEL, TRAIN, mesh.sizes, mesh.coords, plan), per_mb]])
        every = comm.all_gather(mine)
        expected = {(e["axis"], e["op"]): (e["bytes_sent"], e["bytes_recv"])
                    for e in rank_comm_rows(MODEL, TRAIN, mesh.sizes, mesh.coords, plan, TRAIN.steps)}
        traced = {key: b for key, b in run.totals.items() if b != (0, 0)}
        bytes_ok = comm.all_reduce(np.array([float(traced == expected)]), op="min")[0] == 1.0
        if comm.rank == 0:
            print(json.dumps({
                "kind": kind, "m": m, "v": v,
                "losses": run.losses, "reference_losses": reference.losses,
                "max_param_rel_diff": float(every[:, 0].max()),
                "traced_bytes_equal_closed_form": bool(bytes_ok),
                "activation_peak": every[:, 1].astype(int).tolist(),
                "replayed_peak": every[:, 2].astype(int).tolist(),
                "bytes_per_microbatch": every[:, 3].astype(int).tolist(),
                "measured_makespan": run.measured.makespan,
                "simulated_makespan": run.simulated.makespan,
                "gap": critical_path_gap(run.measured, ex.schedule),
                "measured_bubble": run.measured.bubble_fraction,
                "simulated_bubble": run.simulated.bubble_fraction,
            }), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main(json.loads(sys.argv[1]))
