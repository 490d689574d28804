"""The closed forms of a run on any mesh, composed in one place from each strategy's own: bytes per
rank by axis and op, and peak memory per rank by category (refpar/engine runs what they predict).

Legend: p pp size, v chunks, t tp size, c cp size, e ep size, b_j this rank's rows of microbatch j,
T sequence, Ta this cp rank's tokens, Tl the residual stream's (Ta, or its sp shard), C channels.

Per step, the rank at mesh coordinates `coords`:
- tp, cp: for each microbatch and each of its stages, tensor parallelism's calls over the stage's
  blocks (the embedding's on the first stage, the head's on the last; analysis/intra_layer.py) and
  ring attention's hops or Ulysses' all-to-alls (B = b_j, this rank's tokens); in MoE blocks the
  expert buffer's all-reduces and sp's gathers instead of the MLP's (analysis/moe.py).
- ep, data: per MoE layer of its stages and microbatch, the routing counts' all-gather over the
  data ranks and the all-to-alls from the kept and pair counts (analysis/moe.py).
- pp: the activations and input gradients of (b_j, Tl, C) between neighbouring stages on two ranks
  ((2v - [r = 0] - [r = p-1]) each way in a loop); the loss (one float64, three with experts) over
  pp; DualPipe's copies' gradient sum over the mirror ranks r and p-1-r.
- DP, ZeRO, FSDP over each unit's replica group (analysis/data_parallel.py): the buckets, reduce-
  scatters and gathers of the rank's units; the tied wte over the first and last pp rank and the
  sequence-sharded region over tp, on what the rank keeps of them; fp16's overflow flag over each
  group whose ranks hold different gradients; with clipping, the sum of squares (one element of
  the optimizer's dtype) over the replica group under ZeRO, ep under DP with experts, tp and pp
  (refpar/parallel/clipping.py), on the steps the optimizer takes; the loss over the ranks that saw
  different tokens.
`rank_calls` lists the step's collectives one by one with the moment of the step each belongs to
(the forward, the backward, the sums after it, the optimizer step), for the app's Whole mesh page;
`rank_comm_bytes` is their sum.
Memory: the data-parallel strategy's states and transients (analysis/data_parallel.py), and the
activations: the schedule's replay (simulate.stored) of what each F keeps until its B (and, where
the backward is split, what B keeps until W), from analysis/activations.py's terms (the model's
pieces of refpar/parallel/pieces.py, the trivial layout's where nothing is split).

Mixed precision: e = 2 for activations, p2p messages and parameter all-gathers; gradient sums
move gi bytes per element (2, or 4 with fp32_grads); the strategies' float32 pieces (cross-entropy
statistics, ring attention's dK/dV) come from analysis/intra_layer.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from refpar.analysis import data_parallel as dp_forms
from refpar.analysis import moe as moe_forms
from refpar.analysis.activations import (
    core_bytes,
    embed_bytes,
    head_bytes,
    layer_bytes,
    llama_core_bytes,
    llama_layer_bytes,
    mla_core_bytes,
    mla_layer_bytes,
)
from refpar.analysis.intra_layer import _ring_calls, _tp_calls, _ulysses_calls, grad_itemsize, rank_shape
from refpar.analysis.latent_attention import mla_cp_widths, mla_tp_calls
from refpar.comm import cost
from refpar.config import MESH_AXES, ModelConfig, TrainConfig
from refpar.holdings import (
    embed_param_names,
    expert_unit,
    head_param_names,
    held_expert,
    keeps_lowp,
    kv_heads,
    kv_replicas,
    microbatch_samples,
    names,
    sequence_parallel_param_names,
    stage_layers,
    stage_names,
    tied_embedding,
    tp_param_slices,
    units,
)
from refpar.memory import CATEGORIES
from refpar.model import param_shapes
from refpar.schedules import Schedule, StageMap, stage_map
from refpar.schedules.builders import of_plan
from refpar.schedules.simulate import stored
from refpar.sharding import shard_sizes


def rank_coords(sizes: dict, rank: int) -> dict:
    """The mesh coordinates of a world rank (DeviceMesh's layout: pp slowest, tp fastest)."""
    position = np.unravel_index(rank, tuple(sizes[a] for a in MESH_AXES))
    return {a: int(c) for a, c in zip(MESH_AXES, position, strict=True)}


def pipeline(sizes: dict, plan) -> tuple[Schedule, StageMap]:
    """The schedule `plan` runs on the mesh's pp ranks and its layout: which rank runs each stage
    (chunk c of rank r is stage c p + r in a loop; stages r and 2p-1-r in a V) and which part of
    the model each stage is."""
    schedule = of_plan(plan, sizes["pp"])
    return schedule, stage_map(schedule)


def rank_param_numels(model: ModelConfig, sizes: dict, coords: dict, plan) -> dict[str, int]:
    """Elements of each parameter the rank holds: its stages' names, of a MoE block's experts those
    of its ep rank, tp-sliced."""
    lay = pipeline(sizes, plan)[1]
    names = {n for s in lay.stages_of(coords["pp"]) for n in stage_names(model, lay, s)}
    slices = tp_param_slices(model, sizes["tp"], coords["tp"])
    out = {}
    for n, shape in param_shapes(model).items():
        if n in names and held_expert(model, n, sizes["ep"], coords["ep"]):
            axis, index = slices.get(n, (None, None))
            out[n] = math.prod(shape) if axis is None else math.prod(shape) // shape[axis] * len(index)
    return out


def samples(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict, plan, j: int) -> range:
    return microbatch_samples(model, cfg.batch_size, plan.microbatches, sizes, coords, j)


def _group(model, sizes: dict, coords: dict, expert: bool) -> tuple[str, int, int]:
    """(axis, size, rank) of a unit's replica group: dp x cp (the mesh's dp_cp: dp when c = 1), or
    for a MoE model's dense weights its data ranks dp x ep x cp."""
    c, q = sizes["cp"], coords["cp"]
    if model.moe_experts and not expert:
        d = coords["dp"] * sizes["ep"] + coords["ep"]
        return "data", sizes["dp"] * sizes["ep"] * c, d * c + q
    return ("dp" if c == 1 else "dp_cp"), sizes["dp"] * c, coords["dp"] * c + q


def rank_units(model: ModelConfig, sizes: dict, coords: dict, plan) -> dp_forms.RankUnits:
    """The rank's units (holdings.units per stage, dense first) and its schedule row."""
    numels = rank_param_numels(model, sizes, coords, plan)
    schedule, lay = pipeline(sizes, plan)
    P = lay.stages_per_copy
    by_stage = {s: units([n for n in stage_names(model, lay, s) if n in numels], tied_embedding(model))
                for s in lay.stages_of(coords["pp"])}
    order = list(dict.fromkeys([u for us in by_stage.values() for u in us if not expert_unit(u)]
                               + [u for us in by_stage.values() for u in us if expert_unit(u)]))
    # a unit two stages hold (a V's rank 0: wte, and wpe and ln_f in its root) is one, in GPT-2's order
    members = {u: [n for n in numels if any(n in us.get(u, ()) for us in by_stage.values())] for u in order}
    # the microbatches whose backward completes each unit: every stage holding it runs its copy's
    uses = {u: sum(len(lay.microbatches(s)) for s, us in by_stage.items() if u in us) for u in order}
    out = {}
    for u in members:
        axis, n, r = _group(model, sizes, coords, expert_unit(u))
        size = sum(numels[x] for x in members[u])
        out[u] = dp_forms.Unit(size, tuple(shard_sizes(size, n)), r, axis)
    stages = {}
    for s, us in by_stage.items():
        ends = tuple(u for u in ("wte", "root") if u in us)
        blocks = tuple(tuple(u for u in (f"h.{i}", f"h.{i}.experts") if u in us)
                       for i in stage_layers(model.n_layer, P, lay.part(s)))
        head = sum(numels.get(n, 0) for n in head_param_names(model))
        embed = sum(numels.get(n, 0) for n in embed_param_names(model))
        stages[s] = dp_forms.StageUnits(lay.part(s) == 0, lay.part(s) == P - 1, ends, blocks, head, embed)
    return dp_forms.RankUnits(out, stages, schedule[coords["pp"]], lay.split, uses,
                              [(u, x, numels[x]) for u in order for x in members[u]],
                              fused=not split_backward(model, sizes, plan))


def split_backward(model, sizes: dict, plan) -> bool:
    """Whether a stage's backward is split into B and W: every piece's is (refpar/parallel/pieces.py)
    but in a model with MoE blocks, whose layer gives its gradients fused (pipeline/stage.py)."""
    return not model.moe_experts


def precision(model: ModelConfig, cfg: TrainConfig, sizes: dict) -> dp_forms.Precision:
    e = np.dtype(model.dtype).itemsize
    mixed = e == 2
    return dp_forms.Precision(e, grad_itemsize(model, cfg), 4 if mixed else e, mixed,
                              2 if cfg.optimizer == "adamw" else 0, model.dtype == "float16",
                              keeps_lowp(model, sizes))


def _rows(model, cfg, sizes, coords, plan) -> list[int]:
    return [len(samples(model, cfg, sizes, coords, plan, j)) for j in range(plan.microbatches)]


# -------------------------------------------------------------------------------------- bytes
# The moments of a step a call belongs to (refpar/viz/mesh_grid.py steps through them): the passes of
# every microbatch, the sums once every backward is done, and the optimizer's update.
MOMENTS = ("forward", "backward", "after the backward", "optimizer step")


def rank_calls(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict, plan,
               kept: list | None = None, stepped: bool = True) -> list[tuple]:
    """One step's collectives on the rank at `coords`: (moment, axis, op, what, bytes of one call,
    times called), in MOMENTS order (module docstring); `kept` (MoE): per microbatch, layer -> the
    (kept (D c, E), pairs (D c, ep)) counts of this rank's MoE blocks; `stepped`: the optimizer
    took the step."""
    p, t, c = sizes["pp"], sizes["tp"], sizes["cp"]
    r, k = coords["pp"], coords["tp"]
    e, C = np.dtype(model.dtype).itemsize, model.n_embd
    lay = pipeline(sizes, plan)[1]
    P = lay.stages_per_copy
    pr, rows = precision(model, cfg, sizes), _rows(model, cfg, sizes, coords, plan)
    out: list[tuple[str, str, str, str, cost.Bytes, int]] = []

    def add(moment, axis, op, what, b, times=1):
        out.append((moment, axis, op, what, cost.Bytes(*b), times))

    for s in lay.stages_of(r):
        layers = list(stage_layers(model.n_layer, P, lay.part(s)))
        moe_tags = tuple(f"h.{i}.mlp." for i, g in enumerate(layers) if g in model.moe_blocks)
        dense = {} if model.first_k_dense_replace is None else {"first_k_dense_replace": 0}
        blocks = replace(model, n_layer=len(layers), moe_experts=0, moe_layers=None, **dense)
        forms = BLOCK_FORMS[model.arch]
        for b in (rows[j] for j in lay.microbatches(s)):
            shape = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, b)
            calls = _tp_calls(blocks, shape, plan.sp, k) if t > 1 else []
            if t > 1:
                calls = forms.tp_calls(model, calls, shape, plan.sp, k)
            if c > 1:
                ring = (plan.cp_algo or "ring") == "ring"
                widths = forms.cp_widths(model, shape, ring)
                calls += (_ring_calls if ring else _ulysses_calls)(blocks, shape, *widths)
            for call in calls:
                first, last = lay.part(s) == 0, lay.part(s) == P - 1
                embedding = call.tag.startswith(("wte", "model.embed_tokens"))
                if not (call.tag.startswith(("sp.", *moe_tags)) or (embedding and not first)
                        or (call.tag.startswith("lm_head") and not last)):
                    b, tag = (call.bytes_sent, call.bytes_recv), _global_block(call.tag, layers)
                    add("forward" if tag.endswith(":fwd") else "backward", call.axis, call.op, tag, b)
                    if _rerun(tag, plan.recompute):  # the forward again inside the backward
                        add("backward", call.axis, call.op, f"{tag} (recomputed)", b)
    kv = kv_replicas(model, t)
    if kv > 1:  # each block's k_proj and v_proj gradients over the replicas of its kv head, per microbatch
        n = 2 * model.head_size * C
        blocks = sum(len(stage_layers(model.n_layer, P, lay.part(s))) * len(lay.microbatches(s))
                     for s in lay.stages_of(r))
        add("backward", "tp", "all_reduce", "k_proj and v_proj grads over their kv head's replicas",
            cost.all_reduce_bytes(n, kv, k % kv, e), blocks)
    if model.moe_experts:
        Ta = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, 1).Ta
        for (axis, op), b in moe_forms.routing_step_bytes(model, cfg, sizes, coords, plan.microbatches, rows,
                                                          kept or [], Ta, plan.cp_algo, plan.sp,
                                                          plan.recompute == "full").items():
            # one total for both passes: the routing's counts, dispatch and combine forward, their
            # mirror backward
            add("forward", axis, op, "MoE layers' routing, forward and backward", b)
    if p > 1:
        # each stage's activation out and input gradient back, of each microbatch of its copy, where
        # the neighbouring stage sits on another rank: 2v - [r = 0] - [r = p-1] per microbatch in a
        # loop; in a V 2 on rank 0 (the ends) and on rank p-1 (the turn from stage p-1 to p stays on
        # it), 4 on the others. As many arrive as leave (the same pairs of neighbours).
        Tl = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, 1).Tl
        for moment, step, sent, came in (("forward", 1, "activations to the next stage",
                                          "activations from the previous stage"),
                                         ("backward", -1, "input gradients to the previous stage",
                                          "input gradients from the next stage")):
            out_rows = sum(rows[j] for s in lay.stages_of(r) for j in lay.microbatches(s)
                           if 0 <= lay.part(s) + step < P and lay.stage_rank[s + step] != r)
            in_rows = sum(rows[j] for s in lay.stages_of(r) for j in lay.microbatches(s)
                          if 0 <= lay.part(s) - step < P and lay.stage_rank[s - step] != r)
            if out_rows:
                add(moment, "pp", "isend", sent, (out_rows * Tl * C * e, 0))
            if in_rows:
                add(moment, "pp", "irecv", came, (0, in_rows * Tl * C * e))
        add("after the backward", "pp", "all_reduce", "loss:pp",
            cost.all_reduce_bytes(3 if model.moe_experts else 1, p, r, 8))
    clip = cfg.clip_grad_norm > 0
    for axis, op, what, b in data_parallel_bytes(model, sizes, coords, plan, pr, stepped, clip)[1]:
        add(_dp_moment(what), axis, op, what, b)
    axis, n, q = _group(model, sizes, coords, False)
    if n > 1:  # the loss (and the router losses) over the ranks that saw different tokens
        add("after the backward", axis, "all_reduce", "loss", cost.all_reduce_bytes(3 if model.moe_experts
                                                                                    else 1, n, q, 8))
    order = {m: i for i, m in enumerate(MOMENTS)}
    return sorted(out, key=lambda call: order[call[0]])  # stable: program order within a moment


def _global_block(tag: str, layers: list[int]) -> str:
    """A stage's call tag with its block named globally: the stage's block i is the model's layers[i]."""
    if not tag.startswith("h."):
        return tag
    dot = tag.index(".", 2)
    return f"h.{layers[int(tag[2:dot])]}{tag[dot:]}"


def _dp_moment(what: str) -> str:
    """The moment of a data-parallel call (analysis/data_parallel.replay's and data_parallel_bytes'
    tags): the gathers of a unit for a pass, the gradients' sums as backward completes units, the
    gathers of the updated shards, and the sums made once every backward is done."""
    if what.endswith(":params:step"):
        return "optimizer step"
    if what == "copies:grads":  # DualPipe's two copies, summed once both are done
        return "after the backward"
    if ":params:" in what:
        return "forward" if what.endswith("fwd") else "backward"
    if what.endswith(":grads") or what.startswith("bucket."):
        return "backward"
    return "after the backward"  # the tied wte, DualPipe's copies, sp's region, fp16's flag, the norm


def rank_comm_bytes(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict, plan,
                    kept: list | None = None, stepped: bool = True) -> dict:
    """{(axis, op): (sent, received)} of one step: `rank_calls` summed."""
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    for _, axis, op, _, b, times in rank_calls(model, cfg, sizes, coords, plan, kept, stepped):
        cost.add(totals, (axis, op), b, times)
    return totals


def _rerun(tag: str, recompute: str) -> bool:
    """Whether the block call `tag` moves again in the backward (refpar/parallel/recompute.py): every
    forward call of a block under full recomputation, the attention core's (cp's ring or Ulysses
    exchanges) under selective."""
    forward = tag.startswith("h.") and tag.endswith(":fwd")
    if recompute == "full":
        return forward
    return recompute == "selective" and forward and (".attn.ring_kv" in tag or ".attn.ulysses_" in tag)


def data_parallel_bytes(model, sizes, coords, plan, pr, stepped: bool = True,
                        clip: bool = False) -> tuple[dict, list]:
    """({(axis, op): (sent, received)}, the calls in order) of the replicas' collectives in a step
    (analysis/data_parallel.py), the partial sums, fp16's overflow flag and (`clip`) the global
    gradient norm's sums."""
    ru = rank_units(model, sizes, coords, plan)
    _, moved, calls = dp_forms.replay(ru, plan, pr, stepped)
    out = dict(moved)

    def add(key, b, what):
        cost.add(out, key, b)
        calls.append((*key, what, b))

    p, t, r = sizes["pp"], sizes["tp"], coords["pp"]
    numels = rank_param_numels(model, sizes, coords, plan)
    whole = plan.strategy == "dp"
    lay = pipeline(sizes, plan)[1]
    if lay.tied_apart and tied_embedding(model) and r in (0, p - 1):  # the tied wte, whole or its shard
        u = ru.units["wte"]
        tied = cost.all_reduce_bytes(u.size if whole else u.shard, 2, int(r == p - 1), pr.g)
        add(("pp", "all_reduce"), tied, "wte.weight:tied-grad")
    if lay.copies == 2:  # DualPipe: the two copies' gradients, every unit whole or its shard, over r, p-1-r
        n = sum(u.size if whole else u.shard for u in ru.units.values())
        add(("pp", "all_reduce"), cost.all_reduce_bytes(n, 2, int(r > p - 1 - r), pr.g), "copies:grads")
    if plan.sp:
        region = set(sequence_parallel_param_names(model))
        n = (sum(numels[x] for x in region if x in numels) if whole else
             sum(_in_shard(ru, u, region) for u in ru.units))
        add(("tp", "all_reduce"), cost.all_reduce_bytes(n, t, coords["tp"], pr.g), "sp.replicated_grads:bwd")
    if pr.loss_scaling:  # the overflow flag over each group whose ranks hold different gradients
        replicas = _group(model, sizes, coords, False)
        flags = [("tp", t, coords["tp"]), ("pp", p, r)]
        flags.append(replicas if plan.stage else ("ep", sizes["ep"], coords["ep"]))
        for axis, n, q in flags:
            if n > 1:
                add((axis, "all_reduce"), cost.all_reduce_bytes(1, n, q, 4), f"found_inf.{axis}")
    if clip and stepped:  # the sum of squares: ZeRO's shards, DP's experts over ep, tp, pp
        sums = [_group(model, sizes, coords, False) if plan.stage else None,
                ("ep", sizes["ep"], coords["ep"]) if model.moe_experts and not plan.stage else None,
                ("tp", t, coords["tp"]), ("pp", p, r)]
        for axis, n, q in filter(None, sums):
            if n > 1:
                add((axis, "all_reduce"), cost.all_reduce_bytes(1, n, q, pr.state), f"grad_norm.{axis}")
    return out, calls


def _in_shard(ru, unit: str, region: set) -> int:
    """Elements of the parameters in `region` inside this rank's [a, b) of `unit`."""
    u = ru.units[unit]
    a = sum(u.counts[:u.rank])
    b = a + u.shard
    total, start = 0, 0
    for owner, name, n in ru.names:
        if owner != unit:
            continue
        if name in region:
            total += max(0, min(start + n, b) - max(start, a))
        start += n
    return total


def rank_comm_rows(model, cfg, sizes, coords, plan, steps: int, skipped=(), kept_by_step=None) -> list[dict]:
    """The rank's `expected_comm_bytes` rows over `steps` steps, of which fp16 skipped those in
    `skipped` (0-based, from the first); `kept_by_step` (MoE): per step, `rank_comm_bytes`'s `kept`."""
    totals: dict = {}
    for i in range(steps):
        kept = kept_by_step[i] if kept_by_step else None
        step = rank_comm_bytes(model, cfg, sizes, coords, plan, kept, stepped=i not in skipped)
        for key, b in step.items():
            cost.add(totals, key, b)
    return [{"axis": a, "op": o, "bytes_sent": int(s), "bytes_recv": int(rv)}
            for (a, o), (s, rv) in sorted(totals.items()) if s or rv]


# ------------------------------------------------------------------------------------- memory
def microbatch_activation_bytes(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict,
                                stage: int, n_stages: int, b: int, plan, kept: dict | None = None,
                                j: int = 0) -> int:
    """What microbatch j (b rows) keeps on the rank at `coords` of part `stage` of the model cut in
    `n_stages` (StageMap.part) between its F and B; `kept` (MoE): layer -> its (kept, pairs) counts."""
    layers = stage_layers(model.n_layer, n_stages, stage)
    r = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, b)
    dropout = model.dropout > 0.0
    block = BLOCK_FORMS[model.arch].keeps(model, cfg, coords, r, plan, plan.recompute)
    n = len(layers) * block + embed_bytes(model, r, dropout) * (stage == 0) + head_bytes(model, r) * (
        stage == n_stages - 1)
    if model.moe_experts and plan.recompute != "full":  # under full a MoE block keeps its input alone
        n += moe_forms.moe_activation_delta(model, cfg, sizes, coords, layers, b, r.Ta, kept or {},
                                            plan.microbatches, j, plan.cp_algo, plan.sp)
    return n


def _attention(r, plan) -> str:
    """The attention core a rank of shape `r` runs: local, or cp's ring or Ulysses."""
    return "local" if r.c == 1 else (plan.cp_algo or "ring")


def _block_bytes(model: ModelConfig, cfg, coords, r, plan, recompute: str) -> int:
    """What one GPT-2 block keeps on a rank of shape `r` (a tensor_parallel.Layout's pieces)."""
    attention = _attention(r, plan)
    n = layer_bytes(model, r, attention, model.dropout > 0.0, recompute=recompute)
    if attention == "ring" and r.nh == 1 and recompute == "none":
        # One head per rank: the merged heads c_proj keeps are a view of the ring's output, kept once.
        n -= r.B * r.Ta * r.e * model.head_size
    return n


def _core_bytes(model: ModelConfig, cfg, coords, r, plan) -> int:
    """What GPT-2's attention core makes again under selective recomputation (core_bytes)."""
    return core_bytes(model, r, _attention(r, plan), model.dropout > 0.0)


def _llama_shape(model, coords, r, plan) -> dict:
    """The rank's heads, kv heads, tokens and attention core, as llama_layer_bytes takes them."""
    k0, k1 = kv_heads(model, r.t, coords["tp"])
    return dict(heads=r.nh, kv_heads=k1 - k0, Ta=r.Ta, attention=_attention(r, plan), cp=r.c,
                cp_rank=r.cp_rank)


def _llama_block_bytes(model, cfg, coords, r, plan, recompute: str) -> int:
    """What one Llama block keeps on the rank of shape `r` (llama_layer_bytes)."""
    ff = shard_sizes(model.intermediate_size, r.t)[coords["tp"]]
    return llama_layer_bytes(model, r.B, cfg.seq_len, ff=ff, Tl=r.Tl, recompute=recompute,
                             **_llama_shape(model, coords, r, plan))


def _llama_core_bytes(model, cfg, coords, r, plan) -> int:
    """What a Llama block's attention core makes again under selective recomputation (llama_core_bytes)."""
    return llama_core_bytes(model, r.B, cfg.seq_len, **_llama_shape(model, coords, r, plan))


def recompute_working_bytes(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict, stage: int,
                            n_stages: int, b: int, plan, kept: dict | None = None, j: int = 0) -> int:
    """What the backward of microbatch j (b rows) on part `stage` makes again and holds at once
    (refpar/parallel/recompute.py): one attention core's `core_bytes` (selective), or the largest
    block's cache of the stage (full; a MoE block's from its kept counts `kept`); 0 without."""
    if plan.recompute == "none":
        return 0
    r = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, b)
    forms = BLOCK_FORMS[model.arch]
    if plan.recompute == "selective":
        return forms.core(model, cfg, coords, r, plan)
    dense = forms.keeps(model, cfg, coords, r, plan, "none")
    return max(dense + (moe_forms.moe_activation_delta(model, cfg, sizes, coords, [i], b, r.Ta, kept or {},
                                                       plan.microbatches, j, plan.cp_algo, plan.sp)
                        if i in model.moe_blocks else 0)
               for i in stage_layers(model.n_layer, n_stages, stage))


def _tokens(r, plan) -> tuple[int, int, int, int]:
    """(Na, Nl, col, gathered) of a rank of shape `r`: its region's and its residual stream's tokens, the
    tokens a column-parallel linear keeps its input over, and a row-parallel one's output gradient
    gathered over the region (sp), in elements per channel."""
    Na, Nl = r.B * r.Ta, r.B * r.Tl
    return Na, Nl, (Na if plan.sp else Nl), (Na if plan.sp else 0)


def _weight_half_bytes(model, coords, r, plan) -> int:
    """What a GPT-2 block's B keeps for W: mlp.c_proj's and attn.c_proj's inputs (4C/t, C/t), c_fc's and
    c_attn's output gradients (4C/t, 3C/t), their inputs (ln_2's and ln_1's outputs), the row-parallel
    output gradients; the LayerNorm gains."""
    C, (Na, Nl, col, gathered) = model.n_embd, _tokens(r, plan)
    return r.e * (Na * 12 * (C // r.t) + 2 * col * C + 2 * (Nl * C + gathered * C) + 4 * C)


def _llama_weight_half_bytes(model, coords, r, plan) -> int:
    """What a Llama block's B keeps for W: down's input and gradient, gate's and up's gradients, o's
    input and gradient, q's, k's and v's gradients; the two norms' outputs; their gains."""
    C, (Na, _, col, _) = model.n_embd, _tokens(r, plan)
    k0, k1 = kv_heads(model, r.t, coords["tp"])
    Ch, kv = r.nh * model.head_size, (k1 - k0) * model.head_size
    F = shard_sizes(model.intermediate_size, r.t)[coords["tp"]]
    return r.e * (Na * (F + C + 2 * F + Ch + C + Ch + 2 * kv) + 2 * col * C + 2 * C)


def _mla_block_bytes(model, cfg, coords, r, plan, recompute: str) -> int:
    """What one DeepSeek-V3 block keeps on the rank of shape `r` (mla_layer_bytes): latent attention
    on its heads, the dense MLP's columns (a MoE block's difference is analysis/moe.py's)."""
    ff = shard_sizes(model.intermediate_size, r.t)[coords["tp"]]
    return mla_layer_bytes(model, r.B, cfg.seq_len, heads=r.nh, ff=ff, Tl=r.Tl, Ta=r.Ta, recompute=recompute,
                           attention=_attention(r, plan), cp=r.c, cp_rank=r.cp_rank)


def _mla_core_bytes(model, cfg, coords, r, plan) -> int:
    """What latent attention's core makes again under selective recomputation (mla_core_bytes)."""
    return mla_core_bytes(model, r.B, cfg.seq_len, r.nh, r.Ta, attention=_attention(r, plan), cp=r.c,
                          cp_rank=r.cp_rank)


def _mla_weight_half_bytes(model, coords, r, plan) -> int:
    """What a DeepSeek-V3 block's B keeps for W (refpar/parallel/mla_tensor_parallel.py's weight halves):
    the MLP's as Llama's; o_proj's input and gradient; kv_b's and q_b's output gradients and their inputs
    (the latents; q_proj's: the norm's output), entered again; the down-projections' and latent norms'
    gradients, computed in B and given to W; the two gains."""
    C, (Na, _, col, _) = model.n_embd, _tokens(r, plan)
    F = shard_sizes(model.intermediate_size, r.t)[coords["tp"]]
    dn, dr, dv, rkv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.kv_lora_rank
    rq = model.q_lora_rank
    down = (rkv + dr) * C + rkv + (0 if rq is None else rq * C + rq)
    return r.e * (Na * (F + C + 2 * F + r.nh * (dv + (dn + dv) + (dn + dr)) + C)
                  + col * (C + rkv + (C if rq is None else rq)) + down + 2 * C)


@dataclass(frozen=True)
class BlockForms:
    """A family's closed forms of one block on the rank of shape r (intra_layer.rank_shape)."""

    keeps: Callable  # (model, cfg, coords, r, plan, recompute) -> what it keeps between F and B
    core: Callable  # (model, cfg, coords, r, plan) -> what selective recomputation makes again
    weight_half: Callable  # (model, coords, r, plan) -> what B keeps for W where a schedule splits them
    # (model, calls, r, sp, tp_rank) -> intra_layer._tp_calls' calls with the family's own entries
    tp_calls: Callable = lambda model, calls, r, sp, tp_rank: calls
    # (model, r, ring) -> the widths cp moves, as _ring_calls / _ulysses_calls take them (none: GPT-2's)
    cp_widths: Callable = lambda model, r, ring: ()


GPT2_FORMS = BlockForms(_block_bytes, _core_bytes, _weight_half_bytes)
BLOCK_FORMS = {  # ModelConfig.arch -> its block's forms, as refpar/model/__init__.py's FAMILIES
    "gpt2": GPT2_FORMS,
    "llama": BlockForms(_llama_block_bytes, _llama_core_bytes, _llama_weight_half_bytes),
    # latent attention enters the tp region at its latents, and cp moves its keys and values at their widths
    "deepseek-v3": BlockForms(_mla_block_bytes, _mla_core_bytes, _mla_weight_half_bytes, mla_tp_calls,
                              mla_cp_widths),
}


def weight_activation_bytes(model: ModelConfig, cfg: TrainConfig, sizes: dict, coords: dict, stage: int,
                            n_stages: int, b: int, plan) -> int:
    """What B keeps for W where a schedule splits them (refpar/parallel/pieces.py's weight halves),
    on the rank of shape r (b rows): per linear layer its input and its output gradient, a row-
    parallel one's both over the region's Ta tokens (the input gradient gathered under sp) and its
    bias's over the residual stream's Tl; per norm its gains' gradients; the head's norm output and
    the logits' gradient of its vocabulary rows; the first stage's embedding gradient (gathered
    under sp) and token ids, and GPT-2's wpe gradient's input."""
    r = rank_shape(model, cfg, sizes, coords, plan.sp, plan.cp_algo, b)
    e, C, (Na, Nl, col, gathered) = r.e, model.n_embd, _tokens(r, plan)
    fam = names(model)
    n = len(stage_layers(model.n_layer, n_stages, stage)) * BLOCK_FORMS[model.arch].weight_half(
        model, coords, r, plan)
    if stage == n_stages - 1:  # the final norm's gains: LayerNorm's weight and bias, RMSNorm's weight
        n += e * (col * C + Na * r.V + len(fam.final_norm) * C)
    if stage == 0:  # a learned position table's gradient reads the (Tl, C) shard under sp
        n += e * (gathered * C or Nl * C) + 8 * Na + (e * Nl * C if fam.positions and plan.sp else 0)
    return n


def activation_peak(model, cfg, sizes, coords, plan, kept_by_step=None) -> int:
    """The schedule's replay of what each microbatch keeps (the largest over the steps: MoE routing
    changes what a block keeps)."""
    schedule, lay = pipeline(sizes, plan)
    where, P = lay.stage_rank, lay.stages_per_copy
    rows, r = _rows(model, cfg, sizes, coords, plan), coords["pp"]
    split_w = split_backward(model, sizes, plan)
    peak = 0
    for kept in (kept_by_step or [None]):
        def after_f(a, kept=kept):
            if where[a.stage] != r:
                return 0
            return microbatch_activation_bytes(model, cfg, sizes, coords, lay.part(a.stage), P,
                                               rows[a.microbatch], plan, kept[a.microbatch] if kept else None,
                                               a.microbatch)

        def after_b(a):
            if not split_w:
                return 0
            part, b = lay.part(a.stage), rows[a.microbatch]
            return weight_activation_bytes(model, cfg, sizes, coords, part, P, b, plan)

        def during_b(a, kept=kept):
            if where[a.stage] != r:
                return 0
            return recompute_working_bytes(model, cfg, sizes, coords, lay.part(a.stage), P,
                                           rows[a.microbatch], plan, kept[a.microbatch] if kept else None,
                                           a.microbatch)

        peak = max(peak, max(stored(schedule, after_f, after_b, during_b)[r], default=0))
    return peak


def model_state_bytes(model, cfg, sizes, coords, plan) -> int:
    """The model states (params, grads, masters, moments) the rank holds between steps."""
    return sum(dp_forms.state_bytes(rank_units(model, sizes, coords, plan), plan.strategy,
                                    precision(model, cfg, sizes)).values())


def rank_memory_rows(model, cfg, sizes, coords, plan, kept_by_step=None, stepped: bool = True) -> list[dict]:
    """The rank's `expected_memory_peak_bytes` rows."""
    peaks = dp_forms.peak_bytes(rank_units(model, sizes, coords, plan), plan, precision(model, cfg, sizes),
                                stepped)
    peaks["activations"] = activation_peak(model, cfg, sizes, coords, plan, kept_by_step)
    return [{"category": cat, "bytes": int(peaks.get(cat, 0))} for cat in CATEGORIES]
