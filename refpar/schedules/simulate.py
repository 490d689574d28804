"""Running a schedule's lists in order: each rank runs its actions one after the other, each as
soon as its rank is free and its inputs have arrived (the executor's semantics).

`validate(schedule)` raises a `ScheduleError` naming the first action that can never run: its input
comes later on its own rank, or every rank waits on another (a deadlock). `validate(schedule,
ticks=True)` also checks the grid: each action's inputs finish at an earlier tick. `simulate(schedule,
costs)` times the schedule with F, B, W and transfer costs and returns a `Timeline` (slots per rank,
idle intervals, makespan). `stored` replays what each rank keeps for backward (counts, or bytes),
`critical_path_gap` bounds how far an executed timeline may be from its simulation, and `unit_grid`
places the builders' ordered lists on the unit-cost grid the papers draw.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from refpar.config import ConfigError
from refpar.schedules import Action, Schedule, ScheduleError, StageMap, stage_map


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


def run_in_order(schedule: Schedule, smap: StageMap, duration: Callable[[int, int, Action], float],
                 p2p: float) -> Timeline:
    """Runs each rank's list in order, each action as soon as its rank is free and its inputs
    have arrived; raises ScheduleError naming the first action that can never run."""
    for rank, row in schedule.items():
        position = {c: t for t, a in enumerate(row) if a is not None for c in a.computations()}
        for tick, a in enumerate(row):
            for need in ([] if a is None else smap.inputs(a)):
                if smap.stage_rank.get(need.stage) == rank and position.get(need, -1) > tick:
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
                needs = smap.inputs(a)
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
        need = next(n for n in smap.inputs(a) if n not in done)
        owner = smap.stage_rank[need.stage]
        blocker = schedule[owner][pos[owner]]
        raise ScheduleError(f"rank {rank} tick {tick}: {a} would deadlock: it waits for {need} on "
                            f"rank {owner}, which is stuck at tick {pos[owner]} on {blocker}",
                            rank, tick)
    makespan = max((s.end for row in slots.values() for s in row), default=0.0)
    return Timeline(slots, transfers, makespan)


def _unit(rank: int, tick: int, a: Action) -> float:
    return 1.0


def validate(schedule: Schedule, ticks: bool = False) -> StageMap:
    """Raises ScheduleError naming the first action whose input is not ready (or that would
    deadlock); with `ticks`, also the first action placed at a tick before its inputs finish."""
    smap = stage_map(schedule)
    run_in_order(schedule, smap, _unit, 0.0)
    if ticks:
        tick_of = {c: t for row in schedule.values() for t, a in enumerate(row) if a is not None
                   for c in a.computations()}
        late = [(tick_of[n], t, r, a, n) for r, row in schedule.items() for t, a in enumerate(row)
                if a is not None for n in smap.inputs(a) if tick_of[n] >= t]
        if late:
            _, tick, rank, a, need = min(late, key=lambda x: (x[1], x[2]))
            raise ScheduleError(f"rank {rank} tick {tick}: {a} is placed before its input {need} "
                                f"is ready (tick {tick_of[need]} on rank {smap.stage_rank[need.stage]})",
                                rank, tick)
    return smap


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
    smap = stage_map(schedule)

    def compute(a: Action) -> float:
        if a.kind == "B" and (a.stage, a.microbatch) not in smap.split:
            return costs.B + costs.W
        return getattr(costs, a.kind)

    def duration(rank: int, tick: int, a: Action) -> float:
        if durations is not None:
            return durations[rank, tick]
        if a.parts:
            return (max if costs.overlap == "max" else sum)(map(compute, a.parts))
        return compute(a)

    return run_in_order(schedule, smap, duration, costs.p2p)


def critical_path_gap(timeline: Timeline, schedule: Schedule) -> float:
    """Time on the timeline's critical path spent outside actions: walking back from the action
    that ends last, each step to the latest-ending of what it waited for (its rank's previous
    action, its inputs), summing the time between them (messages in flight, bookkeeping between
    actions, a rank waiting for a core). It bounds how far an executed timeline can be from the
    simulation of the same action durations: the chain's durations fit in the simulated makespan,
    and nothing runs earlier than the simulation allows, so
        0 <= measured makespan - simulated makespan <= critical_path_gap(measured)."""
    smap = stage_map(schedule)
    slot_of = {c: s for row in timeline.slots.values() for s in row for c in s.action.computations()}
    before: dict[Action, Slot] = {}
    for row in timeline.slots.values():
        ordered = sorted(row, key=lambda s: s.tick)
        before.update({b.action: a for a, b in zip(ordered, ordered[1:], strict=False)})
    current = max((s for row in timeline.slots.values() for s in row), key=lambda s: s.end)
    gap = timeline.makespan - current.end
    while True:
        waited = [slot_of[n] for n in smap.inputs(current.action)]
        waited += [before[current.action]] if current.action in before else []
        if not waited:
            return gap + current.start
        previous = max(waited, key=lambda s: s.end)
        gap += current.start - previous.end
        current = previous


def stored(schedule: Schedule, after_f: Callable[[Action], int] = lambda a: 1,
           after_b: Callable[[Action], int] = lambda a: 1,
           during_b: Callable[[Action], int] = lambda a: 0) -> dict[int, list[int]]:
    """Per rank, the most stored for backward during each tick: `after_f(F)` from each F until its
    B, then `after_b(B)` until its W where the backward is split, and `during_b(B)` while a B runs
    beside what it consumes (recomputation's working set). With the defaults, the number of
    (stage, microbatch) pairs in flight; with bytes, the activation memory a run must measure. An
    overlapped F&B peaks between its parts: its forward's activations exist before its backward
    frees the other microbatch's (the executor runs them in that order; DualPipe overlaps them)."""
    smap = stage_map(schedule)
    held: dict[tuple[int, int], int] = {}
    out = {}
    for rank, row in schedule.items():
        total, trace = 0, []
        for a in row:
            most = total
            for c in () if a is None else a.computations():
                key = (c.stage, c.microbatch)
                if c.kind == "B":
                    most = max(most, total + during_b(c))
                total -= held.pop(key, 0)
                if c.kind == "F":
                    held[key] = after_f(c)
                elif c.kind == "B" and key in smap.split:
                    held[key] = after_b(c)
                total += held.get(key, 0)
                most = max(most, total)
            trace.append(most)
        out[rank] = trace
    return out


def peak_inflight_microbatches(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) pairs holding stored activations at once."""
    return {rank: max(trace, default=0) for rank, trace in stored(schedule).items()}



def unit_grid(orders: dict[int, list[Action]]) -> Schedule:
    """Places each rank's ordered actions at the tick they start when every action takes one tick
    and transfers are free: the picture the papers draw, which every builder returns."""
    timeline = run_in_order(orders, stage_map(orders), _unit, 0.0)
    makespan = int(timeline.makespan)
    grid: Schedule = {r: [None] * makespan for r in orders}
    for rank, slots in timeline.slots.items():
        for slot in slots:
            grid[rank][int(slot.start)] = slot.action
    return grid
