"""Run by tests/test_pipeline_v.py under `mpiexec -n 4 python tests/jobs/pipeline_v_checks.py CASES`: trains
the V-shaped and bidirectional schedules (and schedules read from torch's CSV) on meshes of the 4
ranks and prints, on rank 0, one JSON line per case: the losses next to the single-device run's,
the largest parameter difference, whether every rank's traced bytes and peak memory per category
are the closed forms (refpar/analysis/closed_forms.py), and per world rank its pipeline coordinate, its
measured activation and parameter peaks and the replay of its schedule list.

CASES is a JSON list of {"mesh": {axis: size}, "schedule": KIND or null, "csv": PATH or null,
"m": microbatches, "zero": stage, "fsdp": bool, "clip": max norm or absent}: a case with "clip" clips
its gradients to that global norm on a cosine schedule, and prints its norms beside one device's."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from refpar.analysis.closed_forms import activation_peak, rank_comm_rows, rank_memory_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig
from refpar.engine import Plan, parallelize, train
from refpar.engine.run import full_params
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

# 8 blocks: one per stage of a V on p=4 ranks (2p stages), two per part of DualPipe's copies, and
# two per stage of a V on p=2, so that every stage of a rank that holds neither the embedding nor
# the head keeps the same bytes per microbatch. Dropout on: every mask is keyed by global sample
# and global layer, whichever stage and copy runs it.
MODEL = ModelConfig(n_layer=8, dropout=0.1, dtype="float64")
TRAIN = TrainConfig(steps=2, batch_size=8, seq_len=8, seed=7)


def main(cases) -> None:
    comm = world(Tracer())
    references = {}  # max norm (0: none) -> the single device's run
    for case in cases:
        cfg = replace(TRAIN, clip_grad_norm=case.get("clip", 0.0),
                      **({"lr_schedule": "cosine", "warmup_steps": 1} if case.get("clip") else {}))
        if cfg.clip_grad_norm not in references:
            references[cfg.clip_grad_norm] = train_single_device(MODEL, cfg)
        reference = references[cfg.clip_grad_norm]
        mesh = DeviceMesh(comm, case["mesh"])
        comm.tracer.clear()  # each case's bytes alone
        csv = Path(case["csv"]).read_text() if case.get("csv") else None
        plan = Plan(schedule=case.get("schedule"), schedule_csv=csv, microbatches=case["m"],
                    zero=case.get("zero", 0), fsdp=case.get("fsdp", False))
        par = parallelize(MODEL, cfg, mesh, plan)
        run = train(par)
        whole = full_params(par)  # whole over tp
        diff = max(rel_diff(p, reference.params[n]) for n, p in whole.items())
        sizes, coords = mesh.sizes, mesh.coords
        expected = {(e["axis"], e["op"]): (e["bytes_sent"], e["bytes_recv"])
                    for e in rank_comm_rows(MODEL, cfg, sizes, coords, plan, cfg.steps)}
        traced = {key: b for key, b in run.totals.items() if b != (0, 0)}
        memory = {r["category"]: r["bytes"] for r in rank_memory_rows(MODEL, cfg, sizes, coords, plan)}
        mine = np.array([[diff, float(traced == expected), float(memory == dict(par.ledger.peak)),
                          coords["pp"], par.ledger.peak["activations"],
                          activation_peak(MODEL, cfg, sizes, coords, plan), par.ledger.peak["params"]]])
        norms = comm.all_gather(np.array([run.grad_norms or [0.0] * cfg.steps]))  # (world, steps)
        every = comm.all_gather(mine)  # (world, 7)
        if comm.rank == 0:
            print(json.dumps({
                **case, "losses": run.losses, "reference_losses": reference.losses,
                "max_param_rel_diff": float(every[:, 0].max()),
                "traced_bytes_equal_closed_form": bool(every[:, 1].min() == 1.0),
                "memory_equal_closed_form": bool(every[:, 2].min() == 1.0),
                "pp": every[:, 3].astype(int).tolist(),
                "activation_peak": every[:, 4].astype(int).tolist(),
                "replayed_peak": every[:, 5].astype(int).tolist(),
                "params": every[:, 6].astype(int).tolist(),
                "params_digest": [float(np.sum(p)) for _, p in sorted(whole.items())],
                "grad_norms": norms.tolist(), "reference_grad_norms": reference.grad_norms,
            }), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main(json.loads(sys.argv[1]))
