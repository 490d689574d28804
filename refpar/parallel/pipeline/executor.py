"""Runs this rank's list of a pipeline schedule over MPI point-to-point messages.

    mpiexec -n 4 python -m refpar train --mesh pp=4 --schedule zb-h1 --microbatches 8 --check

Each rank walks `schedule[rank]` in order and does what each action says:

    F(s, i)  wait for stage s-1's activation of microbatch i (tokens on the first stage), run the
             stage forward, keep its cache, isend the output to stage s+1 (the loss on the last)
    B(s, i)  wait for stage s+1's gradient (the loss starts it on the last stage), run the input
             half of the backward, free the forward cache, isend dx to stage s-1; without a W for
             (s, i) it also runs the weight half
    W(s, i)  the weight half: weight gradients from what B kept, then free that

Every receive is posted (irecv) when the step starts, every send is an isend, so transfers overlap
compute; a message's tag names what moves, e.g. "pp:act:s1:mb3" (stage 1's output of microbatch 3)
or "pp:grad:s2:mb0" (stage 2's input gradient of microbatch 0). Communication is traced by the
Communicator's Tracer; compute actions are timed into `slots` on the same clock, so the measured
timeline and the simulated one can be compared action by action.

Memory: the cache of every F is registered in the MemoryLedger as activations when it is made
and released by the B that consumes it; what B keeps for W is registered until W. So the ledger's
activation peak per rank is the schedule's replay (`schedules.stored`) with those two sizes: for
GPipe and 1F1B, the peak in-flight count times the bytes of one microbatch.

The loss of each microbatch is its token losses over the *global* token count, so the losses add
up to the single device's mean; dropout masks are keyed by global sample ids and global layer
indices, so every stage drops what the single device drops. The tied embedding (wte) lives on the
first and the last stage; after the step its two gradient halves are summed by an all-reduce
between those two ranks, Megatron's "embedding group".

Mixed precision: activations and their gradients travel in the model's 16-bit dtype; microbatch
gradients accumulate in the gradients' dtype (16-bit, or a float32 buffer with `grad_dtype`, the
Ultra-Scale Playbook's fp32 accumulation), and the tied sum runs in it too.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from array_api_compat import array_namespace

from refpar import backend
from refpar.config import ConfigError, ModelConfig
from refpar.memory import MemoryLedger, nbytes_of
from refpar.model.gpt import DropoutContext
from refpar.parallel.pipeline.schedules import Action, Schedule, Slot, Timeline, simulate, validate
from refpar.parallel.pipeline.stage import Stage

if TYPE_CHECKING:  # the communicator module starts MPI when imported; `--help` must not
    from refpar.comm.communicator import Communicator


@dataclass(frozen=True)
class Microbatch:
    tokens: np.ndarray  # (b, T) int
    targets: np.ndarray  # (b, T) int
    sample_ids: tuple[int, ...]  # global ids of the b rows: they key the dropout masks


def _root(a):
    """The array that owns the buffer `a` views (NumPy, torch or CuPy)."""
    return backend.owner(a)


def held_bytes(obj, params: dict) -> int:
    """Bytes of the distinct buffers a cache keeps alive: every array is traced to the buffer it
    views, each buffer counts once, and parameters never. Tuples, lists and dicts are looked into
    (an MoE block's cache is a dict of routing arrays, router and expert caches), except a dict
    keyed by parameter names: that is the parameters themselves (the engine's stages carry theirs
    for the embedding's backward) or their gradients (a fused B hands them to W), which the ledger
    counts as params and grads. A parameter's own buffer (a linear layer's cache holds its weight)
    does not count either."""
    exclude = {id(_root(p)) for p in params.values()}
    roots: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple | list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not item.keys() <= params.keys():
                stack.extend(item.values())
        elif backend.is_array(item):
            root = _root(item)
            if id(root) not in exclude:
                roots[id(root)] = nbytes_of(root)
    return sum(roots.values())


def _now() -> float:
    """time.perf_counter, the clock the Tracer stamps messages with (one clock for every process
    of a machine), so actions and transfers line up."""
    return time.perf_counter()


class PipelineExecutor:
    """Runs `schedule[pp.rank]`; `pp` is the pipeline axis's Communicator (rank = pipeline rank),
    `embedding` the mesh's embedding group (the first and the last pipeline rank; None elsewhere)."""

    def __init__(self, schedule: Schedule, config: ModelConfig, pp: Communicator,
                 ledger: MemoryLedger | None = None, make_stage=Stage, embedding=None):
        if len(schedule) != pp.size:
            raise ConfigError(f"the schedule has {len(schedule)} ranks but the pipeline axis has "
                              f"{pp.size}; build it with p={pp.size}")
        self.schedule, self.config, self.pp = schedule, config, pp
        self.layout = validate(schedule)
        self.rank = pp.rank
        self.row = schedule[self.rank]
        n_stages = self.layout.n_stages
        # make_stage(config, n_stages, stage): Stage, or a subclass with other blocks (engine_moe)
        self.stages = {s: make_stage(config, n_stages, s) for s, r in self.layout.stage_rank.items()
                       if r == self.rank}
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.grad_dtype = None  # float32 to accumulate 16-bit gradients in fp32 (fp32_grads)
        self.like = None  # an array of the run's backend, for steps given no parameters
        self.slots: list[Slot] = []
        self._tags = self._check_tags()
        self.embedding_group = embedding

    def param_names(self) -> list[str]:
        """The parameters this rank holds: those of its stages (wte on both ends)."""
        names = [n for st in self.stages.values() for n in st.param_names()]
        return list(dict.fromkeys(names))

    # -- messages ----------------------------------------------------------------------------------

    def _messages(self) -> list[tuple[Action, int, int, str]]:
        """Every transfer of a step as (producing action, src rank, dst rank, tag)."""
        where = self.layout.stage_rank
        out = []
        for row in self.schedule.values():
            for a in row:
                if a is None:
                    continue
                if a.kind == "F" and a.stage + 1 < self.layout.n_stages:
                    out.append((a, where[a.stage], where[a.stage + 1],
                                f"pp:act:s{a.stage}:mb{a.microbatch}"))
                elif a.kind == "B" and a.stage > 0:
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

    def _post_receives(self, microbatches: list[Microbatch], like) -> dict[Action, object]:
        """irecv of every message this rank gets in a step; arrays arrive in `like`'s namespace."""
        C = self.config.n_embd
        dtype = np.dtype(self.config.dtype)
        requests = {}
        for a, src, dst, tag in self._messages():
            if dst == self.rank:
                shape = (len(microbatches[a.microbatch].sample_ids), microbatches[0].tokens.shape[1], C)
                requests[a] = self.pp.irecv(shape, dtype, src, tag, like=like)
        return requests

    # -- one step ----------------------------------------------------------------------------------

    def step(self, params: dict, microbatches: list[Microbatch], *, step: int, seed: int,
             normalizer: int, dloss: float = 1.0) -> tuple[float, dict]:
        """Runs this rank's actions for one optimizer step. Returns the sum of the microbatch losses
        computed here (0.0 on ranks without the last stage) and this rank's parameter gradients
        (wte's already summed over the embedding group). `dloss`: the fp16 loss scale."""
        for stage in self.stages.values():
            stage.dloss = dloss
        m = self.layout.n_microbatches
        if len(microbatches) != m:
            raise ConfigError(f"the schedule has {m} microbatches but the step got "
                              f"{len(microbatches)}; split the batch into {m}")
        where = self.layout.stage_rank
        self.ledger.free_prefix("grad:")
        self.slots = []  # the last step's actions only
        # Activations arrive in the namespace and on the device of the parameters (or of `like`
        # when the stages gather their own, as the engine's ZeRO-3 does).
        received = self._post_receives(microbatches, like=next(iter(params.values()), self.like))
        local: dict[Action, np.ndarray] = {}  # outputs handed to a stage on this same rank
        sends, caches, saved, grads = [], {}, {}, {}
        loss = 0.0
        tracer = self.pp.tracer

        def take(producer: Action):
            return local.pop(producer) if producer in local else received.pop(producer).wait()

        def give(a: Action, out, to_stage: int) -> None:
            if where[to_stage] == self.rank:
                local[a] = out
            else:
                sends.append(self.pp.isend(out, where[to_stage], self._tags[a]))

        for tick, a in enumerate(self.row):
            if a is None:
                continue
            stage, i, mb = self.stages[a.stage], a.microbatch, microbatches[a.microbatch]
            key = f"{a.stage}:{i}"
            phase = {"F": "fwd", "B": "bwd", "W": "wgrad"}[a.kind]
            context = tracer.context(step=step, microbatch=i, phase=phase) if tracer else nullcontext()
            with context:
                if a.kind == "F":
                    x = mb.tokens if stage.first else take(Action(a.stage - 1, "F", i))
                    start = _now()
                    drop = DropoutContext(seed, step, mb.sample_ids, self.config.dropout, True)
                    out, caches[key] = stage.forward(params, x, mb.targets, drop, normalizer)
                    end = _now()
                    self.ledger.alloc(f"act:{key}", held_bytes(caches[key], params), "activations")
                    if stage.last:
                        loss += float(out)
                    else:
                        give(a, out, a.stage + 1)
                elif a.kind == "B":
                    dout = None if stage.last else take(Action(a.stage + 1, "B", i))
                    start = _now()
                    dx, saved[key] = stage.backward_input(dout, caches.pop(key))
                    if (a.stage, i) not in self.layout.split:
                        new = stage.backward_weight(saved.pop(key))
                    end = _now()
                    self.ledger.free(f"act:{key}")
                    if (a.stage, i) in self.layout.split:
                        self.ledger.alloc(f"wact:{key}", held_bytes(saved[key], params),
                                          "activations")
                    else:
                        self._accumulate(grads, new)
                    if dx is not None:
                        give(a, dx, a.stage - 1)
                else:
                    start = _now()
                    new = stage.backward_weight(saved.pop(key))
                    end = _now()
                    self.ledger.free(f"wact:{key}")
                    self._accumulate(grads, new)
            self.slots.append(Slot(self.rank, tick, a, start, end))
        for request in sends:
            request.wait()
        if self.embedding_group is not None:
            grads["wte.weight"] = self.embedding_group.all_reduce(
                grads["wte.weight"], tag="wte.weight:tied-grad")
        return loss, grads

    def _accumulate(self, grads: dict, new: dict) -> None:
        """Adds a microbatch's gradients; a gradient is in the ledger from its first microbatch
        until the next step starts."""
        for name, g in new.items():
            if name in grads:
                grads[name] += g
            else:
                if self.grad_dtype is not None:  # a float32 buffer the 16-bit gradients add into
                    g = array_namespace(g).astype(g, self.grad_dtype)
                grads[name] = self.ledger.alloc(f"grad:{name}", g, "grads")

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


