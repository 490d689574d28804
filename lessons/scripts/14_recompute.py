"""Lesson 14: activation recomputation's memory and time, measured: the small GPT-2 on --mesh tp=2
--sp with --recompute none, selective and full.

    mpiexec -n 2 python lessons/scripts/14_recompute.py [--seq-len T] [--steps N]

For each mode: every rank's activation peak as its memory ledger measured it, next to the closed
form (refpar/analysis/closed_forms.py); the GEMM FLOPs each rank ran per step (refpar/model/gemm.py),
next to the planner's FLOPs of a step (refpar/analysis/flops.py) shared by the two ranks; and the
mean step time, leaving out the first step.
"""

import argparse

from refpar.analysis.closed_forms import activation_peak
from refpar.analysis.flops import step_flops
from refpar.analysis.presets import from_model_config
from refpar.comm.communicator import world
from refpar.config import RECOMPUTE, Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh

parser = argparse.ArgumentParser()
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

comm = world()
model = model_preset("small")
cfg = TrainConfig(steps=args.steps, batch_size=8, seq_len=args.seq_len)
rows, losses = [], {}
for mode in RECOMPUTE:
    plan = Plan(sp=True, recompute=mode)
    mesh = DeviceMesh(comm, {"tp": 2})
    par = parallelize(model, cfg, mesh, plan)
    out = train(par)
    losses[mode] = out.losses
    mine = (par.ledger.peak["activations"], activation_peak(model, cfg, mesh.sizes, mesh.coords, plan),
            out.flops[-1], out.step_time_s)
    rows.append((mode, comm.gather_object(mine)))
if comm.rank == 0:
    print(f"small GPT-2 ({model.n_layer} blocks, {model.n_embd} channels, {model.dtype}), batch "
          f"{cfg.batch_size} x {cfg.seq_len} tokens, --mesh tp=2 --sp, {cfg.steps} steps")
    print("recompute   activation peak per rank (measured | closed form)   GEMM FLOPs per rank"
          " (planner / 2)   step time")
    base = {}
    for mode, ranks in rows:
        peaks = ", ".join(f"{peak:,} | {closed:,}" for peak, closed, _, _ in ranks)
        planned = step_flops(from_model_config(model), cfg.batch_size, cfg.seq_len, mode) / 2
        flops = ", ".join(f"{f:,}" for _, _, f, _ in ranks)
        seconds = max(t for *_, t in ranks)
        base.setdefault("peak", ranks[0][0])
        base.setdefault("flops", ranks[0][2])
        base.setdefault("time", seconds)
        print(f"{mode:<10}  {peaks}   {flops} ({planned:,.0f})   {seconds * 1e3:.0f} ms")
        print(f"{'':<10}  {ranks[0][0] / base['peak']:.2f} x none's activations, "
              f"{ranks[0][2] / base['flops']:.3f} x its FLOPs, {seconds / base['time']:.2f} x its time")
    same = losses["none"] == losses["selective"] == losses["full"]
    print(f"losses of the three runs bit for bit equal: {same}")
