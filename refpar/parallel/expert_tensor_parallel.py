"""Expert tensor parallelism: each expert a tensor-parallel MLP over `tp` (Megatron-LM's classic
layout, expert tp size = tp), the routing replicated over tp.

    mpiexec -n 4 python -m refpar train --mesh ep=2,tp=2 --moe-experts 4 --moe-topk 2 --check
    mpiexec -n 4 python -m refpar train --mesh ep=2,tp=2 --sp --moe-experts 4 --check

Legend: B rows, Ta the tokens of a row a tp region sees (T, or with cp this cp rank's positions),
Tl this rank's residual tokens (Ta, or shard_range(Ta, t, rank) under sp), C channels, H = 4C an
expert's hidden width, t tp size, Q rows this rank's experts receive.

The MoE layer runs replicated over tp OUTSIDE the experts: the router, the routing exchange over
the data ranks of this tp coordinate, dispatch, the ep all-to-alls (ranks of this tp coordinate)
and combine see the same tokens on every tp rank, so they are one computation done t times and
their gradients (the router's) are the same on every tp rank, with nothing to sum. Under plain tp
the residual stream is already replicated; under sp the layer all-gathers the Ta tokens over tp
before the router and keeps this rank's part after combine; backward all-gathers dout and keeps
its part of dx (the replicated backward computes the whole dx on every rank, so no sum). With cp
the gathered tokens are the cp rank's (sequence_parallel.sp_cp_layout),
so every tp rank routes the runs of positions cp alone routes (`cp`: the exchange group's cp
ranks per data rank, as ExpertParallelMoE's).

Inside, the expert buffer (Q, C) is a tensor-parallel region of its own, entered and left through
Megatron's pair (refpar/parallel/tensor_parallel.py), each expert the family's expert MLP
(moe.MoESpec's `mlp`, run by moe.experts_forward on this rank's shards): GPT-2's moe.GeluMLP and
DeepSeek-V3's SwiGLU (its router and shared experts whole on every tp rank); refpar/engine/validate.py
refuses Mixtral's experts over tp (refpar/parallel/pieces.py: Family.experts_over_tp).

    f  copy_to_tp      on the buffer's rows     identity forward | all-reduce backward
       c_fc            columns shard_range(H, t, rank) of every expert: (Q_e, H/t)
       c_proj          rows of the same range: a partial (Q_e, C)
    g  reduce_from_tp  on the partial outputs   all-reduce forward | identity backward
       + c_proj.bias   whole, once

So per MoE layer and microbatch: one all-reduce of (Q, C) forward (all local experts at once), one
backward, and under sp two all-gathers of (B, Ta, C). c_fc's and c_proj.weight's gradients are this
rank's shard (never summed over tp); c_proj.bias's is the same on every tp rank.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model import moe
from refpar.model.layers import compute, rounded
from refpar.parallel.expert_parallel import ExpertParallelMoE
from refpar.parallel.sequence_parallel import gather_from_sp
from refpar.parallel.tensor_parallel import (
    copy_to_tp,
    copy_to_tp_backward,
    reduce_from_tp,
    reduce_from_tp_backward,
)
from refpar.sharding import shard_range


def tensor_parallel_experts_forward(xe, rows_per_expert, params, layer: int, experts, spec, tp):
    """xe (Q, C) grouped by expert, the same on every tp rank -> (Q, C), the same on every tp rank.
    Each expert is spec.mlp (moe.GeluMLP) on this rank's shards, its down projection's bias left
    out of the partial outputs and added once after their sum."""
    xp = array_namespace(xe)
    tag = f"h.{layer}.mlp.experts"
    xa = copy_to_tp(xe, tp, f"{tag}.c_fc:fwd")  # f: (Q, C)
    partial, ecache = moe.experts_forward(xa, rows_per_expert, params, layer, experts, spec,
                                          down_bias=False)  # (Q, C), partial over t
    y = reduce_from_tp(partial, tp, f"{tag}.c_proj:fwd")  # g: (Q, C), summed
    if spec.mlp.down_bias is not None:
        outs, start = [], 0
        for e, n in zip(experts, rows_per_expert, strict=True):
            b = params[f"{spec.expert_prefix(layer, e)}.{spec.mlp.down_bias}"]
            outs.append(rounded(compute(y[start:start + n, ...]) + compute(b), y.dtype))  # (n_e, C)
            start += n
        y = xp.concat(outs, axis=0)  # (Q, C)
    return y, (ecache, tp, tag)


def tensor_parallel_experts_backward(dye, cache):
    """dye (Q, C), the same on every tp rank -> (dxe (Q, C) summed over tp, this rank's shards of
    the experts' gradients)."""
    ecache, tp, tag = cache
    dy = reduce_from_tp_backward(dye, tp, f"{tag}.c_proj:bwd")  # g backward: (Q, C)
    dxe, grads = moe.experts_backward(dy, ecache)  # (Q, C), partial over t
    dxe = copy_to_tp_backward(dxe, tp, f"{tag}.c_fc:bwd")  # f backward: (Q, C)
    return dxe, grads


class TensorParallelExpertMoE(ExpertParallelMoE):
    """ExpertParallelMoE whose experts are tensor-parallel over `lay.tp` (lay: the stage's
    tensor_parallel.Layout); with `sp` the layer gathers the sequence over tp around itself.
    `data` and `ep` are the communicators of this rank's tp coordinate."""

    def __init__(self, data, ep, config, lay, sp: bool = False, weight: float = 1.0,
                 grad_scale: float = 1.0, cp: int = 1, sequences=None):
        super().__init__(data, ep, config, weight, grad_scale, cp, sequences)
        self.lay, self.sp = lay, sp
        # Ta, the region's tokens: T, or this cp rank's positions (sequence_parallel.sp_cp_layout)
        self.Ta = len(lay.region_pos)

    def forward(self, x, params, layer, config):
        """x (B, Tl, C) -> (B, Tl, C)."""
        if self.sp:
            x = gather_from_sp(x, self.lay.tp, f"h.{layer}.mlp.moe:fwd", self.Ta)  # (B, Ta, C)
        out, cache = super().forward(x, params, layer, config)  # (B, Ta, C) under sp
        return self._mine(out), cache

    def backward(self, dout, cache):
        if self.sp:  # the replicated backward needs the whole region's output gradient
            dout = gather_from_sp(dout, self.lay.tp, f"h.{cache['layer']}.mlp.moe:bwd",
                                  self.Ta)  # (B, Ta, C)
        dx, grads = super().backward(dout, cache)  # (B, Ta, C) under sp: whole on every tp rank
        return self._mine(dx), grads

    def _mine(self, x):
        """(B, Ta, C) -> (B, Tl, C): this rank's part of the region's tokens under sp (the
        all-gather's shard_range of Ta); x itself otherwise."""
        if not self.sp:
            return x
        lo, hi = shard_range(self.Ta, self.lay.tp.size, self.lay.tp.rank)
        return x[:, lo:hi, ...]

    def experts_forward(self, xe, rows_per_expert, params, layer):
        return tensor_parallel_experts_forward(xe, rows_per_expert, params, layer, self.local, self.spec,
                                               self.lay.tp)

    def experts_backward(self, dye, ecache):
        return tensor_parallel_experts_backward(dye, ecache)
