"""Closed forms of expert parallelism: the routing's bytes from its counts, expert memory, and what
a MoE block's cache keeps (refpar/analysis/closed_forms.py composes them with the other strategies').

Legend: E experts, k experts per token, C channels, ep expert-parallel ranks, D = dp * ep data
ranks, c cp ranks, N_d tokens of data rank d, K[d, e] assignments data rank d keeps for expert e
(after the capacity; `refpar.model.routing.kept_counts` from the routing counts), P[d, q] the pairs
(token, ep rank q) of data rank d, a token counted once per ep rank holding at least one of its
kept experts, m = min(k, ceil(E / ep)) a pair record's slots, s itemsize in bytes.

A layer's counts are (K, P): the (D c, E) kept counts and the (D c, ep) pair counts
(ExpertParallelMoE records P in `routing["pairs"]`; the trainer's `microbatch_pair_counts`). P is
not a function of K: two of a token's experts on one rank make one pair, so the runtime gathers it.

Per MoE layer and microbatch (each routes on its own tokens), data rank d in an ep group sends
A_d = sum over the other ep ranks q of P[d, q] pairs and receives B_d = sum over the other members
d' of its group of P[d', q_d]. A pair's rows (refpar/parallel/expert_parallel.py): dispatch C + 2m
elements (the token, then m gates and m local expert indices), combine C (the gate-weighted sum of
its experts' outputs), combine:bwd C (dout), dispatch:bwd C + m (dx and the m gates' gradients).
So forward: sent A (C + 2m) + B C, received B (C + 2m) + A C; backward: sent A C + B (C + m),
received B C + A (C + m), times s; a rank's pairs for its own experts never leave it. The counts
move once, by an all-gather over the stage's data ranks of one (k, E) int64 array per run of
consecutive global tokens (`routing_runs`: 1 per data rank without cp; with c cp ranks, group rank
d c + j, under Ulysses one per row, under ring 2 per row, but rank 0's late chunk ends a row where
its early chunk starts the next, b + 1 runs, and rank c-1's two chunks touch, b runs); the pairs
per destination by one more, of one (ep,) int64 array per exchange rank.

With tp (refpar/parallel/expert_tensor_parallel.py) each expert is a tensor-parallel MLP: per MoE
layer and microbatch an all-reduce of the (Q, C) expert buffer forward and one backward (Q, the
assignments its experts run, from `dispatch_rows`), and under sp two all-gathers of (b_j, Ta_j, C)
around the layer; routing and the all-to-alls run among the ranks of one tp coordinate, the same
as without tp.

Activations: in a MoE block the MLP's terms are replaced by what the MoE layer's cache keeps
(`moe_cache_bytes`), a function of this rank's N = b_j Ta tokens, k, E, C, the exchanged counts,
the R assignments it keeps and the Q its experts run (from that microbatch's K) and the pairs it
sends and receives (from its P, `dispatch_rows`); an expert's hidden width is this tp rank's
columns H of 4C, and under sp the router keeps the gathered (b_j, Ta, C) instead of ln_2's
(b_j, Tl, C) shard. Mixed precision:
e = 2 bytes for the activations; the integer indices and counts stay int64, the two router losses
float32. DeepSeek's shared experts and sequence-wise loss add to it (`routing_option_bytes`).
"""

from __future__ import annotations

import math

import numpy as np

from refpar.comm import cost
from refpar.holdings import expert_of
from refpar.model import moe_spec, param_shapes
from refpar.model.routing import capacity
from refpar.sharding import shard_range, shard_sizes


def _owned(n_experts: int, ep: int, q: int) -> list[int]:
    return list(range(*shard_range(n_experts, ep, q)))


def record_slots(n_experts: int, top_k: int, ep: int) -> int:
    """m, the slots of a pair's record: a token has at most k experts on one ep rank, and at most
    as many as the rank holds (the largest shard of E over ep)."""
    return min(top_k, max(shard_sizes(n_experts, ep)))


def pair_counts_upper_bound(kept, ep: int) -> np.ndarray:
    """(D c, E) kept counts -> (D c, ep) pairs as if every kept assignment of a token lay on its
    own ep rank: one pair per assignment, exact for top-1, otherwise an upper bound (a token with
    two experts on one rank makes one pair). For routings drawn from counts alone."""
    kept = np.asarray(kept)
    return np.stack([kept[:, _owned(kept.shape[1], ep, q)].sum(axis=1) for q in range(ep)], axis=1)


def all_to_all_rows(pairs, ep: int, data_rank: int, cp: int = 1) -> tuple[int, int]:
    """(A, B): the pairs exchange rank `data_rank` sends to and receives from the other ranks of its
    ep group in one all-to-all pass, from the (D c, ep) pair counts of one MoE layer (pairs[g, q]:
    exchange rank g's tokens keeping an expert of ep rank q). With cp > 1, `data_rank` is the group
    rank d c + j; the group's members are the ranks of the same cp rank j, c apart. The pairs of
    its own ep rank never leave it."""
    pairs = np.asarray(pairs)
    q = (data_rank // cp) % ep
    members = [data_rank + (o - q) * cp for o in range(ep) if o != q]
    return int(pairs[data_rank].sum() - pairs[data_rank, q]), int(pairs[members, q].sum())


def all_to_all_bytes(pairs, ep: int, data_rank: int, n_embd: int, itemsize: int, slots: int,
                     cp: int = 1, forwards: int = 1, backwards: int = 1) -> cost.Bytes:
    """Exact ep all-to-all bytes of one MoE layer in one step (`forwards` forward passes, 2 under
    full recomputation, and `backwards` backward), from the module docstring's row layouts:
    dispatch C + 2m, combine C, combine:bwd C, dispatch:bwd C + m elements a pair (m `slots`)."""
    A, B = all_to_all_rows(pairs, ep, data_rank, cp)
    C, m = n_embd, slots
    sent = forwards * (A * (C + 2 * m) + B * C) + backwards * (A * C + B * (C + m))
    recv = forwards * (B * (C + 2 * m) + A * C) + backwards * (B * C + A * (C + m))
    return cost.Bytes(sent * itemsize, recv * itemsize)


def pair_counts_all_gather_bytes(ep: int, ranks: int, rank: int) -> cost.Bytes:
    """The all-gather over the `ranks` exchange ranks of each one's (ep,) int64 pairs per
    destination (`h.{i}.mlp.experts:pairs`): the all-to-alls' receive sizes."""
    return cost.all_gather_bytes([ep] * ranks, rank, 8)


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
    (holdings.microbatch_samples)."""
    if cp == 1:
        return [1] * n_data
    a, b = shard_range(batch_size, microbatches, j)
    return [routing_runs(n, seq_len, cp, q, cp_algo) for n in shard_sizes(b - a, n_data)
            for q in range(cp)]


def routed_counts_all_gather_bytes(config, runs: list[int], rank: int) -> cost.Bytes:
    """The all-gather of one (k, E) int64 count per run, `runs[g]` runs on group rank g."""
    return cost.all_gather_bytes([r * config.moe_top_k * config.moe_experts for r in runs], rank, 8)


def scores_all_gather_bytes(config, cfg, m: int, j: int, n_data: int, cp: int, Ta: int, rank: int,
                            itemsize: int) -> cost.Bytes:
    """Megatron-Core's drop policy "probs" over several ranks (moe.rank_by_score): in microbatch j
    of m every exchange rank (d c + cp rank) all-gathers the scores of its N_g k assignments, N_g =
    its rows of the microbatch (holdings.microbatch_samples) times its Ta positions, in the router's
    dtype (`itemsize`: fp32_compute's float32 under 16-bit activations)."""
    a, b = shard_range(cfg.batch_size, m, j)
    tokens = [rows * Ta for rows in shard_sizes(b - a, n_data) for _ in range(cp)]
    return cost.all_gather_bytes([n * config.moe_top_k for n in tokens], rank, itemsize)


def seq_counts_all_reduce_bytes(config, rows: int, cp: int, cp_rank: int) -> cost.Bytes:
    """DeepSeek-V3's sequence-wise loss (eq. 17-20) under cp: f_i counts a whole sequence's
    selections, of which each of the cp ranks holds some positions, so every MoE layer all-reduces
    its `rows` rows' (rows, E) int64 counts over cp once per forward. P_i, linear in the loss, does
    not move (refpar/model/routing.sequence_balance_coefficients)."""
    return cost.all_reduce_bytes(rows * config.moe_experts, cp, cp_rank, 8)


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
    """Expert parameters (elements) that ep rank `ep_rank` holds, over all MoE blocks (GPT-2's
    GELU experts or Mixtral's SwiGLU ones, by the family's parameter shapes)."""
    mine = _owned(config.moe_experts, ep, ep_rank)
    return sum(math.prod(s) for n, s in param_shapes(config).items() if expert_of(n) in mine)


def expert_param_bytes_per_rank(config, ep: int, ep_rank: int) -> int:
    """Bytes of those parameters in the model's dtype; AdamW adds twice this again for m and v,
    and the gradients once."""
    return expert_params_per_rank(config, ep, ep_rank) * np.dtype(config.dtype).itemsize


# --------------------------------------------------------- activations of MoE in pipeline stages
INDEX_BYTES = 8  # routing's indices and counts: int64, argsort's and the counts' dtype


def dispatch_rows(counts, ep: int, data_rank: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(R, P_out, P_in, Q) of one MoE layer from its counts, (kept (D c, E), pairs (D c, ep)): the
    assignments exchange rank `data_rank` (d c + cp rank) keeps (its routing's rows), the pairs it
    sends and receives (its own ep rank's included), and the assignments its experts run, from
    every member of its ep group (itself included: the ranks of its dp and cp coordinates, c apart)."""
    kept, pairs = (np.asarray(a) for a in counts)
    q = (data_rank // cp) % ep
    members = [data_rank + (o - q) * cp for o in range(ep)]
    mine = _owned(kept.shape[1], ep, q)
    return (int(kept[data_rank].sum()), int(pairs[data_rank].sum()), int(pairs[members, q].sum()),
            int(kept[np.ix_(members, mine)].sum()))


def moe_cache_bytes(N: int, k: int, E: int, C: int, R: int, Q: int, D: int, e: int, H: int | None = None,
                    pairs: tuple[int, int, int, int, int] | None = None,
                    gates_apart: bool | None = None) -> dict[str, int]:
    """Bytes the cache of one MoE block keeps alive on a rank, by part: N tokens routed, R
    assignments kept, Q assignments its experts run, D runs whose counts were exchanged, e bytes
    per activation element; `pairs` (ExpertParallelMoE.forward) = (P_out, P_in, m, ep, G): the
    pairs it sends and receives, a record's slots, the ep ranks and the G exchange ranks (None:
    one device's moe_forward, whose experts take its R rows, Q = R, and keep no pairs). Each buffer
    once, wherever it is referenced from (routing and router cache share the chosen experts, gates
    and keep flags):

        router        probs (N, E) and the logsumexp (N,); argsort's (N, E) int64, whose first k
                      columns are the chosen experts (a view: the whole buffer stays); the chosen
                      probabilities and the gates (N, k), one array where the gate is the
                      probability (`gates_apart` False; None: k = 1, a softmax's top-1, see
                      `gates_are_apart`); keep (N, k) bool; the aux-loss coefficients (E,). Its input,
                      ln_2's output, is the dense block's (kept by c_fc there, by the router here).
        routing       token (int64) and gate of each of the R rows; each assignment's row (N, k)
                      int64; this call's and the global kept rows per expert, (E,) int64 each;
                      every run's selection counts (D, k, E) int64; the aux and z losses, 0-d
                      (float32 when the activations are 16-bit: fp32_compute keeps 0-d fp32);
                      with ep, every exchange rank's pairs per destination (G, ep) int64
        pairs         the sender's: each pair's token (P_out,), each (token, ep rank)'s pair
                      (N, ep) and where each slot's dgate comes back (N, k), int64
        received      the receiver's layout (moe.buffer_layout): token and gate of each of the Q
                      rows, each record slot's row and gate (P_in, m)
        expert_input  the Q rows its experts run, in expert order (Q, C)
        expert_mlps   each local expert's c_fc output, its tanh and the GeLU output: 3 Q H, H = 4C,
                      or this tp rank's columns of it (`H`, refpar/parallel/expert_tensor_parallel.py)
        combine_pad   the Q expert outputs plus combine's zero row, (Q+1, C)
    The rows that travel (dispatched, received, combined) leave with the all-to-alls: not kept."""
    i = INDEX_BYTES
    apart = k > 1 if gates_apart is None else gates_apart
    gates = (2 if apart else 1) * N * k * e
    P_out, P_in, m, ep, G = (0, 0, 0, 0, 0) if pairs is None else pairs
    return {
        "router": N * E * e + N * e + N * E * i + gates + N * k + E * e,
        "routing": R * (i + e) + N * k * i + 2 * E * i + D * k * E * i + 2 * max(e, 4) + G * ep * i,
        "pairs": 0 if pairs is None else (P_out + N * ep + N * k) * i,
        "received": 0 if pairs is None else Q * (i + e) + P_in * m * (i + e),
        "expert_input": Q * C * e,
        "expert_mlps": 3 * Q * (4 * C if H is None else H) * e,
        "combine_pad": (Q + 1) * C * e,
    }


def gates_are_apart(model) -> bool:
    """Whether the router keeps the gates as an array of their own beside the chosen scores
    (refpar/model/routing.py's router_forward): where they are normalised over the k (not a softmax's
    top-1, and moe_norm_topk_prob) or scaled (moe_routed_scaling_factor != 1)."""
    normalised = model.moe_norm_topk_prob and not (model.moe_top_k == 1 and model.moe_gate == "softmax")
    return normalised or model.moe_routed_scaling_factor != 1.0


def routing_option_bytes(model, N: int, rows: int, e: int, ranks: int = 1) -> dict[str, int]:
    """What DeepSeek's routing options and Megatron-Core's drop policy add to a MoE block's cache
    over N tokens in `rows` sequences, routed among `ranks` exchange ranks (D c): each shared
    expert keeps what its MLP keeps (3 N H, H its `expert_width`: GPT-2's 4C, Llama's F, DeepSeek-V3's
    moe_intermediate_size, at full width on every rank: shared experts are replicated, under tp too);
    the sequence-wise balance loss
    its coefficients, one per sequence and expert (rows, E); dropping by score ("probs", with a
    capacity) what each exchange rank keeps per expert, (ranks, E) int64, which the counts alone no
    longer give (moe.routing_kept). Sigmoid
    gates, the aux-free bias and group-limited routing keep nothing more: the scores replace the
    probabilities, and the bias and the group mask only change which experts argsort's (N, E)
    buffer lists first."""
    by_score = model.moe_drop_policy == "probs" and not model.moe_dropless
    H = expert_width(model, shared=True)
    return {"shared_experts": model.moe_shared_experts * 3 * N * H * e,
            "sequence_balance": rows * model.moe_experts * e if model.moe_seq_aux_weight else 0,
            "kept_by_score": ranks * model.moe_experts * INDEX_BYTES if by_score else 0}


def expert_width(model, shared: bool = False) -> int:
    """H, the hidden width of one of the family's routed experts (or `shared` experts): its MoESpec's
    MLP's (refpar.model.moe_spec): GPT-2's 4C, Mixtral's intermediate_size, DeepSeek-V3's
    moe_intermediate_size."""
    spec = moe_spec(model)
    return (spec.shared_kind if shared else spec.mlp).hidden(model)


def mlp_activation_bytes(model, tokens: int, H: int | None = None) -> int:
    """What GPT-2's MLP adds to analysis.activations.layer_bytes (refpar's Keep): over `tokens`
    tokens, GeLU's input, its tanh and c_proj's input, 4C each (`H`, this tp rank's columns of
    4C, under tp); Llama's SwiGLU (activations.llama_layer_bytes) the gate's and up's outputs and
    down's input, H = F each. An MoE block keeps `moe_cache_bytes` in its place (a Mixtral
    expert's SwiGLU keeps the same three of its F columns: expert_mlps, 3 Q F)."""
    return tokens * 3 * (4 * model.n_embd if H is None else H) * np.dtype(model.dtype).itemsize


def moe_activation_delta(model, cfg, sizes: dict, coords: dict, layers, b: int, Ta: int, kept: dict,
                         m: int, j: int, cp_algo: str | None = None, sp: bool = False) -> int:
    """What the MoE blocks among `layers` keep beyond a dense block, for microbatch j of m (b rows of
    Ta tokens) on the rank at `coords`: in each, the MLP's terms give way to `moe_cache_bytes` from
    that block's (kept (D c, E), pairs (D c, ep)) counts (`kept`: layer -> them); under sp the layer keeps the
    gathered (b, Ta, C) its router read instead of ln_2's (b, Tl, C) shard, which the dense block's
    c_fc would keep."""
    c, t, ep = sizes["cp"], sizes["tp"], sizes["ep"]
    D = sizes["dp"] * ep
    N, e, C = b * Ta, np.dtype(model.dtype).itemsize, model.n_embd
    H = shard_sizes(expert_width(model), t)[coords["tp"]]  # this tp rank's columns of an expert
    # and of the dense MLP the MoE replaces: GPT-2's 4C, Llama's and DeepSeek-V3's intermediate_size
    F = shard_sizes(model.intermediate_size or 4 * C, t)[coords["tp"]]
    runs = sum(exchange_runs(cfg.batch_size, m, j, D, cfg.seq_len, c, cp_algo))  # D without cp
    group = (coords["dp"] * ep + coords["ep"]) * c + coords["cp"]  # this rank in the exchange
    n = 0
    for layer in layers:
        if layer in model.moe_blocks:
            R, P_out, P_in, Q = dispatch_rows(kept[layer], ep, group, c)
            m = record_slots(model.moe_experts, model.moe_top_k, ep)
            parts = moe_cache_bytes(N, model.moe_top_k, model.moe_experts, C, R, Q, runs, e, H,
                                    (P_out, P_in, m, ep, D * c), gates_are_apart(model))
            parts |= routing_option_bytes(model, N, b, e, D * c)
            if sp:  # the gathered sequence for the router, ln_2's shard not kept
                parts["sequence"] = (N - b * shard_sizes(Ta, t)[coords["tp"]]) * C * e
            n += sum(parts.values()) - mlp_activation_bytes(model, N, F)
    return n


def routing_step_bytes(model, cfg, sizes: dict, coords: dict, m: int, rows: list[int], kept: list[dict],
                       Ta: int, cp_algo: str | None = None, sp: bool = False, rerun: bool = False) -> dict:
    """{(axis, op): (sent, received)} of one step's MoE layers on the rank at `coords` (module
    docstring): per microbatch j (b_j rows of Ta tokens) and MoE layer of its stages (`kept[j]`:
    layer -> (kept (D c, E), pairs (D c, ep)) counts), the counts' and the pairs' all-gathers over
    the data ranks and the pairs' all-to-alls over ep; dropping by score over several ranks, the
    scores' all-gather over the data ranks (`scores_all_gather_bytes`); with the sequence-wise loss
    and cp > 1 the all-reduce over cp of each row's (b_j, E) int64 selection counts
    (`seq_counts_all_reduce_bytes`); with tp the expert buffer's all-reduce forward and backward
    and, under sp, the gathers of the layer's tokens before it and of their gradient before its
    backward. `rerun` (full recomputation, refpar/parallel/recompute.py): each layer's forward runs
    once more in the backward, its counts, pairs, dispatch and combine, g and gather with it."""
    ep, c, t, k = sizes["ep"], sizes["cp"], sizes["tp"], coords["tp"]
    D, e, C = sizes["dp"] * ep, np.dtype(model.dtype).itemsize, model.n_embd
    group = (coords["dp"] * ep + coords["ep"]) * c + coords["cp"]
    out: dict = {}
    for j, layers in enumerate(kept):
        runs = exchange_runs(cfg.batch_size, m, j, D, cfg.seq_len, c, cp_algo)
        for counts in layers.values():
            counted = routed_counts_all_gather_bytes(model, runs, group)
            cost.add(out, ("data", "all_gather"), counted, 1 + rerun)
            if model.moe_drop_policy == "probs" and not model.moe_dropless and D * c > 1:
                cost.add(out, ("data", "all_gather"), scores_all_gather_bytes(
                    model, cfg, m, j, D, c, Ta, group, max(e, 4)), 1 + rerun)
            if model.moe_seq_aux_weight and c > 1:
                cost.add(out, ("cp", "all_reduce"), seq_counts_all_reduce_bytes(model, rows[j], c,
                                                                                 coords["cp"]), 1 + rerun)
            cost.add(out, ("data", "all_gather"), pair_counts_all_gather_bytes(ep, D * c, group), 1 + rerun)
            cost.add(out, ("ep", "all_to_all"), all_to_all_bytes(
                counts[1], ep, group, C, e, record_slots(model.moe_experts, model.moe_top_k, ep), c,
                forwards=1 + rerun))
            if t > 1:  # g forward and f backward around the local experts' (Q, C) buffer
                Q = dispatch_rows(counts, ep, group, c)[3]  # the assignments this rank's experts run
                cost.add(out, ("tp", "all_reduce"), cost.all_reduce_bytes(Q * C, t, k, e), 2 + rerun)
                if sp:
                    gather = cost.all_gather_bytes(shard_sizes(Ta, t), k, e, rows[j] * C)
                    cost.add(out, ("tp", "all_gather"), gather, 2 + rerun)
    return out


def load_imbalance(loads) -> float:
    """max / mean of one MoE block's per-expert loads at one step: 1 when every expert gets the same
    share, E when one expert gets everything."""
    loads = np.asarray(loads, dtype=float)
    return float(loads.max() / loads.mean())
