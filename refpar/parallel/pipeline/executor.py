"""Runs this rank's list of a pipeline schedule over MPI point-to-point messages.

    mpiexec -n 4 python -m refpar train --mesh pp=4 --schedule zb-h1 --microbatches 8 --check

Each rank walks `schedule[rank]` in order and does what each action says:

    F(s, i)  wait for stage s-1's activation of microbatch i (tokens on the first stage), run the
             stage forward, keep its cache, isend the output to stage s+1 (the loss on the last)
    B(s, i)  wait for stage s+1's gradient (the loss starts it on the last stage), run the input
             half of the backward, free the forward cache, isend dx to stage s-1; without a W for
             (s, i) it also runs the weight half
    W(s, i)  the weight half: weight gradients from what B kept, then free that
    F&B      DualPipe's overlapped pair (schedules.overlapped): its F, then its B, one after the
             other (overlapping them is the simulator's `Costs.overlap="max"`, not done here)

"Stage s+1" and "s-1" are the neighbours within s's copy of the model (schedules.StageMap.part): in a
V the stage after p-1 is p on the same rank, whose output is handed over without a message; in
DualPipe stage p-1 ends copy 0 and stage p starts copy 1.

Every receive is posted (irecv) when the step starts, every send is an isend, so transfers overlap
compute; a message's tag names what moves, e.g. "pp:act:s1:mb3" (stage 1's output of microbatch 3)
or "pp:grad:s2:mb0" (stage 2's input gradient of microbatch 0). Communication is traced by the
Communicator's Tracer; compute actions are timed into `slots` on the same clock, so the measured
timeline and the simulated one can be compared action by action.

Memory: the cache of every F is registered in the MemoryLedger as activations when it is made
and released by the B that consumes it; what B keeps for W is registered until W. So the ledger's
activation peak per rank is the schedule's replay (`simulate.stored`) with those two sizes: for
GPipe and 1F1B, the peak in-flight count times the bytes of one microbatch.

The loss of each microbatch is its token losses over the *global* token count, so the losses add
up to the single device's mean; dropout masks are keyed by global sample ids and global layer
indices, so every stage drops what the single device drops. The stages give their gradients to
their model states piece by piece (pipeline/stage.py), which accumulate them over the
microbatches and sum them where the strategy says.

Mixed precision: activations and their gradients travel in the model's 16-bit dtype.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from refpar import backend
from refpar.config import ConfigError, ModelConfig
from refpar.memory import MemoryLedger, nbytes_of
from refpar.model.gpt import DropoutContext
from refpar.schedules import Action, Schedule
from refpar.schedules.simulate import Slot, Timeline, simulate, validate

if TYPE_CHECKING:  # the communicator module starts MPI when imported; `--help` must not
    from refpar.comm.communicator import Communicator


@dataclass(frozen=True)
class Microbatch:
    tokens: np.ndarray  # (b, T) int
    targets: np.ndarray  # (b, T) int
    sample_ids: tuple[int, ...]  # global ids of the b rows: they key the dropout masks


def held_bytes(obj, params) -> int:
    """Bytes of the distinct buffers a cache keeps alive: every array is traced to the buffer it
    views, each buffer counts once, and parameters never (`params`: the parameters, a dict, or the
    buffers they live in). Tuples, lists and dicts are looked into (an MoE block's cache is a dict of
    routing arrays, router and expert caches), except a dict keyed by parameter names: that is the
    parameters themselves or their gradients, which the ledger counts as params and grads. A
    parameter's own buffer (a linear layer's cache holds its weight) does not count either."""
    arrays = list(params.values()) if isinstance(params, dict) else list(params)
    names = set(params) if isinstance(params, dict) else set()  # a dict of them is not looked into
    exclude = {id(backend.owner(p)) for p in arrays}
    roots: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple | list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not (names and item.keys() <= names):
                stack.extend(item.values())
        elif backend.is_array(item):
            root = backend.owner(item)
            if id(root) not in exclude:
                roots[id(root)] = nbytes_of(root)
    return sum(roots.values())


def _now() -> float:
    """time.perf_counter, the clock the Tracer stamps messages with (one clock for every process
    of a machine), so actions and transfers line up."""
    return time.perf_counter()


class PipelineExecutor:
    """Runs `schedule[pp.rank]`; `pp` is the pipeline axis's Communicator (rank = pipeline rank).
    `make_stage(stage, layout)` builds each stage this rank holds (pipeline/stage.py); `tokens`
    is the residual stream's tokens per row on this rank (Tl), the length of what arrives; `like`
    an array of the run's backend and dtype (receives arrive in its namespace, on its device);
    `buffers` the arrays the parameters live in (no activation)."""

    def __init__(self, schedule: Schedule, config: ModelConfig, pp: Communicator, make_stage, tokens: int,
                 like, buffers, ledger: MemoryLedger | None = None):
        if len(schedule) != pp.size:
            raise ConfigError(f"the schedule has {len(schedule)} ranks but the pipeline axis has "
                              f"{pp.size}; build it with p={pp.size}")
        self.schedule, self.config, self.pp = schedule, config, pp
        self.layout = validate(schedule)
        self.rank = pp.rank
        self.row = schedule[self.rank]
        self.stages = {s: make_stage(s, self.layout) for s in self.layout.stages_of(self.rank)}
        self.tokens, self.like, self.buffers = tokens, like, buffers
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.slots: list[Slot] = []
        self._tags = self._check_tags()

    # -- messages ----------------------------------------------------------------------------------

    def _messages(self) -> list[tuple[Action, int, int, str]]:
        """Every transfer of a step as (producing action, src rank, dst rank, tag)."""
        lay = self.layout
        where, last = lay.stage_rank, lay.stages_per_copy - 1
        out = []
        for row in self.schedule.values():
            for a in (c for x in row if x is not None for c in x.computations()):
                if a.kind == "F" and lay.part(a.stage) < last:
                    out.append((a, where[a.stage], where[a.stage + 1],
                                f"pp:act:s{a.stage}:mb{a.microbatch}"))
                elif a.kind == "B" and lay.part(a.stage) > 0:
                    out.append((a, where[a.stage], where[a.stage - 1],
                                f"pp:grad:s{a.stage}:mb{a.microbatch}"))
        return [msg for msg in out if msg[1] != msg[2]]

    def _check_tags(self) -> dict[Action, str]:
        """MPI matches messages by (source, integer tag); the Communicator hashes string tags to
        integers, so two messages on one link must not share a hash or they could swap."""
        from refpar.comm.communicator import _mpi_tag

        links: dict[tuple[int, int], dict[int, str]] = {}
        tags = {}
        for a, src, dst, tag in self._messages():
            seen = links.setdefault((src, dst), {})
            if _mpi_tag(tag) in seen:
                raise ConfigError(f"pipeline tags {seen[_mpi_tag(tag)]} and {tag} map to the same MPI "
                                  "tag; use a different number of microbatches")
            seen[_mpi_tag(tag)] = tag
            tags[a] = tag
        return tags

    def _post_receives(self, microbatches: list[Microbatch]) -> dict[Action, object]:
        """irecv of every message this rank gets in a step: (b, Tl, C) of the model's dtype."""
        dtype, C = np.dtype(self.config.dtype), self.config.n_embd
        return {a: self.pp.irecv((len(microbatches[a.microbatch].sample_ids), self.tokens, C), dtype, src,
                                 tag, like=self.like)
                for a, src, dst, tag in self._messages() if dst == self.rank}

    # -- one step ----------------------------------------------------------------------------------

    def step(self, microbatches: list[Microbatch], *, step: int, seed: int, normalizer: int,
             dloss: float = 1.0) -> float:
        """Runs this rank's actions for one optimizer step; returns the sum of the microbatch losses
        computed here (0.0 on ranks without the last stage). The gradients are in the stages'
        model states. `dloss`: the fp16 loss scale."""
        for stage in self.stages.values():
            stage.dloss = dloss
            if stage.recompute is not None:
                stage.recompute.spans.clear()  # the last step's reruns only, as `slots`
        m = self.layout.n_microbatches
        if len(microbatches) != m:
            raise ConfigError(f"the schedule has {m} microbatches but the step got "
                              f"{len(microbatches)}; split the batch into {m}")
        where = self.layout.stage_rank
        self.slots = []  # the last step's actions only
        received = self._post_receives(microbatches)
        local: dict[Action, np.ndarray] = {}  # outputs handed to a stage on this same rank
        sends, caches, saved = [], {}, {}
        loss = 0.0
        tracer = self.pp.tracer

        def take(producer: Action):
            return local.pop(producer) if producer in local else received.pop(producer).wait()

        def give(a: Action, out, to_stage: int) -> None:
            if where[to_stage] == self.rank:
                local[a] = out
            else:
                sends.append(self.pp.isend(out, where[to_stage], self._tags[a]))

        def run(a: Action) -> tuple[float, float]:
            """One F, B or W; its compute's start and end."""
            nonlocal loss
            stage, i, mb = self.stages[a.stage], a.microbatch, microbatches[a.microbatch]
            key = f"{a.stage}:{i}"
            phase = {"F": "fwd", "B": "bwd", "W": "wgrad"}[a.kind]
            context = tracer.context(step=step, microbatch=i, phase=phase) if tracer else nullcontext()
            with context:
                if a.kind == "F":
                    x = mb.tokens if stage.first else take(Action(a.stage - 1, "F", i))
                    start = _now()
                    drop = DropoutContext(seed, step, mb.sample_ids, self.config.dropout, True)
                    out, caches[key] = stage.forward(x, mb.targets, drop, normalizer, i)
                    end = _now()
                    self.ledger.alloc(f"act:{key}", held_bytes(caches[key], self.buffers), "activations")
                    if stage.last:
                        loss += float(out)
                    else:
                        give(a, out, a.stage + 1)
                elif a.kind == "B":
                    dout = None if stage.last else take(Action(a.stage + 1, "B", i))
                    start = _now()
                    split = (a.stage, i) in self.layout.split
                    dx, saved[key] = stage.backward_input(dout, caches.pop(key), i, weight=not split)
                    end = _now()
                    self.ledger.free(f"act:{key}")
                    if split:
                        self.ledger.alloc(f"wact:{key}", held_bytes(saved[key], self.buffers),
                                          "activations")
                    if dx is not None:
                        give(a, dx, a.stage - 1)
                else:
                    start = _now()
                    stage.backward_weight(saved.pop(key))
                    end = _now()
                    self.ledger.free(f"wact:{key}")
            return start, end

        for tick, a in enumerate(self.row):
            if a is None:
                continue
            times = [run(c) for c in a.computations()]  # an F&B: its F, then its B
            self.slots.append(Slot(self.rank, tick, a, times[0][0], times[-1][1]))
        for request in sends:
            request.wait()
        return loss

    # -- the executed timeline ---------------------------------------------------------------------

    def measured_timeline(self) -> Timeline:
        """Every pipeline rank's executed actions (gathered over pp), times from the earliest start.
        Idle is everything that is not compute: waiting for a message, and the bookkeeping between
        actions."""
        mine = np.array([[s.rank, s.tick, s.start, s.end] for s in self.slots], dtype=np.float64)
        rows = self.pp.all_gather(mine.reshape(-1, 4), tag="pp:timeline")
        t0 = float(rows[:, 2].min())
        slots: dict[int, list[Slot]] = {r: [] for r in self.schedule}
        for rank, tick, start, end in rows:
            r, t = int(rank), int(tick)
            slots[r].append(Slot(r, t, self.schedule[r][t], start - t0, end - t0))
        return Timeline(slots, [], float(rows[:, 3].max()) - t0)

    def simulated_timeline(self, measured: Timeline) -> Timeline:
        """The schedule simulated with each action's measured duration and free transfers."""
        durations = {(s.rank, s.tick): s.end - s.start
                     for row in measured.slots.values() for s in row}
        return simulate(self.schedule, durations=durations)


