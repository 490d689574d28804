"""One serving run on a mesh, measured and checked: what `refpar generate` prints.

    mpiexec -n 2 python -m refpar generate --mesh tp=2 --check --json

Every rank serves; rank 0 gathers the rows (traced bytes, ledger bytes, timings) and builds the
summary. `--check` replays every request alone on one device, recomputing the whole sequence for
each token, and reports the largest relative difference of the logits and whether the tokens agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from refpar import model
from refpar.analysis.serving import (
    block_bytes,
    kv_bytes_per_rank,
    kv_ratio_to_multi_head,
    kv_shards,
    kv_total_bytes,
    paged_blocks,
    paged_wasted_slots,
    pass_comm_bytes,
)
from refpar.comm import cost
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig
from refpar.memory import MemoryLedger
from refpar.mesh import DeviceMesh, check_job_size
from refpar.model import kv_cache_shape
from refpar.serving.batching import ServeMesh, check_serving, serve
from refpar.serving.paged import Paging
from refpar.serving.requests import Request, check_requests, reference_generate
from refpar.serving.sampling import Sampling


@dataclass(frozen=True)
class ServeOptions:
    max_batch: int = 4
    seed: int = 0  # the weights' seed
    check: bool = False
    paging: Paging | None = None  # None: the contiguous cache
    progress: bool = False  # print a paged run's engine steps as they end (rank 0)


def rel_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(np.asarray(b))), 1e-300))


def run_serving(world, sizes: dict, config: ModelConfig, requests: list[Request], sampling: Sampling,
                opts: ServeOptions, params: dict | None = None) -> dict | None:
    """Serves `requests` on the mesh `sizes` over `world` with the whole `params` (default: drawn from
    `opts.seed`); the summary on world rank 0, else None."""
    check_requests(config, requests)
    check_serving(config, sizes, opts.max_batch)  # on every rank, before any communication
    check_job_size(sizes, world.size)
    tracer = Tracer()
    world = world.split(0, world.rank)  # this run's own communicator, traced by its own tracer
    world.tracer, tracer.rank = tracer, world.world_rank
    mesh = DeviceMesh(world, sizes)
    sm = ServeMesh.from_mesh(mesh)
    ledger = MemoryLedger(record_events=True)
    params = model.init_params(config, opts.seed) if params is None else params
    progress = (lambda line: print(line, flush=True)) if opts.progress and world.rank == 0 else None
    result = serve(params, config, requests, sampling, sm, opts.max_batch, ledger, tracer, opts.paging,
                   progress)

    kv_expected = [kv_bytes_per_rank(config, cached.values(), sm.sizes, sm.coords)
                   for cached in result.cached]
    pool = None
    if opts.paging is not None:
        # Without sharing each request holds ceil(n_r / B) blocks of its own; with sharing the
        # saving depends on which requests hold a prefix together (the test works it out for its
        # mix), so the ledger is held to the blocks the tables hold.
        B, c, cr = opts.paging.block_size, sm.sizes["cp"], sm.coords["cp"]
        unshared = [paged_blocks(held.values(), B, c, cr) for held in result.reserved]
        taken = [p["blocks"] for p in result.pool]
        kv_expected = [block_bytes(config, B, sm.sizes, sm.coords) * n
                       for n in (taken if opts.paging.prefix_sharing else unshared)]
        pool = {"blocks": taken, "blocks_closed_form_unshared": unshared,
                "used_slots": [p["used_slots"] for p in result.pool],
                "wasted_slots": [p["wasted_slots"] for p in result.pool],
                "wasted_slots_closed_form_unshared": [paged_wasted_slots(held.values(), B, c, cr)
                                                      for held in result.reserved],
                "reserved": [{str(rid): n for rid, n in held.items()} for held in result.reserved],
                "copies": result.pool[-1]["copies"] if result.pool else 0,
                "tables": [{str(rid): t for rid, t in p["tables"].items()} for p in result.pool],
                "block_bytes": block_bytes(config, B, sm.sizes, sm.coords)}
    expected: dict = {}
    for p in result.passes:
        for key, moved in pass_comm_bytes(config, sm.sizes, sm.coords, p.groups).items():
            cost.add(expected, (p.phase, *key), moved)
    measured: dict = {}
    for e in tracer.events:
        cost.add(measured, (e.phase, e.axis, e.op), (e.bytes_sent, e.bytes_recv))
    diffs, same = [], True
    if opts.check and result.logits:
        for r in requests:
            tokens, logits = reference_generate(params, config, r, sampling)
            same &= tokens == result.tokens[r.rid]
            diffs += [rel_diff(a, b) for a, b in zip(result.logits[r.rid], logits, strict=True)]
    mine = {
        "rank": world.rank, "coords": sm.coords, "measured": measured, "expected": expected,
        "kv": result.kv_bytes, "kv_by_request": result.kv_by_request,
        "kv_expected": kv_expected, "kv_peak": ledger.peak["activations"],
        "params_bytes": ledger.current["params"], "diffs": diffs, "same": same,
        "passes": [(p.phase, p.tokens, p.rows, p.seconds) for p in result.passes],
        "pool": pool, "logits_sha256": _digest(result.logits), "kv_blocks": result.kv_blocks,
    }
    every = world.gather_object(mine)
    if world.rank != 0:
        return None
    return _summary(config, sizes, requests, sampling, opts, result, every)


def _digest(logits: dict) -> str | None:
    """sha256 of every logit row in request order (None off the last stage): equal digests are
    bitwise equal logits."""
    if not logits:
        return None
    h = hashlib.sha256()
    for rid in sorted(logits):
        for row in logits[rid]:
            h.update(np.ascontiguousarray(row).tobytes())
    return h.hexdigest()


def _summary(config, sizes, requests, sampling, opts, result, every) -> dict:
    phases = {"prefill": [0, 0, 0.0, 0], "decode": [0, 0, 0.0, 0]}  # tokens in, chosen, seconds, passes
    for phase, n, r, _ in every[0]["passes"]:
        phases[phase][0] += n
        phases[phase][1] += r
        phases[phase][3] += 1
    for i in range(len(every[0]["passes"])):  # a pass lasts as long as its slowest rank
        phases[every[0]["passes"][i][0]][2] += max(row["passes"][i][3] for row in every)
    comm, expected, per_token = [], [], {}
    for row in every:
        for rows, source in ((comm, row["measured"]), (expected, row["expected"])):
            rows += [{"rank": row["rank"], "phase": ph, "axis": ax, "op": op, "bytes_sent": s,
                      "bytes_recv": r} for (ph, ax, op), (s, r) in sorted(source.items())]
    sent: dict = {}  # (axis:phase, rank) -> bytes sent
    for c in comm:
        key = (f"{c['axis']}:{c['phase']}", c["rank"])
        sent[key] = sent.get(key, 0) + c["bytes_sent"]
    for (key, _), nbytes in sent.items():  # per token that went through the passes of the phase
        per_token[key] = max(per_token.get(key, 0.0), nbytes / phases[key.split(":")[1]][0])
    # tp splits the kv heads until each rank holds one (Llama's GQA replicates it past that); MLA's
    # latent is whole on every tp rank
    shape, shards = kv_cache_shape(config), kv_shards(config, sizes)
    peak_tokens = max((sum(cached.values()) for cached in result.cached), default=0)
    itemsize = np.dtype(config.dtype).itemsize
    prefill, decode = phases["prefill"], phases["decode"]
    diffs = [d for row in every for d in row["diffs"]]
    return {
        "mesh": {a: sizes.get(a, 1) for a in ("tp", "cp", "pp")}, "world_size": len(every),
        "model": config.to_dict(), "dtype": config.dtype, "sampling": sampling.describe(),
        "max_batch": opts.max_batch, "steps": result.steps,
        "requests": [{"rid": r.rid, "prompt_len": len(r.prompt), "new_tokens": r.max_new_tokens,
                      "arrival": r.arrival, "tokens": result.tokens[r.rid]} for r in requests],
        "tokens_generated": sum(len(t) for t in result.tokens.values()),
        "latency": {
            "prefill": {"passes": prefill[3], "prompt_tokens": prefill[0], "seconds": prefill[2],
                        "s_per_token": prefill[2] / max(prefill[0], 1)},
            "decode": {"passes": decode[3], "tokens": decode[1], "seconds": decode[2],
                       "s_per_step": decode[2] / max(decode[3], 1)},
        },
        "comm_bytes": comm, "expected_comm_bytes": expected,
        "comm_matches_closed_form": sorted(map(str, comm)) == sorted(map(str, expected)),
        "bytes_per_token": per_token,
        "kv_cache": [{"rank": row["rank"], "coords": row["coords"], "bytes_timeline": row["kv"],
                      "expected_bytes_timeline": row["kv_expected"], "peak_bytes": row["kv_peak"],
                      "bytes_by_request": [{str(k): v for k, v in d.items()} for d in row["kv_by_request"]],
                      "params_bytes": row["params_bytes"]} for row in every],
        "kv_moments": result.moments,
        "kv_matches_closed_form": all(row["kv"] == row["kv_expected"] for row in every),
        "kv_peak_tokens": peak_tokens,  # cached positions of all running requests at their largest
        "kv_cached_tokens": [sum(cached.values()) for cached in result.cached],  # at each kv moment
        "kv_cached_by_request": [{str(rid): n for rid, n in cached.items()} for cached in result.cached],
        "kv_heads": shape.heads, "kv_shards": shards, "kv_latent": shape.latent,
        "kv_closed_form_at_peak": kv_total_bytes(config, peak_tokens, shards),
        # per token per layer, the whole model's cache: as kept, and as multi-head K/V would keep it
        "kv_bytes_per_token_per_layer": shape.per_token * itemsize,
        "kv_multi_head_bytes_per_token_per_layer": shape.multi_head * itemsize,
        "kv_ratio_to_multi_head": kv_ratio_to_multi_head(config),
        "max_logit_rel_diff": max(diffs) if opts.check and diffs else None,
        "tokens_match_reference": all(row["same"] for row in every) if opts.check else None,
        "logits_sha256": next(row["logits_sha256"] for row in every if row["logits_sha256"]),
        "paged": None if opts.paging is None else {
            "block_size": opts.paging.block_size, "prefix_sharing": opts.paging.prefix_sharing,
            "kv_blocks": every[0]["kv_blocks"], "preemptions": result.preemptions,
            "shared_positions": {str(k): v for k, v in result.shared.items()},
            "pool": [{"rank": row["rank"], "coords": row["coords"], **row["pool"]} for row in every]},
    }
