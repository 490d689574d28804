"""One MPI job that trains several tp / sp / cp / dp layouts and checks each against the single
device and the closed forms; rank 0 prints one JSON line per layout. Run by tests/test_intra_layer.py:

    mpiexec -n 2 python tests/intra_layer_job.py '[{"mesh": {"tp": 2}, "sp": true, "seq_len": 15}]'

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

from refpar import precision
from refpar.analysis.activations import activation_peak_bytes
from refpar.analysis.intra_layer import expected_calls
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import TrainConfig, model_preset
from refpar.memory import MemoryLedger
from refpar.mesh import DeviceMesh
from refpar.model.data import MarkovCorpus
from refpar.parallel.intra_layer import IntraLayerTrainer
from refpar.parallel.intra_layer_runner import expected_memory
from refpar.parallel.tensor_parallel import tp_param_slices
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

STEPS = 3


def check(spec: dict, comm, tracer: Tracer, references: dict) -> dict:
    model = model_preset("tiny", **spec.get("model", {}))
    train = TrainConfig(steps=STEPS, batch_size=spec.get("batch_size", 4), seq_len=spec.get("seq_len", 16),
                        optimizer=spec.get("optimizer", "adamw"), **spec.get("train", {}))
    sp, cp_algo = spec.get("sp", False), spec.get("cp_algo")
    mesh = DeviceMesh(comm, spec["mesh"])
    ledger = MemoryLedger()
    to_backend = None
    if spec.get("backend") == "torch":  # the array-API plug: the same code on torch CPU tensors
        import torch

        to_backend = torch.from_numpy
    trainer = IntraLayerTrainer(model, train, mesh, ledger, sp=sp, cp_algo=cp_algo, to_backend=to_backend)
    corpus = MarkovCorpus(model.vocab_size, train.seed)
    tracer.clear()
    losses = []
    forced = spec.get("force_overflow")  # [world rank, step]: that rank alone finds an inf
    found = precision.has_overflow  # what overflow_anywhere asks
    for step in range(STEPS):
        if forced is not None:
            hit = (comm.rank, step) == tuple(forced)
            precision.has_overflow = (lambda grads: True) if hit else found
        with tracer.context(step=step):
            losses.append(trainer.step(step, corpus))
    precision.has_overflow = found
    events = list(tracer.events)
    full = trainer.full_params()

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
        for axis in ("tp", "cp", "dp"):
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

    out["activation_peak"] = ledger.peak["activations"]
    out["activation_expected"] = activation_peak_bytes(model, train, mesh.sizes, mesh.coords, sp, cp_algo)
    out["memory"] = dict(ledger.peak)
    out["memory_expected"] = expected_memory(model, train, mesh.sizes, comm.rank, sp, cp_algo)
    out["losses"], out["reference_losses"] = losses, ref.losses
    # fp16 loss scaling: what each rank skipped, and a digest of the parameters every tp rank holds
    # whole (they stay equal only if all ranks skip the same steps)
    sharded = tp_param_slices(model, mesh.sizes["tp"], mesh.coords["tp"])
    out["skipped_steps"], out["reference_skipped"] = trainer.skipped_steps, ref.skipped_steps
    out["scales"] = trainer.scales
    out["optimizer_t"] = trainer.state["t"]
    out["replicated_digest"] = hashlib.sha256(b"".join(
        np.ascontiguousarray(full[n]).tobytes() for n in sorted(full) if n not in sharded)).hexdigest()
    return out


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
