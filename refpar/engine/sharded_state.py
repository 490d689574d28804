"""What a rank holds, as pieces of the global tensors: the one mechanism every mesh saves and
resumes through (refpar/checkpoint.py keeps the file format and reassembles any piece from any
other mesh's).

Each data-parallel strategy lists what it holds (`states.held()`): per unit, a flat range of its
parameters, fp32 masters or AdamW moments, and whether the unit's replica group holds the same
(DP's whole units, ZeRO-1/2's parameters) or its own shard (ZeRO's state). A flat range of a unit
is a flat range of each parameter it overlaps, of this rank's tp shard of it; `checkpoint.shard_pieces`
cuts that into boxes of the global tensor (a tp shard's columns of c_attn are three runs). Saving
writes each element once: of what a group holds alike each rank its `shard_range`, of what every
tp rank holds whole tp rank 0, of the tied embedding pp rank 0 (the last stage's is the same), of
DualPipe's two copies the first rank of each mirror pair, of a Llama kv head that b = tp / n_kv_head
tp ranks replicate (holdings.kv_replicas) the first of them.
"""

from __future__ import annotations

import math

import numpy as np

from refpar import backend, checkpoint
from refpar.agreement import gather_json
from refpar.holdings import kv_replicas, tied_embedding
from refpar.model import param_shapes
from refpar.precision import dtype_of
from refpar.sharding import shard_range

KV_PROJ = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")  # Llama's kv heads' matrices


def pieces(par, saving: bool) -> list:
    """(checkpoint.Piece, view) of everything this rank holds; loading writes through the views."""
    units, coords = par.states.units, par.mesh.coords
    slices = par.tp_slices
    tied = tied_embedding(par.model)
    kv_copy = coords["tp"] % kv_replicas(par.model, par.mesh.sizes["tp"]) > 0  # another rank writes its kv
    out = []
    if saving and par.copies is not None and par.copies.rank > 0:  # its mirror writes the same
        return out
    for prefix, unit, first, flat, replicated in par.states.held():
        lo, hi = first, first + flat.shape[0]
        if saving and replicated:  # each rank of the group writes its part
            group = units.group[unit]
            a, b = shard_range(units.size[unit], group.size, group.rank)
            lo, hi = max(lo, a), min(hi, b)
        for name, a, b in units.segments(unit, lo, hi):
            if saving and ((name not in slices and coords["tp"]) or (name == tied and coords["pp"])
                           or (kv_copy and name.endswith(KV_PROJ))):
                continue
            axis, index = slices.get(name, (None, None))
            offset = units.offsets[name][1]
            out += checkpoint.shard_pieces(f"{prefix}/{name}", flat[a - first:b - first],
                                           units.shapes[name], a - offset, axis, index)
    return out


def gather_params(par, comm) -> dict | None:
    """Every parameter whole, on `comm`'s rank 0 (None elsewhere): each rank's pieces of them, as a save
    writes them (each element once, whatever the mesh), sent to rank 0 over `comm` (their names as
    JSON, their numbers as arrays) and reassembled. The validation loss evaluates these on one
    process (refpar/trainer.validation_loss)."""
    dtype = dtype_of(par.model.dtype)
    mine = [(p, backend.to_host(v)) for p, v in pieces(par, saving=True) if p.tensor.startswith("params/")]
    # the pieces' names as JSON and their numbers as one flat array each rank sends: nothing pickled
    flat = np.concatenate([np.ravel(v) for _, v in mine]) if mine else np.empty(0, dtype)  # (n_rank,)
    every = gather_json(comm, [p.to_json() for p, _ in mine])
    if comm.rank != 0:
        if flat.size:
            comm.send(np.ascontiguousarray(flat, dtype), 0, tag="params:gather")
        return None
    arrays = list(mine)
    for rank, part in enumerate(every[1:], start=1):
        held = [checkpoint.Piece.from_json(d) for d in part]
        sizes = [math.prod(p.shape) for p in held]
        data = comm.recv((sum(sizes),), dtype, rank, tag="params:gather") if sum(sizes) else None
        for p, a, b in zip(held, np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
            arrays.append((p, data[a:b].reshape(p.shape)))
    shapes = param_shapes(par.model)
    whole = checkpoint.assemble(arrays, {f"params/{n}": (s, dtype) for n, s in shapes.items()})
    return {n: whole[f"params/{n}"] for n in shapes}


def saved_position(t: int, scaler) -> dict:
    """What `checkpoint.save_training` keeps beside the arrays so that a resumed run goes on bit for
    bit: AdamW's step count (behind the step when fp16 skipped steps) and the loss scaler's state."""
    return {"optimizer_t": t, "loss_scaler": None if scaler is None else scaler.state_dict()}


def open_resume(path: str, model, cfg, plan) -> dict:
    """The manifest of the checkpoint `path` if this run can resume from it, else a CheckpointError:
    every rank reads the same manifest, so every rank refuses alike, before any message."""
    manifest = checkpoint.open_training(path, model, cfg)
    if model.moe_experts:
        saved = int(manifest.get("moe_microbatches", 1))
        if saved != plan.microbatches:
            raise checkpoint.CheckpointError(
                f"checkpoint {manifest['dir']} routed its tokens in {saved} microbatches per step and "
                f"this run in {plan.microbatches}; resume with --microbatches {saved} (capacity and "
                "router losses are per microbatch)")
    return manifest


def resume_from(par, path: str) -> int:
    """Loads this rank's holdings from the checkpoint `path` (any mesh's) and the optimizer's and
    fp16 loss scaler's position; returns the steps done."""
    states = par.states
    manifest = open_resume(path, par.model, par.train, par.plan)
    wanted = pieces(par, saving=False)
    for (_, view), loaded in zip(wanted, checkpoint.load(path, [p for p, _ in wanted], manifest),
                                 strict=True):
        view[...] = loaded
    step = int(manifest["step"])
    states.t = int(manifest.get("optimizer_t", step))
    if states.dtypes.scaler is not None and manifest.get("loss_scaler") is not None:
        states.dtypes.scaler.load_state_dict(manifest["loss_scaler"])
    return step
