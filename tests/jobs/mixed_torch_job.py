"""One MPI job that trains each mesh of a list in bf16-mixed (or fp16-mixed) twice, on the NumPy
backend and on torch CPU tensors, through the engine and its report (refpar/engine/run.py:collect,
what `refpar train --check --json` runs); rank 0 prints one JSON line per mesh with both runs'
summaries and the differences between them. Run by tests/test_mixed_precision_torch.py:

    mpiexec -n 2 python tests/jobs/mixed_torch_job.py '[{"mesh": {"tp": 2}, "plan": {"sp": true}}]'

A spec may set "model" (ModelConfig fields beside dtype, e.g. moe_experts) and "train".
"""

from __future__ import annotations

import json
import sys

import numpy as np

from refpar import backend
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine.run import collect
from refpar.mesh import DeviceMesh
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

STEPS = 3


def bits(a) -> np.ndarray:
    """The bit patterns of a host array (16- or 32-bit floats), for an equality count."""
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def arrays(tree):
    """Every array in a strategy's attributes (nested dicts and lists): parameters, gradients,
    master weights and moments, whole or sharded."""
    for v in tree.values() if isinstance(tree, dict) else tree:
        if backend.is_array(v):
            yield v
        elif isinstance(v, dict | list):
            yield from arrays(v)


def run_on(name: str, configs, comm, plain, ref):
    """The report's (summary, every rank's measurements) on backend `name`, and every rank's held
    arrays as (module, dtype) pairs: proof of the namespace the run computed in."""
    model, train, sizes, plan = configs
    backend.use(name)
    comm.tracer.clear()
    summary, par, _, every = collect(model, train, DeviceMesh(comm, sizes), plan, check=True, ref=ref,
                                     plain=plain)
    held = sorted({(type(a).__module__.split(".")[0], str(a.dtype).rsplit(".", 1)[-1])
                   for a in arrays(vars(par.states))})
    backend.use("numpy")
    return summary, every, plain.gather_object(held)


def compare(spec: dict, comm, plain) -> dict | None:
    model = model_preset("tiny", dtype=spec.get("dtype", "bfloat16"), **spec.get("model", {}))
    train = TrainConfig(steps=STEPS, batch_size=4, seq_len=16, **spec.get("train", {}))
    configs = (model, train, spec["mesh"], Plan(**spec.get("plan", {})))
    # the single device, once for both runs (rank 0 compares)
    ref = train_single_device(model, train, microbatches=configs[3].microbatches) if comm.rank == 0 else None
    numpy_summary, numpy_every, numpy_held = run_on("numpy", configs, comm, plain, ref)
    torch_summary, torch_every, torch_held = run_on("torch", configs, comm, plain, ref)
    if comm.rank != 0:
        return None
    param_diffs, same, total = [], 0, 0
    for mine, theirs in zip(torch_every, numpy_every, strict=True):  # rank by rank, name by name
        for n, p in mine["full"].items():
            a, b = backend.to_host(p), backend.to_host(theirs["full"][n])
            assert a.dtype == b.dtype, (n, a.dtype, b.dtype)
            param_diffs.append(rel_diff(a, b))
            same += int(np.sum(bits(a) == bits(b)))
            total += a.size
    losses = zip(torch_summary["losses"], numpy_summary["losses"], strict=True)
    return {"spec": spec, "numpy": numpy_summary, "torch": torch_summary,
            "numpy_held": numpy_held, "torch_held": torch_held,
            "loss_rel_diffs": [abs(a - b) / abs(b) for a, b in losses],
            "max_param_rel_diff": max(param_diffs), "param_bits_equal": same, "param_elems": total}


def main() -> None:
    comm, plain = world(Tracer()), world()  # plain: the gathers, left out of the trace
    for spec in json.loads(sys.argv[1]):
        out = compare(spec, comm, plain)
        if out is not None:
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
