"""Pipeline schedules as data: who runs which forward and backward, in what order.

    p  ranks (pipeline stages per model copy)      m  microbatches per optimizer step
    v  model chunks per rank (interleaved: any; V-shaped and bidirectional: 2)
    S  stages in all, S = p * v: stage = chunk*p + rank in a loop, stages r and 2p-1-r on rank r in a V

An `Action(stage, kind, microbatch)` prints as `"1F0"`: stage 1 runs the forward of microbatch 0.
Kinds: `F` forward; `B` backward for the input gradient, or the full backward (input and weight
gradients) where the schedule has no `W` for that stage and microbatch; `W` the weight gradient
(zero-bubble schedules split B from W because W is needed by nobody downstream). An overlapped
`F&B` action (DualPipe) runs one forward and one backward, its `parts`, as one slot: "0F5&7B2".

A schedule is `dict[rank, list[Action | None]]`: one list per rank, `None` an idle tick. The
builders return *grids*: each action sits at the tick where it can start when every action takes
one tick and transfers are free, so `format_grid` draws the unit-cost picture of the papers.

    gpipe(p, m)                 Huang et al. 2019: all forwards, then all backwards.
    one_f_one_b(p, m)           Narayanan et al. 2019 (PipeDream-flush): p-rank-1 warm-up forwards,
                                then one forward, one backward.
    interleaved_1f1b(p, m, v)   Narayanan et al. 2021: v chunks per rank, Megatron-LM's order.
    zb_h1(p, m), zb_h2(p, m)    Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.
    zbv, v-half, v-min, dualpipev, dualpipe   two stages per rank: schedules_v.py.

Dependencies (what "the input is ready" means):
    F(s, i) needs F(s-1, i)                     (the activation from the previous stage)
    B(s, i) needs F(s, i) and B(s+1, i)         (its own stored activations, the output gradient)
    W(s, i) needs B(s, i)                       (the output gradients B computed)
within one copy of the model: DualPipe's stages 0..p-1 and p..2p-1 are two (`Layout.copies`).

`validate(schedule)` runs every rank's list in order (the executor's semantics) and raises a
`ScheduleError` naming the first action that can never run: its input comes later on its own rank,
or every rank waits on another (a deadlock). `validate(schedule, ticks=True)` also checks the grid:
each action's inputs finish at an earlier tick. `simulate(schedule, costs)` times the schedule with
F, B, W and transfer costs and returns a `Timeline` (slots per rank, idle intervals, makespan).
`stored` replays what each rank keeps for backward (counts, or bytes), `critical_path_gap` bounds
how far an executed timeline may be from its simulation. `to_csv` and `from_csv` write and read
torch.distributed.pipelining's schedule CSV. `refpar schedule 1f1b -p 3 -m 4` prints:

    tick    0   1   2   3   4   5   6   7   8   9   10  11
    rank 0  0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3
    rank 1  .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .
    rank 2  .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .
"""

from __future__ import annotations

import csv
import io
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from refpar.config import ConfigError

KINDS = ("F", "B", "W")
ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1", "zb-h2")  # the others hold 2 (or v) stages per rank
OVERLAP = "F&B"  # a forward and a backward run as one action (DualPipe's overlapped chunk pair)


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str  # "F", "B", "W", or OVERLAP: then `parts` holds the two and stage, microbatch are -1
    microbatch: int
    parts: tuple[Action, ...] = ()  # OVERLAP only: the forward, then the backward, run in that order

    def __str__(self) -> str:
        if self.parts:
            return "&".join(map(str, self.parts))  # "0F5&7B2", DualPipe's F&B
        return f"{self.stage}{self.kind}{self.microbatch}"

    def computations(self) -> tuple[Action, ...]:
        """The F, B and W this action runs: itself, or an overlapped action's two parts."""
        return self.parts or (self,)


def overlapped(forward: Action, backward: Action) -> Action:
    """DualPipe's F&B: the forward of one microbatch and the backward of another as one action.
    The executor runs the forward and then the backward; the simulator charges one slot of
    max(F, B) or F + B (`Costs.overlap`)."""
    return Action(-1, OVERLAP, -1, (forward, backward))


Schedule = dict[int, list[Action | None]]


class ScheduleError(ConfigError):
    """A schedule that cannot run; `rank` and `tick` locate the offending action in the grid."""

    def __init__(self, message: str, rank: int | None = None, tick: int | None = None):
        super().__init__(message)
        self.rank, self.tick = rank, tick


# ---------------------------------------------------------------- structure and dependencies

@dataclass(frozen=True)
class Layout:
    """What a schedule implies: which rank owns each stage, how many microbatches, which
    (stage, microbatch) pairs split their backward into B and W, and how many copies of the model
    the stages hold (DualPipe's 2: stages 0..S/2-1 are one copy and take the first half of the
    microbatches, S/2..S-1 the other copy and the second half; 1 for every other schedule)."""

    stage_rank: dict[int, int]
    n_microbatches: int
    split: frozenset[tuple[int, int]]
    copies: int = 1

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @cached_property
    def stages_per_copy(self) -> int:
        """The model's parts: each copy cuts the model into this many stages."""
        return self.n_stages // self.copies

    def part(self, stage: int) -> int:
        """Which part of the model (which blocks) `stage` runs: 0 holds the embedding, the last
        part the head."""
        return stage % self.stages_per_copy

    def microbatches(self, stage: int) -> range:
        """The microbatches that go through `stage`: all of them, or its copy's share."""
        share = self.n_microbatches // self.copies
        copy = stage // self.stages_per_copy
        return range(copy * share, (copy + 1) * share)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` runs, lowest first."""
        return sorted(s for s, r in self.stage_rank.items() if r == rank)

    @property
    def tied_apart(self) -> bool:
        """Whether the tied embedding's two ends, the first part's wte and the last part's head,
        sit on two ranks whose gradients must be summed: in a loop (ranks 0 and p-1). Not in a V,
        where rank 0 holds both, nor in DualPipe, whose copies' sum covers them."""
        return self.copies == 1 and self.stage_rank[0] != self.stage_rank[self.n_stages - 1]

    def chunk(self, stage: int) -> int:
        """Which of its rank's stages `stage` is, counted from the lowest: 0 or 1 in a V."""
        rank = self.stage_rank[stage]
        return sorted(s for s, r in self.stage_rank.items() if r == rank).index(stage)

    def inputs(self, a: Action) -> list[Action]:
        if a.parts:  # an overlapped pair waits for what either part waits for
            return [n for part in a.parts for n in self.inputs(part) if n not in a.parts]
        if a.kind == "F":
            return [Action(a.stage - 1, "F", a.microbatch)] if self.part(a.stage) > 0 else []
        if a.kind == "B":
            later = ([Action(a.stage + 1, "B", a.microbatch)]
                     if self.part(a.stage) < self.stages_per_copy - 1 else [])
            return [Action(a.stage, "F", a.microbatch), *later]
        return [Action(a.stage, "B", a.microbatch)]


def layout(schedule: Schedule) -> Layout:
    """Checks the shape of a schedule (ranks 0..p-1, each stage on one rank, every stage and
    microbatch with exactly one F and one B and at most one W) and returns its `Layout`."""
    if sorted(schedule) != list(range(len(schedule))) or not schedule:
        raise ScheduleError(f"schedule ranks are {sorted(schedule)}; they must be 0..p-1")
    stage_rank: dict[int, int] = {}
    seen: set[Action] = set()
    for rank, row in schedule.items():
        for tick, a in enumerate(row):
            if a is None:
                continue
            where = f"rank {rank} tick {tick}: {a}"
            if a.kind == OVERLAP and [part.kind for part in a.parts] != ["F", "B"]:
                raise ScheduleError(f"{where} overlaps {len(a.parts)} actions; an overlapped action "
                                    "is one F and then one B", rank, tick)
            for c in a.computations():
                if c.kind not in KINDS or c.stage < 0 or c.microbatch < 0:
                    raise ScheduleError(f"{where} is not an action; use kinds F, B, W and indices >= 0",
                                        rank, tick)
                if stage_rank.setdefault(c.stage, rank) != rank:
                    raise ScheduleError(f"{where} puts stage {c.stage} on rank {rank}, but rank "
                                        f"{stage_rank[c.stage]} runs it too; a stage lives on one rank",
                                        rank, tick)
                if c in seen:
                    raise ScheduleError(f"rank {rank} tick {tick}: {c} appears twice; run each action "
                                        "once", rank, tick)
                seen.add(c)
    if not seen:
        raise ScheduleError("the schedule has no actions")
    n_stages = max(stage_rank) + 1
    m = max(a.microbatch for a in seen) + 1
    split = frozenset((a.stage, a.microbatch) for a in seen if a.kind == "W")
    lay = Layout(stage_rank, m, split, _copies(seen, n_stages, m))
    for s in range(n_stages):
        for i in lay.microbatches(s):
            for kind in "FB":
                if Action(s, kind, i) not in seen:
                    raise ScheduleError(f"the schedule never runs {Action(s, kind, i)}; every stage "
                                        f"needs an F and a B for each of the {m} microbatches")
    stray = [a for a in seen if a.microbatch not in lay.microbatches(a.stage)]
    if stray:
        a = min(stray)
        share = lay.microbatches(a.stage)
        raise ScheduleError(f"the schedule runs {a}, but stage {a.stage} belongs to the copy of the "
                            f"model that takes microbatches {share.start}..{share.stop - 1}")
    return lay


def _copies(seen: set[Action], n_stages: int, m: int) -> int:
    """2 where stage 0 runs the first half of the microbatches and stage S/2 the second half (the
    two copies of DualPipe), else 1: then every stage must run every microbatch."""
    def forwards(stage: int) -> set[int]:
        return {a.microbatch for a in seen if a.stage == stage and a.kind == "F"}

    half = m // 2
    if m % 2 == 0 and n_stages % 2 == 0 and forwards(0) == set(range(half)) \
            and forwards(n_stages // 2) == set(range(half, m)):
        return 2
    return 1


# ---------------------------------------------------------------- running the lists in order

@dataclass(frozen=True)
class Slot:
    """One action as timed: rank, its position in the rank's list, start and end."""

    rank: int
    tick: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Transfer:
    """A point-to-point message: `action`'s output (an activation or a gradient) from src to dst."""

    action: Action
    src: int
    dst: int
    start: float
    end: float


@dataclass
class Timeline:
    slots: dict[int, list[Slot]]
    transfers: list[Transfer]
    makespan: float
    idle: dict[int, list[tuple[float, float]]] = field(init=False)

    def __post_init__(self) -> None:
        self.idle = {}
        for rank, slots in self.slots.items():
            gaps, t = [], 0.0
            for slot in sorted(slots, key=lambda s: s.start):
                if slot.start > t:
                    gaps.append((t, slot.start))
                t = max(t, slot.end)
            if t < self.makespan:
                gaps.append((t, self.makespan))
            self.idle[rank] = gaps

    def idle_time(self, rank: int) -> float:
        return sum(end - start for start, end in self.idle[rank])

    def busy_time(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.slots[rank])

    def inner_idle_time(self, rank: int) -> float:
        """Idle time between the rank's first start and its last end: what remains of the bubble
        when steps follow each other back to back (Qi et al.'s "steady state")."""
        first = min(s.start for s in self.slots[rank])
        last = max(s.end for s in self.slots[rank])
        return sum(max(0.0, min(e, last) - max(s, first)) for s, e in self.idle[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all rank-time: (p-1)/(m+p-1) for GPipe and 1F1B with uniform costs."""
        return sum(map(self.idle_time, self.slots)) / (len(self.slots) * self.makespan)

    @property
    def bubble_over_ideal(self) -> float:
        """Idle over compute time, Narayanan et al.'s form: (p-1)/m for 1F1B, (p-1)/(v*m) for
        interleaved 1F1B with uniform costs."""
        return sum(map(self.idle_time, self.slots)) / sum(map(self.busy_time, self.slots))


def _run(schedule: Schedule, lay: Layout, duration: Callable[[int, int, Action], float],
         p2p: float) -> Timeline:
    """Runs each rank's list in order, each action as soon as its rank is free and its inputs
    have arrived; raises ScheduleError naming the first action that can never run."""
    for rank, row in schedule.items():
        position = {c: t for t, a in enumerate(row) if a is not None for c in a.computations()}
        for tick, a in enumerate(row):
            for need in ([] if a is None else lay.inputs(a)):
                if lay.stage_rank.get(need.stage) == rank and position.get(need, -1) > tick:
                    raise ScheduleError(f"rank {rank} tick {tick}: {a} needs {need}, which rank "
                                        f"{rank} runs later at tick {position[need]}", rank, tick)
    done: dict[Action, Slot] = {}
    slots: dict[int, list[Slot]] = {r: [] for r in schedule}
    transfers: list[Transfer] = []
    pos, free = dict.fromkeys(schedule, 0), dict.fromkeys(schedule, 0.0)
    # A rank runs down its list until an input is missing, then waits on that input; finishing an
    # action wakes the ranks waiting on it. (The times do not depend on which rank goes first.)
    waiting: dict[Action, list[int]] = {}
    awake = deque(schedule)
    while awake:
        rank = awake.popleft()
        row = schedule[rank]
        while pos[rank] < len(row):
            a = row[pos[rank]]
            if a is not None:
                needs = lay.inputs(a)
                missing = next((n for n in needs if n not in done), None)
                if missing is not None:
                    waiting.setdefault(missing, []).append(rank)
                    break
                start = free[rank]
                for n in needs:
                    src = done[n].rank
                    arrive = done[n].end + (p2p if src != rank else 0.0)
                    if src != rank:
                        transfers.append(Transfer(n, src, rank, done[n].end, arrive))
                    start = max(start, arrive)
                slot = Slot(rank, pos[rank], a, start, start + duration(rank, pos[rank], a))
                done.update(dict.fromkeys(a.computations(), slot))
                slots[rank].append(slot)
                free[rank] = slot.end
                for c in a.computations():
                    awake.extend(waiting.pop(c, ()))
            pos[rank] += 1
    stuck = [(pos[r], r) for r in schedule if pos[r] < len(schedule[r])]
    if stuck:
        tick, rank = min(stuck)
        a = schedule[rank][tick]
        need = next(n for n in lay.inputs(a) if n not in done)
        owner = lay.stage_rank[need.stage]
        blocker = schedule[owner][pos[owner]]
        raise ScheduleError(f"rank {rank} tick {tick}: {a} would deadlock: it waits for {need} on "
                            f"rank {owner}, which is stuck at tick {pos[owner]} on {blocker}",
                            rank, tick)
    makespan = max((s.end for row in slots.values() for s in row), default=0.0)
    return Timeline(slots, transfers, makespan)


def _unit(rank: int, tick: int, a: Action) -> float:
    return 1.0


def validate(schedule: Schedule, ticks: bool = False) -> Layout:
    """Raises ScheduleError naming the first action whose input is not ready (or that would
    deadlock); with `ticks`, also the first action placed at a tick before its inputs finish."""
    lay = layout(schedule)
    _run(schedule, lay, _unit, 0.0)
    if ticks:
        tick_of = {c: t for row in schedule.values() for t, a in enumerate(row) if a is not None
                   for c in a.computations()}
        late = [(tick_of[n], t, r, a, n) for r, row in schedule.items() for t, a in enumerate(row)
                if a is not None for n in lay.inputs(a) if tick_of[n] >= t]
        if late:
            _, tick, rank, a, need = min(late, key=lambda x: (x[1], x[2]))
            raise ScheduleError(f"rank {rank} tick {tick}: {a} is placed before its input {need} "
                                f"is ready (tick {tick_of[need]} on rank {lay.stage_rank[need.stage]})",
                                rank, tick)
    return lay


OVERLAP_COSTS = ("sum", "max")


@dataclass(frozen=True)
class Costs:
    """Duration of each action kind and of one transfer. A full backward (B where the schedule
    has no W) costs B + W. Qi et al. take F = B = W; Narayanan et al. take B = 2F.

    `overlap` prices an overlapped F&B: "sum" charges F + B, what a device that runs the two one
    after the other takes (refpar's executor does); "max" charges max(F, B), DualPipe's premise
    that one chunk's computation hides the other's communication, so that at best the pair costs
    its longer part (DeepSeek-V3 report, section 3.2.1). B here is the part's own backward: B + W
    where it is a full backward."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    p2p: float = 0.0
    overlap: str = "sum"

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP_COSTS:
            raise ConfigError(f"overlap cost {self.overlap!r} is not one of {', '.join(OVERLAP_COSTS)}; "
                              "choose sum (F + B) or max (max(F, B))")


def simulate(schedule: Schedule, costs: Costs | None = None,
             durations: dict[tuple[int, int], float] | None = None) -> Timeline:
    """Times the schedule. `durations` (rank, tick) -> seconds overrides `costs` per action, e.g.
    with the times an executed run measured."""
    costs = costs or Costs()
    lay = layout(schedule)

    def compute(a: Action) -> float:
        if a.kind == "B" and (a.stage, a.microbatch) not in lay.split:
            return costs.B + costs.W
        return getattr(costs, a.kind)

    def duration(rank: int, tick: int, a: Action) -> float:
        if durations is not None:
            return durations[rank, tick]
        if a.parts:
            return (max if costs.overlap == "max" else sum)(map(compute, a.parts))
        return compute(a)

    return _run(schedule, lay, duration, costs.p2p)


def critical_path_gap(timeline: Timeline, schedule: Schedule) -> float:
    """Time on the timeline's critical path spent outside actions: walking back from the action
    that ends last, each step to the latest-ending of what it waited for (its rank's previous
    action, its inputs), summing the time between them (messages in flight, bookkeeping between
    actions, a rank waiting for a core). It bounds how far an executed timeline can be from the
    simulation of the same action durations: the chain's durations fit in the simulated makespan,
    and nothing runs earlier than the simulation allows, so
        0 <= measured makespan - simulated makespan <= critical_path_gap(measured)."""
    lay = layout(schedule)
    slot_of = {c: s for row in timeline.slots.values() for s in row for c in s.action.computations()}
    before: dict[Action, Slot] = {}
    for row in timeline.slots.values():
        ordered = sorted(row, key=lambda s: s.tick)
        before.update({b.action: a for a, b in zip(ordered, ordered[1:], strict=False)})
    current = max((s for row in timeline.slots.values() for s in row), key=lambda s: s.end)
    gap = timeline.makespan - current.end
    while True:
        waited = [slot_of[n] for n in lay.inputs(current.action)]
        waited += [before[current.action]] if current.action in before else []
        if not waited:
            return gap + current.start
        previous = max(waited, key=lambda s: s.end)
        gap += current.start - previous.end
        current = previous


def stored(schedule: Schedule, after_f: Callable[[Action], int] = lambda a: 1,
           after_b: Callable[[Action], int] = lambda a: 1) -> dict[int, list[int]]:
    """Per rank, the most stored for backward during each tick: `after_f(F)` from each F until its
    B, then `after_b(B)` until its W where the backward is split. With the defaults, the number of
    (stage, microbatch) pairs in flight; with bytes, the activation memory a run must measure. An
    overlapped F&B peaks between its parts: its forward's activations exist before its backward
    frees the other microbatch's (the executor runs them in that order; DualPipe overlaps them)."""
    lay = layout(schedule)
    held: dict[tuple[int, int], int] = {}
    out = {}
    for rank, row in schedule.items():
        total, trace = 0, []
        for a in row:
            most = total
            for c in () if a is None else a.computations():
                key = (c.stage, c.microbatch)
                total -= held.pop(key, 0)
                if c.kind == "F":
                    held[key] = after_f(c)
                elif c.kind == "B" and key in lay.split:
                    held[key] = after_b(c)
                total += held.get(key, 0)
                most = max(most, total)
            trace.append(most)
        out[rank] = trace
    return out


def peak_inflight_microbatches(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) pairs holding stored activations at once."""
    return {rank: max(trace, default=0) for rank, trace in stored(schedule).items()}


# ---------------------------------------------------------------- builders

def _check(p: int, m: int) -> None:
    if p < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got p={p}; use --stages 1 or more")
    if m < 1:
        raise ConfigError(f"a step needs at least one microbatch, got m={m}; use --microbatches 1 "
                          "or more")


def _grid(orders: dict[int, list[Action]]) -> Schedule:
    """Places each rank's ordered actions at the tick they start when every action takes one tick
    and transfers are free: the picture the papers draw."""
    timeline = _run(orders, layout(orders), _unit, 0.0)
    makespan = int(timeline.makespan)
    grid: Schedule = {r: [None] * makespan for r in orders}
    for rank, slots in timeline.slots.items():
        for slot in slots:
            grid[rank][int(slot.start)] = slot.action
    return grid


def gpipe(p: int, m: int) -> Schedule:
    _check(p, m)
    return _grid({r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                  for r in range(p)})


def one_f_one_b(p: int, m: int) -> Schedule:
    """Rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and one backward,
    so it holds at most min(p-r, m) microbatches' activations (GPipe holds m)."""
    _check(p, m)
    orders = {}
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Action(r, "F", i) for i in range(warm)]
        for k in range(m - warm):
            order += [Action(r, "F", warm + k), Action(r, "B", k)]
        orders[r] = order + [Action(r, "B", k) for k in range(m - warm, m)]
    return _grid(orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved order (schedules.py, forward_backward_pipelining_with_interleaving):
    microbatches go through a rank's chunks in groups of p; rank r warms up with
    2(p-r-1) + (v-1)p forwards (all of them when m == p), then alternates."""
    _check(p, m)
    if v < 2:
        raise ConfigError(f"interleaved 1F1B needs at least 2 chunks per rank, got v={v}; use "
                          "--chunks 2 or more, or the 1f1b schedule")
    if m % p:
        raise ConfigError(f"interleaved 1F1B needs the microbatches divisible by the stages (m={m}, "
                          f"p={p}); use m in {{{p}, {2 * p}, {3 * p}}}")
    total = m * v

    def action(k: int, kind: str, rank: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        return Action(chunk * p + rank, kind, group * p + within % p)

    orders = {}
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [action(k, "F", r) for k in range(warm)]
        for k in range(total - warm):
            order += [action(warm + k, "F", r), action(k, "B", r)]
        orders[r] = order + [action(k, "B", r) for k in range(total - warm, total)]
    return _grid(orders)


def zb_h1(p: int, m: int) -> Schedule:
    """1F1B with the backward split: rank r runs B as soon as it can and delays each W by r
    microbatches, so the W's fill the cool-down. Rank r holds full activations for at most p-r
    microbatches, as in 1F1B, and W inputs for up to r more: p in flight on every rank, 1F1B's
    peak (Qi et al., Table 2: p M_B). Bubble (p-1)(F+B-W) per rank instead of 1F1B's (p-1)(F+B+W).
    """
    _check(p, m)
    orders = {}
    for r in range(p):
        warm, lag = min(p - r, m), r
        order = [Action(r, "F", i) for i in range(warm)]
        for k in range(m):
            order.append(Action(r, "B", k))
            if k >= lag:
                order.append(Action(r, "W", k - lag))
            if warm + k < m:
                order.append(Action(r, "F", warm + k))
        orders[r] = order + [Action(r, "W", i) for i in range(max(0, m - lag), m)]
    return _grid(orders)


def zb_h2(p: int, m: int) -> Schedule:
    """Qi et al.'s ZB-H2 by their greedy rule (section 3): rank r may hold 2(p-r)-1 forwards
    awaiting B and 2p-1 awaiting W; each tick it runs a ready B, else a ready allowed F, else the
    oldest pending W. With m >= 2p-1 and F = B = W no rank idles between its first and last
    action, so back-to-back steps have no bubble."""
    _check(p, m)
    lay = Layout({r: r for r in range(p)}, m, frozenset((r, i) for r in range(p) for i in range(m)))
    grid: Schedule = {r: [] for r in range(p)}
    finished: dict[Action, int] = {}
    n_f, n_b, n_w = [0] * p, [0] * p, [0] * p
    tick = 0

    def ready(a: Action) -> bool:  # inputs finished at an earlier tick
        return all(finished.get(n, tick) < tick for n in lay.inputs(a))

    while sum(n_w) < p * m:
        chosen: list[Action | None] = []
        for r in range(p):
            b, f, w = Action(r, "B", n_b[r]), Action(r, "F", n_f[r]), Action(r, "W", n_w[r])
            if n_b[r] < m and ready(b):
                chosen.append(b)
            elif (n_f[r] < m and ready(f) and n_f[r] - n_b[r] < 2 * (p - r) - 1
                  and n_f[r] - n_w[r] < 2 * p - 1):
                chosen.append(f)
            elif n_w[r] < n_b[r]:
                chosen.append(w)
            else:
                chosen.append(None)
        for r, a in enumerate(chosen):
            grid[r].append(a)
            if a is not None:
                finished[a] = tick
                counter = {"F": n_f, "B": n_b, "W": n_w}[a.kind]
                counter[r] += 1
        tick += 1
    return grid


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


def default_chunks(kind: str) -> int:
    """Stages per rank when none is asked for: 2 for interleaved 1F1B (any v >= 2 works) and for
    the V-shaped and bidirectional schedules (always 2), 1 for the others."""
    return 1 if kind in ONE_STAGE_PER_RANK else 2


def model_parts(kind: str, p: int, v: int | None = None) -> int:
    """How many parts a schedule cuts the model into: its p x v stages (v free for interleaved
    1F1B only), or DualPipe's p (each of its two copies runs the whole model over the p ranks)."""
    if kind == "dualpipe":
        return p
    return p * (v if kind == "interleaved-1f1b" and v is not None else default_chunks(kind))


def of_plan(plan, p: int) -> Schedule:
    """The schedule a refpar.config.Plan runs on p pipeline ranks: read from its CSV (torch's
    format, `from_csv`), or built by its kind."""
    if plan.schedule_csv is not None:
        return from_csv(plan.schedule_csv)
    return build(plan.kind, p, plan.microbatches, plan.chunks)


def build(kind: str, p: int, m: int, v: int | None = None) -> Schedule:
    """`build("1f1b", 4, 8)`; `v`, the stages per rank, is free for interleaved-1f1b only (default
    2); the others have default_chunks(kind)."""
    if kind not in BUILDERS:
        raise ConfigError(f"unknown schedule {kind!r}; choose one of {', '.join(BUILDERS)}")
    v = default_chunks(kind) if v is None else v
    if kind == "interleaved-1f1b":
        return interleaved_1f1b(p, m, v)
    if v != default_chunks(kind):
        if default_chunks(kind) == 1:
            raise ConfigError(f"--chunks {v} applies to interleaved-1f1b only; drop it for {kind}")
        raise ConfigError(f"{kind} places two stages on every rank (stages r and 2p-1-r), not {v}; "
                          "drop --chunks or give --chunks 2")
    return BUILDERS[kind](p, m)


# ---------------------------------------------------------------- printing

def format_grid(schedule: Schedule, error: ScheduleError | None = None) -> str:
    """Ranks x ticks, `.` for idle; the action an error names is marked `!`, and the error
    follows the grid."""
    width = max([len(str(a)) for row in schedule.values() for a in row if a is not None] + [3]) + 1
    width += error is not None  # room for the mark
    n_ticks = max((len(row) for row in schedule.values()), default=0)
    lines = ["tick    " + "".join(f"{t:<{width}}" for t in range(n_ticks)).rstrip()]
    for rank, row in sorted(schedule.items()):
        cells = []
        for tick, a in enumerate(row):
            text = "." if a is None else str(a)
            if error is not None and (error.rank, error.tick) == (rank, tick):
                text = "!" + text
            cells.append(f"{text:<{width}}")
        lines.append(f"rank {rank:<3}" + "".join(cells).rstrip())
    if error is not None:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def published_bubble_fraction(kind: str, p: int, m: int, v: int = 1) -> float | None:
    """The published bubble with uniform costs F = B = W, as a fraction of total time, where the
    schedule's builder attains it: GPipe and 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v*m) of
    compute, i.e. (p-1)/(v*m+p-1) of total; ZB-H1 idle (p-1)(F+B-W) per rank."""
    if kind in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1" and m >= p:
        return (p - 1) / (3 * m + p - 1)
    return None


# ---------------------------------------------------------------- torch.distributed.pipelining's CSV

# torch's PipelineScheduleMulti._dump_csv(path, format="compute_only") writes one row per rank with
# csv.writer, a cell per list entry: an _Action's repr ("0F0"), empty for an idle tick (None). Its
# kinds: F; I, the backward for the input only (refpar's B where a W follows); B, the full backward
# (refpar's B with no W); W; and OVERLAP_F_B, a forward and a backward as one action, written
# "(0F5;7B2)OVERLAP_F_B". _load_csv reads the rows back, row k being rank k.
_CELL = re.compile(r"(\d+)([FIBW])(\d+)")
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMMS = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def _torch_name(a: Action, lay: Layout) -> str:
    if a.parts:
        return f"({';'.join(_torch_name(part, lay) for part in a.parts)})OVERLAP_F_B"
    kind = "I" if a.kind == "B" and (a.stage, a.microbatch) in lay.split else a.kind
    return f"{a.stage}{kind}{a.microbatch}"


def to_csv(schedule: Schedule) -> str:
    """The schedule as torch.distributed.pipelining writes a compute-only schedule: what
    `refpar schedule KIND --csv` prints and torch's _load_csv reads."""
    lay = layout(schedule)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(schedule):
        writer.writerow(["" if a is None else _torch_name(a, lay) for a in schedule[rank]])
    return out.getvalue()


def _read_cell(cell: str, rank: int, tick: int) -> tuple[bool, list[tuple[Action, str]]]:
    """Whether the cell is an overlapped pair, and its computations with the kind torch wrote
    (I or B for refpar's B)."""
    pair = _PAIR.fullmatch(cell)
    out = []
    for name in (pair.group(1).split(";") if pair else [cell] if cell else []):
        found = _CELL.fullmatch(name.strip())
        if found is None:
            hint = (" (torch's compute_comms format: dump with format='compute_only')"
                    if _COMMS.fullmatch(name.strip()) else "")
            shown = repr(cell if len(cell) <= 40 else cell[:37] + "...")  # a file that is no CSV: its start
            raise ScheduleError(f"rank {rank} tick {tick}: {shown} is not a computation{hint}; a cell "
                                "holds an action such as 0F0 (kinds F, I, B, W), an overlapped pair "
                                "such as (0F1;3B0)OVERLAP_F_B, or nothing for an idle tick", rank, tick)
        stage, kind, mb = int(found[1]), found[2], int(found[3])
        out.append((Action(stage, "B" if kind == "I" else kind, mb), kind))
    return pair is not None, out


def from_csv(text: str) -> Schedule:
    """A schedule from torch's compute-only CSV: row k is rank k, an empty cell an idle tick.
    Raises ScheduleError naming the first cell that is not a computation, an I with no W, or a W
    after a full backward B."""
    schedule: Schedule = {}
    backward: dict[Action, tuple[str, int, int]] = {}  # refpar's B -> (torch's I or B, rank, tick)
    weight: dict[Action, tuple[int, int]] = {}  # the B whose W it is -> (rank, tick)
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):  # blank lines at the end
        rows.pop()
    for rank, row in enumerate(rows):
        schedule[rank] = []
        for tick, cell in enumerate(row):
            pair, found = _read_cell(cell.strip(), rank, tick)
            for a, kind in found:
                if a.kind == "B":
                    backward[a] = (kind, rank, tick)
                elif a.kind == "W":
                    weight[Action(a.stage, "B", a.microbatch)] = (rank, tick)
            parts = tuple(a for a, _ in found)
            # a pair of other than two parts goes in as written, for layout() to name
            schedule[rank].append(Action(-1, OVERLAP, -1, parts) if pair else parts[0] if parts else None)
    if not any(a is not None for row in schedule.values() for a in row):
        raise ScheduleError("the CSV holds no action; write one row per rank, its cells the rank's "
                            "actions in order, e.g. 0F0,0I0,0W0")
    for b, (kind, rank, tick) in sorted(backward.items(), key=lambda item: item[1][1:]):
        s, i = b.stage, b.microbatch
        if kind == "I" and b not in weight:
            raise ScheduleError(f"rank {rank} tick {tick}: {s}I{i} computes the input gradient only, "
                                f"and no {s}W{i} computes the weights'; add {s}W{i} or write {s}B{i}, "
                                "the full backward", rank, tick)
        if kind == "B" and b in weight:
            r, t = weight[b]
            raise ScheduleError(f"rank {r} tick {t}: {s}W{i} computes the weight gradient that the "
                                f"full backward {s}B{i} already computed; write {s}I{i} for the input "
                                "gradient only", r, t)
    return schedule
