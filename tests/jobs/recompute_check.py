"""One MPI job (8 ranks) that trains each mesh of CASES with --recompute none, selective and full
and prints, on rank 0, one JSON line per (case, recompute): the judgement against one device
(commands/verify.judge: float64 loss and parameters, traced bytes and peak memory per rank and
category against the closed forms), whether every rank's parameters are bit for bit those of the
run without recomputation, every rank's activation peak next to its closed form, and how many
collectives each rank ran under the trace phase "recompute", the GEMM FLOPs each rank ran per step
next to the planner's FLOPs of a step (refpar/analysis/flops.step_flops). Run by tests/test_recompute.py:

    mpiexec -n 8 python tests/jobs/recompute_check.py
"""

from __future__ import annotations

import json

import numpy as np

from refpar.analysis.closed_forms import activation_peak
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.commands.verify import judge
from refpar.config import RECOMPUTE, TrainConfig, model_preset
from refpar.engine import Plan
from refpar.engine.run import _kept, collect, full_params
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device

CASES = [
    # Megatron's 3D: dp x tp+sp x pp, 1F1B, ZeRO-1
    {"name": "dp x tp+sp x pp", "mesh": {"dp": 2, "tp": 2, "pp": 2}, "moe": False,
     "plan": {"sp": True, "microbatches": 2, "zero": 1}},
    # ring attention over cp inside an interleaved pipeline (two stages of one block per rank)
    {"name": "dp x cp ring x pp interleaved", "mesh": {"dp": 2, "cp": 2, "pp": 2}, "moe": False,
     "plan": {"schedule": "interleaved-1f1b", "chunks": 2, "microbatches": 2}},
    # MoE blocks over ep with expert tp, their dispatch run again under full recomputation
    {"name": "dp x ep x tp (MoE)", "mesh": {"dp": 2, "ep": 2, "tp": 2}, "moe": True,
     "plan": {"microbatches": 2}},
    # the model's own blocks with B split from W (zb-h1), parameters gathered by FSDP
    {"name": "dp x pp zb-h1 FSDP", "mesh": {"dp": 4, "pp": 2}, "moe": False,
     "plan": {"schedule": "zb-h1", "microbatches": 2, "fsdp": True}},
]
TRAIN = TrainConfig(steps=2, batch_size=8, seq_len=16)


def main() -> None:
    comm = world(Tracer())
    for case in CASES:
        model = model_preset("tiny", **({"moe_experts": 4, "moe_top_k": 2} if case["moe"] else {}))
        m = case["plan"]["microbatches"]
        ref = train_single_device(model, TRAIN, microbatches=m) if comm.rank == 0 else None
        base = None
        for mode in RECOMPUTE:
            comm.tracer.clear()
            mesh, plan = DeviceMesh(comm, case["mesh"]), Plan(**case["plan"], recompute=mode)
            summary, par, out, _ = collect(model, TRAIN, mesh, plan, check=True, ref=ref)
            reruns = sum(e.phase == "recompute" for e in comm.tracer.events)
            params = full_params(par)
            base = params if base is None else base
            mine = {"coords": mesh.coords, "reruns": reruns,
                    "bitwise": all(np.array_equal(params[n], base[n]) for n in base),
                    "activations": par.ledger.peak["activations"],
                    "closed_form": activation_peak(model, TRAIN, mesh.sizes, mesh.coords, plan, _kept(out))}
            every = comm.gather_object(mine)
            if comm.rank == 0:
                print(json.dumps({"case": case["name"], "recompute": mode, **judge(summary),
                                  "losses": summary["losses"], "ranks": every,
                                  "flops": summary["flops_per_step"],
                                  "planned_flops": summary["planned_flops_per_step"]}), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
