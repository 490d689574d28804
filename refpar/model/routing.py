"""Routing for a Mixture of Experts layer: the router's scores, the top-k choice, capacity and the
experts' queues, the router losses with hand-written gradients, and the aux-free bias update. The
layer that moves tokens by this routing, runs the experts and combines their outputs is
refpar/model/moe.py.

Legend: N tokens of this call (B*T), C channels, E experts, k experts per token, P runs of the
global batch (`Parts`), R rows of the expert buffer (assignments kept).

The conventions, so that the numbers can be reproduced elsewhere:
- Router (Switch Transformer, Fedus et al. 2021): logits = x @ router.weight, weight (C, E) with
  no bias; probs = softmax(logits).
- Top-k: the k largest probabilities, ties to the lower expert index. Gates: with k = 1 the gate is
  the probability itself (Switch; renormalising a single gate would make it 1 and cut the router
  off from the task loss); with k >= 2 the k selected probabilities are renormalised to sum to 1
  (Mixtral, Jiang et al. 2024: the same as a softmax over the selected logits). With
  `moe_norm_topk_prob` False (Hugging Face's norm_topk_prob) no gate is renormalised; every gate is
  then multiplied by `moe_routed_scaling_factor` (DeepSeek-V3's routed_scaling_factor, 2.5 there;
  Megatron-Core's moe_router_topk_scaling_factor; 1 by default).
- Capacity: an expert takes at most ceil(N_global * k * capacity_factor / E) assignments, where
  an assignment is one (token, slot) pair and N_global the tokens of the whole global batch.
  An expert's queue is ordered by slot first, then by global token index b * T + t: every first
  choice is served before any second choice (GShard, Lepikhin et al. 2020), earlier tokens of the
  batch before later ones. Assignments past the capacity are dropped: they add nothing, so a token
  that loses all its experts leaves the block through the residual unchanged. Gates are not
  renormalised after a drop. With `moe_dropless` there is no capacity.
- Load-balancing loss (Switch eq. 4, for any k): alpha * E * sum_i f_i * P_i with f_i the share
  of the N_global * k selections (before dropping) that chose expert i and P_i the mean of
  probs[:, i] over the global batch; uniform routing gives alpha. f is piecewise constant, so
  the gradient flows through P only.
- Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): beta * mean over tokens of logsumexp(logits)^2.
- Both losses enter the training loss with weight 1 (alpha and beta are their weights), and
  `router_backward` includes their gradients.

The routing of DeepSeekMoE and DeepSeek-V3, and Megatron-Core's drop policies (ModelConfig fields):
- `moe_shared_experts` S (DeepSeekMoE, Dai et al. 2024, eq. 9): S experts every token passes
  through, ungated, added to the routed output, each the family's expert MLP (GPT-2's GELU MLP,
  Llama's and DeepSeek-V3's SwiGLU; refpar/model/moe.py; no routing).
- Fine-grained experts (DeepSeekMoE §3.1): any E and k (DeepSeek-V3: 256 routed, k = 8); an
  expert's width stays 4C here, the planner's preset (refpar/analysis/presets.py) has V3's own.
- `moe_gate="sigmoid"` (DeepSeek-V3, Liu et al. 2024, eq. 13-15): s = sigmoid(logits); the gates
  are the chosen s normalised over the k (unless `moe_norm_topk_prob` is False). The balance losses
  read s' = s / sum_E s (eq. 19).
- `moe_balance`: "aux" is the Switch loss above; "aux-free" (DeepSeek-V3 §2.1.2, from Wang et al.
  2024) drops it and adds a bias b (E,) to the scores for the top-k choice only, never to the gates;
  after each step b_i += gamma * sign(mean load - load_i) (`update_expert_bias`, gamma =
  `moe_bias_rate`), the load being the step's global selections; "none": neither.
- `moe_seq_aux_weight` alpha (DeepSeek-V3 eq. 17-20): alpha * sum_i f_i P_i per sequence, f_i =
  E / (k T) * the sequence's selections of i, P_i its mean s'_i, averaged over the sequences of the
  global (micro)batch; it is added to `aux_loss`. Where context parallelism splits the sequences,
  f's counts are summed over the cp ranks (`sum_sequences`); P enters linearly and stays local.
- `moe_groups` G and `moe_group_limit` M (DeepSeek-V3's node-limited routing): the E experts form G
  groups of E / G consecutive ones (on a mesh with ep = G, one per ep rank); a token first keeps the
  M groups whose best biased scores sum highest, then picks its k among their experts, so its rows
  cross to at most M groups. How many of a group's scores sum (`moe_group_score`): "deepseek", the
  best 2 (DeepSeek-V3's reference code and Hugging Face's DeepseekV3TopkRouter), or "megatron", the
  best floor(k / M) (Megatron-Core's group_limited_topk). The paper's K_r / M is 2 for DeepSeek-V3
  (K_r = 8, M = 4), where both agree; they differ wherever floor(k / M) != 2.
- `moe_drop_policy` (Megatron-Core's moe_token_drop_policy): "position" is the queue order above;
  "probs" lets each expert keep the `capacity` assignments of highest score, ties in queue order.
  It ranks the whole batch's scores: over several ranks each gathers every rank's scores in queue
  order (`route`'s gather_scores, `rank_by_score`), and ranks the same global queues.
- Microbatches (Megatron-Core's convention): a step of M microbatches routes each microbatch on
  its own tokens: N_global above is the microbatch's token count (capacity, queue order, f and P
  are the microbatch's), and each microbatch's aux and z losses enter with weight 1/M
  (`route`'s `weight`), so the step's router losses are the mean over microbatches. M = 1 is the
  global-batch routing above.

Mixed precision: the router (softmax, gates, losses) runs under `fp32_compute` (refpar/precision.py).

Everything that depends on the rest of the global batch comes from the selection counts alone:
`route` takes an `exchange(counts) -> every part's counts`, the identity here on one device and an
all-gather under expert parallelism (refpar/parallel/expert_parallel.py). A part is a run of
consecutive global token indices: a data rank's rows (T tokens each, rows consecutive) are one, a
context-parallel rank's positions of its rows are several (`Parts`), and a run's place in each
expert's queue comes from the runs before it in global order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace, device

from refpar.backend import to_host
from refpar.model.layers import as_like, linear_backward, linear_forward, one_hot
from refpar.precision import fp32_compute


def capacity(n_tokens: int, config) -> int | None:
    """Assignments one expert takes from a batch of n_tokens (None: dropless)."""
    if config.moe_dropless:
        return None
    return math.ceil(n_tokens * config.moe_top_k * config.moe_capacity_factor / config.moe_experts)


# -------------------------------------------------------------------------------------- router
def router_scores(logits, gate: str):
    """logits (N, E) -> (scores (N, E), lse (N,)): softmax probabilities (Switch) or sigmoid
    affinities (DeepSeek-V3 eq. 15), and the logits' logsumexp, which the z-loss squares."""
    xp = array_namespace(logits)
    m = xp.max(logits, axis=-1, keepdims=True)  # (N, 1): exp cannot overflow
    e = xp.exp(logits - m)  # (N, E)
    s = xp.sum(e, axis=-1, keepdims=True)  # (N, 1)
    lse = xp.reshape(m + xp.log(s), (-1,))  # (N,)
    scores = e / s if gate == "softmax" else 1.0 / (1.0 + xp.exp(-logits))  # (N, E)
    return scores, lse


def group_score_size(convention: str, k: int, group_limit: int) -> int:
    """How many of a group's best biased scores sum to its score (`moe_group_score`): "deepseek" 2,
    as DeepSeek-V3's reference code and Hugging Face's DeepseekV3TopkRouter (the paper's K_r / M
    with its K_r = 8, M = 4); "megatron" floor(k / M), as Megatron-Core's group_limited_topk."""
    return 2 if convention == "deepseek" else k // group_limit


def select_experts(scores, k: int, bias=None, groups: int = 1, group_limit: int | None = None,
                   group_score: str = "deepseek"):
    """scores (N, E) -> the k chosen experts (N, k), a view of argsort's (N, E) buffer (what a
    cache keeps). Ties go to the lower expert index. DeepSeek-V3's two changes (§2.1.2, eq. 16 and
    "node-limited routing"): `bias` (E,) is added for the choice only, never to the gates; with
    `group_limit` M the experts, in `groups` runs of E / G, are first narrowed to the M groups
    whose best biased scores sum highest (how many: `group_score_size`), ties to the lower group."""
    xp = array_namespace(scores)
    choice = scores if bias is None else scores + bias  # (N, E)
    if group_limit is not None:
        N, E = choice.shape
        per = E // groups
        best = xp.sort(xp.reshape(choice, (N, groups, per)), axis=-1, descending=True)  # (N, G, E/G)
        group_score = xp.sum(best[..., :group_score_size(group_score, k, group_limit)], axis=-1)  # (N, G)
        top = xp.argsort(-group_score, axis=-1, stable=True)[:, :group_limit]  # (N, M)
        allowed = xp.sum(one_hot(top, groups, xp.int64), axis=1) > 0  # (N, G)
        allowed = xp.reshape(xp.broadcast_to(allowed[..., None], (N, groups, per)), (N, E))  # (N, E)
        choice = xp.where(allowed, choice, -xp.inf)  # (N, E): the other groups are never chosen
    return xp.argsort(-choice, axis=-1, stable=True)[:, :k]  # (N, k)


def normalises(k: int, gate: str, norm_topk_prob: bool) -> bool:
    """Whether the k chosen scores are divided by their sum: with `norm_topk_prob` (Hugging Face's
    name), except a softmax's top-1 (Switch: renormalising a single gate would make it 1 and cut the
    router off from the task loss)."""
    return norm_topk_prob and not (k == 1 and gate == "softmax")


def router_forward(x2, w, k: int, gate: str = "softmax", bias=None, groups: int = 1,
                   group_limit: int | None = None, group_score: str = "deepseek",
                   norm_topk_prob: bool = True, scaling: float = 1.0):
    """x2 (N, C), w (C, E) -> scores (N, E), lse (N,), the k chosen experts (N, k), their scores
    (N, k) and their gates (N, k). Gates: the chosen scores, softmax (Mixtral) or sigmoid (DeepSeek-V3
    eq. 13), normalised over the k where `normalises`, then times `scaling` (DeepSeek-V3's
    routed_scaling_factor, Megatron-Core's moe_router_topk_scaling_factor). `bias`, `groups`,
    `group_limit` and `group_score` as in `select_experts`."""
    xp = array_namespace(x2, w)
    logits, lin_cache = linear_forward(x2, w, None)  # (N, E)
    scores, lse = router_scores(logits, gate)  # (N, E), (N,)
    experts = select_experts(scores, k, bias, groups, group_limit, group_score)  # (N, k)
    chosen = xp.take_along_axis(scores, experts, axis=-1)  # (N, k)
    gates = chosen / xp.sum(chosen, axis=-1, keepdims=True) if normalises(k, gate, norm_topk_prob) else chosen
    gates = gates if scaling == 1.0 else scaling * gates  # (N, k)
    return scores, lse, experts, chosen, gates, lin_cache


def balance_affinities(scores, gate: str):
    """The router's per-token distribution the balance losses read: softmax probabilities as they
    are; sigmoid affinities normalised over all E experts (DeepSeek-V3 eq. 19's s')."""
    xp = array_namespace(scores)
    return scores if gate == "softmax" else scores / xp.sum(scores, axis=-1, keepdims=True)  # (N, E)


def selection_counts(experts, n_experts: int):
    """(N, k) chosen experts -> (k, E): how many tokens chose expert e in slot j."""
    xp = array_namespace(experts)
    hot = one_hot(experts, n_experts, xp.int64)  # (N, k, E)
    return xp.sum(hot, axis=0)  # (k, E)


@dataclass(frozen=True)
class Parts:
    """Where one call's tokens lie in the global (micro)batch. The call's N tokens, in its order, are
    runs of `sizes` tokens, each a run of consecutive global token indices b*T + t; `index[i]` is
    run i's place among the runs of every part in global order (the order of `exchange`'s result).
    `owners[p]`: the exchange rank holding run p (None: run p is rank p's), so that `kept_counts`
    can add up what each rank sends."""

    sizes: tuple[int, ...]
    index: tuple[int, ...]
    owners: tuple[int, ...] | None = None


def queue_offsets(all_counts, rank: int):
    """(parts, k, E) counts of every part of the global batch (in batch order) -> (k, E): the
    assignments queued ahead of part `rank`'s first slot-j choice of expert e, namely all earlier
    slots' and the earlier parts' slot-j ones."""
    xp = array_namespace(all_counts)
    total = xp.sum(all_counts, axis=0)  # (k, E)
    earlier_slots = xp.cumulative_sum(total, axis=0) - total  # (k, E)
    earlier_ranks = xp.sum(all_counts[:rank, ...], axis=0)  # (k, E)
    return earlier_slots + earlier_ranks


def routing_kept(routing):
    """(ranks, E): the assignments each exchange rank keeps per expert in one routing (`route`), the
    all-to-all's sizes. By position a function of the counts (`kept_counts`); by score (drop policy
    "probs") of every assignment's score, so `route` keeps what it found."""
    if "kept_by_score" in routing:
        return routing["kept_by_score"]
    return kept_counts(routing["selections"], routing["capacity"], routing["owners"])


def kept_counts(all_counts, cap, owners=None):
    """(parts, k, E) selection counts -> (parts, E) assignments each part keeps per expert: part p's
    slot-j choices of e hold queue places [offset, offset + count), and those below `cap` stay.
    With `owners` (parts,) the parts are added up per owner: (ranks, E), ranks = max(owners) + 1."""
    xp = array_namespace(all_counts)
    if cap is None:
        kept = xp.sum(all_counts, axis=1)  # (parts, E)
    else:
        parts = all_counts.shape[0]
        start = xp.stack([queue_offsets(all_counts, r) for r in range(parts)])  # (parts, k, E)
        room = xp.clip(cap - start, min=0)  # (parts, k, E)
        kept = xp.sum(xp.minimum(room, all_counts), axis=1)  # (parts, E)
    if owners is None:
        return kept
    owners = np.asarray(owners)
    return xp.stack([xp.sum(xp.take(kept, as_like(np.flatnonzero(owners == r), kept), axis=0), axis=0)
                     for r in range(int(owners.max()) + 1)])  # (ranks, E)


@fp32_compute
def route(x2, w, config, exchange=None, rank: int = 0, weight: float = 1.0, grad_scale: float = 1.0,
          parts: Parts | None = None, bias=None, seq_len: int | None = None, seq_rows: int | None = None,
          sum_sequences=None, gather_scores=None):
    """Router forward and the routing decision for this call's tokens.

    `exchange(counts (runs, k, E)) -> (P, k, E)` gathers the selection counts of the runs of every
    part of the global batch in global order; `parts` says which runs this call's tokens are (by
    default one run, the `rank`-th: a data rank's rows without context parallelism); by default
    this call is the whole batch. `weight` weighs both router losses (1/M for one of M
    microbatches); `grad_scale` is the fp16 loss scale the backward will start from: the router
    losses' gradients are scaled by it like the task loss's, their reported values are not.
    `bias` (E,): aux-free balancing's expert bias (`update_expert_bias`), for the choice only;
    `seq_len` T, the sequences' length, which the sequence-wise loss needs: this call's tokens are
    `seq_rows` rows (by default N / T: whole sequences) of N / seq_rows positions each, row-major;
    where other ranks hold the rest of each row (context parallelism), `sum_sequences(counts
    (seq_rows, E)) -> (seq_rows, E)` sums each row's selection counts over them.
    `gather_scores(scores (n,), counts) -> (sum(counts),)`: with the drop policy "probs" over more
    than one exchange rank, every rank's scores in rank order (`rank_by_score`); None: this call is
    the whole batch.
    Returns (routing, cache): routing is a dict with the chosen `experts` (N, k), `gates` (N, k),
    `keep` (N, k), the buffer layout (`token_of_row` (R,), `gate_of_row` (R,), `row` (N, k),
    `rows_per_expert` (E,) of this call), the losses `aux_loss`, `z_loss` (this call's share of the
    global ones), the global `tokens_per_expert` (E,) kept and `dropped` assignments, `capacity`,
    `selections`, every run's counts (P, k, E), and `owners`, `parts.owners`; under the drop policy
    "probs" also `kept_by_score` (ranks, E) (`routing_kept`).
    """
    xp = array_namespace(x2, w)
    N, E, k = x2.shape[0], config.moe_experts, config.moe_top_k
    scores, lse, experts, chosen, gates, lin_cache = router_forward(
        x2, w, k, config.moe_gate, bias, config.moe_groups, config.moe_group_limit, config.moe_group_score,
        config.moe_norm_topk_prob, config.moe_routed_scaling_factor)
    parts = Parts((N,), (rank,)) if parts is None else parts
    hot = one_hot(experts, E, xp.int64)  # (N, k, E)
    # Earlier selections of this call: cum[n] counts tokens 0..n-1, so a run's counts are the
    # difference of cum at its ends, and a token's place within its run cum[n] - cum[run start].
    cum = xp.cumulative_sum(hot, axis=0, include_initial=True)  # (N+1, k, E)
    ends = np.cumsum(parts.sizes)  # (runs,) host
    starts = as_like(ends - np.asarray(parts.sizes), hot)  # (runs,)
    at_start = xp.take(cum, starts, axis=0)  # (runs, k, E)
    counts = xp.take(cum, as_like(ends, hot), axis=0) - at_start  # (runs, k, E)
    all_counts = counts if exchange is None else exchange(counts)  # (P, k, E)
    selected = xp.sum(all_counts, axis=(0, 1))  # (E,) global selections per expert
    n_global = int(xp.sum(selected)) // k
    cap = capacity(n_global, config)

    offsets = xp.stack([queue_offsets(all_counts, p) for p in parts.index])  # (runs, k, E)
    run_of = as_like(np.repeat(np.arange(len(parts.sizes)), parts.sizes), hot)  # (N,)
    ahead = cum[:-1, ...] + xp.take(offsets - at_start, run_of, axis=0)  # (N, k, E)
    position = xp.sum(ahead * hot, axis=-1)  # (N, k): place in the expert's global queue
    kept_by_score = None  # (ranks, E): under "probs", what each exchange rank keeps per expert
    if config.moe_drop_policy == "probs" and cap is not None:
        keep, kept_by_score = rank_by_score(experts, chosen, position, all_counts, cap, parts.owners,
                                            gather_scores)  # (N, k), (ranks, E)
    else:
        keep = position >= 0 if cap is None else position < cap  # (N, k)

    kept_hot = hot * xp.astype(keep, xp.int64)[..., None]  # (N, k, E)
    alpha = config.moe_aux_loss_weight if config.moe_balance == "aux" else 0.0
    aux_coef = (weight * alpha * E / n_global) * (
        xp.astype(selected, x2.dtype) / (n_global * k)
    )  # (E,): alpha * E * f_i / N_global, d aux / d probs[n, i]
    affinity = balance_affinities(scores, config.moe_gate)  # (N, E)
    balance, seq_coef = xp.sum(affinity * aux_coef), None
    if config.moe_seq_aux_weight:
        rows = N // seq_len if seq_rows is None else seq_rows
        seq_coef = sequence_balance_coefficients(hot, rows, seq_len, n_global, config, weight,
                                                 scores.dtype, sum_sequences)  # (rows, E)
        balance = balance + xp.sum(xp.reshape(affinity, (rows, -1, E)) * seq_coef[:, None, :])
    z_coef = weight * config.moe_z_loss_weight / n_global
    kept_global = selected if cap is None else xp.minimum(selected, xp.asarray(cap, dtype=xp.int64))
    routing = {
        "experts": experts, "gates": gates, "keep": keep,
        **buffer_layout(experts, keep, gates, E),  # token_of_row (R,), gate_of_row (R,), row (N, k)
        "rows_per_expert": xp.sum(kept_hot, axis=(0, 1)),  # (E,) this call's
        # the balance losses: Switch's and, with moe_seq_aux_weight, the sequence-wise one
        "aux_loss": balance,
        "z_loss": z_coef * xp.sum(lse * lse),
        "tokens_per_expert": kept_global,  # (E,) global
        "dropped": int(xp.sum(selected - kept_global)),
        "capacity": cap,
        "selections": all_counts,  # (P, k, E) of every run of the global batch
        "owners": parts.owners,  # (P,) the exchange rank of each run, or None: run p is rank p's
    }
    if kept_by_score is not None:  # not a function of the counts: kept here for `routing_kept`
        routing["kept_by_score"] = kept_by_score  # (ranks, E) host int64
    if grad_scale != 1.0:  # the losses above stay unscaled; their gradients, like the rest, scale
        aux_coef, z_coef = aux_coef * grad_scale, z_coef * grad_scale
        seq_coef = None if seq_coef is None else seq_coef * grad_scale
    cache = (scores, lse, experts, chosen, gates, keep, aux_coef, seq_coef, z_coef, config.moe_gate,
             lin_cache, normalises(k, config.moe_gate, config.moe_norm_topk_prob),
             config.moe_routed_scaling_factor)
    return routing, cache


def buffer_layout(experts, keep, gates, n_experts: int) -> dict:
    """The expert buffer's rows of n tokens' assignments: experts, keep and gates (n, k) ->
    `token_of_row` (R,), `gate_of_row` (R,) and each assignment's `row` (n, k), R (the zero row)
    where dropped. Rows are the kept assignments sorted by expert, then slot, then token: listed
    slot-major, (j, t) -> j n + t, they are in queue order, so a stable sort by expert gives it.
    `route` lays out a call's tokens so; expert parallelism's receiver lays out its pairs' records
    so (refpar/parallel/expert_parallel.py), with its local experts as `experts`."""
    xp = array_namespace(experts)
    n, k = experts.shape
    key = xp.reshape(xp.where(keep, experts, n_experts).T, (-1,))  # (k n,): dropped ones sort last
    perm = xp.argsort(key, stable=True)  # (k n,)
    R = int(xp.sum(xp.astype(keep, xp.int64)))
    order = perm[:R]  # (R,) flat slot-major index of each row's assignment
    row = xp.reshape(xp.argsort(perm, stable=True), (k, n)).T  # (n, k): inverse permutation
    n_dev = xp.asarray(n, dtype=xp.int64, device=device(experts))
    return {"token_of_row": xp.remainder(order, n_dev),  # (R,)
            "gate_of_row": xp.take(xp.reshape(gates.T, (-1,)), order, axis=0),  # (R,)
            "row": xp.minimum(row, xp.asarray(R, dtype=row.dtype))}  # (n, k): R is the zero row


@fp32_compute
def router_backward(dgates, cache):
    """dgates (N, k) of the kept assignments -> (dx2 (N, C), dw (C, E)), the balance and z-loss
    gradients included."""
    scores, lse, experts, chosen, gates, keep, aux_coef, seq_coef, z_coef, gate, lin_cache, norm, f = cache
    xp = array_namespace(scores)
    N, E = scores.shape
    dgates = dgates * xp.astype(keep, dgates.dtype)  # (N, k): a dropped gate changes nothing
    if not norm:  # g_j = f s_j
        dchosen = dgates if f == 1.0 else f * dgates  # (N, k)
    else:  # g_j = f s_j / S with S = sum of the chosen s: ds_j = (f dg_j - sum_l dg_l g_l) / S
        S = xp.sum(chosen, axis=-1, keepdims=True)  # (N, 1)
        fdg = dgates if f == 1.0 else f * dgates  # (N, k)
        dchosen = (fdg - xp.sum(dgates * gates, axis=-1, keepdims=True)) / S  # (N, k)
    dscores = xp.sum(one_hot(experts, E, scores.dtype) * dchosen[..., None], axis=1)  # (N, E)
    daffinity = aux_coef  # (E,), d(balance losses) / d affinity[n, i]
    if seq_coef is not None:  # (rows, E) -> each token's row of it, N / rows tokens a row
        per_row = N // seq_coef.shape[0]
        daffinity = xp.reshape(xp.broadcast_to(seq_coef[:, None, :], (seq_coef.shape[0], per_row, E)),
                               (N, E)) + aux_coef  # (N, E)
    if gate == "softmax":  # the affinity is the probability itself
        dscores = dscores + daffinity  # (N, E)
        dlogits = scores * (dscores - xp.sum(scores * dscores, axis=-1, keepdims=True))  # (N, E)
        softmax = scores  # (N, E)
    else:  # affinity s / sum(s) over the E experts; sigmoid' = s (1 - s)
        total = xp.sum(scores, axis=-1, keepdims=True)  # (N, 1)
        dscores = dscores + (daffinity - xp.sum(daffinity * scores, axis=-1, keepdims=True) / total) / total
        dlogits = dscores * scores * (1.0 - scores)  # (N, E)
        # the z-loss reads the logits' softmax, which a sigmoid router does not keep: one GEMM again
        softmax = xp.exp(linear_forward(*lin_cache[:2], None)[0] - lse[:, None])  # (N, E)
    dlogits = dlogits + (2.0 * z_coef) * lse[:, None] * softmax  # d lse^2 = 2 lse softmax
    dx2, dw, _ = linear_backward(dlogits, lin_cache)
    return dx2, dw


def queue_owners(all_counts, owners=None) -> np.ndarray:
    """(P, k, E) counts of every run in global order -> (k N_global,) host ints: the exchange rank
    holding each assignment of the experts' queues laid end to end, expert by expert, each in queue
    order (slot, then global token: run p's slot-j choices of e are one segment of e's queue).
    `owners` (P,) as in `Parts` (None: run p is rank p's)."""
    counts = to_host(all_counts)  # (P, k, E)
    P, k, E = counts.shape
    owners = np.arange(P) if owners is None else np.asarray(owners)  # (P,)
    segments = np.transpose(counts, (2, 1, 0)).reshape(-1)  # (E k P,): expert, slot, run
    return np.repeat(np.tile(owners, E * k), segments)  # (k N_global,)


def rank_by_score(experts, chosen, position, all_counts, cap: int, owners=None, gather=None):
    """Megatron-Core's drop policy "probs" over the global (micro)batch: each expert keeps the `cap`
    assignments of highest score, ties in queue order (slot, then token), where "position" keeps
    the first `cap` queued. (N, k) chosen experts, their scores and their places in the experts'
    queues (`position`, what the position policy ranks by) -> (keep (N, k) of this call, kept
    (ranks, E) host ints: the assignments each exchange rank keeps per expert, which `kept_counts`
    gives for the position policy).

    Ranking needs every assignment's score, not only the counts: each rank lists its scores in its
    experts' queue order, `gather(scores, counts)` concatenates every exchange rank's list in rank
    order (an all-gather over the data ranks, `counts` the ranks' lengths; None: this call is the
    whole batch), and the counts say where each gathered score sits in the queues
    (`queue_owners`), so every rank ranks the same global queue, identically, and keeps its own."""
    xp = array_namespace(experts)
    P, _, E = all_counts.shape
    selected = xp.sum(all_counts, axis=(0, 1))  # (E,) each expert's queue length
    first = xp.cumulative_sum(selected) - selected  # (E,) where each expert's queue starts
    flat = xp.reshape(xp.take(first, xp.reshape(experts, (-1,))), experts.shape) + position  # (N, k)
    mine = xp.argsort(xp.reshape(flat, (-1,)), stable=True)  # (N k,) own assignments in queue order
    sent = xp.take(xp.reshape(chosen, (-1,)), mine)  # (N k,)
    owner = queue_owners(all_counts, owners)  # (k N_global,) host
    ranks = P if owners is None else int(np.max(owners)) + 1
    got = sent if gather is None else gather(sent, np.bincount(owner, minlength=ranks).tolist())
    # gathered entry i, rank by rank each in queue order, is the score at queue index dest[i]
    dest = np.argsort(owner, kind="stable")  # (k N_global,)
    queue = xp.take(got, as_like(np.argsort(dest), got))  # (k N_global,) the queues end to end
    expert_of = xp.repeat(xp.arange(E, dtype=xp.int64, device=device(experts)), selected)  # (k N_global,)
    by_score = xp.argsort(-queue, stable=True)  # (k N_global,)
    # expert-major, best first within each expert
    order = xp.take(by_score, xp.argsort(xp.take(expert_of, by_score), stable=True))  # (k N_global,)
    index = xp.arange(queue.shape[0], dtype=xp.int64, device=device(experts))  # (k N_global,)
    # each queue entry's place in its expert's queue by score: 0 for the best
    score_place = xp.take(index - xp.take(first, expert_of), xp.argsort(order, stable=True))  # (k N_global,)
    kept_flat = to_host(score_place) < cap  # (k N_global,) host
    kept = np.bincount(owner * E + to_host(expert_of), weights=kept_flat,
                       minlength=ranks * E).astype(np.int64).reshape(ranks, E)  # (ranks, E)
    keep = xp.reshape(xp.take(score_place, xp.reshape(flat, (-1,))), flat.shape) < cap  # (N, k)
    return keep, kept


def sequence_balance_coefficients(hot, rows: int, seq_len: int, n_global: int, config, weight: float,
                                  dtype, sum_sequences=None):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) per sequence of T tokens,
    alpha * sum_i f_i P_i with f_i = E / (k T) * (the sequence's selections of expert i) and
    P_i = mean over its tokens of the affinity s'_i, averaged over the B_g = N_global / T sequences
    of the global (micro)batch. It is linear in the affinities: the loss is sum over tokens t of
    s'[t, i] * coef[row of t, i], coef = weight * alpha * E / (B_g k T^2) * counts. hot (N, k, E)
    of `rows` rows (N / rows positions of each) -> coef (rows, E) of `dtype`.

    Under context parallelism a rank holds only some positions of each row: f_i needs the whole
    row's counts, so `sum_sequences` adds the (rows, E) partial counts up over the ranks holding
    the rest (an all-reduce over cp). P_i needs no exchange: the loss is linear in it, so each rank
    sums s' * coef over its own tokens and the shares add up to the loss, and its gradient is local."""
    xp = array_namespace(hot)
    N, k, E = hot.shape
    counts = xp.sum(xp.reshape(hot, (rows, (N // rows) * k, E)), axis=1)  # (rows, E) this call's
    counts = counts if sum_sequences is None else sum_sequences(counts)  # (rows, E) whole rows'
    scale = weight * config.moe_seq_aux_weight * E / ((n_global // seq_len) * k * seq_len ** 2)
    return scale * xp.astype(counts, dtype)  # (rows, E)


def update_expert_bias(bias: dict, routings: list[dict], config) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2, after Wang et al. 2024): after each step,
    b_i += gamma * sign(mean load - load_i) for every MoE layer in `routings` (one dict layer ->
    routing per microbatch), the load c_i being the step's selections of expert i over the whole
    global batch (before any drop: every rank's counts, summed over dp, ep and cp by the routing's
    exchange, so every rank holding the layer computes the same bias and none sends a byte).
    `bias`: layer -> (E,) float64, updated in place; a layer starts at zero."""
    if config.moe_balance != "aux-free":
        return
    for layer in (routings[0] if routings else {}):
        xp = array_namespace(routings[0][layer]["selections"])
        load = xp.astype(sum(xp.sum(rs[layer]["selections"], axis=(0, 1)) for rs in routings),
                         xp.float64)  # (E,)
        step = config.moe_bias_rate * xp.sign(xp.mean(load) - load)  # (E,)
        bias[layer] = step if layer not in bias else bias[layer] + step

