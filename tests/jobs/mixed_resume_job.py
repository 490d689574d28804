"""Checkpoints of mixed-precision DP, ZeRO and FSDP runs, resumed on the same mesh, another dp size
and one process.

    mpiexec -n 3 python tests/jobs/mixed_resume_job.py DIR

Run by tests/test_mixed_precision_dp.py on 3 ranks. For each case (bf16-mixed ZeRO-3; fp16-mixed
ZeRO-1 whose loss scale starts too high, so steps are skipped and the scale moves across the save;
bf16-mixed DP with fp32 gradients) a 4-step run saves after steps 2 and 4, and then:
- the manifest stores the 16-bit parameters as their dtype (bit patterns in the files), fp32 master
  weights and moments, AdamW's step count (fewer than the steps when fp16 skipped some) and the
  loss scaler's state;
- resumed from step 2 on the same mesh and strategy, steps 3 and 4 are bit for bit the run's:
  losses, loss scales, skipped steps and every parameter's bits;
- resumed under another strategy on 2 ranks (rank 2 meanwhile resumes on one process with the
  single-device trainer), the losses stay within the single-device comparison's tolerance of the
  run's (tests/test_mixed_precision_dp.py: 2^-8 for bf16, 2^-11 for fp16) and fp16 skips the same
  steps.
Rank 0 prints one JSON line: {"failures", "checks"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from refpar import checkpoint
from refpar.comm.communicator import abort_on_error, world
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan, parallelize, train
from refpar.mesh import DeviceMesh
from refpar.model.gpt import param_shapes
from refpar.trainer import train_single_device

# (ModelConfig.dtype, TrainConfig overrides, strategy saved on 3 ranks, strategy resumed on 2,
#  loss tolerance of a resume elsewhere)
CASES = (
    ("bfloat16", {}, "zero3", "dp", 2.0 ** -8),
    ("float16", {"loss_scale": 2.0 ** 20, "loss_scale_window": 2}, "zero1", "fsdp", 2.0 ** -11),
    ("bfloat16", {"fp32_grads": True}, "dp", "zero2", 2.0 ** -8),
)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def run_data_parallel(strategy: str, model, cfg, comm, **saving):
    """(the run, its parameters whole after the last step) of `strategy` over dp = comm's ranks."""
    plan = Plan(zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp")
    par = parallelize(model, cfg, DeviceMesh(comm, {"dp": comm.size}), plan)
    run = train(par, **saving)
    scaling = run.loss_scaling or {"scales": [], "skipped_steps": []}
    return run, par.states.full_params(), scaling["scales"], scaling["skipped_steps"]


def main(root: Path) -> None:
    w = world()
    failures, checks = [], 0

    def expect(ok: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(f"rank {w.rank}: {what}")

    pair = w.split(0 if w.rank < 2 else None)  # ranks 0 and 1 resume under another dp size
    for k, (dtype, overrides, saved_as, resumed_as, tolerance) in enumerate(CASES):
        model = model_preset("tiny", dtype=dtype)
        cfg = TrainConfig(steps=4, batch_size=7, **overrides)
        what = f"{dtype} {overrides} {saved_as}"
        folder = root / f"case{k}"
        run, params, scales, skipped_steps = run_data_parallel(saved_as, model, cfg, w, save=str(folder),
                                                               save_every=2)
        step2 = checkpoint.step_dir(folder, 2)
        man = checkpoint.read_manifest(step2)
        shapes = param_shapes(model)
        expect(all(man["tensors"][f"params/{n}"][1] == dtype for n in shapes), f"{what}: params dtype")
        expect(all(man["tensors"][f"{p}/{n}"][1] == "float32" for p in ("master", "adamw.m", "adamw.v")
                   for n in shapes), f"{what}: master and moments are not all fp32")
        skipped_before = sum(s < 2 for s in skipped_steps)
        expect(man["optimizer_t"] == 2 - skipped_before, f"{what}: optimizer_t {man['optimizer_t']}")
        if dtype == "float16":
            expect(skipped_before > 0, f"{what}: no step skipped before the save")
            expect(man["loss_scaler"]["scale"] == scales[2], f"{what}: scaler {man['loss_scaler']}")
        else:
            expect(man["loss_scaler"] is None, f"{what}: a bf16 run stored a loss scaler")

        same, same_params, same_scales, same_skipped = run_data_parallel(saved_as, model, cfg, w,
                                                                         resume=str(step2))
        expect(same.losses == run.losses[2:], f"{what}: resumed losses {same.losses} != {run.losses[2:]}")
        expect(same_scales == scales[2:], f"{what}: scales {same_scales}")
        expect(same_skipped == [s for s in skipped_steps if s >= 2], f"{what}: skipped")
        expect(all(np.array_equal(bits(same_params[n]), bits(p)) for n, p in params.items()),
               f"{what}: resumed parameters are not bit for bit the run's")

        if pair is not None:
            other, _, _, skipped = run_data_parallel(resumed_as, model, cfg, pair, resume=str(step2))
            losses, where = other.losses, f"{resumed_as} on 2 ranks"
        else:
            one = train_single_device(model, cfg, resume=str(step2))
            losses, skipped, where = one.losses, one.skipped_steps, "one process"
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, run.losses[2:], strict=True))
        expect(diff <= tolerance, f"{what} resumed as {where}: loss rel diff {diff:.2e} > {tolerance:.2e}")
        expect(skipped == [s for s in skipped_steps if s >= 2], f"{what} as {where}: skipped {skipped}")
    reports = w.gather_object((checks, failures))
    if w.rank == 0:
        print(json.dumps({"checks": sum(c for c, _ in reports),
                          "failures": [f for _, fs in reports for f in fs][:40]}), flush=True)


if __name__ == "__main__":
    with abort_on_error(), np.errstate(over="ignore", invalid="ignore"):
        main(Path(sys.argv[1]))
