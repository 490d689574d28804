"""V-shaped and bidirectional pipeline schedules: two stages on every rank.

    p  ranks    m  microbatches    S = 2p stages    M  peak activations per rank, in stages' units

The V placement (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): rank r holds
stage r and stage 2p-1-r. A microbatch goes down the ranks through stages 0..p-1 and comes back up
through p..2p-1, so the first and the last stage, the embedding and the tied head, share rank 0,
and every rank holds one early and one late stage: the activations a rank keeps, long-lived for its
early stage and short-lived for its late one, add up to about the same on every rank.

    zbv(p, m)        Qi et al. 2024, section 6 (ZB-V): the zero-bubble V, 1F1B's activation memory.
    v_half(p, m)     Qi et al. 2024b, "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024),
    v_min(p, m)      section 3: a building block repeated every 6 ticks; half and a third of 1F1B's
                     activation memory.
    dualpipev(p, m)  DeepSeek's DualPipe cut in half (Sea AI Lab's "cut-in-half"; deepseek-ai/DualPipe,
                     dualpipev.py): the V placement with overlapped forward-and-backward pairs.
    dualpipe(p, m)   DeepSeek-V3 technical report, section 3.2.1 (deepseek-ai/DualPipe, dualpipe.py):
                     two copies of the model fed from both ends of the pipeline.

Every builder returns a grid (simulate.unit_grid: each action at the tick it starts when every
action takes one tick), which validate, simulate, stored and format_grid read like any other
schedule; builders.BUILDERS names them for `build`. What their papers publish: published.py.
"""

from __future__ import annotations

import numpy as np

from refpar.config import ConfigError
from refpar.schedules import Action, Schedule, StageMap, check_sizes, overlapped
from refpar.schedules.simulate import unit_grid


def v_stages(p: int, rank: int) -> tuple[int, int]:
    """The two stages of `rank` in the V placement: its early stage going down, its late one
    coming back up."""
    return rank, 2 * p - 1 - rank


def v_placement(p: int) -> dict[int, int]:
    """Stage -> rank for 2p stages in a V: stages r and 2p-1-r on rank r."""
    return {s: min(s, 2 * p - 1 - s) for s in range(2 * p)}


class _Order:
    """One rank's list of actions, each stage's passes taking the microbatches in turn."""

    def __init__(self, first: dict[int, int] | None = None):
        self.actions: list[Action] = []
        self.first = first or {}  # stage -> its first microbatch (DualPipe's second copy: m/2)
        self.taken: dict[tuple[int, str], int] = {}

    def next(self, stage: int, kind: str) -> Action:
        i = self.taken.get((stage, kind), self.first.get(stage, 0))
        self.taken[stage, kind] = i + 1
        return Action(stage, kind, i)

    def add(self, stage: int, kind: str) -> Action:
        a = self.next(stage, kind)
        self.actions.append(a)
        return a

    def count(self, stage: int, kind: str) -> int:
        return self.taken.get((stage, kind), self.first.get(stage, 0)) - self.first.get(stage, 0)


# ---------------------------------------------------------------- ZB-V

def zbv(p: int, m: int) -> Schedule:
    """Qi et al.'s ZB-V (section 6, figure 8), rank r with its stages down = r and up = 2p-1-r:
    warm-up, 2(p-r)-1 forwards down, r pairs (F up, F down), p-r triples (F up, B up, W up);
    steady state, (F down, B down, W down, F up, B up, W up) per microbatch; cool-down, r pairs
    (B down, B up), p-r pairs (B down, W down), then the W's left. With F = B = W a rank never
    idles between its first and its last action once m >= 2p-1, and it holds at most 2p stage
    activations, p microbatches of its two stages: 1F1B's peak. With fewer microbatches the
    pattern is built for 2p-1 and the missing ones are left out, as torch's ScheduleZBVZeroBubble
    does."""
    check_sizes(p, m)
    n = max(m, 2 * p - 1)
    orders = {}
    for r in range(p):
        down, up = v_stages(p, r)
        o = _Order()
        for _ in range(2 * (p - r) - 1):
            o.add(down, "F")
        for _ in range(r):
            o.add(up, "F"), o.add(down, "F")
        for _ in range(p - r):
            o.add(up, "F"), o.add(up, "B"), o.add(up, "W")
        while o.count(down, "F") < n or o.count(up, "F") < o.count(down, "F"):
            if o.count(down, "F") < n:
                o.add(down, "F")
            o.add(down, "B"), o.add(down, "W"), o.add(up, "F"), o.add(up, "B"), o.add(up, "W")
        for _ in range(r):
            o.add(down, "B"), o.add(up, "B")
        for _ in range(p - r):
            o.add(down, "B"), o.add(down, "W")
        for stage in (up, down):
            while o.count(stage, "W") < o.count(stage, "B"):
                o.add(stage, "W")
        orders[r] = [a for a in o.actions if a.microbatch < m]
    return unit_grid(orders)


# ---------------------------------------------------------------- V-Half and V-Min from a building block

# The building block of Qi et al. 2024b (section 3): the ticks at which rank r runs microbatch 0's
# four passes (F down, F up, B up, B down); microbatch j runs them 6j ticks later, and W's take the
# free ticks. A rank does six passes per microbatch (F, B and W on two stages), so a block repeated
# every 6 ticks keeps every rank busy in the steady state, and needs its four ticks distinct modulo
# 6 on every rank. Peak memory is set by the lifespans: a microbatch's activations stay on a rank
# from its F to its W, and a block whose passes step fewer ticks from rank to rank lives shorter.

def v_min_block(p: int, r: int) -> tuple[int, int, int, int]:
    """Every pass steps one tick per rank, the tightest V: F down reaches rank r at r, F up at
    2p-1-r, B up at 2p+r, B down at 4p-1-r. Where 3 divides p, B up would share its tick modulo 6
    with F down, and B down with F up (2p = 0 mod 6), so both backward passes start 2 ticks later.
    A rank's two lifespans add up to about 4p ticks (4p-1-2r for its early stage, 2r+1 for its late
    one); with a microbatch every 6 ticks it holds 4p/6 = 2p/3 stages' activations, p/3
    microbatches of its two stages: a third of 1F1B's p."""
    gap = 2 if p % 3 == 0 else 0
    return r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p - 1 + gap - r


def v_half_block(p: int, r: int) -> tuple[int, int, int, int]:
    """The passes going down step two ticks per rank and those going up one: F down at 2r, F up
    at 3p-2-r, B up at 3p-1+2r, B down at 6p-2-r, a tick later than it could, because at 6p-3-r it
    would share its tick modulo 6 with F down on odd ranks. Where p is even, F up and B down would
    share theirs (3p = 0 mod 6), so both backward passes start 3 ticks later. A rank's lifespans add
    up to about 6p ticks (6p-2-3r and 3r+1): p stages' activations, p/2 microbatches, half of
    1F1B's p."""
    gap = 3 if p % 2 == 0 else 0
    return 2 * r, 3 * p - 2 - r, 3 * p - 1 + gap + 2 * r, 6 * p - 2 + gap - r


FREE, FORWARD, BACKWARD = 0, 1, 2  # what a rank's tick holds, in from_block's arrays


def _held_peak(at: np.ndarray) -> int:
    """A rank's peak of stored activations (stage units: +1 at an F, -1 at its W) when `at[t]`
    says what tick t runs (FREE, FORWARD or BACKWARD) and each free tick runs the oldest W
    waiting. The W's are a queue that B's fill and free ticks serve, so by the end of tick t the
    W's run are free(t) + min(0, min over u < t of b(u) - free(u)), with free(u) and b(u) the free
    ticks and the B's in ticks 0..u (Lindley's recursion, unrolled)."""
    free = np.cumsum(at == FREE)
    b = np.cumsum(at == BACKWARD)
    slack = np.minimum.accumulate(np.concatenate(([0], (b - free)[:-1])))  # (T,)
    held = np.cumsum(at == FORWARD) - (free + slack)  # (T,)
    return int(held.max(initial=0))


def _with_weights(ticks: dict[Action, int]) -> list[Action]:
    """A rank's list: its F's and B's in tick order, the oldest waiting W in each free tick."""
    order: list[Action] = []
    waiting: list[Action] = []
    last = -1
    for t, a in sorted((t, a) for a, t in ticks.items()):
        ran = min(len(waiting), t - last - 1)
        order += waiting[:ran]
        del waiting[:ran]
        order.append(a)
        if a.kind == "B":
            waiting.append(Action(a.stage, "W", a.microbatch))
        last = t
    return order + waiting


def from_block(p: int, m: int, block) -> Schedule:
    """Qi et al. 2024b's three steps (section 3 and appendix): repeat the block every 6 ticks for
    m microbatches; move each F and B, in tick order, to the earliest free tick after its inputs
    (and after the same pass of the microbatch before) where its rank's peak memory does not grow,
    which closes the gaps the repetition leaves in the warm-up and the cool-down; put each W in a
    free tick; then squeeze, every action as early as its rank's order allows."""
    check_sizes(p, m)
    stage_rank = v_placement(p)
    smap = StageMap(stage_rank, m, frozenset((s, i) for s in stage_rank for i in range(m)))
    ticks: dict[int, dict[Action, int]] = {}
    for r in range(p):
        if len({t % 6 for t in block(p, r)}) < 4:
            raise ValueError(f"the block's ticks {block(p, r)} on rank {r} share a tick modulo 6")
        down, up = v_stages(p, r)
        passes = ((down, "F"), (up, "F"), (up, "B"), (down, "B"))
        ticks[r] = {Action(s, kind, j): t + 6 * j
                    for j in range(m) for (s, kind), t in zip(passes, block(p, r), strict=True)}
    span = max(t for row in ticks.values() for t in row.values()) + 1
    at = {r: np.zeros(span, dtype=np.int8) for r in ticks}  # (span,) FREE, FORWARD or BACKWARD
    for r, row in ticks.items():
        for a, t in row.items():
            at[r][t] = FORWARD if a.kind == "F" else BACKWARD
    cap = max(map(_held_peak, at.values()))
    for start, r, a in sorted((t, r, a) for r, row in ticks.items() for a, t in row.items()):
        own, mine = ticks[r], at[r]
        after = [ticks[stage_rank[n.stage]][n] for n in smap.inputs(a)]
        if a.microbatch > 0:
            after.append(own[Action(a.stage, a.kind, a.microbatch - 1)])
        earliest = max(after, default=-1) + 1
        for t in earliest + np.flatnonzero(mine[earliest:start] == FREE):
            mine[t], mine[start] = mine[start], FREE
            if _held_peak(mine) <= cap:
                own[a] = int(t)
                break
            mine[start], mine[t] = mine[t], FREE
    return unit_grid({r: _with_weights(row) for r, row in ticks.items()})


def v_half(p: int, m: int) -> Schedule:
    """V-Half: (p+2)//2 microbatches of activations per rank at most, about half of 1F1B's p."""
    return from_block(p, m, v_half_block)


def v_min(p: int, m: int) -> Schedule:
    """V-Min: (p+4)//3 microbatches of activations per rank at most, about a third of 1F1B's p."""
    return from_block(p, m, v_min_block)


# ---------------------------------------------------------------- DualPipe and DualPipeV

def _dualpipe_order(o: _Order, h: int, P: int, M: int, stage0: int, stage1: int) -> list[Action]:
    """The eight steps of deepseek-ai/DualPipe's step() on one rank, h ranks from its end of a
    pipeline of P, M microbatches through each of its two stages; `stage0` is the stage its first
    forwards go through, `stage1` the other. An F&B pair is one action: a forward and a full
    backward (DualPipe overlaps the two chunks); a split backward (B with a W later, "zero bubble")
    queues its W, and each W step runs the oldest."""
    weights: list[Action] = []

    def backward(stage: int, split: bool) -> None:
        b = o.add(stage, "B")
        if split:
            weights.append(Action(stage, "W", b.microbatch))

    def weight() -> None:
        if weights:
            o.actions.append(weights.pop(0))

    def pair(forward_stage: int, backward_stage: int) -> None:
        o.actions.append(overlapped(o.next(forward_stage, "F"), o.next(backward_stage, "B")))

    middle = h == P - 1
    for _ in range(2 * (P - h - 1)):  # 1: forwards through the first stage
        o.add(stage0, "F")
    for _ in range(h + 1):  # 2: forwards through both
        o.add(stage0, "F"), o.add(stage1, "F")
    for _ in range(P - h - 1):  # 3: B, W, F on the second stage, backward split
        backward(stage1, True), weight(), o.add(stage1, "F")
    for i in range(M - 2 * P + h + 1):  # 4: the steady state, two overlapped pairs per microbatch
        if i == 0 and middle:  # DualPipe does not overlap the middle rank's first pair
            o.add(stage0, "F"), backward(stage1, False)
        else:
            pair(stage0, stage1)
        pair(stage1, stage0)
    for _ in range(P - h - 1):  # 5: B on the second stage, then a pair
        backward(stage1, False), pair(stage1, stage0)
    split = False
    for i in range(h + 1):  # 6: the last backwards, split from the middle of the step on
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        backward(stage1, split)
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        backward(stage0, split)
    for _ in range(P - h - 1):  # 7: W, then a split B on the first stage
        weight(), backward(stage0, True)
    for _ in range(h + 1):  # 8: the W's left
        weight()
    return o.actions


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipe cut in half: p ranks in a V (2p stages), rank r runs DualPipe's steps as rank r of
    a pipeline of p. Needs m >= 2p (DualPipe's step() asserts num_chunks >= 2 * num_ranks).
    DeepSeek's README: bubble (PP/2-1)(F&B + B - 3W) with PP = 2p stages, activations of PP+1
    stages per rank, on PP/2 devices."""
    check_sizes(p, m)
    if m < 2 * p:
        raise ConfigError(f"dualpipev needs at least 2p = {2 * p} microbatches, got m={m}; use "
                          f"--microbatches {2 * p} or more")
    return unit_grid({r: _dualpipe_order(_Order(), r, p, m, *v_stages(p, r)) for r in range(p)})


def dualpipe(p: int, m: int) -> Schedule:
    """Bidirectional DualPipe on p ranks (p even) with two copies of the model: copy 0's part k is
    stage k on rank k, copy 1's part k is stage p+k on rank p-1-k (so rank r holds stages r and
    2p-1-r, the V placement, and twice 1F1B's parameters). Microbatches 0..m/2-1 enter copy 0 at
    rank 0 and m/2..m-1 enter copy 1 at rank p-1. A rank in the first half of the pipeline sends
    its first forwards through copy 0, one in the second half through copy 1; each runs DualPipe's
    steps as rank min(r, p-1-r) of a half pipeline of p/2 ranks. Needs m even and >= 2p. README:
    bubble (PP/2-1)(F&B + B - 3W) with PP = p, activations of PP+1 stages per rank."""
    check_sizes(p, m)
    if p % 2:
        raise ConfigError(f"dualpipe feeds the pipeline from both ends and needs an even number of "
                          f"ranks, got p={p}; use p in {{{p - 1}, {p + 1}}}")
    if m % 2 or m < 2 * p:
        raise ConfigError(f"dualpipe splits the microbatches between its two copies and needs m even "
                          f"and at least 2p = {2 * p}, got m={m}; use --microbatches {max(2 * p, m + m % 2)}")
    orders = {}
    for r in range(p):
        mine, theirs = r, 2 * p - 1 - r  # copy 0's stage, copy 1's stage
        first = {theirs: m // 2}  # copy 1 takes the second half of the microbatches
        stage0, stage1 = (mine, theirs) if r < p // 2 else (theirs, mine)
        orders[r] = _dualpipe_order(_Order(first), min(r, p - 1 - r), p // 2, m // 2, stage0, stage1)
    return unit_grid(orders)
