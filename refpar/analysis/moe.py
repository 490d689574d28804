"""Closed forms for expert parallelism: all-to-all bytes per rank and step, and expert memory.

Legend: E experts, k experts per token, C channels, ep expert-parallel ranks, D = dp * ep data
ranks, N_d tokens of data rank d, K[d, e] assignments data rank d keeps for expert e (after the
capacity; `refpar.model.moe.kept_counts` from the routing counts), s itemsize in bytes.

Per MoE layer and step, data rank d in an ep group sends A_d = sum over the experts e of the
other ep ranks of K[d, e] rows and receives B_d = sum over the other members d' of its group of
K[d', e] over its own experts. Forward: dispatch sends A, receives B; combine sends B, receives
A. Backward repeats both with gradients. So bytes sent = bytes received = 2 (A_d + B_d) C s; a
rank's rows for its own experts never leave it. The counts themselves move once, by an all-gather
of D (k, E) int64 arrays over the data ranks (refpar.comm.cost.all_gather_bytes).

A training step (refpar/parallel/expert_parallel_run.py) adds one all-reduce of the dense
gradients over the D data ranks (axis `data`), one of this rank's expert gradients over dp, and one
of three loss numbers over the data ranks. With M microbatches each microbatch routes on its own:
the counts' all-gather and the all-to-alls come once per microbatch and MoE layer, from that
microbatch's K.

In pipeline stages (refpar/engine_moe.py, p pp ranks, v chunks, b_j this rank's rows of microbatch
j, T sequence) the rank at pp rank r does the above for the MoE layers of its stages, over its
stage's D data ranks, with the dense gradients of its stages only; and on pp: (2v - [r = 0] -
[r = p-1]) activations or input gradients of (b_j, T, C) each way per microbatch, wte (V, C)
all-reduced by the first and the last rank, and the three loss numbers.

Activations in pipeline stages: a microbatch keeps, between its F and its B, what the dense
engine's stage keeps (refpar.analysis.engine.microbatch_activation_bytes), except that in each MoE
block the MLP's terms are replaced by what the MoE layer's cache keeps (`moe_cache_bytes`), a
function of this rank's N = b_j T tokens, k, E, C, the D data ranks' counts (D, k, E), the R rows
it dispatches and the Q rows its experts receive, both from that microbatch's K (`dispatch_rows`).
The rank's peak is the schedule's replay (schedules.stored) with those bytes per F, the largest
over the steps (each step routes anew). Mixed precision: e = 2 bytes for the activations; the
integer indices and counts stay int64, the two router losses float32.

With context parallelism (c cp ranks, cp rank j holding Ta_j positions of each row, `ring` or
`ulysses`) the routing group is the stage's D x c ranks (group rank d c + j, axis `data`): the
counts' all-gather carries one (k, E) array per run of consecutive global tokens (`routing_runs`:
1 per data rank without cp; under Ulysses one per row; under ring 2 per row, but rank 0's late
chunk ends a row where its early chunk starts the next, b + 1 runs, and rank c-1's two chunks
touch, b runs), the all-to-alls stay inside an ep group (same dp and cp rank), the dense gradients
and the loss sum over D x c ranks, an expert's gradient over dp x c (axis `dp_cp`), the pipeline
messages are (b_j, Ta_j, C), and each microbatch adds the stages' ring K/V hops or Ulysses'
all-to-alls over cp (analysis.intra_layer's closed forms).

Under ZeRO (refpar/engine_moe_zero.py) a dense unit is sharded over the stage's D (x c) data ranks
(axis "data", rank d, d c + j with cp) and an expert unit over dp (axis "dp"; with cp dp x cp,
"dp_cp"), each with shard_range shares s_u;
the all-reduces of the gradients give way to, per step: ZeRO-1 a reduce-scatter of Ψ_d over data
and of Ψ_e over dp, and the all-gathers of the updated shards; ZeRO-2 per microbatch and stage a
reduce-scatter of each unit, per step an all-gather of each unit; ZeRO-3 per microbatch and stage
two all-gathers and a reduce-scatter of each unit; FSDP the same with the ends' units (wte, root)
gathered once on the first stage and twice on the last. The tied wte's all-reduce over pp moves
its shard (ZeRO-2/3), fp16's overflow flag goes over pp and data. Memory: the shards of every unit
(grads, AdamW's m and v, 16-bit masters), plus what is transient (`pipeline_state_bytes`).

With tp (t ranks, refpar/parallel/expert_tensor_parallel.py; under ZeRO sharded once more) a rank holds tp
shards: the dense weights as tensor_parallel.tp_param_slices cuts them, each expert's c_fc and
c_proj.weight divided by t (c_proj.bias whole), so every count of elements above (gradients, wte,
memory) is of those shards. Routing, all-to-alls and the data ranks' sums are the same as without
tp, among the ranks of one tp coordinate (each tp rank routes all its stage's tokens: with cp the
cp rank's Ta_j tokens, the same runs as cp alone). On tp, per microbatch j and stage: the engine's
tensor-parallel calls of attention, embedding and head over b_j rows of Ta_j tokens (T without
cp; analysis.intra_layer; the dense MLP's calls left out of MoE blocks), and per MoE layer an
all-reduce of the (Q, C) expert buffer forward and one backward (Q from `dispatch_rows`); under sp
two all-gathers of (b_j, Ta_j, C) around the layer, activations on pp of (b_j, Tl, C), Tl this tp
rank's shard of Ta_j, and one all-reduce per step of the sequence-sharded parameters' gradients.
With cp the ring's K/V blocks and Ulysses' all-to-alls carry this tp rank's n_head / t heads.
Activations: the dense terms are the engine's tp (sp) ones on Ta_j tokens, an expert's hidden
width this tp rank's columns H of 4C, and under sp the router keeps the gathered (b_j, Ta_j, C)
instead of ln_2's (b_j, Tl, C) shard.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from refpar.analysis.engine import (
    _gathers,
    _owned_units,
    cp_tokens,
    microbatch_activation_bytes,
    region_in_shard,
)
from refpar.analysis.intra_layer import RankShape, _ring_calls, _tp_calls, _ulysses_calls
from refpar.comm import cost
from refpar.config import MESH_AXES
from refpar.holdings import (
    ENDS,
    expert_unit,
    moe_fsdp_units,
    moe_units_of,
    sequence_parallel_param_names,
    stage_layers,
    stage_param_names,
    tp_param_slices,
)
from refpar.model.gpt import param_shapes
from refpar.model.moe import capacity, expert_param_shapes, expert_prefix
from refpar.parallel.pipeline.schedules import build, layout, stored
from refpar.sharding import shard_range, shard_sizes


def _owned(n_experts: int, ep: int, q: int) -> list[int]:
    return list(range(*shard_range(n_experts, ep, q)))


def all_to_all_rows(kept, ep: int, data_rank: int, cp: int = 1) -> tuple[int, int]:
    """(A, B): rows data rank `data_rank` sends to and receives from the other ranks of its ep
    group in one all-to-all pass (dispatch), from the (D, E) kept counts of one MoE layer. With
    cp > 1, `data_rank` is the group rank d c + j and kept is (D c, E); the group's members are
    the ranks of the same cp rank j."""
    kept = np.asarray(kept)
    q = (data_rank // cp) % ep
    members = [data_rank + (s - q) * cp for s in range(ep)]
    mine = _owned(kept.shape[1], ep, q)
    sent = int(kept[data_rank].sum() - kept[data_rank, mine].sum())
    received = int(sum(kept[members[s], mine].sum() for s in range(ep) if s != q))
    return sent, received


def all_to_all_bytes(kept, ep: int, data_rank: int, n_embd: int, itemsize: int, cp: int = 1) -> cost.Bytes:
    """Exact ep all-to-all bytes of one MoE layer in one step (forward and backward)."""
    A, B = all_to_all_rows(kept, ep, data_rank, cp)
    both = 2 * (A + B) * n_embd * itemsize
    return cost.Bytes(both, both)


def counts_all_gather_bytes(config, n_data: int, data_rank: int) -> cost.Bytes:
    """The all-gather of every data rank's (k, E) int64 selection counts, one per MoE layer."""
    per_rank = config.moe_top_k * config.moe_experts
    return cost.all_gather_bytes([per_rank] * n_data, data_rank, 8)


def routing_runs(rows: int, seq_len: int, cp: int, cp_rank: int, cp_algo: str | None) -> int:
    """Runs of consecutive global tokens a rank holding `rows` consecutive rows routes: 1 without
    cp, `rows` under Ulysses and on ring's last rank (its chunks c-1 and c touch), `rows` + 1 on
    ring's rank 0 (its late chunk ends each row where its early chunk starts the next), 2 `rows`
    on ring's other ranks."""
    if cp == 1:
        return 1
    if (cp_algo or "ring") == "ulysses" or cp_rank == cp - 1:
        return rows
    return rows + 1 if cp_rank == 0 else 2 * rows


def exchange_runs(batch_size: int, microbatches: int, j: int, n_data: int, seq_len: int, cp: int,
                  cp_algo: str | None) -> list[int]:
    """Runs each member of the routing exchange (group rank d c + cp rank) routes in microbatch j:
    1 per data rank without cp, else `routing_runs` of data rank d's rows of microbatch j
    (expert_parallel_run.microbatch_samples)."""
    if cp == 1:
        return [1] * n_data
    a, b = shard_range(batch_size, microbatches, j)
    return [routing_runs(n, seq_len, cp, q, cp_algo) for n in shard_sizes(b - a, n_data)
            for q in range(cp)]


def routed_counts_all_gather_bytes(config, runs: list[int], rank: int) -> cost.Bytes:
    """The all-gather of one (k, E) int64 count per run, `runs[g]` runs on group rank g."""
    return cost.all_gather_bytes([r * config.moe_top_k * config.moe_experts for r in runs], rank, 8)


def cp_attention_bytes(config, n_layers: int, rows: int, seq_len: int, cp: int, cp_rank: int,
                       cp_algo: str | None, tp: int = 1) -> dict:
    """{(cp, op): Bytes} of ring attention's K/V hops or Ulysses' all-to-alls in `n_layers`
    blocks for one microbatch of `rows` rows, forward and backward (analysis.intra_layer), on
    this rank's n_head / tp heads."""
    tokens = cp_tokens(seq_len, cp, cp_algo)
    shape = RankShape(B=rows, T=seq_len, Ta=tokens[cp_rank], Tl=tokens[cp_rank], t=tp, c=cp,
                      nh=config.n_head // tp, V=config.vocab_size, e=np.dtype(config.dtype).itemsize,
                      cp_tokens=tuple(tokens), cp_rank=cp_rank)
    blocks = replace(config, n_layer=n_layers, moe_layers=None)
    out = {}
    for call in (_ring_calls if (cp_algo or "ring") == "ring" else _ulysses_calls)(blocks, shape):
        old = out.get((call.axis, call.op), cost.Bytes(0, 0))
        out[(call.axis, call.op)] = cost.Bytes(old.sent + call.bytes_sent, old.recv + call.bytes_recv)
    return out


def expected_all_to_all_bytes(config, tokens_per_rank: int, n_data: int, ep: int,
                              itemsize: int) -> float:
    """ep all-to-all bytes of one MoE layer per rank and step when routing is uniform and balanced:
    every expert gets the same share of the N_global * k assignments, of which it keeps up to its
    capacity, from every rank alike, and a fraction (ep - 1) / ep of them belong to other ranks
    (E divisible by ep)."""
    n_global = tokens_per_rank * n_data
    k = config.moe_top_k
    cap = capacity(n_global, config)
    share = n_global * k / config.moe_experts  # assignments per expert
    kept = 1.0 if cap is None else min(1.0, cap / share)
    rows = tokens_per_rank * k * kept * (ep - 1) / ep  # A = B
    return 4 * rows * config.n_embd * itemsize


def expert_params_per_rank(config, ep: int, ep_rank: int) -> int:
    """Expert parameters (elements) that ep rank `ep_rank` holds, over all MoE blocks."""
    per_expert = sum(math.prod(s) for s in expert_param_shapes(config).values())
    return len(_owned(config.moe_experts, ep, ep_rank)) * per_expert * len(config.moe_blocks)


def expert_param_bytes_per_rank(config, ep: int, ep_rank: int) -> int:
    """Bytes of those parameters in the model's dtype; AdamW adds twice this again for m and v,
    and the gradients once."""
    return expert_params_per_rank(config, ep, ep_rank) * np.dtype(config.dtype).itemsize


def dense_params(config) -> int:
    """Elements of every parameter that is not an expert's (routers included)."""
    return sum(math.prod(s) for n, s in param_shapes(config).items() if ".mlp.experts." not in n)


def step_comm_bytes(config, sizes: dict[str, int], coords: dict[str, int], kept_by_layer,
                    grad_itemsize: int | None = None) -> dict:
    """{(axis, op): Bytes} of one training step on the rank at `coords` of a dp x ep mesh, given the
    (D, E) kept counts of each MoE layer in that step. Tokens move in the model's dtype (2 bytes in
    mixed precision), gradients in theirs (`grad_itemsize`: default the model's, 4 with fp32_grads);
    fp16 adds the ep ranks' overflow flag (one float32)."""
    dp, ep = sizes.get("dp", 1), sizes.get("ep", 1)
    n_data, data_rank = dp * ep, coords["dp"] * ep + coords["ep"]
    itemsize = np.dtype(config.dtype).itemsize
    g = grad_itemsize or itemsize
    out = {}

    def add(key, b):
        old = out.get(key, cost.Bytes(0, 0))
        out[key] = cost.Bytes(old.sent + b.sent, old.recv + b.recv)

    for kept in kept_by_layer:
        add(("data", "all_gather"), counts_all_gather_bytes(config, n_data, data_rank))
        add(("ep", "all_to_all"), all_to_all_bytes(kept, ep, data_rank, config.n_embd, itemsize))
    if n_data > 1:
        add(("data", "all_reduce"), cost.all_reduce_bytes(dense_params(config), n_data, data_rank, g))
    if dp > 1:
        add(("dp", "all_reduce"), cost.all_reduce_bytes(
            expert_params_per_rank(config, ep, coords["ep"]), dp, coords["dp"], g))
    add(("data", "all_reduce"), cost.all_reduce_bytes(3, n_data, data_rank, 8))  # the losses
    if config.dtype == "float16" and ep > 1:  # the ep ranks agree on an overflow (one float32)
        add(("ep", "all_reduce"), cost.all_reduce_bytes(1, ep, coords["ep"], 4))
    return out


def model_state_bytes(config, ep: int, ep_rank: int, optimizer: str, microbatches: int = 1,
                      fp32_grads: bool = False) -> dict[str, int]:
    """Peak bytes per category of what ep rank `ep_rank` holds in an expert-parallel run: the dense
    weights and its experts, their gradients (one dict at a time; two while a later microbatch's
    are added to the sum) and AdamW's m and v; a 16-bit model adds fp32 master weights and keeps
    the moments in fp32 (2 + 2 + 4 + 8 bytes per parameter), fp32_grads makes the gradients 4."""
    itemsize = np.dtype(config.dtype).itemsize
    n = dense_params(config) + expert_params_per_rank(config, ep, ep_rank)
    state = 4 if itemsize == 2 else itemsize  # master weights and moments
    grads = n * (4 if fp32_grads else itemsize) * (2 if microbatches > 1 else 1)
    return {"params": n * itemsize, "grads": grads,
            "master": n * 4 if itemsize == 2 else 0,
            "optimizer": {"adamw": 2, "sgd": 0}[optimizer] * n * state}


# ------------------------------------------------------------------- MoE in pipeline stages
def rank_param_numels(config, sizes: dict[str, int], coords: dict[str, int], chunks: int = 1
                      ) -> dict[str, int]:
    """Elements of each parameter the rank at `coords` holds in a pp x dp x ep (x tp) run: of its
    stages' dense weights and, of their MoE blocks, of the experts of its ep rank, the tp shards
    (whole without tp)."""
    p, ep = sizes.get("pp", 1), sizes.get("ep", 1)
    names = {n for c in range(chunks) for n in stage_param_names(config, p * chunks, c * p + coords["pp"])}
    mine = tuple(expert_prefix(i, e) + "." for i in config.moe_blocks
                 for e in _owned(config.moe_experts, ep, coords["ep"]))
    slices = tp_param_slices(config, sizes.get("tp", 1), coords.get("tp", 0))

    def numel(n, shape):
        axis, index = slices.get(n, (None, None))
        return math.prod(shape) if axis is None else math.prod(shape) // shape[axis] * len(index)

    return {n: numel(n, s) for n, s in param_shapes(config).items()
            if n in names and (".mlp.experts." not in n or n.startswith(mine))}


def zero_group(sizes: dict[str, int], coords: dict[str, int], unit: str) -> tuple[str, int, int]:
    """(axis, size, rank) of the ranks a unit is sharded over: dp (dp x cp, axis dp_cp, with cp) for
    experts, the stage's data ranks (dp x ep x cp) for the rest."""
    c, j = sizes.get("cp", 1), coords.get("cp", 0)
    if expert_unit(unit):
        return ("dp" if c == 1 else "dp_cp"), sizes.get("dp", 1) * c, coords["dp"] * c + j
    d = coords["dp"] * sizes.get("ep", 1) + coords["ep"]
    return "data", sizes.get("dp", 1) * sizes.get("ep", 1) * c, d * c + j


def stage_units(config, sizes: dict[str, int], coords: dict[str, int], chunks: int, by_unit: bool
                ) -> dict[int, dict[str, int]]:
    """stage -> unit -> elements on this rank: engine_moe_zero.moe_fsdp_units (`by_unit`: ZeRO-2,
    FSDP) or moe_units_of (ZeRO-3) over the weights the rank holds of each of its stages."""
    p = sizes.get("pp", 1)
    numels = rank_param_numels(config, sizes, coords, chunks)
    unit_fn = moe_fsdp_units if by_unit else moe_units_of
    out = {}
    for s in (c * p + coords["pp"] for c in range(chunks)):
        names = [n for n in stage_param_names(config, p * chunks, s) if n in numels]
        out[s] = {u: sum(numels[n] for n in members) for u, members in unit_fn(names).items()}
    return out


def _shard(sizes, coords, unit: str, n: int) -> int:
    _, size, rank = zero_group(sizes, coords, unit)
    return shard_sizes(n, size)[rank]


def pipeline_state_bytes(config, sizes: dict[str, int], coords: dict[str, int], chunks: int,
                         optimizer: str, fp32_grads: bool = False, zero: int = 0, fsdp: bool = False
                         ) -> dict[str, int]:
    """Peak params, grads, master and optimizer bytes of a rank of a MoE pipeline: what it holds,
    once each (the executor counts each gradient's sum over microbatches), AdamW twice; a 16-bit
    model's fp32 master weights and moments take 4 bytes per element. ZeRO-1: masters and moments
    of the data-rank share of the dense weights and the dp share of the experts. ZeRO-2/3, FSDP:
    shards of every unit, plus the transient (module docstring, `_sharded_state_bytes`)."""
    numels = rank_param_numels(config, sizes, coords, chunks)
    n = sum(numels.values())
    e = np.dtype(config.dtype).itemsize
    state = 4 if e == 2 else e
    out = {"params": n * e, "grads": n * (4 if fp32_grads else e), "master": n * 4 if e == 2 else 0,
           "optimizer": {"adamw": 2, "sgd": 0}[optimizer] * n * state}
    if zero == 1:  # engine.ZeroOne keeps m and v for either optimizer
        dense = sum(k for name, k in numels.items() if ".mlp.experts." not in name)
        share = _shard(sizes, coords, "rest", dense) + _shard(sizes, coords, "experts", n - dense)
        return out | {"master": share * 4 if e == 2 else 0, "optimizer": 2 * share * state}
    if zero >= 2:
        return out | _sharded_state_bytes(config, sizes, coords, chunks, optimizer, fp32_grads, zero,
                                          fsdp, numels)
    return out


def _sharded_state_bytes(config, sizes, coords, chunks, optimizer, fp32_grads, zero, fsdp, numels
                         ) -> dict[str, int]:
    """ZeRO-2, 3 and FSDP (engine_zero3.ShardedGrads): each owned unit's shard of the gradients (gi
    bytes), AdamW's m and v and a 16-bit model's masters (4 bytes each, else e), plus, in "grads",
    the largest transient: ZeRO-3 a stage's whole gradient (e) and one unit's flat copy (gi);
    ZeRO-2 and FSDP a block's gradient (its dense and experts units) and the larger unit's copy, on a
    stage that is first and last with the head's wte and ln_f gradients held, or the ends' gradients
    and the larger one's copy. "params": ZeRO-2 the whole weights; ZeRO-3 the shards plus the largest
    gathered piece (a stage; FSDP a block's two units or the ends)."""
    e = np.dtype(config.dtype).itemsize
    gi, state = 4 if fp32_grads else e, 4 if e == 2 else e
    by_unit = zero == 2 or fsdp
    stages = stage_units(config, sizes, coords, chunks, by_unit)
    owned = sum(_shard(sizes, coords, u[1] if isinstance(u, tuple) else u, n)
                for u, n in _owned_units(stages).items())
    n_stages = sizes.get("pp", 1) * chunks
    head = numels.get("wte.weight", 0) + numels.get("ln_f.weight", 0) + numels.get("ln_f.bias", 0)
    transient, pieces = 0, []
    for s, units in stages.items():
        ends = [n for u, n in units.items() if u in ENDS]
        if not by_unit:
            transient = max(transient, sum(units.values()) * e + max(units.values()) * gi)
            pieces.append(sum(units.values()))
            continue
        held = head * e if s == 0 and s == n_stages - 1 else 0
        for block in {u.removesuffix(".experts") for u in units if u not in ENDS}:
            parts = [units[u] for u in (block, f"{block}.experts") if u in units]
            transient = max(transient, held + sum(parts) * e + max(parts) * gi)
            pieces.append(sum(parts))
        transient = max(transient, sum(ends) * e + max(ends, default=0) * gi)
        pieces.append(sum(ends))
    out = {"grads": owned * gi + transient, "master": owned * 4 if e == 2 else 0,
           "optimizer": 2 * owned * state if optimizer == "adamw" else 0}
    if zero == 3:
        out["params"] = (owned + max(pieces)) * e
    return out


def pipeline_step_comm_bytes(config, sizes: dict[str, int], coords: dict[str, int], chunks: int,
                             rows: list[int], seq_len: int, kept_by_microbatch: list[list],
                             grad_itemsize: int | None = None, cp_algo: str | None = None,
                             batch_size: int | None = None, zero: int = 0, fsdp: bool = False,
                             sp: bool = False) -> dict:
    """{(axis, op): Bytes} of one step of a MoE pipeline on the rank at `coords`; `rows` its b_j,
    `kept_by_microbatch[j]` the (D c, E) kept counts of each MoE layer of its stages in microbatch j.
    Gradients move in their dtype (`grad_itemsize`, default the model's); fp16 adds the overflow
    flag (one float32) over pp, ep and tp, the axes whose ranks hold different gradients (under
    ZeRO over pp and data). With cp (`cp_algo`), `batch_size` B gives every data rank's rows, which
    set its runs' count. `zero`, `fsdp`: the ZeRO stage's collectives over data and dp (dp x cp)
    instead of the gradients' all-reduces (module docstring), for a step that was not skipped.
    `sp`: sequence parallelism over tp."""
    p, dp, ep, c = sizes.get("pp", 1), sizes.get("dp", 1), sizes.get("ep", 1), sizes.get("cp", 1)
    t = sizes.get("tp", 1)
    j_cp = coords.get("cp", 0)
    r, n_data = coords["pp"], dp * ep
    group = (coords["dp"] * ep + coords["ep"]) * c + j_cp  # rank in the stage's D x c ranks
    e = np.dtype(config.dtype).itemsize
    g = grad_itemsize or e
    numels = rank_param_numels(config, sizes, coords, chunks)
    Ta = cp_tokens(seq_len, c, cp_algo)[j_cp]
    out = {}

    def add(key, b):
        old = out.get(key, cost.Bytes(0, 0))
        out[key] = cost.Bytes(old.sent + b.sent, old.recv + b.recv)

    m = len(kept_by_microbatch)
    for j, layers in enumerate(kept_by_microbatch):
        runs = exchange_runs(batch_size, m, j, n_data, seq_len, c, cp_algo)
        for kept in layers:
            add(("data", "all_gather"), routed_counts_all_gather_bytes(config, runs, group))
            add(("ep", "all_to_all"), all_to_all_bytes(kept, ep, group, config.n_embd, e, c))
    if c > 1:
        n_layers = sum(len(stage_layers(config.n_layer, p * chunks, v * p + r)) for v in range(chunks))
        for b in rows:
            for key, moved in cp_attention_bytes(config, n_layers, b, seq_len, c, j_cp, cp_algo,
                                                 t).items():
                add(key, moved)
    if t > 1:
        for key, b in tensor_parallel_step_bytes(config, sizes, coords, chunks, rows, seq_len,
                                                 kept_by_microbatch, g, sp, cp_algo, zero, fsdp).items():
            add(key, b)
    if p > 1:
        Tl = shard_sizes(Ta, t)[coords.get("tp", 0)] if sp else Ta
        p2p = (2 * chunks - (r == 0) - (r == p - 1)) * sum(rows) * Tl * config.n_embd * e
        add(("pp", "isend"), cost.Bytes(p2p, 0))
        add(("pp", "irecv"), cost.Bytes(0, p2p))
        if r in (0, p - 1):
            tied = numels["wte.weight"] if zero < 2 else _shard(sizes, coords, "wte", numels["wte.weight"])
            add(("pp", "all_reduce"), cost.all_reduce_bytes(tied, 2, int(r == p - 1), g))
        add(("pp", "all_reduce"), cost.all_reduce_bytes(3, p, r, 8))  # the losses
    dense = sum(n for name, n in numels.items() if ".mlp.experts." not in name)
    experts = sum(numels.values()) - dense
    if zero == 0:
        if n_data * c > 1:
            add(("data", "all_reduce"), cost.all_reduce_bytes(dense, n_data * c, group, g))
        if dp * c > 1 and experts:  # over the copies of this rank's experts: dp, or dp x cp
            axis = "dp" if c == 1 else "dp_cp"
            add((axis, "all_reduce"), cost.all_reduce_bytes(experts, dp * c, coords["dp"] * c + j_cp, g))
    else:
        for key, b in zero_step_comm_bytes(config, sizes, coords, chunks, len(rows), g, zero, fsdp,
                                           dense, experts).items():
            add(key, b)
    add(("data", "all_reduce"), cost.all_reduce_bytes(3, n_data * c, group, 8))  # the losses
    if config.dtype == "float16":  # the overflow flag
        for axis, size, at in (("pp", p, r), ("ep", ep, coords["ep"]) if zero == 0 else
                               ("data", n_data * c, group), ("tp", t, coords.get("tp", 0))):
            if size > 1:
                add((axis, "all_reduce"), cost.all_reduce_bytes(1, size, at, 4))
    return out


def zero_step_comm_bytes(config, sizes: dict[str, int], coords: dict[str, int], chunks: int, m: int,
                         g: int, zero: int, fsdp: bool, dense: int, experts: int) -> dict:
    """{(axis, op): Bytes} of ZeRO's collectives in one step of m microbatches (module docstring):
    parameters gathered in the model's dtype, gradients reduced in theirs (g bytes)."""
    e = np.dtype(config.dtype).itemsize
    out = {}

    def add(unit, op, n, times=1):
        axis, size, rank = zero_group(sizes, coords, unit)
        b = (cost.all_gather_bytes(shard_sizes(n, size), rank, e) if op == "all_gather"
             else cost.reduce_scatter_bytes(n, size, rank, g))
        old = out.get((axis, op), cost.Bytes(0, 0))
        out[(axis, op)] = cost.Bytes(old.sent + times * b.sent, old.recv + times * b.recv)

    if zero == 1:
        for unit, n in (("rest", dense), ("experts", experts)):
            if n:
                add(unit, "reduce_scatter", n)
                add(unit, "all_gather", n)
        return out
    stages = stage_units(config, sizes, coords, chunks, zero == 2 or fsdp)
    n_stages = sizes.get("pp", 1) * chunks
    for s, units in stages.items():
        for u, n in units.items():
            add(u, "reduce_scatter", n, m)  # after each microbatch's backward
            if zero == 3:
                add(u, "all_gather", n, m * _gathers(u, s, n_stages, fsdp))
    if zero == 2:  # the updated shards, once per step
        for u, n in _owned_units(stages).items():
            add(u[1] if isinstance(u, tuple) else u, "all_gather", n)
    return out


# --------------------------------------------------------- activations of MoE in pipeline stages
INDEX_BYTES = 8  # routing's indices and counts: int64, argsort's and the counts' dtype


def dispatch_rows(kept, ep: int, data_rank: int, cp: int = 1) -> tuple[int, int]:
    """(R, Q) of one MoE layer from its (D c, E) kept counts: the rows exchange rank `data_rank`
    (d c + cp rank) dispatches (every assignment it keeps, its own experts' included) and the rows
    its experts receive (from every member of its ep group, itself included: the ranks of its dp
    and cp coordinates, c apart)."""
    kept = np.asarray(kept)
    q = (data_rank // cp) % ep
    members = [data_rank + (o - q) * cp for o in range(ep)]
    mine = _owned(kept.shape[1], ep, q)
    return int(kept[data_rank].sum()), int(kept[np.ix_(members, mine)].sum())


def moe_cache_bytes(N: int, k: int, E: int, C: int, R: int, Q: int, D: int, ep: int, El: int,
                    e: int, H: int | None = None) -> dict[str, int]:
    """Bytes the cache of one MoE block (ExpertParallelMoE.forward) keeps alive on a rank, by part:
    N tokens routed, R rows dispatched, Q rows received by its El local experts, D data ranks, e
    bytes per activation element. Each buffer once, wherever it is referenced from (routing and
    router cache share the chosen experts, gates and keep flags):

        router        probs (N, E) and the logsumexp (N,); argsort's (N, E) int64, whose first k
                      columns are the chosen experts (a view: the whole buffer stays); the chosen
                      probabilities and the gates (N, k), one array when k = 1 (the gate is the
                      probability); keep (N, k) bool; the aux-loss coefficients (E,). Its input,
                      ln_2's output, is the dense block's (kept by c_fc there, by the router here).
        routing       token (int64) and gate of each of the R rows; each assignment's row (N, k)
                      int64; this call's and the global kept rows per expert, (E,) int64 each;
                      every data rank's selection counts (D, k, E) int64; the aux and z losses,
                      0-d (float32 when the activations are 16-bit: fp32_compute keeps 0-d fp32)
        expert_input  the Q rows received, in expert order (Q, C)
        expert_mlps   each local expert's c_fc output, its tanh and the GeLU output: 3 Q H, H = 4C,
                      or this tp rank's columns of it (`H`, refpar/parallel/expert_tensor_parallel.py)
        combine_pad   the R rows that came back plus combine's zero row, (R+1, C)
        counts        the rows each ep rank sends each local expert, (ep, El) int64
    The dispatched (R, C) buffer and the expert outputs leave with the all-to-alls: not kept."""
    i = INDEX_BYTES
    gates = N * e if k == 1 else 2 * N * k * e
    return {
        "router": N * E * e + N * e + N * E * i + gates + N * k + E * e,
        "routing": R * (i + e) + N * k * i + 2 * E * i + D * k * E * i + 2 * max(e, 4),
        "expert_input": Q * C * e,
        "expert_mlps": 3 * Q * (4 * C if H is None else H) * e,
        "combine_pad": (R + 1) * C * e,
        "counts": ep * El * i,
    }


def mlp_activation_bytes(model, tokens: int, H: int | None = None) -> int:
    """What GPT-2's MLP adds to analysis.activations.layer_bytes (refpar's Keep): over `tokens`
    tokens, GeLU's input, its tanh and c_proj's input, 4C each (`H`, this tp rank's columns of
    4C, under tp). An MoE block keeps `moe_cache_bytes` in its place."""
    return tokens * 3 * (4 * model.n_embd if H is None else H) * np.dtype(model.dtype).itemsize


def moe_microbatch_activation_bytes(model, train, sizes: dict, coords: dict, stage: int,
                                    n_stages: int, b: int, kept_by_layer: dict, runs: int | None = None,
                                    cp_algo: str | None = None, sp: bool = False) -> int:
    """What one microbatch of b rows keeps on the rank at `coords` of `stage` between its F and
    its B: the dense engine's closed form (with cp: on this cp rank's Ta tokens, ring or Ulysses)
    with, in each MoE block of the stage, the MLP's terms replaced by `moe_cache_bytes` from that
    block's (D c, E) kept counts in this microbatch (`kept_by_layer`: layer -> counts, as
    MoEStep.microbatch_kept_counts[j]); `runs`: the runs every member of the exchange routes
    together (`exchange_runs`; default D, one per data rank). With tp (`sp`: and sequence
    parallelism) the dense terms are the engine's tensor-parallel ones and each expert's hidden
    width is this tp rank's columns; under sp the MoE layer keeps the gathered (b, Ta, C) its router
    read instead of ln_2's (b, Tl, C) shard, which the dense block's c_fc would keep."""
    sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
    coords = {a: coords.get(a, 0) for a in MESH_AXES}
    c, t = sizes["cp"], sizes["tp"]
    # whole blocks or tp's pieces, on whole sequences or this cp rank's tokens
    n = microbatch_activation_bytes(model, train, sizes, coords, stage, n_stages, b, sp,
                                    cp_algo if c > 1 else None)
    ep, D = sizes["ep"], sizes["dp"] * sizes["ep"]
    El = len(_owned(model.moe_experts, ep, coords["ep"]))
    Ta = cp_tokens(train.seq_len, c, cp_algo)[coords["cp"]]
    N, e, C = b * Ta, np.dtype(model.dtype).itemsize, model.n_embd
    H = shard_sizes(4 * C, t)[coords["tp"]]  # 4C without tp
    group = (coords["dp"] * ep + coords["ep"]) * c + coords["cp"]  # this rank in the exchange
    for layer in stage_layers(model.n_layer, n_stages, stage):
        if layer in model.moe_blocks:
            R, Q = dispatch_rows(kept_by_layer[layer], ep, group, c)
            parts = moe_cache_bytes(N, model.moe_top_k, model.moe_experts, C, R, Q,
                                    D if runs is None else runs, ep, El, e, H)
            if sp:  # the gathered sequence for the router, ln_2's shard not kept
                parts["sequence"] = (N - b * shard_sizes(Ta, t)[coords["tp"]]) * C * e
            n += sum(parts.values()) - mlp_activation_bytes(model, N, H)
    return n


def pipeline_activation_peak(model, train, sizes: dict, coords: dict, schedule: str,
                             microbatches: int, chunks: int, rows: list[int],
                             kept_by_step: list[list[dict]], cp_algo: str | None = None,
                             sp: bool = False) -> int:
    """Peak activation bytes of the rank at `coords` of a MoE pipeline: per step, the replay of the
    schedule (schedules.stored) with what each of its F keeps until the B (B hands W gradients, no
    activations), the largest over the steps. `rows`: its b_j; `kept_by_step[s][j]`: layer -> (D,
    E) kept counts of microbatch j in step s (MoEStep.microbatch_kept_counts; empty on a rank
    whose stages hold no MoE block); `cp_algo`: ring or ulysses when the mesh has cp; `sp`:
    sequence parallelism over tp."""
    p, r = sizes.get("pp", 1), coords["pp"]
    D, c = sizes.get("dp", 1) * sizes.get("ep", 1), sizes.get("cp", 1)
    runs = [sum(exchange_runs(train.batch_size, microbatches, j, D, train.seq_len, c, cp_algo))
            for j in range(microbatches)]
    plan = build(schedule, p, microbatches, chunks)
    where, S = layout(plan).stage_rank, p * chunks
    peak = 0
    for kept in kept_by_step:
        def after_f(a, kept=kept):
            if where[a.stage] != r:  # another rank's F: its routing is not this rank's to know
                return 0
            return moe_microbatch_activation_bytes(model, train, sizes, coords, a.stage, S,
                                                   rows[a.microbatch], kept[a.microbatch] if kept else {},
                                                   runs[a.microbatch], cp_algo, sp)
        peak = max(peak, max(stored(plan, after_f, lambda a: 0)[r], default=0))
    return peak


def sp_shard_numel(config, sizes: dict[str, int], coords: dict[str, int], chunks: int, by_unit: bool
                   ) -> int:
    """Elements of the sequence-sharded region's parameters inside this rank's ZeRO-2/3 gradient
    shards (units `moe_fsdp_units` when `by_unit`, else `moe_units_of`, each over its group):
    what ShardedGrads.sum_sequence_parallel all-reduces over tp."""
    numels = rank_param_numels(config, sizes, coords, chunks)
    region = set(sequence_parallel_param_names(config))
    unit_fn = moe_fsdp_units if by_unit else moe_units_of
    p, total = sizes.get("pp", 1), 0
    for s in (c * p + coords["pp"] for c in range(chunks)):
        names = [n for n in stage_param_names(config, p * chunks, s) if n in numels]
        for unit, members in unit_fn(names).items():
            _, size, rank = zero_group(sizes, coords, unit)
            a, b = shard_range(sum(numels[n] for n in members), size, rank)
            total += region_in_shard(members, numels, region, a, b)
    return total


def tensor_parallel_step_bytes(config, sizes: dict[str, int], coords: dict[str, int], chunks: int,
                               rows: list[int], seq_len: int, kept_by_microbatch: list[list],
                               grad_itemsize: int, sp: bool = False, cp_algo: str | None = None,
                               zero: int = 0, fsdp: bool = False) -> dict:
    """{(axis, op): Bytes} on tp of one step of a MoE run with tp (module docstring): the dense
    pieces as analysis.intra_layer counts them (every stage's blocks, the embedding on the first,
    the head on the last), the MoE layers' expert buffers and sp gathers, sp's gradient sum (under
    ZeRO-2/3, `zero`, of the gradient shards only). With cp (`cp_algo`) every piece works on this
    cp rank's Ta tokens (sp shards them over tp)."""
    p, ep, t, k = sizes.get("pp", 1), sizes.get("ep", 1), sizes["tp"], coords["tp"]
    c, j_cp = sizes.get("cp", 1), coords.get("cp", 0)
    S, C, e = p * chunks, config.n_embd, np.dtype(config.dtype).itemsize
    group = (coords["dp"] * ep + coords["ep"]) * c + j_cp  # rank in the stage's D x c ranks
    Ta = cp_tokens(seq_len, c, cp_algo)[j_cp]
    Tl = shard_sizes(Ta, t)[k] if sp else Ta
    out = {}

    def add(key, b):
        old = out.get(key, cost.Bytes(0, 0))
        out[key] = cost.Bytes(old.sent + b.sent, old.recv + b.recv)

    for s in (c * p + coords["pp"] for c in range(chunks)):
        layers = list(stage_layers(config.n_layer, S, s))
        moe_tags = tuple(f"h.{i}.mlp." for i, g in enumerate(layers) if g in config.moe_blocks)
        blocks = replace(config, n_layer=len(layers), moe_experts=0, moe_layers=None)
        for b in rows:
            shape = RankShape(B=b, T=seq_len, Ta=Ta, Tl=Tl, t=t, c=1, nh=config.n_head // t,
                              V=shard_sizes(config.vocab_size, t)[k], e=e, cp_tokens=(Ta,), cp_rank=0)
            for call in _tp_calls(blocks, shape, sp, k):
                if not (call.tag.startswith(("sp.", *moe_tags)) or (call.tag.startswith("wte") and s != 0)
                        or (call.tag.startswith("lm_head") and s != S - 1)):
                    add(("tp", call.op), cost.Bytes(call.bytes_sent, call.bytes_recv))
    for j, layers in enumerate(kept_by_microbatch):  # empty when this rank's stages hold no MoE block
        for kept in layers:
            buffer = cost.all_reduce_bytes(dispatch_rows(kept, ep, group, c)[1] * C, t, k, e)
            add(("tp", "all_reduce"), cost.Bytes(2 * buffer.sent, 2 * buffer.recv))  # g fwd, f bwd
            if sp:  # the region's tokens gathered before the router, and their gradient before the backward
                gather = cost.all_gather_bytes(shard_sizes(Ta, t), k, e, rows[j] * C)
                add(("tp", "all_gather"), cost.Bytes(2 * gather.sent, 2 * gather.recv))
    if sp and zero >= 2:
        n = sp_shard_numel(config, sizes, coords, chunks, zero == 2 or fsdp)
        add(("tp", "all_reduce"), cost.all_reduce_bytes(n, t, k, grad_itemsize))
    elif sp:
        numels = rank_param_numels(config, sizes, coords, chunks)
        n = sum(numels[name] for name in sequence_parallel_param_names(config) if name in numels)
        add(("tp", "all_reduce"), cost.all_reduce_bytes(n, t, k, grad_itemsize))
    return out
