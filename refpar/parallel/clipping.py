"""Gradient clipping by the global norm on any mesh: the single device's norm, every element once.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --clip-grad-norm 0.05 --check

The single device (refpar/trainer.py) multiplies every gradient by clip_coefficient(‖g‖) =
min(1, X / (‖g‖ + 1e-6)) (torch.nn.utils.clip_grad_norm_'s formula and eps), with ‖g‖ the L2 norm
over all the model's parameters. After the gradient sums (`states.finish`) a rank holds pieces and
copies of that vector; it sums the squares of the elements it *counts*, so that every element of
the model is counted by exactly one rank of the groups the sums are then all-reduced over:

    axis        what the ranks along it hold                    counted               all-reduced
    tp          shards of the tp-split tensors (vocabulary,     the shards; a copy    yes
                heads, MLP columns), copies of the others       on tp rank 0 only
                (LayerNorms, row-parallel biases, wpe, router)
    pp          other stages' tensors; the tied wte on the      wte on the rank of    yes
                first and the last stage (summed, the same)     stage 0 only
                (a V: both on rank 0, one unit); DualPipe:      on the lower rank r
                ranks r and p-1-r hold the same parts, their    of the pair only
                copies' gradients summed (the same)
    replicas    DP: the same summed gradient (copies)           every rank            no (DP)
    (dp x cp,   ZeRO-1/2/3, FSDP: disjoint shards of each unit  its shard             yes (ZeRO)
    dp x ep x cp)
    ep          other experts; a MoE model's dense weights      dense on ep rank 0    DP: yes; ZeRO:
                (copies under DP, shards of the data group      under DP              inside the data
                under ZeRO)                                                           group's sum

This is Megatron-LM's rule (megatron/core/optimizer/clip_grads.py: `param_is_not_shared` and
`param_is_not_tensor_parallel_duplicate` filter what a rank counts, then one sum over the model-
parallel group, the data-parallel group too with its distributed optimizer). The classic bugs are
the rows left out: a norm over the local pipeline stage only (pytorch/torchtitan#596), tp copies
counted once per tp rank, the tied wte counted on both ends.

Mixed precision: the squares are summed in fp32 (the optimizer's dtype: float64 runs in float64),
of the gradients as backward wrote them, and the norm multiplied by 1/loss scale (a power of two:
the norm of the unscaled gradients, exactly). An fp16 step that overflowed was skipped before
(model_states.ModelStates.begin_update): no norm. Traced: one all-reduce of that one number per axis, tagged
"grad_norm.AXIS" (refpar/analysis/closed_forms.py counts them).
"""

from __future__ import annotations

from collections.abc import Callable

from refpar import backend
from refpar.holdings import is_expert, tp_param_slices
from refpar.model.optim import clip_coefficient, sum_of_squares


class GlobalNormClip:
    """Clips to `max_norm`. `counted(name)`: whether this rank counts its gradient elements of
    parameter `name`; `axes`: the groups the partial sums are all-reduced over, in order."""

    def __init__(self, max_norm: float, counted: Callable[[str], bool], axes: list):
        self.max_norm, self.counted, self.axes = max_norm, counted, axes
        self.norm: float | None = None  # the last step's, before clipping

    def squares(self, states):
        """(1,): Σ g² over the gradient elements this rank holds after the sums and counts (`states`:
        its model_states.ModelStates)."""
        u = states.units
        pieces = [g[lo - start:hi - start] for unit, start, g in states.held_grads()
                  for name, lo, hi in u.segments(unit, start, start + g.shape[0]) if self.counted(name)]
        like = states.held_grads()[0][2]
        total = backend.zeros(like, 1, states.dtypes.state)  # (1,)
        return total + sum_of_squares(pieces) if pieces else total

    def coefficient(self, states, inv_scale: float) -> float:
        """This step's clip_coefficient of the global norm, the same on every rank; keeps the norm."""
        total = self.squares(states)
        for axis in self.axes:
            total = axis.all_reduce(total, tag=f"grad_norm.{axis.axis}")
        self.norm = float(backend.to_host(total)[0]) ** 0.5 * inv_scale
        return clip_coefficient(self.norm, self.max_norm)


def clip_for(model, train, mesh, plan, stages: list[int], data, copies=None) -> GlobalNormClip | None:
    """The run's clipping (None without --clip-grad-norm): what this rank counts (module docstring)
    and the axes its sums go over; `stages` the pipeline stages it runs, `data` its replica group
    of dense weights (dp x cp, or dp x ep x cp with experts), `copies` DualPipe's mirror group."""
    if not train.clip_grad_norm:
        return None
    t, sharded = mesh.sizes["tp"], plan.stage > 0
    split = set(tp_param_slices(model, t, mesh.coords["tp"])) if t > 1 else set()
    first_tp, first_ep = mesh.coords["tp"] == 0, mesh.coords["ep"] == 0
    holds_stage_0 = 0 in stages
    mirrored = copies is not None and copies.rank > 0  # DualPipe: the lower rank of the pair counts

    def counted(name: str) -> bool:
        if mirrored or (name == "wte.weight" and not holds_stage_0):
            return False
        if model.moe_experts and not sharded and not is_expert(name) and not first_ep:
            return False
        return name in split or first_tp

    replicas = data if sharded else None  # DP's replicas hold copies
    experts = mesh.ep if model.moe_experts and not sharded else None  # under ZeRO the data group has ep
    axes = [g for g in (replicas, experts, mesh.tp, mesh.pp) if g is not None and g.size > 1]
    return GlobalNormClip(train.clip_grad_norm, counted, axes)
