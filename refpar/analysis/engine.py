"""Closed forms of an engine run (refpar/engine.py): bytes per rank by axis and op, and peak memory
per rank by category, composed from the strategies' own closed forms.

Legend: p pp size, d dp size, t tp size, v chunks, b_i rows of microbatch i, B_d = sum b_i the
rows of this pipeline, T sequence, c cp size, Ta the cp rank's tokens (`cp_tokens`; T without cp),
Tl residual tokens (Ta, or Ta/t under sp), C channels, e bytes per element, Ψl elements of the
parameters a rank holds (its stages' tp shards), n the ranks ZeRO shards over (`zero_shards`: d,
or d c over the "dp_cp" axis when the mesh has cp), Ψ_u a unit (ZeRO-3: engine_zero3.units_of,
wte and the rest of a stage; ZeRO-2 and FSDP: engine_fsdp.fsdp_units, wte, root and each block),
s_u this rank's share of it.

Per step, the rank at (pp r, dp q, cp j, tp k):
- tp: for each microbatch and each of its stages, the calls of tensor parallelism over the stage's
  blocks (analysis.intra_layer; the embedding's calls on the first stage, the head's on the last),
  with B = b_i (under sp the pair spans Ta tokens); under sp one all-reduce of the sequence-sharded
  region's gradients (ZeRO-2/3: only their segments inside this rank's gradient shards).
- pp: (2v - [r = 0] - [r = p-1]) activations or input gradients of (B_d, Tl, C) each way (see
  pipeline/runner.expected_comm_rows); wte's shard (V/t, C) all-reduced by the first and last
  rank; the loss (one float64) over pp.
- cp: for each microbatch and each of its stages, ring attention's K/V hops or Ulysses'
  all-to-alls over the stage's blocks (analysis.intra_layer, B = b_i, this rank's tokens); the
  loss, and under --zero 0 one all-reduce of Ψl.
- dp (ZeRO: over n ranks): --zero 0: one all-reduce of Ψl; --zero 1: a reduce-scatter and an
  all-gather of Ψl (ZeRO's 2Ψ); --zero 2: per microbatch and stage a reduce-scatter of each unit,
  per step an all-gather of each unit; --zero 3: per microbatch and stage two all-gathers and a
  reduce-scatter of each unit (3Ψ); --fsdp: the same but the ends' units gathered once on the
  first stage and twice on the last (`_gathers`); the loss over dp.
Memory: params and grads Ψl e; AdamW 2Ψl e (zero 1: 2 e times this rank's shard_range share);
activations: the schedule's replay (schedules.stored) with the bytes a microbatch keeps after F
(analysis.activations: embedding, blocks with local, ring or Ulysses attention, head, for b_i
rows and this rank's tokens); comm (zero 1): the flat gradient and the reduced shard,
(Ψl + Ψl/n) e. ZeRO-2, 3 and FSDP (`_sharded_peaks`): grads Σ s_u plus the transient ones (ZeRO-3:
a stage's whole gradient and one unit's flat copy; ZeRO-2 and FSDP `_unit_grads`: one block's and
its copy, or the ends'); AdamW 2 Σ s_u; ZeRO-3 params Σ s_u plus the largest stage gathered, FSDP
plus the largest piece's units; comm the largest s_u; ZeRO-2 params Ψl, comm the largest Ψ_u
(gathered after the step).

Mixed precision: e = 2 for activations, p2p messages and parameter all-gathers; gradient sums
(cp, dp, ZeRO's reduce-scatters, the tied wte, sp's region) move gi bytes per element
(`analysis.intra_layer.grad_itemsize`: 2, or 4 with fp32_grads); the strategies' float32 pieces
(cross-entropy statistics, ring attention's dK/dV) come from analysis.intra_layer; fp16 adds an
all-reduce of one float32 overflow flag over each axis whose ranks hold different gradients (tp,
pp, and ZeRO's group), and ZeRO-1 and 2 gather no parameters in a skipped step. Memory adds "master",
4 bytes per parameter this rank updates (all it holds, or its ZeRO shard), and AdamW's moments take
4 bytes each; gradients held whole after backward are e bytes, gradient shards and buffers gi.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from refpar.analysis.activations import embed_bytes, head_bytes, layer_bytes
from refpar.analysis.intra_layer import (
    RankShape,
    _ring_calls,
    _tp_calls,
    _ulysses_calls,
    grad_itemsize,
    zigzag_lengths,
)
from refpar.comm import cost
from refpar.config import MESH_AXES, ModelConfig, TrainConfig
from refpar.holdings import (
    ENDS,
    fsdp_units,
    sequence_parallel_param_names,
    stage_layers,
    stage_param_names,
    tp_param_slices,
    units_of,
)
from refpar.memory import CATEGORIES
from refpar.model.gpt import param_shapes
from refpar.parallel.pipeline.schedules import build, stored
from refpar.sharding import shard_range, shard_sizes


def rank_coords(sizes: dict, rank: int) -> dict:
    """The mesh coordinates of a world rank (DeviceMesh's layout: pp slowest, tp fastest)."""
    position = np.unravel_index(rank, tuple(sizes[a] for a in MESH_AXES))
    return {a: int(c) for a, c in zip(MESH_AXES, position, strict=True)}


def rank_param_numels(model: ModelConfig, sizes: dict, coords: dict, chunks: int) -> dict[str, int]:
    """Elements of each parameter the rank holds: its stages' names, tp-sliced."""
    p, t = sizes["pp"], sizes["tp"]
    slices = tp_param_slices(model, t, coords["tp"])
    names = {n for c in range(chunks) for n in stage_param_names(model, p * chunks, c * p + coords["pp"])}
    out = {}
    for name, shape in param_shapes(model).items():
        if name in names:
            shape = list(shape)
            if name in slices:
                axis, index = slices[name]
                shape[axis] = len(index)
            out[name] = int(np.prod(shape))
    return out


def zero3_units(model: ModelConfig, sizes: dict, coords: dict, chunks: int, unit_fn=units_of
                ) -> dict[int, dict[str, int]]:
    """stage -> unit -> elements (engine_zero3.units_of, or engine_fsdp.fsdp_units, over the rank's
    tp shards)."""
    numels = rank_param_numels(model, sizes, coords, chunks)
    p = sizes["pp"]
    return {s: {u: sum(numels[n] for n in names)
                for u, names in unit_fn(stage_param_names(model, p * chunks, s)).items()}
            for s in (c * p + coords["pp"] for c in range(chunks))}


def zero_shards(sizes: dict, coords: dict) -> tuple[str, int, int]:
    """(axis, size, rank) of the ranks ZeRO shards over (the mesh's dp_cp group): dp, or dp x cp."""
    c = sizes.get("cp", 1)
    if c == 1:
        return "dp", sizes["dp"], coords["dp"]
    return "dp_cp", sizes["dp"] * c, coords["dp"] * c + coords["cp"]


def sp_shard_numel(model: ModelConfig, sizes: dict, coords: dict, chunks: int, unit_fn=units_of) -> int:
    """Elements of the sequence-sharded region's parameters inside this rank's ZeRO-2/3 gradient
    shards: what ShardedGrads.sum_sequence_parallel all-reduces over tp."""
    numels = rank_param_numels(model, sizes, coords, chunks)
    region = set(sequence_parallel_param_names(model))
    _, n_z, g = zero_shards(sizes, coords)
    p, total = sizes["pp"], 0
    for s in (c * p + coords["pp"] for c in range(chunks)):
        for names in unit_fn(stage_param_names(model, p * chunks, s)).values():
            a, b = shard_range(sum(numels[n] for n in names), n_z, g)
            total += region_in_shard(names, numels, region, a, b)
    return total


def region_in_shard(names: list[str], numels: dict, region: set, a: int, b: int) -> int:
    """Elements of the parameters in `region` inside [a, b) of a unit's `names` laid end to end."""
    total, start = 0, 0
    for n in names:
        if n in region:
            total += max(0, min(start + numels[n], b) - max(start, a))
        start += numels[n]
    return total


def cp_tokens(T: int, c: int, cp_algo: str | None) -> list[int]:
    """Tokens of each cp rank: zig-zag chunks under ring attention, contiguous under Ulysses."""
    if c == 1:
        return [T]
    return zigzag_lengths(T, c) if (cp_algo or "ring") == "ring" else shard_sizes(T, c)


def _shape(model: ModelConfig, sizes: dict, T: int, coords: dict, b: int, sp: bool, cp_algo: str | None
           ) -> RankShape:
    t, k, c = sizes["tp"], coords["tp"], sizes.get("cp", 1)
    tokens = cp_tokens(T, c, cp_algo)
    Ta = tokens[coords.get("cp", 0)]
    return RankShape(B=b, T=T, Ta=Ta, Tl=shard_sizes(Ta, t)[k] if sp else Ta, t=t, c=c,
                     nh=model.n_head // t, V=shard_sizes(model.vocab_size, t)[k],
                     e=np.dtype(model.dtype).itemsize, cp_tokens=tuple(tokens), cp_rank=coords.get("cp", 0))


def _rows_of(train: TrainConfig, d: int, q: int, m: int) -> list[int]:
    first, stop = shard_range(train.batch_size, d, q)
    return [b - a for a, b in (shard_range(stop - first, m, i) for i in range(m))]


def expected_comm_rows(model: ModelConfig, train: TrainConfig, sizes: dict, opts, skipped: int = 0
                       ) -> list[dict]:
    """Every rank's bytes over the run, rows as refpar train's `comm_bytes`; `skipped`: steps an
    fp16 overflow skipped, in which ZeRO-1 and ZeRO-2 gather no updated parameters."""
    p, d, t, v, T = sizes["pp"], sizes["dp"], sizes["tp"], opts.chunks, train.seq_len
    c = sizes.get("cp", 1)
    e, C, S = np.dtype(model.dtype).itemsize, model.n_embd, sizes["pp"] * opts.chunks
    gi = grad_itemsize(model, train)
    out = []
    for rank in range(int(np.prod(list(sizes.values())))):
        co = rank_coords(sizes, rank)
        r, q, k = co["pp"], co["dp"], co["tp"]
        rows = _rows_of(train, d, q, opts.microbatches)
        totals: dict[tuple[str, str], list[int]] = {}

        def add(axis, op, sent, recv, totals=totals):
            row = totals.setdefault((axis, op), [0, 0])
            row[0], row[1] = row[0] + sent, row[1] + recv

        for s in (j * p + r for j in range(v)):
            blocks = replace(model, n_layer=len(stage_layers(model.n_layer, S, s)))
            for b in rows:
                shape = _shape(model, sizes, T, co, b, opts.sp, opts.cp_algo)
                calls = _tp_calls(blocks, shape, opts.sp, k) if t > 1 else []
                if c > 1:
                    ring = (opts.cp_algo or "ring") == "ring"
                    calls += _ring_calls(blocks, shape) if ring else _ulysses_calls(blocks, shape)
                for call in calls:
                    if (call.tag.startswith("sp.") or (call.tag.startswith("wte") and s != 0)
                            or (call.tag.startswith("lm_head") and s != S - 1)):
                        continue
                    add(call.axis, call.op, call.bytes_sent, call.bytes_recv)
        numels = rank_param_numels(model, sizes, co, v)
        axis, n_z, g = zero_shards(sizes, co)  # ZeRO's group
        unit_fn = fsdp_units if opts.fsdp or opts.zero == 2 else units_of  # engine.sharded_grads
        if opts.sp:
            n = (sp_shard_numel(model, sizes, co, v, unit_fn) if opts.zero >= 2 else
                 sum(numels[nm] for nm in sequence_parallel_param_names(model) if nm in numels))
            ar = cost.all_reduce_bytes(n, t, k, gi)
            add("tp", "all_reduce", ar.sent, ar.recv)
        if model.dtype == "float16":  # the overflow flag, over the axes whose gradients differ
            for flag_axis, size, at in (("tp", t, k), ("pp", p, r), (axis, n_z if opts.zero else 1, g)):
                if size > 1:
                    ar = cost.all_reduce_bytes(1, size, at, 4)
                    add(flag_axis, "all_reduce", ar.sent, ar.recv)
        if p > 1:
            Ta = cp_tokens(T, c, opts.cp_algo)[co["cp"]]
            Tl = shard_sizes(Ta, t)[k] if opts.sp else Ta
            p2p = (2 * v - (r == 0) - (r == p - 1)) * sum(rows) * Tl * C * e
            add("pp", "isend", p2p, 0)
            add("pp", "irecv", 0, p2p)
            if r in (0, p - 1):
                tied = numels["wte.weight"] if opts.zero < 2 else shard_sizes(numels["wte.weight"], n_z)[g]
                ar = cost.all_reduce_bytes(tied, 2, int(r == p - 1), gi)
                add("pp", "all_reduce", ar.sent, ar.recv)
            ar = cost.all_reduce_bytes(1, p, r, 8)
            add("pp", "all_reduce", ar.sent, ar.recv)
        total = sum(numels.values())
        if c > 1:  # every gradient (unless ZeRO sums them over dp x cp), then the loss, over cp
            for n, size in ((0 if opts.zero else total, gi), (1, 8)):
                ar = cost.all_reduce_bytes(n, c, co["cp"], size)
                add("cp", "all_reduce", ar.sent, ar.recv)
        if opts.zero == 3:  # per microbatch and stage: gathered for F and for B, reduced after B
            for s, units in zero3_units(model, sizes, co, v, unit_fn).items():
                for u, n in units.items():
                    ag = cost.all_gather_bytes(shard_sizes(n, n_z), g, e)
                    rs = cost.reduce_scatter_bytes(n, n_z, g, gi)
                    k = len(rows) * _gathers(u, s, S, opts.fsdp)
                    add(axis, "all_gather", k * ag.sent, k * ag.recv)
                    add(axis, "reduce_scatter", rs.sent * len(rows), rs.recv * len(rows))
        elif opts.zero == 2:  # per microbatch and stage each unit reduced after B; gathered once
            for units in zero3_units(model, sizes, co, v, unit_fn).values():
                for n in units.values():
                    rs = cost.reduce_scatter_bytes(n, n_z, g, gi)
                    add(axis, "reduce_scatter", rs.sent * len(rows), rs.recv * len(rows))
            taken = (train.steps - skipped) / train.steps  # a skipped step gathers nothing
            for n in _owned_units(zero3_units(model, sizes, co, v, unit_fn)).values():
                ag = cost.all_gather_bytes(shard_sizes(n, n_z), g, e)
                add(axis, "all_gather", ag.sent * taken, ag.recv * taken)
        elif opts.zero == 1:
            rs = cost.reduce_scatter_bytes(total, n_z, g, gi)
            ag = cost.all_gather_bytes(shard_sizes(total, n_z), g, e)
            taken = (train.steps - skipped) / train.steps  # the steps that gathered parameters
            add(axis, "reduce_scatter", rs.sent, rs.recv)
            add(axis, "all_gather", ag.sent * taken, ag.recv * taken)
        elif d > 1:
            ar = cost.all_reduce_bytes(total, d, q, gi)
            add("dp", "all_reduce", ar.sent, ar.recv)
        if d > 1:
            ar = cost.all_reduce_bytes(1, d, q, 8)
            add("dp", "all_reduce", ar.sent, ar.recv)
        out += [{"rank": rank, "axis": a, "op": o, "bytes_sent": round(sb * train.steps),
                 "bytes_recv": round(rb * train.steps)}
                for (a, o), (sb, rb) in totals.items() if sb or rb]
    return out


def _gathers(unit: str, stage: int, n_stages: int, fsdp: bool) -> int:
    """All-gathers of a unit per microbatch: ZeRO-3 gathers the stage for F and for B; FSDP gathers
    a block for F and for B, the ends' units (wte, root) for the embedding's F and the head's F and B
    (engine_fsdp.UnitStage)."""
    if not fsdp or unit not in ENDS:
        return 2
    return (stage == 0) + 2 * (stage == n_stages - 1)


def _unit_grads(stages: dict[int, dict[str, int]], numels: dict, n_stages: int, e: int, gi: int) -> int:
    """The transient gradients (bytes) of a stage that reduces unit by unit (ZeRO-2 and FSDP,
    engine_fsdp.UnitStage): while a block is reduced, its gradient (e bytes each, as backward leaves
    it) and flat copy (gi, the dtype it is reduced in), and on a stage that is both first and last
    the head's gradients of wte and ln_f, kept until the embedding's backward; while the ends'
    gradients (wte, root) are reduced, they and the larger one's flat copy."""
    head = numels.get("wte.weight", 0) + numels.get("ln_f.weight", 0) + numels.get("ln_f.bias", 0)
    most = 0
    for s, units in stages.items():
        blocks = [n for u, n in units.items() if u not in ENDS]
        ends = [n for u, n in units.items() if u in ENDS]
        most = max(most, (head if s == n_stages - 1 and s == 0 else 0) * e + max(blocks) * (e + gi),
                   sum(ends) * e + max(ends, default=0) * gi)
    return most


def _owned_units(stages: dict[int, dict[str, int]]) -> dict:
    """unit -> elements, wte once when the first and the last stage are on one rank."""
    return {("wte" if u == "wte" else (s, u)): n for s, us in stages.items() for u, n in us.items()}


def _sharded_peaks(stages: dict[int, dict[str, int]], d: int, q: int, e: int, optimizer: str,
                   zero: int, unit_grads: int | None = None, gi: int | None = None) -> dict:
    """ZeRO-2, 3 and FSDP: shards of every unit's gradient and AdamW moments, plus the transient
    gradients: `unit_grads` when the stage reduces unit by unit (ZeRO-2, FSDP: engine_fsdp.UnitStage),
    else, while a microbatch's gradients are reduced, the stage's whole gradient and one unit's flat
    copy. ZeRO-2: the parameters stay whole (the caller's), the largest unit is all-gathered after
    the step (comm). ZeRO-3: the parameter shards plus the largest stage gathered; FSDP: plus the
    largest set of units one piece gathers (the ends' wte and root together, or one block); both:
    the largest reduced shard (comm). Bytes: parameters e, gradient shards and flat copies gi (the
    gradients' dtype), a 16-bit model's master shards 4 and its moments 4 (else e)."""
    gi = e if gi is None else gi
    s = 4 if e == 2 else e
    units = _owned_units(stages)
    shards = {k: shard_sizes(n, d)[q] for k, n in units.items()}
    owned = sum(shards.values())
    transient = unit_grads if unit_grads is not None else max(
        sum(us.values()) * e + max(us.values()) * gi for us in stages.values())
    peaks = {"grads": owned * gi + transient, "master": owned * 4 if e == 2 else 0,
             "optimizer": 2 * owned * s if optimizer == "adamw" else 0}
    if zero == 2:
        return peaks | {"comm": max(max(units.values()) * e, max(shards.values()) * gi)}
    if unit_grads is not None:  # FSDP
        pieces = [n for us in stages.values() for u, n in us.items() if u not in ENDS]
        pieces += [sum(n for u, n in us.items() if u in ENDS) for us in stages.values()]
    else:
        pieces = [sum(us.values()) for us in stages.values()]
    return peaks | {"params": (owned + max(pieces)) * e, "comm": max(shards.values()) * gi}


def microbatch_activation_bytes(model: ModelConfig, train: TrainConfig, sizes: dict, coords: dict,
                                stage: int, n_stages: int, b: int, sp: bool = False,
                                cp_algo: str | None = None) -> int:
    """What one microbatch of b rows keeps on the rank at `coords` of `stage` between its F and its B."""
    r = _shape(model, sizes, train.seq_len, coords, b, sp, cp_algo)
    dropout = model.dropout > 0.0
    attention = "local" if r.c == 1 else (cp_algo or "ring")
    per_layer = layer_bytes(model, r, attention, dropout)
    if attention == "ring" and r.nh == 1:
        # One head per rank: the merged heads c_proj keeps are a view of the ring's output, kept once.
        per_layer -= r.B * r.Ta * r.e * model.head_size
    n = len(stage_layers(model.n_layer, n_stages, stage)) * per_layer
    if stage == 0:
        n += embed_bytes(model, r, dropout)
    if stage == n_stages - 1:
        n += head_bytes(model, r)
    return n


def expected_memory_rows(model: ModelConfig, train: TrainConfig, sizes: dict, opts) -> list[dict]:
    """Every rank's peak bytes by category, rows as refpar train's `memory_peak_bytes`."""
    p, d, v = sizes["pp"], sizes["dp"], opts.chunks
    e, S = np.dtype(model.dtype).itemsize, p * v
    gi, s = grad_itemsize(model, train), (4 if e == 2 else e)  # gradients; moments and masters
    schedule = build(opts.schedule, p, opts.microbatches, v)
    out = []
    for rank in range(int(np.prod(list(sizes.values())))):
        co = rank_coords(sizes, rank)
        r, q = co["pp"], co["dp"]
        rows = _rows_of(train, d, q, opts.microbatches)
        kept = stored(schedule, lambda a, co=co, rows=rows: microbatch_activation_bytes(
            model, train, sizes, co, a.stage, S, rows[a.microbatch], opts.sp, opts.cp_algo), lambda a: 0)
        held = sum(rank_param_numels(model, sizes, co, v).values())
        _, n_z, g = zero_shards(sizes, co)
        share = shard_sizes(held, n_z)[g] if opts.zero == 1 else held
        peaks = {"params": held * e, "grads": held * gi, "master": share * 4 if e == 2 else 0,
                 "optimizer": 2 * share * s if train.optimizer == "adamw" else 0,
                 "activations": max(kept[r], default=0),
                 "comm": (held + share) * gi if opts.zero == 1 else 0}
        if opts.zero >= 2:
            by_unit = opts.fsdp or opts.zero == 2  # engine_fsdp.UnitStage
            units = zero3_units(model, sizes, co, v, fsdp_units if by_unit else units_of)
            transient = (_unit_grads(units, rank_param_numels(model, sizes, co, v), S, e, gi) if by_unit
                         else None)
            peaks |= _sharded_peaks(units, n_z, g, e, train.optimizer, opts.zero, transient, gi)
        out += [{"rank": rank, "category": c, "bytes": int(peaks[c])} for c in CATEGORIES]
    return out
