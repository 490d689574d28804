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
of three loss numbers over the data ranks.
"""

from __future__ import annotations

import math

import numpy as np

from refpar.comm import cost
from refpar.model.gpt import param_shapes
from refpar.model.moe import capacity, expert_param_shapes
from refpar.sharding import shard_range


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
    bf16-mixed), gradients in theirs (`grad_itemsize`: default the model's, 4 with fp32_grads)."""
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


def model_state_bytes(config, ep: int, ep_rank: int, optimizer: str, fp32_grads: bool = False
                      ) -> dict[str, int]:
    """Peak bytes per category of what ep rank `ep_rank` holds in an expert-parallel run: the dense
    weights and its experts, their gradients (one dict at a time), and AdamW's m and v; a 16-bit
    model adds fp32 master weights and keeps the moments in fp32 (2 + 2 + 4 + 8 bytes per
    parameter), fp32_grads makes the gradients 4 bytes."""
    itemsize = np.dtype(config.dtype).itemsize
    n = dense_params(config) + expert_params_per_rank(config, ep, ep_rank)
    state = 4 if itemsize == 2 else itemsize  # master weights and moments
    return {"params": n * itemsize, "grads": n * (4 if fp32_grads else itemsize),
            "master": n * 4 if itemsize == 2 else 0,
            "optimizer": {"adamw": 2, "sgd": 0}[optimizer] * n * state}
