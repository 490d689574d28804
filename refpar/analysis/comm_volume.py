"""Bytes each data-parallel rank sends and receives per training step, in closed form.

The ZeRO paper (Rajbhandari et al. 2020, sec. 7) counts elements per rank per step with a
bandwidth-optimal (ring) collective: DP and ZeRO-1/2 move 2(N-1)/N·Ψ (an all-reduce, or a
reduce-scatter plus an all-gather), ZeRO-3 3(N-1)/N·Ψ (all-gathers for forward and for backward,
a reduce-scatter of the gradients). `paper_step_elems` is that.

`step_calls` lists the collectives refpar's implementation really calls in one step (per bucket, per
unit, per micro-batch, from the replay of refpar/analysis/data_parallel.py; the rings it writes out
as isend/irecv to overlap them with compute too) and `step_bytes` sums them, priced with
`refpar.comm.cost`, exact for uneven `shard_range` partitions: the number a trace must show, to the
byte. These are the data-parallel mesh's (`--mesh dp=N`); refpar/analysis/closed_forms.py composes the
same for any mesh. Gradients move in
their dtype (2 bytes in bf16/fp16-mixed, 4 with --fp32-grads), parameters in theirs (2 bytes in
mixed precision); fp16's loss scaling adds one 4-byte float32 flag all-reduced over dp where the
ranks hold different gradient shards (ZeRO and FSDP; plain DP's all-reduced gradients agree).
"""

from __future__ import annotations

from refpar.analysis import closed_forms
from refpar.analysis.memory import Options, check_strategy
from refpar.comm import cost


def paper_step_elems(psi: float, n: int, stage: int) -> float:
    """Elements one rank sends per step: 2(N-1)/N·Ψ for DP (stage 0) and ZeRO-1/2, 3(N-1)/N·Ψ for
    ZeRO-3 (paper sec. 7.2)."""
    return (3 if stage == 3 else 2) * (n - 1) / n * psi


def step_calls(config, n: int, rank: int, opts: Options, loss: bool = True, stepped: bool = True) -> list:
    """(axis, op, what, Bytes) of every collective `rank` of n calls in one step, in order; with
    `loss` the last is the loss's one-element all-reduce (a float64 whatever the model's dtype)."""
    check_strategy(opts.strategy)
    sizes = {"pp": 1, "dp": n, "ep": 1, "cp": 1, "tp": 1}
    _, calls = closed_forms.data_parallel_bytes(config, sizes, closed_forms.rank_coords(sizes, rank), opts,
                                          opts.precision, stepped)
    if loss and n > 1:
        calls.append(("dp", "all_reduce", "loss", cost.all_reduce_bytes(1, n, rank, 8)))
    return calls


def step_bytes(config, n: int, rank: int, opts: Options, steps: int = 1,
               loss: bool = True, skipped: int = 0) -> dict[str, cost.Bytes]:
    """op -> bytes sent and received by `rank` of `n` over `steps` steps (`loss=False`: the model
    states' traffic only). The written-out rings move the bytes of the ring collective they replace,
    traced as isend (sent) and irecv (received). `skipped` of the steps overflowed in fp16: ZeRO-1/2
    gather no parameters after them (none changed)."""
    out: dict[str, tuple[int, int]] = {}
    for stepped, times in ((True, steps - skipped), (False, skipped)):
        for _, op, _, b in step_calls(config, n, rank, opts, loss, stepped) if times else ():
            cost.add(out, op, b, times)
    return {op: cost.Bytes(s, r) for op, (s, r) in out.items()}
