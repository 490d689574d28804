"""Pipeline schedules as data: who runs which forward and backward, in what order.

    p  ranks (pipeline stages per model copy)      m  microbatches per optimizer step
    v  model chunks per rank (interleaved: any; V-shaped and bidirectional: 2)
    S  stages in all, S = p * v: stage = chunk*p + rank in a loop, stages r and 2p-1-r on rank r in a V

An `Action(stage, kind, microbatch)` prints as `"1F0"`: stage 1 runs the forward of microbatch 0.
Kinds: `F` forward; `B` backward for the input gradient, or the full backward (input and weight
gradients) where the schedule has no `W` for that stage and microbatch; `W` the weight gradient
(zero-bubble schedules split B from W because W is needed by nobody downstream). An overlapped
`F&B` action (DualPipe) runs one forward and one backward, its `parts`, as one slot: "0F5&7B2".

A schedule is `dict[rank, list[Action | None]]`: one list per rank, `None` an idle tick.
`stage_map(schedule)` checks its shape and returns its `StageMap`: which rank runs each stage,
the microbatches, which backwards are split, the copies of the model, and what each action waits
for. Dependencies (what "the input is ready" means):
    F(s, i) needs F(s-1, i)                     (the activation from the previous stage)
    B(s, i) needs F(s, i) and B(s+1, i)         (its own stored activations, the output gradient)
    W(s, i) needs B(s, i)                       (the output gradients B computed)
within one copy of the model: DualPipe's stages 0..p-1 and p..2p-1 are two (`StageMap.copies`).

The rest of the package works on these types: builders.py and builders_v.py build the schedules of
the papers, simulate.py runs the lists in order (validate, simulate, stored), formats.py prints the
grid and reads and writes torch's CSV, published.py holds the papers' closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from refpar.config import ConfigError

KINDS = ("F", "B", "W")
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
    max(F, B) or F + B (`simulate.Costs.overlap`)."""
    return Action(-1, OVERLAP, -1, (forward, backward))


Schedule = dict[int, list[Action | None]]


class ScheduleError(ConfigError):
    """A schedule that cannot run; `rank` and `tick` locate the offending action in the grid."""

    def __init__(self, message: str, rank: int | None = None, tick: int | None = None):
        super().__init__(message)
        self.rank, self.tick = rank, tick


@dataclass(frozen=True)
class StageMap:
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
        return self.stages_of(self.stage_rank[stage]).index(stage)

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


def stage_map(schedule: Schedule) -> StageMap:
    """Checks the shape of a schedule (ranks 0..p-1, each stage on one rank, every stage and
    microbatch with exactly one F and one B and at most one W) and returns its `StageMap`."""
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
    smap = StageMap(stage_rank, m, split, _copies(seen, n_stages, m))
    for s in range(n_stages):
        for i in smap.microbatches(s):
            for kind in "FB":
                if Action(s, kind, i) not in seen:
                    raise ScheduleError(f"the schedule never runs {Action(s, kind, i)}; every stage "
                                        f"needs an F and a B for each of the {m} microbatches")
    stray = [a for a in seen if a.microbatch not in smap.microbatches(a.stage)]
    if stray:
        a = min(stray)
        share = smap.microbatches(a.stage)
        raise ScheduleError(f"the schedule runs {a}, but stage {a.stage} belongs to the copy of the "
                            f"model that takes microbatches {share.start}..{share.stop - 1}")
    return smap


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


def check_sizes(p: int, m: int) -> None:
    """What every builder refuses: no rank, or no microbatch."""
    if p < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got p={p}; use --stages 1 or more")
    if m < 1:
        raise ConfigError(f"a step needs at least one microbatch, got m={m}; use --microbatches 1 "
                          "or more")
