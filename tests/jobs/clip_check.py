"""One MPI job (8 ranks) that trains with clipping on a mesh and computes, from the same gradients,
the global norm as the engine does and as each classic bug would; rank 0 prints one JSON line per
mesh: every rank's norms next to the single device's. Run by tests/test_clipping.py:

    mpiexec -n 8 python tests/jobs/clip_check.py

The bugs are the engine's own GlobalNormClip with one rule of refpar/parallel/clipping.py left out:
the axis a sum skips, or the copies a rank counts although another rank counts them too.
"""

from __future__ import annotations

import json

from refpar.comm.communicator import abort_on_error, world
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan, parallelize, train
from refpar.holdings import is_expert, tp_param_slices
from refpar.mesh import DeviceMesh
from refpar.parallel.clipping import GlobalNormClip, clip_for
from refpar.schedules import stage_map
from refpar.schedules.builders import of_plan
from refpar.trainer import train_single_device

MAX_NORM = 0.05  # the tiny model's norms are about 1: every step clips
MESHES = [
    # pipeline stages, tp copies, the tied wte on both ends, ZeRO-1 shards over dp
    {"sizes": {"pp": 2, "dp": 2, "tp": 2}, "zero": 1, "microbatches": 2, "moe": False},
    # DualPipe: pipeline ranks r and p-1-r hold the same parts, their copies' gradients summed
    {"sizes": {"pp": 2, "dp": 2, "tp": 2}, "zero": 1, "microbatches": 4, "moe": False,
     "schedule": "dualpipe"},
    # experts over ep, the dense weights' copies on each ep rank (plain DP), tp inside the experts
    {"sizes": {"dp": 2, "ep": 2, "tp": 2}, "zero": 0, "microbatches": 2, "moe": True},
]


def bugs(par) -> dict:
    """name -> the GlobalNormClip of that bug on this rank."""
    good, mesh, model = par.clip, par.mesh, par.model
    split = set(tp_param_slices(model, mesh.sizes["tp"], mesh.coords["tp"]))

    def without(axis):
        return GlobalNormClip(MAX_NORM, good.counted, [a for a in good.axes if a.axis != axis])

    def counting(extra):
        return GlobalNormClip(MAX_NORM, lambda n: good.counted(n) or extra(n), good.axes)

    if par.copies is not None:  # the mirror rank's rule left out: on p = 2 both ranks hold the model
        stages = stage_map(of_plan(par.plan, mesh.sizes["pp"])).stages_of(mesh.coords["pp"])
        return {"DualPipe copies counted on both mirror ranks": clip_for(
                    model, par.train, mesh, par.plan, stages, mesh.axis("dp_cp"), copies=None)}
    if not model.moe_experts:
        return {"local pipeline stage only": without("pp"),
                "tp copies counted on every tp rank": counting(lambda n: n not in split),
                "tied wte counted on both ends": counting(lambda n: n == "wte.weight"),
                "ZeRO shards not summed over dp": without("dp")}
    return {"experts not summed over ep": without("ep"),
            "dense copies counted on every ep rank": counting(
                lambda n: not is_expert(n) and (n in split or mesh.coords["tp"] == 0))}


def norm_of(clip, states) -> float:
    clip.coefficient(states, 1.0)  # float64: no loss scale
    return clip.norm


def main() -> None:
    comm = world()
    for spec in MESHES:
        model = model_preset("tiny", **({"moe_experts": 4, "moe_top_k": 2} if spec["moe"] else {}))
        cfg = TrainConfig(steps=2, batch_size=8, clip_grad_norm=MAX_NORM, lr_schedule="cosine",
                          warmup_steps=1, min_lr=1e-3)
        plan = Plan(spec.get("schedule"), microbatches=spec["microbatches"], zero=spec["zero"])
        par = parallelize(model, cfg, DeviceMesh(comm, spec["sizes"]), plan)
        run = train(par)
        # the last step's gradients are still held, summed: each bug's norm of them
        mine = {"engine": run.grad_norms, "lrs": run.lrs,
                "bugs": {name: norm_of(clip, par.states) for name, clip in bugs(par).items()}}
        every = comm.gather_object(mine)
        if comm.rank == 0:
            ref = train_single_device(model, cfg, microbatches=plan.microbatches)
            print(json.dumps({"sizes": spec["sizes"], "ranks": every, "reference": ref.grad_norms,
                              "reference_lrs": ref.lrs}), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main()
