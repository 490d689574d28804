"""Bytes each data-parallel rank sends and receives per training step, in closed form.

The ZeRO paper (Rajbhandari et al. 2020, sec. 7) counts elements per rank per step with a
bandwidth-optimal (ring) collective: DP and ZeRO-1/2 move 2(N-1)/N·Ψ (an all-reduce, or a
reduce-scatter plus an all-gather), ZeRO-3 3(N-1)/N·Ψ (all-gathers for forward and for backward,
a reduce-scatter of the gradients). `paper_step_elems` is that.

`step_collectives` lists the blocking collectives refpar's implementation really calls in one step
(per bucket, per unit, per micro-batch), `ring_collectives` those it writes out as isend/irecv
rings to overlap them with compute, and `step_bytes` prices each with `refpar.comm.cost`, exact
for uneven `shard_range` partitions: the number a trace must show, to the byte. Gradients move in
their dtype (2 bytes in bf16/fp16-mixed, 4 with --fp32-grads), parameters in theirs (2 bytes in
mixed precision); fp16's loss scaling adds one 4-byte float32 flag all-reduced over dp where the
ranks hold different gradient shards (ZeRO and FSDP; plain DP's all-reduced gradients agree).
"""

from __future__ import annotations

from refpar.analysis.memory import ROOT, Options, bucket_sizes, check_strategy, unit_sizes
from refpar.comm import cost
from refpar.sharding import shard_sizes


def paper_step_elems(psi: float, n: int, stage: int) -> float:
    """Elements one rank sends per step: 2(N-1)/N·Ψ for DP (stage 0) and ZeRO-1/2, 3(N-1)/N·Ψ for
    ZeRO-3 (paper sec. 7.2)."""
    return (3 if stage == 3 else 2) * (n - 1) / n * psi


LOSS = ("all_reduce", 1, 1)  # the step's loss, one float64, summed so every rank can print it
# fp16: did any rank's gradient shard overflow? One float32, max. Built at run time so that it is
# a distinct object from LOSS (equal constant tuples are one object): `itemsize` tells them apart.
FOUND_INF = tuple(["all_reduce", 1, 1])


def step_collectives(config, n: int, opts: Options, loss: bool = True) -> list[tuple[str, int, int]]:
    """(op, elements, calls per step) of every blocking collective one step runs; with `loss` the
    last is the loss's one-element all-reduce (a float64 whatever the model's dtype). Collectives
    written out as rings of isend/irecv are in `ring_collectives`."""
    check_strategy(opts.strategy)
    sizes, M = unit_sizes(config), opts.microbatches
    calls: list[tuple[str, int, int]] = []
    if opts.strategy == "dp" and not opts.overlap:
        calls += [("all_reduce", b, 1) for b in bucket_sizes(config, opts.bucket_elems)]
    elif opts.strategy in ("zero1", "zero2"):
        # Stage 1 reduce-scatters once (last micro-batch), stage 2 every micro-batch; both gather
        # the updated parameters once after the step.
        rs_calls = 1 if opts.strategy == "zero1" else M
        for size in sizes.values():
            calls += [("reduce_scatter", size, rs_calls), ("all_gather", size, 1)]
    elif opts.strategy in ("zero3", "fsdp"):
        gathers = unit_gathers(config, opts)
        for u, size in sizes.items():
            if not (opts.strategy == "fsdp" and opts.prefetch and u != ROOT):
                calls.append(("all_gather", size, gathers[u]))
            calls.append(("reduce_scatter", size, M))
    if opts.loss_scaling and opts.strategy != "dp":
        calls.append(FOUND_INF)
    if loss:
        calls.append(LOSS)
    return [c for c in calls if c[2] > 0]


def unit_gathers(config, opts: Options) -> dict[str, int]:
    """All-gathers of each unit per step. ZeRO-3: forward and again backward (the root: for the
    embedding and for the head). FSDP: the root once; a block twice, or once without resharding."""
    M, sizes = opts.microbatches, unit_sizes(config)
    if opts.strategy == "zero3":
        return dict.fromkeys(sizes, 2 * M)
    return {u: M if u == ROOT or not opts.reshard_after_forward else 2 * M for u in sizes}


def ring_collectives(config, n: int, opts: Options) -> list[tuple[str, int, int]]:
    """(op, elements, calls per step) of the collectives refpar writes out as rings of isend/irecv
    (refpar/parallel/ring.py) to overlap them with compute: DP's buckets with overlap=True, FSDP's
    block all-gathers with prefetch=True. One rank alone runs none."""
    if n == 1:
        return []
    if opts.strategy == "dp" and opts.overlap:
        return [("all_reduce", b, 1) for b in bucket_sizes(config, opts.bucket_elems)]
    if opts.strategy == "fsdp" and opts.prefetch:
        gathers, sizes = unit_gathers(config, opts), unit_sizes(config)
        return [("all_gather", size, gathers[u]) for u, size in sizes.items() if u != ROOT]
    return []


def itemsize(call, opts: Options) -> int:
    """Bytes per element of a step collective: the loss a float64, the overflow flag a float32,
    gradient reductions the gradients' dtype, parameter all-gathers the parameters'."""
    if call is LOSS:
        return 8
    if call is FOUND_INF:
        return 4
    return opts.itemsize if call[0] == "all_gather" else opts.grad_bytes


def collective_bytes(op: str, elems: int, n: int, rank: int, itemsize: int) -> cost.Bytes:
    """Bytes of one native (ring) collective on `elems` elements, split with `shard_range`."""
    if op == "all_reduce":
        return cost.all_reduce_bytes(elems, n, rank, itemsize)
    if op == "reduce_scatter":
        return cost.reduce_scatter_bytes(elems, n, rank, itemsize)
    return cost.all_gather_bytes(shard_sizes(elems, n), rank, itemsize)


def step_bytes(config, n: int, rank: int, opts: Options, steps: int = 1,
               loss: bool = True, skipped: int = 0) -> dict[str, cost.Bytes]:
    """op -> bytes sent and received by `rank` of `n` over `steps` steps, in first-call order
    (`loss=False`: the model states' traffic only). The written-out rings move the bytes of the
    ring collective they replace, traced as isend (sent) and irecv (received). `skipped` of the
    steps overflowed in fp16: ZeRO-1/2 gather no parameters after them (none changed)."""
    out: dict[str, list[int]] = {}

    def add(op: str, moved: cost.Bytes, calls: int) -> None:
        sent, recv = out.setdefault(op, [0, 0])
        out[op] = [sent + moved.sent * calls, recv + moved.recv * calls]

    for call in step_collectives(config, n, opts, loss):
        op, elems, calls = call
        after_step = op == "all_gather" and opts.strategy in ("zero1", "zero2")
        add(op, collective_bytes(op, elems, n, rank, itemsize(call, opts)),
            calls * (steps - skipped if after_step else steps))
    for op, elems, calls in ring_collectives(config, n, opts):
        b = collective_bytes(op, elems, n, rank, opts.grad_bytes if op == "all_reduce" else opts.itemsize)
        add("isend", cost.Bytes(b.sent, 0), calls * steps)
        add("irecv", cost.Bytes(0, b.recv), calls * steps)
    return {op: cost.Bytes(s, r) for op, (s, r) in out.items()}
