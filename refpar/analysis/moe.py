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

Under ZeRO (refpar/engine_moe_zero.py) a dense unit is sharded over the stage's D data ranks
(axis "data", rank d) and an expert unit over dp (axis "dp"), each with shard_range shares s_u;
the all-reduces of the gradients give way to, per step: ZeRO-1 a reduce-scatter of Ψ_d over data
and of Ψ_e over dp, and the all-gathers of the updated shards; ZeRO-2 per microbatch and stage a
reduce-scatter of each unit, per step an all-gather of each unit; ZeRO-3 per microbatch and stage
two all-gathers and a reduce-scatter of each unit; FSDP the same with the ends' units (wte, root)
gathered once on the first stage and twice on the last. The tied wte's all-reduce over pp moves
its shard (ZeRO-2/3), fp16's overflow flag goes over pp and data. Memory: the shards of every unit
(grads, AdamW's m and v, 16-bit masters), plus what is transient (`pipeline_state_bytes`).
"""

from __future__ import annotations

import math

import numpy as np

from refpar.analysis.engine import _gathers, _owned_units
from refpar.comm import cost
from refpar.engine_fsdp import ENDS
from refpar.engine_moe_zero import expert_unit, moe_fsdp_units, moe_units_of
from refpar.model.gpt import param_shapes
from refpar.model.moe import capacity, expert_param_shapes, expert_prefix
from refpar.parallel.pipeline.stage import stage_param_names
from refpar.sharding import shard_range, shard_sizes


def _owned(n_experts: int, ep: int, q: int) -> list[int]:
    return list(range(*shard_range(n_experts, ep, q)))


def all_to_all_rows(kept, ep: int, data_rank: int) -> tuple[int, int]:
    """(A, B): rows data rank `data_rank` sends to and receives from the other ranks of its ep
    group in one all-to-all pass (dispatch), from the (D, E) kept counts of one MoE layer."""
    kept = np.asarray(kept)
    q = data_rank % ep
    base = data_rank - q
    mine = _owned(kept.shape[1], ep, q)
    sent = int(kept[data_rank].sum() - kept[data_rank, mine].sum())
    received = int(sum(kept[base + s, mine].sum() for s in range(ep) if s != q))
    return sent, received


def all_to_all_bytes(kept, ep: int, data_rank: int, n_embd: int, itemsize: int) -> cost.Bytes:
    """Exact ep all-to-all bytes of one MoE layer in one step (forward and backward)."""
    A, B = all_to_all_rows(kept, ep, data_rank)
    both = 2 * (A + B) * n_embd * itemsize
    return cost.Bytes(both, both)


def counts_all_gather_bytes(config, n_data: int, data_rank: int) -> cost.Bytes:
    """The all-gather of every data rank's (k, E) int64 selection counts, one per MoE layer."""
    per_rank = config.moe_top_k * config.moe_experts
    return cost.all_gather_bytes([per_rank] * n_data, data_rank, 8)


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
    """Elements of each parameter the rank at `coords` holds in a pp x dp x ep run: its stages'
    dense weights whole and, of their MoE blocks, the experts of its ep rank."""
    p, ep = sizes.get("pp", 1), sizes.get("ep", 1)
    names = {n for c in range(chunks) for n in stage_param_names(config, p * chunks, c * p + coords["pp"])}
    mine = tuple(expert_prefix(i, e) + "." for i in config.moe_blocks
                 for e in _owned(config.moe_experts, ep, coords["ep"]))
    return {n: math.prod(s) for n, s in param_shapes(config).items()
            if n in names and (".mlp.experts." not in n or n.startswith(mine))}


def zero_group(sizes: dict[str, int], coords: dict[str, int], unit: str) -> tuple[str, int, int]:
    """(axis, size, rank) of the ranks a unit is sharded over: dp for experts, data for the rest."""
    if expert_unit(unit):
        return "dp", sizes.get("dp", 1), coords["dp"]
    return "data", sizes.get("dp", 1) * sizes.get("ep", 1), coords["dp"] * sizes.get("ep", 1) + coords["ep"]


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
                             grad_itemsize: int | None = None, zero: int = 0, fsdp: bool = False
                             ) -> dict:
    """{(axis, op): Bytes} of one step of a MoE pipeline on the rank at `coords`; `rows` its b_j,
    `kept_by_microbatch[j]` the (D, E) kept counts of each MoE layer of its stages in microbatch j.
    Gradients move in their dtype (`grad_itemsize`, default the model's); fp16 adds the overflow
    flag (one float32) over pp and over ep, the axes whose ranks hold different gradients (under
    ZeRO over pp and data). `zero`, `fsdp`: the ZeRO stage's collectives over data and dp instead
    of the gradients' all-reduces (module docstring), for a step that was not skipped."""
    p, dp, ep = sizes.get("pp", 1), sizes.get("dp", 1), sizes.get("ep", 1)
    r, n_data, data_rank = coords["pp"], dp * ep, coords["dp"] * ep + coords["ep"]
    e = np.dtype(config.dtype).itemsize
    g = grad_itemsize or e
    numels = rank_param_numels(config, sizes, coords, chunks)
    out = {}

    def add(key, b):
        old = out.get(key, cost.Bytes(0, 0))
        out[key] = cost.Bytes(old.sent + b.sent, old.recv + b.recv)

    for kept in (k for layers in kept_by_microbatch for k in layers):
        add(("data", "all_gather"), counts_all_gather_bytes(config, n_data, data_rank))
        add(("ep", "all_to_all"), all_to_all_bytes(kept, ep, data_rank, config.n_embd, e))
    if p > 1:
        p2p = (2 * chunks - (r == 0) - (r == p - 1)) * sum(rows) * seq_len * config.n_embd * e
        add(("pp", "isend"), cost.Bytes(p2p, 0))
        add(("pp", "irecv"), cost.Bytes(0, p2p))
        if r in (0, p - 1):
            tied = numels["wte.weight"] if zero < 2 else _shard(sizes, coords, "wte", numels["wte.weight"])
            add(("pp", "all_reduce"), cost.all_reduce_bytes(tied, 2, int(r == p - 1), g))
        add(("pp", "all_reduce"), cost.all_reduce_bytes(3, p, r, 8))  # the losses
    dense = sum(n for name, n in numels.items() if ".mlp.experts." not in name)
    experts = sum(numels.values()) - dense
    if zero == 0:
        if n_data > 1:
            add(("data", "all_reduce"), cost.all_reduce_bytes(dense, n_data, data_rank, g))
        if dp > 1 and experts:
            add(("dp", "all_reduce"), cost.all_reduce_bytes(experts, dp, coords["dp"], g))
    else:
        for key, b in zero_step_comm_bytes(config, sizes, coords, chunks, len(rows), g, zero, fsdp,
                                           dense, experts).items():
            add(key, b)
    add(("data", "all_reduce"), cost.all_reduce_bytes(3, n_data, data_rank, 8))  # the losses
    if config.dtype == "float16":  # the overflow flag
        for axis, size, at in (("pp", p, r), ("ep", ep, coords["ep"]) if zero == 0 else
                               ("data", n_data, data_rank)):
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
