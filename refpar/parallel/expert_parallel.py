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
expert_parallel_run.microbatch_samples for which tokens form microbatch j). Before dispatch every
rank all-gathers the (k, E) selection counts of every data rank (`moe.route`'s exchange); from them
it knows the global token count, its place in each expert's queue, and how many rows every rank
sends to every expert (`moe.kept_counts`), so it drops exactly what one device drops and knows each
all-to-all's receive sizes before it starts.

Per MoE layer and step: one all-gather of counts (data axis), four all-to-alls on ep (dispatch and
combine forward, and the same two backward), shown by the tags `h.{i}.mlp.experts:dispatch` etc.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.config import ConfigError
from refpar.model import moe
from refpar.sharding import shard_range


def check_expert_parallel(config, ep: int) -> None:
    """ConfigErrors for an MoE model on `ep` ranks, raised before any communication."""
    if ep > 1 and config.moe_experts == 0:
        raise ConfigError(f"ep={ep} needs experts to spread; add --moe-experts E with E >= {ep}")
    if config.moe_experts and config.moe_experts < ep:
        raise ConfigError(
            f"moe_experts={config.moe_experts} is fewer than ep={ep}; use at least {ep} experts"
        )


def owned_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    """The experts ep rank `ep_rank` holds: a contiguous `shard_range` of 0..E-1."""
    return range(*shard_range(n_experts, ep, ep_rank))


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


class ExpertParallelMoE:
    """refpar.model.moe's layer with the experts spread over `ep`; pass it to `block_forward` as
    `moe`. `data` is the communicator over all dp x ep ranks in batch order, `ep` the one over this
    rank's ep group. After each forward, `last_routing[layer]` holds that layer's routing.
    `weight`: the router losses' weight, 1/M when a step has M microbatches; `grad_scale`: the fp16
    loss scale the next backward starts from (both as in moe.route)."""

    def __init__(self, data, ep, config, weight: float = 1.0, grad_scale: float = 1.0):
        if data.rank % ep.size != ep.rank:
            raise ValueError("the data ranks must list each ep group contiguously, in ep order")
        self.data, self.ep, self.config = data, ep, config
        self.weight, self.grad_scale = weight, grad_scale
        E = config.moe_experts
        self.owners = [owned_experts(E, ep.size, q) for q in range(ep.size)]
        self.local = self.owners[ep.rank]
        self.group_base = data.rank - ep.rank  # data rank of this ep group's first member
        self.last_routing: dict[int, dict] = {}

    def experts_forward(self, xe, rows_per_expert, params, layer):
        """This rank's experts on their rows, xe (Q, C) grouped by expert -> (Q, C); expert tensor
        parallelism (refpar/parallel/expert_tensor_parallel.py) splits each expert over tp here."""
        return moe.experts_forward(xe, rows_per_expert, params, layer, self.local)

    def experts_backward(self, dye, ecache):
        """(Q, C) -> (dxe (Q, C), the local experts' gradients by name)."""
        return moe.experts_backward(dye, ecache)

    def _exchange(self, layer):
        def gather(counts):  # (k, E) -> (D, k, E)
            return self.data.all_gather(counts[None, ...], tag=f"h.{layer}.mlp.router:counts")
        return gather

    def forward(self, x, params, layer, config):
        xp = array_namespace(x)
        x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, C)
        routing, rcache = moe.route(x2, params[moe.router_name(layer)], config,
                                    exchange=self._exchange(layer), rank=self.data.rank,
                                    weight=self.weight, grad_scale=self.grad_scale)
        kept = backend.to_host(moe.kept_counts(routing["selections"], routing["capacity"]))  # (D, E)
        mine = kept[self.data.rank]  # (E,) rows this rank sends to each expert
        send = [int(mine[list(self.owners[q])].sum()) for q in range(self.ep.size)]
        recv = kept[self.group_base:self.group_base + self.ep.size, list(self.local)]  # (S, El)

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
        self.last_routing[layer] = routing
        cache = {"routing": routing, "router": rcache, "experts": ecache, "pad": pad,
                 "layer": layer, "shape": x.shape, "send": send, "recv": recv}
        return xp.reshape(out, x.shape), cache

    def backward(self, dout, cache):
        xp = array_namespace(dout)
        routing, layer, send, recv = cache["routing"], cache["layer"], cache["send"], cache["recv"]
        tag = f"h.{layer}.mlp.experts"
        dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, C)
        dybuf, dgates = moe.combine_backward(dout2, cache["pad"], routing)  # (R, C), (N, k)
        got = self.ep.all_to_all(_split_rows(dybuf, send), tag=f"{tag}:combine:bwd",
                                 recv_counts=[int(c) for c in recv.sum(axis=1)])
        dxe, grads = self.experts_backward(_expert_major(got, recv), cache["experts"])  # (Q, C)
        back = self.ep.all_to_all(_source_major(dxe, recv), tag=f"{tag}:dispatch:bwd",
                                  recv_counts=send)
        dx2 = moe.dispatch_backward(xp.concat(back, axis=0), routing)  # (N, C)
        dx_router, grads[moe.router_name(layer)] = moe.router_backward(dgates, cache["router"])
        return xp.reshape(dx2 + dx_router, cache["shape"]), grads
