"""Closed forms of DP, ZeRO-1/2/3 and FSDP for any rank: the bytes of its collectives in a step and
its memory peaks, from the units it holds and the actions its pipeline schedule gives it.

Legend: Ψ_u elements of unit u on the rank, s_u its `shard_range` share over the unit's group of N
ranks, b bytes of a parameter, g of a gradient (b, or 4 with fp32 gradients), k the unit's gathers.

refpar/parallel/{data_parallel, zero, fsdp}.py run every piece of a stage (the embedding, each
block, the head) between an acquire and a release of its units, fold its gradients in, and say
which units it completed (refpar/parallel/model_states.py). What moves and what is held follows from
that sequence alone, so this module replays it on sizes (`replay`), for the rank's list of the
schedule (one stage, one microbatch after another, without a pipeline):

- bytes: DP one all-reduce per bucket (2(N-1)/N Ψ in all) or, overlapped, the same ring written
  out as isend/irecv; ZeRO-1 a reduce-scatter of each unit in the last microbatch and an all-gather
  after the step; ZeRO-2 a reduce-scatter per microbatch; ZeRO-3 and FSDP k all-gathers per unit,
  k from the replay (2 per microbatch: forward and backward; the head's units stay gathered from
  its forward to its backward; FSDP keeps the ends from the embedding through the head on a stage
  holding both, and blocks from forward to backward without resharding), FSDP's prefetched ones as
  rings. Then the tied wte's all-reduce over the embedding group and the sequence-sharded region's
  over tp, on what the rank keeps of them (whole, or the shards' segments).
- memory: the persistent states (params Ψ b or Σ s_u b; grads Ψ (g + b·wide) or Σ s_u g; masters
  4 and moments 2 state bytes per element kept) plus the transients the replay sees: a piece's
  gradient dict until folded, a unit's whole gradient from its first piece to its reduce-scatter,
  the units gathered at once, a collective's output before it is consumed, the send copy and
  receive buffer of every ring round in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from refpar import holdings
from refpar.comm import cost
from refpar.sharding import shard_sizes

ENDS = ("wte", "root")


@dataclass(frozen=True)
class Unit:
    size: int  # Ψ_u
    counts: tuple[int, ...]  # every group rank's s_u
    rank: int  # this rank's place in the unit's group
    axis: str  # the group's name in the trace

    @property
    def shard(self) -> int:
        return self.counts[self.rank]

    @property
    def n(self) -> int:
        return len(self.counts)


@dataclass(frozen=True)
class StageUnits:
    """One stage of the rank: its ends' units, its blocks' units (layer order) and the elements of
    the gradient dict each piece's backward returns."""

    first: bool
    last: bool
    ends: tuple[str, ...]
    blocks: tuple[tuple[str, ...], ...]
    head_grads: int  # wte's and ln_f's
    embed_grads: int  # wte's and wpe's


@dataclass(frozen=True)
class Precision:
    b: int  # bytes of a parameter element
    g: int  # of a gradient element
    state: int  # of a master or moment element
    mixed: bool  # fp32 master weights kept
    moments: int  # 2 for AdamW, 0 for SGD
    loss_scaling: bool = False  # fp16: the ranks holding different gradients agree on an overflow
    lowp: bool = True  # with g > b, the 16-bit gradients stay beside the accumulator (holdings.keeps_lowp)

    @property
    def wide(self) -> bool:
        """The 16-bit gradients backward writes are kept beside the wider accumulator."""
        return self.g != self.b and self.lowp


@dataclass
class RankUnits:
    """What a rank holds and runs: its units in layout order, its stages, its schedule row (actions
    or None), the (stage, microbatch) pairs whose backward is split into B and W, and per unit the
    backwards in a step that complete it (m; 2m for a V's wte, which two stages hold; DualPipe's
    blocks m/2, each stage running its copy's half of the microbatches)."""

    units: dict[str, Unit]
    stages: dict[int, StageUnits]
    row: list
    split: frozenset
    uses: dict[str, int]
    names: list  # (unit, parameter, elements) of every parameter, in layout order
    fused: bool = False  # tensor-parallel pieces: B computes the weight gradients too, W nothing


def buckets(ru: RankUnits, bucket_elems: int) -> list[tuple[int, frozenset]]:
    """DP's buckets as (elements, units) in the order backward completes them (holdings.buckets)."""
    params = [(unit, n, ru.units[unit].axis) for unit, _, n in ru.names]
    return [(b - a, members) for a, b, members in holdings.buckets(params, bucket_elems)]


def _ring_rounds(counts, rank: int, reduce: bool, itemsize: int) -> list[int]:
    """Bytes of the send copy and the receive buffer of each round of refpar/parallel/ring.py."""
    p = len(counts)
    out = []
    for k in range((2 if reduce else 1) * (p - 1)):
        if reduce and k < p - 1:
            send, recv = (rank - k - 1) % p, (rank - k - 2) % p
        else:
            j = k - (p - 1) if reduce else k
            send, recv = (rank - j) % p, (rank - j - 1) % p
        out.append((counts[send] + counts[recv]) * itemsize)
    return out


def replay(ru: RankUnits, plan, pr: Precision, stepped: bool = True) -> tuple[dict, dict, list]:
    """(transient peaks {"params", "grads", "comm"} in bytes above the persistent states,
    collectives {(axis, op): (sent, recv)} of one step, and the same as a list of (axis, op, what,
    Bytes) in the order the rank calls them) for `plan.strategy` (dp, zero1-3, fsdp) with its
    options (refpar.config.Plan's: DP's buckets, overlapped; FSDP's prefetch and reshard after
    forward); `stepped`: the optimizer stepped (ZeRO-1/2 gather only then)."""
    strategy, prefetch, reshard = plan.strategy, plan.prefetch, plan.reshard_after_forward
    bucket_list = buckets(ru, plan.bucket_elems) if strategy == "dp" else ()
    U, stage3 = ru.units, strategy in ("zero3", "fsdp")
    peak = {"params": 0, "grads": 0, "comm": 0}
    now = {"params": 0, "grads": 0, "comm": 0}
    moved: dict[tuple[str, str], tuple[int, int]] = {}
    calls: list[tuple] = []

    def move(axis, op, b, what=""):
        cost.add(moved, (axis, op), b)
        calls.append((axis, op, what, b))

    def hold(cat, n):  # n bytes allocated (negative: freed)
        now[cat] += n
        peak[cat] = max(peak[cat], now[cat])

    gathered, holders, rings = set(), {u: set() for u in U}, {}  # rings: unit -> [rounds left]
    waiting = dict(ru.uses)
    unit_grads = set()
    flight, sent = [], set()  # DP overlap: [bytes of each round left] per bucket in flight
    single = any(s.first and s.last for s in ru.stages.values())  # one stage holds both ends

    def holds(u, phase):
        if strategy == "fsdp" and u not in ENDS:
            return phase == "fwd" and not reshard
        return phase == "head:fwd" or (strategy == "fsdp" and phase == "embed:fwd" and single)

    def finish_ring(u):
        rounds = rings.pop(u)
        hold("comm", -rounds[0])
        for r in rounds[1:]:
            hold("comm", r)
            hold("comm", -r)

    def acquire(units, phase, key, following):
        for u in units:
            if u in rings:
                finish_ring(u)
        if not stage3:
            return
        for u in units:
            if u not in gathered:
                gathered.add(u)
                move(U[u].axis, "all_gather", cost.all_gather_bytes(list(U[u].counts), U[u].rank, pr.b),
                     f"{u}:params:{phase}")
                hold("params", U[u].size * pr.b)
            if holds(u, phase):
                holders[u].add(key)
        if prefetch:
            for u in following:
                if u not in ENDS and u not in gathered:
                    gathered.add(u)
                    hold("params", U[u].size * pr.b)
                    rounds = _ring_rounds(U[u].counts, U[u].rank, False, pr.b)
                    b = cost.all_gather_bytes(list(U[u].counts), U[u].rank, pr.b)
                    move(U[u].axis, "isend", cost.Bytes(b.sent, 0), f"{u}:params:{phase}")
                    move(U[u].axis, "irecv", cost.Bytes(0, b.recv), f"{u}:params:{phase}")
                    if rounds:
                        rings[u] = rounds
                        hold("comm", rounds[0])

    def release(units, phase, key):
        if not stage3:
            return
        for u in units:
            if phase.endswith("bwd"):
                holders[u].discard(key)
            if not holders[u] and u in gathered:
                gathered.discard(u)
                hold("params", -U[u].size * pr.b)

    def fold(units, elems):
        hold("grads", elems * pr.b)  # the piece's dict
        for u in units:
            if strategy in ("zero2", "zero3", "fsdp") and u not in unit_grads:
                unit_grads.add(u)
                hold("grads", U[u].size * (pr.g + pr.b * pr.wide))
        hold("grads", -elems * pr.b)

    def done(units):
        complete = []
        for u in units:
            waiting[u] -= 1
            last = waiting[u] == 0
            if strategy in ("zero2", "zero3", "fsdp") or (strategy == "zero1" and last):
                rs = cost.reduce_scatter_bytes(U[u].size, U[u].n, U[u].rank, pr.g)
                move(U[u].axis, "reduce_scatter", rs, f"{u}:grads")
                hold("comm", U[u].shard * pr.g)
                if u in unit_grads:
                    unit_grads.discard(u)
                    hold("grads", -U[u].size * (pr.g + pr.b * pr.wide))
                hold("comm", -U[u].shard * pr.g)
            complete += [u] * last
        if strategy == "dp" and complete:
            advance()
            finished = {u for u, left in waiting.items() if left == 0}
            for i, (n, members) in enumerate(bucket_list):
                if i in sent or not members <= finished:
                    continue
                sent.add(i)
                unit = U[next(iter(members))]
                if unit.n == 1:
                    continue
                b = cost.all_reduce_bytes(n, unit.n, unit.rank, pr.g)
                if plan.overlap:
                    move(unit.axis, "isend", cost.Bytes(b.sent, 0), f"bucket.{i}:grad")
                    move(unit.axis, "irecv", cost.Bytes(0, b.recv), f"bucket.{i}:grad")
                    rounds = overlap_rounds(n, unit)
                    flight.append(rounds)
                    hold("comm", rounds[0])
                else:
                    move(unit.axis, "all_reduce", b, f"bucket.{i}:grad")
                    hold("comm", n * pr.g)
                    hold("comm", -n * pr.g)

    def advance():
        for rounds in flight:
            hold("comm", -rounds.pop(0))
            if rounds:
                hold("comm", rounds[0])
        flight[:] = [r for r in flight if r]

    def overlap_rounds(n, unit):
        return _ring_rounds(shard_sizes(n, unit.n), unit.rank, True, pr.g)

    for a in (c for x in ru.row if x is not None for c in x.computations()):  # an F&B: its F, then B
        s, key = ru.stages[a.stage], (a.stage, a.microbatch)
        blocks = list(s.blocks)
        if a.kind == "F":
            pieces = ([(s.ends, "embed:fwd")] if s.first else []) + [(b, "fwd") for b in blocks] \
                + ([(s.ends, "head:fwd")] if s.last else [])
            for j, (units, phase) in enumerate(pieces):
                acquire(units, phase, key, pieces[j + 1][0] if j + 1 < len(pieces) else ())
                release(units, phase, key)
            continue
        # each piece's (units folded into, gradient elements, units it completes), in backward order;
        # on a first stage the embedding completes the ends the head folded into
        grads = ([(s.ends, s.head_grads, () if s.first else s.ends)] if s.last else []) + [
            (b, sum(U[u].size for u in b), b) for b in reversed(blocks)] + (
            [(s.ends, s.embed_grads, s.ends)] if s.first else [])
        if a.kind == "B":
            pieces = ([(s.ends, "head:bwd")] if s.last else []) + [(b, "bwd") for b in reversed(blocks)]
            now_w = ru.fused or key not in ru.split  # else W folds them
            for j, (units, phase) in enumerate(pieces):
                acquire(units, phase, key, pieces[j + 1][0] if j + 1 < len(pieces) else ())
                release(units, phase, key)
                if now_w:
                    fold(*grads[j][:2])
                    done(grads[j][2])
            if s.first and now_w:
                fold(*grads[-1][:2])
                done(grads[-1][2])
        if a.kind == "W" and not ru.fused:
            for units, elems, completed in grads:
                fold(units, elems)
                done(completed)
    while flight:
        advance()
    if strategy in ("zero1", "zero2") and stepped:  # every updated unit gathered into the whole
        for name, u in U.items():
            ag = cost.all_gather_bytes(list(u.counts), u.rank, pr.b)
            move(u.axis, "all_gather", ag, f"{name}:params:step")
            hold("comm", u.size * pr.b)
            hold("comm", -u.size * pr.b)
    return peak, moved, calls


def state_bytes(ru: RankUnits, strategy: str, pr: Precision) -> dict[str, int]:
    """Persistent bytes per category between steps."""
    psi = sum(u.size for u in ru.units.values())
    s = sum(u.shard for u in ru.units.values())
    stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[strategy]
    state = pr.state * (psi if stage == 0 else s)  # one fp32 (or full-precision) copy
    return {"params": pr.b * (psi if stage < 3 else s),
            "grads": (pr.g + pr.b * pr.wide) * psi if stage < 2 else pr.g * s,
            "master": state if pr.mixed else 0,
            "optimizer": pr.moments * state}


def peak_bytes(ru: RankUnits, plan, pr: Precision, stepped: bool = True) -> dict[str, int]:
    """Peak bytes per category in a step: the persistent states plus the replay's transients."""
    states, (transient, _, _) = state_bytes(ru, plan.strategy, pr), replay(ru, plan, pr, stepped)
    return {c: states.get(c, 0) + transient.get(c, 0) for c in (*states, *transient)}
