"""Lesson 14: the clipping bug of pytorch/torchtitan#596, reproduced on two pipeline stages: each
stage clips by the norm of its own gradients instead of the whole model's.

    mpiexec -n 2 python lessons/scripts/14_local_norm.py

The same run three times: on one device; on --mesh pp=2 with refpar's clipping (the squares summed
over pp, refpar/parallel/clipping.py); on pp=2 with the bug. The bug is the engine's own
GlobalNormClip with the pp axis left out of its sum: a few lines here, no option of refpar's.
"""

from refpar.comm.communicator import world
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh
from refpar.parallel.clipping import GlobalNormClip
from refpar.trainer import train_single_device

MAX_NORM = 0.05  # the tiny model's gradient norm is about 1: every step clips
comm = world()
model = model_preset("tiny")
cfg = TrainConfig(steps=10, clip_grad_norm=MAX_NORM)
plan = Plan(microbatches=2)


def run(local_norm: bool):
    par = parallelize(model, cfg, DeviceMesh(comm, {"pp": 2}), plan)
    if local_norm:  # the bug: each stage's sum of squares stays its own
        par.states.clip = GlobalNormClip(MAX_NORM, par.clip.counted,
                                         [axis for axis in par.clip.axes if axis.axis != "pp"])
    out = train(par)
    return out.losses, comm.gather_object(out.grad_norms)  # the losses are the model's: every rank's


good, good_norms = run(local_norm=False)
bad, bad_norms = run(local_norm=True)
if comm.rank == 0:
    ref = train_single_device(model, cfg, microbatches=plan.microbatches)
    print(f"tiny GPT-2, AdamW lr {cfg.lr}, --clip-grad-norm {MAX_NORM} (every step clips), --mesh pp=2 "
          f"--microbatches {plan.microbatches}")
    print(" step  one device   pp=2 global norm   pp=2 local norm  |  norm: one device  stage 0  stage 1")
    for step in range(cfg.steps):
        print(f"{step + 1:>5} {ref.losses[step]:11.6f} {good[step]:18.6f} {bad[step]:17.6f}  |  "
              f"{ref.grad_norms[step]:17.6f} {bad_norms[0][step]:8.6f} {bad_norms[1][step]:8.6f}")
    gap = max(abs(a - b) / b for a, b in zip(good, ref.losses, strict=True))
    off = max(abs(a - b) / b for a, b in zip(bad, ref.losses, strict=True))
    norm_gap = max(abs(a - b) / b for rank in good_norms for a, b in zip(rank, ref.grad_norms, strict=True))
    print(f"global norm: losses within {gap:.0e} of one device, every rank's norm within {norm_gap:.0e}")
    n0, n1 = bad_norms[0][0], bad_norms[1][0]  # step 1: the same gradients in all three runs
    print(f"step 1: sqrt({n0:.6f}^2 + {n1:.6f}^2) = {(n0 * n0 + n1 * n1) ** 0.5:.6f}, the global norm: "
          "each stage divided by the norm of its part only")
    print(f"local norm: losses off by up to {off:.1%} from one device")
