"""One MPI job that trains several strategies on a chosen backend and compares each with the NumPy
single-device run; rank 0 prints one JSON line per strategy. Run by tests/test_backends.py:

    mpiexec -n 2 python tests/jobs/backend_job.py torch,array-api-strict '["zero3", "tp_sp", "pp_1f1b", "ep"]'
    mpiexec -n 8 python tests/jobs/backend_job.py torch '["3d"]'
    mpiexec -n 2 python tests/jobs/backend_job.py torch '["tp_sp"]' torch.distributed   # the transport

On a GPU machine benchmarks/gpu_check.py runs it with `torch:cuda` and `cupy`.
"""

from __future__ import annotations

import json
import sys

from refpar import backend
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan, parallelize, train
from refpar.engine.run import full_params
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

TRAIN = TrainConfig(steps=2, batch_size=4, seq_len=16)
MESHES = {"zero3": {"dp": 2}, "tp_sp": {"tp": 2}, "cp_ulysses": {"cp": 2}, "pp_1f1b": {"pp": 2},
          "ep": {"ep": 2}, "3d": {"dp": 2, "tp": 2, "pp": 2}}


PLANS = {"zero3": Plan(zero=3), "tp_sp": Plan(sp=True), "cp_ulysses": Plan(cp_algo="ulysses"),
         "pp_1f1b": Plan(microbatches=2), "ep": Plan(), "3d": Plan(microbatches=2)}


def train_on(name: str, comm):
    """(losses, arrays the run holds, this rank's parameters whole on the host, the reference's
    losses and parameters)."""
    model = model_preset("tiny", moe_experts=4 if name == "ep" else 0)
    par = parallelize(model, TRAIN, DeviceMesh(comm, MESHES[name]), PLANS[name])
    run, ref = train(par), train_single_device(model, TRAIN)
    held = dict(enumerate(par.states.buffers()))
    return run.losses, held, full_params(par), ref.losses, ref.params


def check(name: str, comm, tracer: Tracer) -> dict:
    tracer.clear()
    losses, held, whole, ref_losses, ref_params = train_on(name, comm)
    return {"loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "param_rel_diff": max(rel_diff(backend.to_host(p), ref_params[n]) for n, p in whole.items()),
            # The module of the arrays the strategy holds: proof that the run computed on the backend.
            "namespaces": sorted({type(a).__module__.split(".")[0] for a in held.values()}),
            "staged": sorted({e.staged for e in tracer.events}), "events": len(tracer.events),
            "algos": sorted({e.algo for e in tracer.events})}


def main() -> None:
    tracer = Tracer()
    comm = world(tracer, transport=sys.argv[3] if len(sys.argv) > 3 else "mpi")
    for spec in sys.argv[1].split(","):  # backend[:device], several in one job
        backend.use(*spec.split(":"))
        for name in json.loads(sys.argv[2]):
            mine = check(name, comm, tracer)
            ranks = comm.gather_object(mine)
            if comm.rank == 0:
                print(json.dumps({"strategy": name, "backend": spec, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
