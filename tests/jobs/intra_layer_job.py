"""One MPI job that trains several tp / sp / cp / dp layouts and checks each against the single
device and the closed forms; rank 0 prints one JSON line per layout. Run by tests/test_intra_layer.py:

    mpiexec -n 2 python tests/jobs/intra_layer_job.py '[{"mesh": {"tp": 2}, "sp": true, "seq_len": 15}]'

A spec may set "model": {"dtype": "bfloat16"} (mixed precision: compared with the single-device
bfloat16 run) and "force_overflow": [world rank, step], which makes that rank alone find an inf in
its gradients at that step (fp16 loss scaling: every rank must then skip the step).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter

import numpy as np

from refpar import backend, precision
from refpar.analysis.closed_forms import rank_memory_rows, rank_param_numels
from refpar.analysis.intra_layer import expected_calls
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan, parallelize, train
from refpar.engine.run import full_params
from refpar.holdings import tp_param_slices
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

STEPS = 3


def check(spec: dict, comm, tracer: Tracer, references: dict) -> dict:
    model = model_preset("tiny", **spec.get("model", {}))
    train = TrainConfig(steps=STEPS, batch_size=spec.get("batch_size", 4), seq_len=spec.get("seq_len", 16),
                        optimizer=spec.get("optimizer", "adamw"), **spec.get("train", {}))
    sp, cp_algo = spec.get("sp", False), spec.get("cp_algo")
    mesh = DeviceMesh(comm, spec["mesh"])
    plan = Plan(sp=sp, cp_algo=cp_algo)
    tracer.clear()
    forced = spec.get("force_overflow")  # [world rank, step]: that rank alone finds an inf
    found = precision.has_overflow  # what overflow_anywhere asks
    if forced is not None:
        hit = comm.rank == forced[0]
        precision.has_overflow = lambda grads: (hit and step_now[0] == forced[1]) or found(grads)
    step_now = [0]
    backend.use(spec.get("backend", "numpy"))  # torch: the array-API plug, the same code on torch CPU tensors
    par = parallelize(model, train, mesh, plan)
    run = train_model(par, step_now)
    backend.use("numpy")
    precision.has_overflow = found
    events = [e for e in tracer.events if e.step is not None]  # the training steps'
    losses = run.losses
    full = full_params(par)

    key = json.dumps([model.to_dict(), train.to_dict()])
    if key not in references:
        references[key] = train_single_device(model, train)
    ref = references[key]
    out = {"loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses, strict=True)),
           "param_rel_diff": max(rel_diff(full[n], ref.params[n]) for n in ref.params)}

    # Traced calls == closed form, call by call (op, tag, bytes), for every step and axis.
    want = [(c.axis, c.op, c.tag, c.bytes_sent, c.bytes_recv)
            for c in expected_calls(model, train, mesh.sizes, mesh.coords, sp, cp_algo)]
    mismatches = []
    for step in range(STEPS):
        got = [(e.axis, e.op, e.tag, e.bytes_sent, e.bytes_recv) for e in events if e.step == step]
        for axis in ("tp", "cp", "dp", "dp_cp"):
            g, w = [c for c in got if c[0] == axis], [c for c in want if c[0] == axis]
            if g != w:
                pairs = zip(g, w, strict=False)
                first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(g), len(w)))
                mismatches.append({"step": step, "axis": axis, "index": first, "got": g[first:first + 1],
                                   "want": w[first:first + 1], "n_got": len(g), "n_want": len(w)})
    out["comm_mismatches"] = mismatches
    out["bytes"] = {f"{a}.{o}": [sum(e.bytes_sent for e in events if (e.axis, e.op) == (a, o))]
                    for a, o in sorted({(e.axis, e.op) for e in events})}

    # Collectives per block per step, read from the trace (block 0, step 0).
    per_block = Counter(f"{e.op}:regather" if e.tag.endswith(":regather") else e.op
                        for e in events if e.axis == "tp" and e.step == 0 and e.tag.startswith("h.0."))
    out["tp_calls_per_block"] = dict(per_block)
    block_bytes = Counter()
    for e in events:
        if e.axis == "tp" and e.step == 0 and e.tag.startswith("h.0.") and not e.tag.endswith(":regather"):
            block_bytes["sent"] += e.bytes_sent
    out["tp_block_bytes"] = block_bytes["sent"]

    expected = {r["category"]: r["bytes"]
                for r in rank_memory_rows(model, train, mesh.sizes, mesh.coords, plan)}
    out["activation_peak"] = par.ledger.peak["activations"]
    out["activation_expected"] = expected["activations"]
    out["memory"] = dict(par.ledger.peak)
    out["memory_expected"] = expected
    # the largest gradient dict a backward piece hands over: one block's (of this rank's shards)
    numels = rank_param_numels(model, mesh.sizes, mesh.coords, plan)
    out["block_grad_elems"] = sum(n for name, n in numels.items() if name.startswith("h.0."))
    out["losses"], out["reference_losses"] = losses, ref.losses
    # fp16 loss scaling: what each rank skipped, and a digest of the parameters every tp rank holds
    # whole (they stay equal only if all ranks skip the same steps)
    sharded = tp_param_slices(model, mesh.sizes["tp"], mesh.coords["tp"])
    scaling = run.loss_scaling or {"skipped_steps": [], "scales": []}
    out["skipped_steps"], out["reference_skipped"] = scaling["skipped_steps"], ref.skipped_steps
    out["scales"] = scaling["scales"]
    out["optimizer_t"] = par.states.t
    out["replicated_digest"] = hashlib.sha256(b"".join(
        np.ascontiguousarray(full[n]).tobytes() for n in sorted(full) if n not in sharded)).hexdigest()
    return out


def train_model(par, step_now):
    """`train`, telling `step_now` which step runs (for a forced overflow)."""
    def on_step(step, *_, **__):  # the loop also names grad_norm
        step_now[0] = step + 1

    return train(par, on_step)


def main() -> None:
    tracer = Tracer()
    comm = world(tracer)
    references: dict = {}
    for spec in json.loads(sys.argv[1]):
        mine = check(spec, comm, tracer, references)
        ranks = comm.gather_object(mine)
        if comm.rank == 0:
            print(json.dumps({"spec": spec, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
