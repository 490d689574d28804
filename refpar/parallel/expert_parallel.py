"""Expert parallelism (axis `ep`): each rank holds some experts, and tokens travel to their experts
and back by all-to-all.

    mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 2 --check

Legend: N this rank's tokens, C channels, E experts, k experts per token, D = dp * ep data ranks,
El this rank's experts, P the pairs (token, ep rank) it sends: a token once to every ep rank
holding at least one of its kept experts, P_in the pairs it receives, Q the assignments its
experts run (from every member of its ep group), m = min(k, ceil(E / ep)) a record's slots.

The all-to-alls move pairs, as DeepEP and DeepSeek-V3's node-limited routing do, not one row per
(token, expert) assignment. A pair's rows, in the activations' dtype: dispatch C + 2m (the token,
then its record: m gates and m of the receiver's local expert indices in slot order, gate 0 and
index -1 past the token's slots; an index is exact in a float, up to 256 local experts in 16 bits);
combine C (the sum over the row's experts of gate * output); combine:bwd C (dout); dispatch:bwd
C + m (the sum of the experts' dx, then each slot's dgate = <dout, y_expert>, which
routing.router_backward reads as on one device). The receiver lays its pairs' assignments out by local
expert (routing.buffer_layout, route's own layout), so experts_forward / experts_backward (and expert
tensor parallelism there) see one batch per expert as before; moe.combine / combine_backward weigh
and sum per pair as one device does per token; the sender adds up a token's pairs (the gathers of
moe.dispatch_backward). A pair exists when at least one of its assignments is kept; with a group
limit M a token's pairs go to at most M ep ranks (G = ep), which is where the limit saves rows.

Layout (as DeepSpeed-MoE and Megatron-Core lay it): ep lies inside data parallelism. Each of the
dp x ep ranks holds its own part of the global batch (data rank d = dp_rank * ep + ep_rank, in batch
order) and a full copy of the dense weights (embeddings, attention, LayerNorms, routers); expert e
lives on the ep rank whose `shard_range(E, ep, q)` holds it, once in every dp group. So
- tokens move by all-to-all only inside an ep group (the ranks of one dp coordinate);
- dense gradients are summed over all dp x ep ranks, which saw the whole batch between them;
- an expert's gradient is summed over dp, the ranks holding copies of it (the expert-data-parallel
  group); ranks of one ep group hold different experts and never sum them.
Why this layout: ep ranks that also split the batch do no redundant dense work. Ep ranks sharing
one batch part would compute every attention layer ep times over.

Capacity is global over the global microbatch (the whole batch with one microbatch; see
holdings.microbatch_samples for which tokens form microbatch j). Before dispatch every
rank all-gathers the (k, E) selection counts of every data rank (`routing.route`'s exchange); from them
it knows the global token count, its place in each expert's queue, and how many assignments every
rank keeps for every expert (`routing.kept_counts`), so it drops exactly what one device drops. The
pairs do not follow from those counts (two of a token's experts on one rank make one pair), so each
rank then all-gathers over the data ranks its (ep,) int64 pairs per destination
(`h.{i}.mlp.experts:pairs`): every rank knows each all-to-all's receive sizes before it starts, and
the closed forms read the same counts (refpar/analysis/moe.py, the trainer's microbatch_pair_counts).

Both families alike: the experts' MLP, their names and the router's layout are the family's
`MoESpec` (refpar/model/moe.py; refpar.model.moe_spec), the routing is routing.route's.

Per MoE layer and step: two all-gathers on the data axis (the selection counts, the pairs), four
all-to-alls on ep (dispatch and combine forward, and the same two backward), shown by the tags
`h.{i}.mlp.experts:dispatch` etc.

DeepSeek's routing options (refpar/model/routing.py) change no message: the aux-free bias is updated
from the gathered counts, the same on every rank (`self.bias`, routing.update_expert_bias); shared
experts are dense weights every data rank holds and runs on its own tokens; a group limit only
shrinks the pairs. Dropping by score (Megatron-Core's
"probs") needs every assignment's score, not only counts: per MoE layer and microbatch each rank
all-gathers over the data ranks the scores of all its N k assignments, in its experts' queue order
(`h.{i}.mlp.router:scores`), and every rank ranks the same global queues
(routing.rank_by_score); what each rank sends each expert then comes from that ranking
(routing.routing_kept), not from the counts.
The sequence-wise loss (DeepSeek-V3 eq. 17-20) needs each sequence's counts f_i: with cp > 1 a rank
holds some positions of its rows, so per MoE layer and microbatch it all-reduces its (rows, E)
int64 partial counts over cp (`h.{i}.mlp.router:seq_counts`); the loss is linear in the affinities,
so their sums P_i, the loss's value and its gradient stay local.

With context parallelism a rank's tokens are runs of the global order (refpar/parallel/routing_runs.py,
`self.runs`): the exchange group is then the dp x ep x cp ranks (group rank d * c + cp rank, cp
innermost), each rank gathers one (k, E) count per run. The all-to-alls stay on ep (same dp and cp
rank).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, device

from refpar import backend
from refpar.config import ConfigError
from refpar.model import moe, moe_spec
from refpar.model.layers import as_like
from refpar.model.routing import buffer_layout, route, router_backward, routing_kept
from refpar.parallel.routing_runs import RoutingRuns
from refpar.sharding import shard_range


def check_expert_parallel(config, ep: int) -> None:
    """ConfigErrors for an MoE model on `ep` ranks, raised before any communication. Every routing
    option runs on every mesh: none is refused here; a 16-bit pair record names at most 256 local
    experts (its indices are floats of the activations' dtype)."""
    if ep > 1 and config.moe_experts == 0:
        raise ConfigError(f"ep={ep} needs experts to spread; add --moe-experts E with E >= {ep}")
    if config.moe_experts and config.moe_experts < ep:
        raise ConfigError(
            f"moe_experts={config.moe_experts} is fewer than ep={ep}; use at least {ep} experts"
        )
    El = -(-config.moe_experts // max(ep, 1))
    if config.dtype in ("bfloat16", "float16") and El > 256:  # a record's index must be exact
        raise ConfigError(f"{El} experts per ep rank exceed the 256 a 16-bit pair record can name; "
                          f"use ep >= {-(-config.moe_experts // 256)}")


def owned_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    """The experts ep rank `ep_rank` holds: a contiguous `shard_range` of 0..E-1."""
    return range(*shard_range(n_experts, ep, ep_rank))


def _take_rows(a, order):
    """Rows `order` of a, in a's namespace and on its device."""
    return array_namespace(a).take(a, as_like(np.asarray(order), a), axis=0)


def _split_rows(buf, sizes):
    """(sum(sizes), C) -> list of (size_i, C) consecutive pieces."""
    bounds = np.cumsum([0, *sizes])
    return [buf[int(a):int(b), ...] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def pair_layout(experts, keep, owner, first, m: int) -> dict:
    """The (token, ep rank) pairs of one call's routing, host ints: experts and keep (N, k), owner
    (E,) the ep rank of each expert, first (ep,) each ep rank's first expert, m a record's slots.
    -> `token` (P,) each pair's token, destination-major and ascending within; `sizes` (ep,) the
    pairs bound for each ep rank; `row` (N, ep) the pair of token n and rank q, or P (the zero row)
    where n keeps no expert of q; `local` (P, m) the receiver's local expert of each of the pair's
    slots, in slot order, then -1; `gate` (P, m) where each slot's gate lies in the flat (N k)
    gates, N k (a zero) past them; `gate_at` (N, k) where each kept slot's dgate comes back in the
    flat (P m) record gradients, P m (a zero) where dropped."""
    N, k = experts.shape
    ep = len(first)
    dest = np.where(keep, owner[experts], -1)  # (N, k) the ep rank of each kept assignment
    has = np.stack([np.any(dest == q, axis=1) for q in range(ep)])  # (ep, N)
    token = np.concatenate([np.flatnonzero(h) for h in has])  # (P,), a buffer of its own: kept
    q_of = np.repeat(np.arange(ep), has.sum(axis=1))  # (P,)
    P = token.shape[0]
    row = np.full((N, ep), P, dtype=np.int64)  # (N, ep)
    row[token, q_of] = np.arange(P)
    bound = dest[token] == q_of[:, None]  # (P, k)
    order = np.argsort(~bound, axis=1, kind="stable")[:, :m]  # (P, m): the bound slots first
    filled = np.take_along_axis(bound, order, axis=1)  # (P, m)
    at = np.flatnonzero(filled)  # the filled record slots, p m + i
    gate_at = np.full((N, k), P * m, dtype=np.int64)  # (N, k)
    gate_at[token[at // m], order.reshape(-1)[at]] = at
    return {"token": token, "sizes": [int(c) for c in has.sum(axis=1)], "row": row,
            "local": np.where(filled, experts[token[:, None], order] - first[q_of][:, None], -1),
            "gate": np.where(filled, token[:, None] * k + order, N * k), "gate_at": gate_at}


def _take_padded(a, index):
    """Entries `index` (host ints, any shape) of a flattened, a zero appended for the index past
    its end: (...) -> index.shape, in a's namespace, dtype and device."""
    xp = array_namespace(a)
    flat = xp.concat([xp.reshape(a, (-1,)), xp.zeros((1,), dtype=a.dtype, device=device(a))])
    return xp.reshape(xp.take(flat, as_like(np.reshape(index, (-1,)), a)), index.shape)


class ExpertParallelMoE:
    """refpar.model.moe's layer with the experts spread over `ep`; pass it to `block_forward` as
    `moe`. `data` is the communicator over all dp x ep (x cp) ranks in batch order (cp innermost,
    `cp` of them per data rank), `ep` the one over this rank's ep group. After each forward,
    `last_routing[layer]` holds that layer's routing. `weight`: the router losses' weight, 1/M when
    a step has M microbatches; `grad_scale`: the fp16 loss scale the next backward starts from
    (both as in routing.route); `runs`: the RoutingRuns of the microbatch the next forward routes
    (None: each group rank's tokens are one run, as without cp; needed with cp > 1);
    `sequences`: with cp > 1, the communicator over the cp ranks holding the rest of this rank's
    sequences (mesh.cp), over which the sequence-wise loss sums its counts."""

    def __init__(self, data, ep, config, weight: float = 1.0, grad_scale: float = 1.0, cp: int = 1,
                 sequences=None):
        if (sequences.size if sequences is not None else 1) != cp:
            raise ValueError("pass the cp communicator as `sequences` exactly when cp > 1")
        if (data.rank // cp) % ep.size != ep.rank:
            raise ValueError("the data ranks must list each ep group contiguously, in ep order")
        self.data, self.ep, self.config, self.sequences = data, ep, config, sequences
        self.spec = moe_spec(config)  # the experts' MLP and names, the router's layout
        self.weight, self.grad_scale = weight, grad_scale
        E = config.moe_experts
        self.owners = [owned_experts(E, ep.size, q) for q in range(ep.size)]
        self.local = self.owners[ep.rank]
        self.owner = np.repeat(np.arange(ep.size), [len(o) for o in self.owners])  # (E,) ep rank
        self.first = np.asarray([o.start for o in self.owners])  # (ep,) each ep rank's first expert
        self.m = min(config.moe_top_k, max(len(o) for o in self.owners))  # a record's slots
        # group ranks of this ep group's members (same dp and cp rank), in ep order
        base = (data.rank // cp - ep.rank) * cp + data.rank % cp
        self.members = [base + q * cp for q in range(ep.size)]
        self.runs: RoutingRuns | None = None
        self.last_routing: dict[int, dict] = {}
        self.bias: dict = {}  # aux-free balancing: layer -> (E,), equal on every rank (update_expert_bias)

    def experts_forward(self, xe, rows_per_expert, params, layer):
        """This rank's experts on their rows, xe (Q, C) grouped by expert -> (Q, C); expert tensor
        parallelism (refpar/parallel/expert_tensor_parallel.py) splits each expert over tp here."""
        return moe.experts_forward(xe, rows_per_expert, params, layer, self.local, self.spec)

    def experts_backward(self, dye, ecache):
        """(Q, C) -> (dxe (Q, C), the local experts' gradients by name)."""
        return moe.experts_backward(dye, ecache)

    def _exchange(self, layer):
        runs = self.runs

        def gather(counts):  # (runs, k, E) -> (P, k, E) in global order
            got = self.data.all_gather(counts, tag=f"h.{layer}.mlp.router:counts",
                                       counts=None if runs is None else list(runs.per_rank))
            return got if runs is None else _take_rows(got, runs.order)
        return gather

    def _sum_sequences(self, layer):
        """The sequence-wise loss's (rows, E) counts of this rank's positions -> its rows' whole
        counts: summed over the cp ranks holding the rest (None without cp: rows are whole)."""
        if self.sequences is None:
            return None
        return lambda counts: self.sequences.all_reduce(counts, tag=f"h.{layer}.mlp.router:seq_counts")

    def _gather_scores(self, layer):
        """The drop policy "probs" (routing.rank_by_score): every data rank's scores in queue order,
        concatenated in rank order; `counts`, the ranks' lengths, come from the gathered counts
        (a rank holding nothing of the batch may be left off the end of them)."""
        def gather(scores, counts):  # (n,) -> (k N_global,)
            counts = counts + [0] * (self.data.size - len(counts))
            return self.data.all_gather(scores, tag=f"h.{layer}.mlp.router:scores", counts=counts)
        return gather

    def forward(self, x, params, layer, config):
        xp = array_namespace(x)
        x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, C)
        parts = None if self.runs is None else self.runs.parts
        cp = 1 if self.sequences is None else self.sequences.size
        routing, rcache = route(x2, self.spec.router_weight(params, layer), config,
                                exchange=self._exchange(layer), rank=self.data.rank,
                                weight=self.weight, grad_scale=self.grad_scale, parts=parts,
                                bias=self.bias.get(layer), seq_len=x.shape[1] * cp,
                                seq_rows=x.shape[0], sum_sequences=self._sum_sequences(layer),
                                gather_scores=self._gather_scores(layer))
        C, m, tag = x2.shape[1], self.m, f"h.{layer}.mlp.experts"
        lay = pair_layout(backend.to_host(routing["experts"]), backend.to_host(routing["keep"]),
                          self.owner, self.first, m)
        sizes = lay["sizes"]  # pairs to each ep rank
        pairs = backend.to_host(self.data.all_gather(
            np.asarray(sizes, dtype=np.int64), tag=f"{tag}:pairs",
            counts=[self.ep.size] * self.data.size)).reshape(self.data.size, self.ep.size)
        routing["pairs"] = pairs  # (group ranks, ep): every exchange rank's, for the closed forms
        pairs_in = [int(c) for c in pairs[self.members, self.ep.rank]]  # from each ep rank
        mine = {"token_of_row": as_like(lay["token"], x2), "row": as_like(lay["row"], x2),
                "gate_at": lay["gate_at"]}  # the sender's side of its pairs
        xrow = xp.concat([moe.dispatch(x2, mine), _take_padded(routing["gates"], lay["gate"]),
                          xp.astype(as_like(lay["local"], x2), x2.dtype)], axis=1)  # (P, C + 2m)
        got = self.ep.all_to_all(_split_rows(xrow, sizes), tag=f"{tag}:dispatch",
                                 recv_counts=pairs_in)  # S x (., C + 2m)
        del xrow
        xr = xp.concat(got, axis=0)  # (P_in, C + 2m): every pair sent here, source by source
        # the receiver lays its pairs' assignments out by local expert (routing.buffer_layout)
        expert_in = xp.astype(xr[:, C + m:], xp.int64)  # (P_in, m) local experts, -1 past the slots
        gate_in = xp.astype(xr[:, C:C + m], x2.dtype)  # (P_in, m) 0 past the slots (a copy)
        lr = buffer_layout(expert_in, expert_in >= 0, gate_in, len(self.local)) | {"gates": gate_in}
        xe = moe.dispatch(xr[:, :C], lr)  # (Q, C) grouped by local expert
        del xr, got
        kept = backend.to_host(routing_kept(routing))  # (group ranks, E)
        per_expert = [int(c) for c in kept[np.ix_(self.members, list(self.local))].sum(axis=0)]
        ye, ecache = self.experts_forward(xe, per_expert, params, layer)  # (Q, C)
        yr, ypad = moe.combine(ye, lr)  # (P_in, C): each pair's experts weighted and summed
        back = self.ep.all_to_all(_split_rows(yr, pairs_in), tag=f"{tag}:combine",
                                  recv_counts=sizes)  # S x (., C)
        # a token's output: its pairs' rows summed, the gathers of dispatch's backward
        out = moe.dispatch_backward(xp.concat(back, axis=0), mine)  # (N, C)
        # shared experts are dense: every rank holds them and runs its own tokens through them
        shared, scache = moe.shared_experts_forward(x2, params, layer, config.moe_shared_experts, self.spec)
        out = out if shared is None else out + shared  # (N, C)
        self.last_routing[layer] = routing
        cache = {"routing": routing, "router": rcache, "experts": ecache, "layer": layer,
                 "shape": x.shape, "shared": scache, "sizes": sizes, "pairs_in": pairs_in,
                 "pairs": mine, "received": lr, "pad": ypad}
        return xp.reshape(out, x.shape), cache

    def backward(self, dout, cache):
        xp = array_namespace(dout)
        layer, sizes, pairs_in, mine = cache["layer"], cache["sizes"], cache["pairs_in"], cache["pairs"]
        tag = f"h.{layer}.mlp.experts"
        dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
        C = dout2.shape[1]
        dx_shared, shared_grads = moe.shared_experts_backward(dout2, cache["shared"])  # (N, C)
        # the combine's backward: each pair's dout once, to the rank that summed it
        got = self.ep.all_to_all(_split_rows(moe.dispatch(dout2, mine), sizes), tag=f"{tag}:combine:bwd",
                                 recv_counts=pairs_in)  # S x (., C)
        # each expert's dy = gate * dout; dgate = <dout, y_expert> (moe.combine_backward)
        dye, dgr = moe.combine_backward(xp.concat(got, axis=0), cache["pad"], cache["received"])
        dxe, grads = self.experts_backward(dye, cache["experts"])  # (Q, C)
        dxr = moe.dispatch_backward(dxe, cache["received"])  # (P_in, C): summed over a pair's experts
        back = self.ep.all_to_all(_split_rows(xp.concat([dxr, xp.astype(dgr, dxr.dtype)], axis=1),
                                              pairs_in), tag=f"{tag}:dispatch:bwd",
                                  recv_counts=sizes)  # S x (., C + m)
        back = xp.concat(back, axis=0)  # (P, C + m)
        dx2 = moe.dispatch_backward(back[:, :C], mine)  # (N, C)
        dgates = _take_padded(back[:, C:], mine["gate_at"])  # (N, k), 0 where dropped
        dx_router, dw = router_backward(dgates, cache["router"])  # dw (C, E)
        grads[self.spec.router_name(layer)] = self.spec.router_grad(dw)
        dx2 = dx2 + dx_router if dx_shared is None else dx2 + dx_router + dx_shared  # (N, C)
        return xp.reshape(dx2, cache["shape"]), grads | shared_grads
