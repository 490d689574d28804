"""MoE with expert tensor parallelism (mesh pp x dp x ep x tp, and --sp; with cp too), run under mpiexec by
tests/test_moe_tp.py.

    mpiexec -n 4 python tests/jobs/moe_tp_check.py /tmp/checkpoints

Prints one JSON line per run from rank 0. Training runs: the largest loss and parameter (gathered
over tp) differences from the single-device reference of the same precision with the same
microbatches, whether the aux losses and the routing statistics are the reference's, whether
every step's traced bytes per (axis, op) and the params/grads/optimizer (bf16: and master) and
activation peaks equal the closed forms, and how many expert-buffer all-reduces each rank made
per MoE layer and microbatch. Checkpoint runs: 4 steps on ep=2,tp=2 --sp saved after step 2,
resumed from there on the same mesh (compared exactly), on pp=2,tp=2, on ep=2 and on one process;
4 steps on cp=2,tp=2 --sp (ring) resumed on the same mesh, on ep=2 and on one process (each
rank's loaded tensors compared exactly with the global ones; the shards hold each element of
every saved tensor once).
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from refpar import checkpoint
from refpar.analysis.closed_forms import rank_comm_bytes, rank_memory_rows
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig, parse_mesh
from refpar.engine import parallelize
from refpar.engine.sharded_state import resume_from
from refpar.mesh import DeviceMesh
from refpar.model.gpt import param_shapes
from refpar.parallel.tensor_parallel import shard_params_tp
from refpar.trainer import train_single_device
from tests.jobs.moe_pipeline_check import DEEPSEEK, emit, plan_of, resume_row, train
from tests.numerics import rel_diff

MODEL = ModelConfig(vocab_size=32, n_positions=8, n_embd=16, n_head=2, n_layer=4, dropout=0.1,
                    moe_experts=4, moe_top_k=2, moe_capacity_factor=0.8, moe_layers=(1, 2, 3))
TRAIN = TrainConfig(steps=3, batch_size=8, seq_len=8, lr=1e-2, seed=11)
# (mesh, sp, schedule, microbatches, model changes, cp algorithm)
RUNS = [
    ("ep=2,tp=2", False, "1f1b", 1, {}, None),
    ("ep=2,tp=2", True, "1f1b", 2, {}, None),
    ("ep=2,tp=2", True, "1f1b", 2, DEEPSEEK, None),  # shared experts replicated over tp, like the router
    ("pp=2,tp=2", True, "1f1b", 2, {"moe_top_k": 1}, None),
    ("dp=2,tp=2", False, "1f1b", 2, {"moe_layers": (0, 3)}, None),
    ("ep=2,tp=2", True, "1f1b", 2, {"dtype": "bfloat16"}, None),  # the same pieces in mixed precision
    # cp and tp together: routing over cp's runs on every tp rank (sp gathers them back over tp);
    # Ulysses needs cp <= n_head / tp; with sp, DeepSeek-V3's sequence-wise loss, its counts summed
    # over cp
    ("cp=2,tp=2", False, "1f1b", 2, {}, "ring"),
    ("cp=2,tp=2", True, "1f1b", 2, {"n_head": 4, "moe_seq_aux_weight": 0.01}, "ulysses"),
]


def all_ranks(comm, ok: bool) -> bool:
    return bool(comm.all_reduce(np.array([int(ok)]), op="min")[0])


def local(par) -> dict:
    """The parameters this rank holds (its tp shards), by name (plain DP keeps them whole)."""
    u = par.states.units
    return {n: v for k in u.names for n, v in u.views(k, u.slice(k, par.states.params)).items()}


def check_run(comm, mesh_text, sp, schedule, m, changes, algo) -> dict:
    model = replace(MODEL, **changes)
    comm.tracer.clear()
    mesh = DeviceMesh(comm, parse_mesh(mesh_text))
    run, par, whole = train(model, TRAIN, mesh, schedule, m, 1, algo, sp)
    events = [e for e in comm.tracer.events if e.step is not None]
    ref = train_single_device(model, TRAIN, microbatches=m)
    param_diff = float(comm.all_reduce(np.array([max(rel_diff(np.asarray(p, np.float64), np.asarray(
        ref.params[n], np.float64)) for n, p in whole.items())]), op="max")[0])
    routing_same = all(s.dropped == {i: r.dropped[i] for i in s.dropped}
                       and s.tokens_per_expert == {i: r.tokens_per_expert[i] for i in s.tokens_per_expert}
                       and s.expert_bias == {i: r.expert_bias[i] for i in s.expert_bias}
                       for s, r in zip(run.moe_steps, ref.moe_steps, strict=True))
    bytes_ok = True
    for s in run.moe_steps:
        traced = {k: b for k, b in comm.tracer.totals(step=s.step).items() if b != (0, 0)}
        expected = rank_comm_bytes(model, TRAIN, mesh.sizes, mesh.coords, par.plan, s.microbatch_counts)
        bytes_ok &= traced == {key: tuple(b) for key, b in expected.items() if tuple(b) != (0, 0)}
    states = {r["category"]: r["bytes"] for r in rank_memory_rows(
        model, TRAIN, mesh.sizes, mesh.coords, par.plan, [s.microbatch_counts for s in run.moe_steps])}
    memory_ok = dict(par.ledger.peak) == states
    # this rank's expert-buffer all-reduces and sp gathers per MoE layer it runs, microbatch and step
    layers = len(run.moe_steps[0].kept_counts) * m * TRAIN.steps
    buffers = [sum(e.tag.endswith(f"experts.{t}") for e in events) / max(layers, 1)
               for t in ("c_proj:fwd", "c_fc:bwd")]
    gathers = sum(".mlp.moe:" in e.tag for e in events) / max(layers, 1)
    return {
        "run": f"{mesh_text}{' --sp' if sp else ''}{f' {algo}' if algo else ''} {schedule} m={m} {changes}",
        "dtype": model.dtype,
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True)),
        "param_diff": param_diff,
        "aux_diff": max(abs(a.aux_loss - b.aux_loss) / b.aux_loss
                        for a, b in zip(run.moe_steps, ref.moe_steps, strict=True)),
        "routing_same": all_ranks(comm, routing_same),
        "dropped": [sum(s.dropped.values()) for s in ref.moe_steps],
        "bytes_ok": all_ranks(comm, bytes_ok),
        "memory_ok": all_ranks(comm, memory_ok),
        "buffer_all_reduces": comm.all_gather(np.array([buffers])).tolist(),
        "sp_gathers": comm.all_gather(np.array([gathers])).tolist(),
        "expert_param_ratio": expert_ratio(local(par), model),
    }


def expert_ratio(params: dict, model) -> float:
    """Expert elements this rank holds over those of the same experts whole (tp slices them)."""
    mine = {n: p for n, p in params.items() if ".mlp.experts." in n}
    if not mine:
        return 0.0
    shapes = param_shapes(model)
    return sum(p.size for p in mine.values()) / sum(int(np.prod(shapes[n])) for n in mine)


def reassembles_exactly(mesh, path: Path, train_cfg) -> bool:
    """Whether loading the checkpoint gives this rank of `mesh` exactly its slices of the saved
    global tensors (read whole on one process): parameters and AdamW's m and v."""
    par = parallelize(MODEL, train_cfg, mesh, plan_of(None, 2, 1))
    resume_from(par, str(path))
    states, u = par.states, par.states.units
    _, whole, moments = checkpoint.load_whole(str(path), MODEL, train_cfg)
    mine = {"params": states.params, "m": states.state["m"], "v": states.state["v"]}
    held = {"params": whole, "m": moments["m"], "v": moments["v"]}
    ok = True
    for kind, flat in mine.items():
        for k in u.names:
            views = u.views(k, u.slice(k, flat))
            cut = shard_params_tp({n: held[kind][n] for n in views}, MODEL, mesh.sizes["tp"],
                                  mesh.coords["tp"])
            ok &= all(np.array_equal(v, cut[n]) for n, v in views.items())
    return ok


def check_resumes(comm, root: Path, saved_on: str, algo: str | None, targets: list) -> list[dict]:
    """4 steps on `saved_on` with --sp (cp: `algo`), saved after 2, resumed on each (mesh, sp) of
    `targets` from there (a target with cp uses `algo` too)."""
    train4 = replace(TRAIN, steps=4)
    path = root / saved_on.replace(",", "_").replace("=", "")
    full = train(MODEL, train4, DeviceMesh(comm, parse_mesh(saved_on)), "1f1b", 2, 1, algo, True,
                 save=str(path), save_every=2)
    saved = path / "step-00000002"
    manifest = json.loads((saved / "manifest.json").read_text())
    written = sum(int(np.prod([b - a for a, b in piece["box"]])) for f in manifest["files"]
                  for piece in f["arrays"])
    once = written == sum(int(np.prod(t["shape"])) for t in manifest["tensors"].values())
    out = []
    for mesh_b, sp in targets:
        n = {"ep=2": 2, "1": 1}.get(mesh_b, comm.size)
        group = comm if n == comm.size else comm.split(0 if comm.rank < n else None, key=comm.rank,
                                                       axis="world")
        if group is not None:
            mesh = DeviceMesh(group, parse_mesh(mesh_b) if mesh_b != "1" else {})
            exact_slices = reassembles_exactly(mesh, saved, train4)
            resumed = train(MODEL, train4, mesh, "1f1b", 2, 1, algo if mesh.sizes["cp"] > 1 else None, sp,
                            resume=str(saved))
            out.append(resume_row(group, f"{saved_on} --sp -> {mesh_b}{' --sp' if sp else ''}", resumed,
                                  full, mesh_b == saved_on, exact_slices)
                       | {"each_element_written_once": once})
        comm.barrier()
    return out


def main():
    comm = world(Tracer(rank=None))
    emit(comm, [check_run(comm, *run) for run in RUNS])
    resumes = check_resumes(comm, Path(sys.argv[1]), "ep=2,tp=2", None, [
        ("ep=2,tp=2", True), ("pp=2,tp=2", False), ("ep=2", False), ("1", False)])
    resumes += check_resumes(comm, Path(sys.argv[1]), "cp=2,tp=2", "ring", [
        ("cp=2,tp=2", True), ("ep=2", False), ("1", False)])
    emit(comm, resumes)
    comm.barrier()


if __name__ == "__main__":
    with abort_on_error():
        main()
