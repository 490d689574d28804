"""Expert parallelism (axis `ep`): each rank holds some experts, and tokens travel to their experts
and back by all-to-all.

    mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 2 --check

Legend: N this rank's tokens, C channels, E experts, k experts per token, D = dp * ep data ranks,
R rows this rank sends (its kept assignments), Q rows its experts receive.

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
rank all-gathers the (k, E) selection counts of every data rank (`moe.route`'s exchange); from them
it knows the global token count, its place in each expert's queue, and how many rows every rank
sends to every expert (`moe.kept_counts`), so it drops exactly what one device drops and knows each
all-to-all's receive sizes before it starts.

Both families: GPT-2's experts (refpar/model/moe.py, GELU MLPs, router (C, E)) and Llama's Mixtral
experts (refpar/model/mixtral.py: SwiGLU, router stored (E, C) as HF's MixtralSparseMoeBlock.gate),
routed alike by moe.route (softmax, top-k, renormalised for k >= 2: Mixtral's router).

Per MoE layer and step: one all-gather of counts (data axis), four all-to-alls on ep (dispatch and
combine forward, and the same two backward), shown by the tags `h.{i}.mlp.experts:dispatch` etc.

DeepSeek's routing options (refpar/model/moe.py) change no message: the aux-free bias is updated
from the gathered counts, the same on every rank (`self.bias`, moe.update_expert_bias); shared
experts are dense weights every data rank holds and runs on its own tokens; with a group limit a
token's rows go to the ranks of at most M expert groups (one group per ep rank when G = ep), so the
all-to-all's sizes, which come from the counts as before, shrink. Dropping by score (Megatron-Core's
"probs") needs every assignment's score, not only counts: per MoE layer and microbatch each rank
all-gathers over the data ranks the scores of all its N k assignments, in its experts' queue order
(`h.{i}.mlp.router:scores`), and every rank ranks the same global queues
(moe.rank_by_score); what each rank sends each expert then comes from that ranking
(moe.routing_kept), not from the counts.
The sequence-wise loss (DeepSeek-V3 eq. 17-20) needs each sequence's counts f_i: with cp > 1 a rank
holds some positions of its rows, so per MoE layer and microbatch it all-reduces its (rows, E)
int64 partial counts over cp (`h.{i}.mlp.router:seq_counts`); the loss is linear in the affinities,
so their sums P_i, the loss's value and its gradient stay local.

With context parallelism each data rank's rows are split over c cp ranks
by position, so the exchange group is the dp x ep x cp ranks (group rank d * c + cp rank, cp
innermost) and a rank's tokens are no longer one contiguous block of the global order: of each
of its rows it holds runs of positions (two zig-zag chunks under ring attention, one chunk under
Ulysses). Routing then works on runs (`token_runs`, maximal runs of consecutive global token
indices b*T + t): each rank all-gathers one (k, E) count per run, and each run's queue offset
comes from the runs before it in global order (`moe.Parts`). The global order of the runs is
computed by every rank from the microbatch's rows and the cp layout, without communication
(`RoutingRuns`): the all-gather carries only counts, and without cp a data rank's rows are one
run, so the exchange is the dp x ep runner's. The all-to-alls stay on ep (same dp and cp rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.config import ConfigError
from refpar.model import mixtral, moe
from refpar.model.layers import as_like
from refpar.sharding import shard_range


def check_expert_parallel(config, ep: int) -> None:
    """ConfigErrors for an MoE model on `ep` ranks, raised before any communication. Every routing
    option runs on every mesh: none is refused here."""
    if ep > 1 and config.moe_experts == 0:
        raise ConfigError(f"ep={ep} needs experts to spread; add --moe-experts E with E >= {ep}")
    if config.moe_experts and config.moe_experts < ep:
        raise ConfigError(
            f"moe_experts={config.moe_experts} is fewer than ep={ep}; use at least {ep} experts"
        )


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


def _expert_major(pieces, counts):
    """pieces[s] (sum_e counts[s, e], C), grouped by expert -> (Q, C) grouped by expert, then by
    source: each local expert sees one batch of rows, in the order of the global queue."""
    xp = array_namespace(pieces[0])
    split = [_split_rows(p, counts[s]) for s, p in enumerate(pieces)]
    return xp.concat([split[s][e] for e in range(counts.shape[1]) for s in range(len(pieces))],
                     axis=0)


def _source_major(buf, counts):
    """The inverse of `_expert_major`: (Q, C) -> pieces[s] grouped by expert."""
    xp = array_namespace(buf)
    S, El = counts.shape
    rows = _split_rows(buf, [int(counts[s, e]) for e in range(El) for s in range(S)])
    return [xp.concat([rows[e * S + s] for e in range(El)], axis=0) for s in range(S)]


def token_runs(sample_ids, positions, seq_len: int) -> list[tuple[int, int]]:
    """The maximal runs (first global token index, length) of consecutive global token indices
    s * T + t among rows `sample_ids` (ascending) at `positions` (ascending), in that order: the
    order of the tokens of a (rows, positions) batch flattened."""
    runs: list[tuple[int, int]] = []
    for s in sample_ids:
        for t in positions:
            g = int(s) * seq_len + int(t)
            if runs and sum(runs[-1]) == g:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((g, 1))
    return runs


@dataclass(frozen=True)
class RoutingRuns:
    """The runs of one global microbatch over the exchange group: `parts`, this rank's runs for
    moe.route; `per_rank`, how many runs each group rank holds (the all-gather's counts); `order`,
    the runs as gathered (group rank by group rank) in global order."""

    parts: moe.Parts
    per_rank: tuple[int, ...]
    order: tuple[int, ...]


def routing_runs(runs_by_rank: list[list[tuple[int, int]]], rank: int) -> RoutingRuns:
    """`runs_by_rank[g]`: group rank g's `token_runs`; the RoutingRuns of group rank `rank`."""
    gathered = [(start, g, n) for g, runs in enumerate(runs_by_rank) for start, n in runs]
    order = sorted(range(len(gathered)), key=lambda i: gathered[i][0])  # global order
    place = {i: p for p, i in enumerate(order)}
    first = sum(len(r) for r in runs_by_rank[:rank])
    mine = range(first, first + len(runs_by_rank[rank]))
    parts = moe.Parts(tuple(gathered[i][2] for i in mine), tuple(place[i] for i in mine),
                      tuple(gathered[i][1] for i in order))
    return RoutingRuns(parts, tuple(len(r) for r in runs_by_rank), tuple(order))


class ExpertParallelMoE:
    """refpar.model.moe's layer with the experts spread over `ep`; pass it to `block_forward` as
    `moe`. `data` is the communicator over all dp x ep (x cp) ranks in batch order (cp innermost,
    `cp` of them per data rank), `ep` the one over this rank's ep group. After each forward,
    `last_routing[layer]` holds that layer's routing. `weight`: the router losses' weight, 1/M when
    a step has M microbatches; `grad_scale`: the fp16 loss scale the next backward starts from
    (both as in moe.route); `runs`: the RoutingRuns of the microbatch the next forward routes (None:
    each group rank's tokens are one run, the dp x ep runner's case; needed with cp > 1);
    `sequences`: with cp > 1, the communicator over the cp ranks holding the rest of this rank's
    sequences (mesh.cp), over which the sequence-wise loss sums its counts."""

    def __init__(self, data, ep, config, weight: float = 1.0, grad_scale: float = 1.0, cp: int = 1,
                 sequences=None):
        if (sequences.size if sequences is not None else 1) != cp:
            raise ValueError("pass the cp communicator as `sequences` exactly when cp > 1")
        if (data.rank // cp) % ep.size != ep.rank:
            raise ValueError("the data ranks must list each ep group contiguously, in ep order")
        self.data, self.ep, self.config, self.sequences = data, ep, config, sequences
        self.family = mixtral if config.arch == "llama" else moe  # the experts' and router's names
        self.weight, self.grad_scale = weight, grad_scale
        E = config.moe_experts
        self.owners = [owned_experts(E, ep.size, q) for q in range(ep.size)]
        self.local = self.owners[ep.rank]
        # group ranks of this ep group's members (same dp and cp rank), in ep order
        base = (data.rank // cp - ep.rank) * cp + data.rank % cp
        self.members = [base + q * cp for q in range(ep.size)]
        self.runs: RoutingRuns | None = None
        self.last_routing: dict[int, dict] = {}
        self.bias: dict = {}  # aux-free balancing: layer -> (E,), equal on every rank (update_expert_bias)

    def experts_forward(self, xe, rows_per_expert, params, layer):
        """This rank's experts on their rows, xe (Q, C) grouped by expert -> (Q, C); expert tensor
        parallelism (refpar/parallel/expert_tensor_parallel.py) splits each expert over tp here."""
        return self.family.experts_forward(xe, rows_per_expert, params, layer, self.local)

    def experts_backward(self, dye, ecache):
        """(Q, C) -> (dxe (Q, C), the local experts' gradients by name)."""
        return self.family.experts_backward(dye, ecache)

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
        """The drop policy "probs" (moe.rank_by_score): every data rank's scores in queue order,
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
        w = params[self.family.router_name(layer)]  # GPT-2's (C, E), Mixtral's (E, C)
        w = xp.matrix_transpose(w) if self.family is mixtral else w  # (C, E), the layout route takes
        routing, rcache = moe.route(x2, w, config,
                                    exchange=self._exchange(layer), rank=self.data.rank,
                                    weight=self.weight, grad_scale=self.grad_scale, parts=parts,
                                    bias=self.bias.get(layer), seq_len=x.shape[1] * cp,
                                    seq_rows=x.shape[0], sum_sequences=self._sum_sequences(layer),
                                    gather_scores=self._gather_scores(layer))
        kept = backend.to_host(moe.routing_kept(routing))  # (group ranks, E)
        mine = kept[self.data.rank]  # (E,) rows this rank sends to each expert
        send = [int(mine[list(self.owners[q])].sum()) for q in range(self.ep.size)]
        recv = kept[np.ix_(self.members, list(self.local))]  # (S, El)

        xbuf = moe.dispatch(x2, routing)  # (R, C)
        tag = f"h.{layer}.mlp.experts"
        rows_in = [int(c) for c in recv.sum(axis=1)]  # from each ep rank: known, nothing to ask
        got = self.ep.all_to_all(_split_rows(xbuf, send), tag=f"{tag}:dispatch",
                                 recv_counts=rows_in)  # S x (., C)
        xe = _expert_major(got, recv)  # (Q, C)
        ye, ecache = self.experts_forward(xe, [int(c) for c in recv.sum(axis=0)], params,
                                          layer)  # (Q, C)
        back = self.ep.all_to_all(_source_major(ye, recv), tag=f"{tag}:combine",
                                  recv_counts=send)  # S x (., C)
        out, pad = moe.combine(xp.concat(back, axis=0), routing)  # (N, C)
        # shared experts are dense: every rank holds them and runs its own tokens through them
        shared, scache = moe.shared_experts_forward(x2, params, layer, config.moe_shared_experts)
        out = out if shared is None else out + shared  # (N, C)
        self.last_routing[layer] = routing
        cache = {"routing": routing, "router": rcache, "experts": ecache, "pad": pad,
                 "layer": layer, "shape": x.shape, "send": send, "recv": recv, "shared": scache}
        return xp.reshape(out, x.shape), cache

    def backward(self, dout, cache):
        xp = array_namespace(dout)
        routing, layer, send, recv = cache["routing"], cache["layer"], cache["send"], cache["recv"]
        tag = f"h.{layer}.mlp.experts"
        dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
        dx_shared, shared_grads = moe.shared_experts_backward(dout2, cache["shared"])  # (N, C)
        dybuf, dgates = moe.combine_backward(dout2, cache["pad"], routing)  # (R, C), (N, k)
        got = self.ep.all_to_all(_split_rows(dybuf, send), tag=f"{tag}:combine:bwd",
                                 recv_counts=[int(c) for c in recv.sum(axis=1)])
        dxe, grads = self.experts_backward(_expert_major(got, recv), cache["experts"])  # (Q, C)
        back = self.ep.all_to_all(_source_major(dxe, recv), tag=f"{tag}:dispatch:bwd",
                                  recv_counts=send)
        dx2 = moe.dispatch_backward(xp.concat(back, axis=0), routing)  # (N, C)
        dx_router, dw = moe.router_backward(dgates, cache["router"])  # dw (C, E)
        grads[self.family.router_name(layer)] = xp.matrix_transpose(dw) if self.family is mixtral else dw
        dx2 = dx2 + dx_router if dx_shared is None else dx2 + dx_router + dx_shared  # (N, C)
        return xp.reshape(dx2, cache["shape"]), grads | shared_grads
