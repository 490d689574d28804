"""What a training run records, on one device (refpar/trainer.py) and on a mesh (refpar/engine/train.py)
alike: `Run`, one rank's view of a finished run, and `MoEStep`, one step's routing of a MoE model
(`step_record` builds it from the routing of every MoE layer; `router_shares` adds up its losses).

    run = train_single_device(model, train)          # or engine.train(parallelize(...)) on each rank
    run.losses, run.step_time_s, run.loss_scaling, run.moe_steps[0].tokens_per_expert
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from refpar import backend
from refpar.model.routing import routing_kept

if TYPE_CHECKING:
    from refpar.schedules.simulate import Timeline


@dataclass
class MoEStep:
    """One step's routing as the whole run saw it: every number is global (the same on every rank)."""

    step: int
    loss: float  # cross-entropy + router losses, the single device's loss
    aux_loss: float  # sum over MoE blocks of the load-balancing losses
    z_loss: float  # sum over MoE blocks of the router z-losses
    tokens_per_expert: dict[int, list[int]]  # layer -> assignments each expert kept
    dropped: dict[int, int]  # layer -> assignments dropped by the capacity
    kept_counts: dict[int, np.ndarray]  # layer -> (D, E) kept per data rank (x cp rank) and expert
    time_s: float
    # one dict per microbatch: layer -> (D, E) kept in that microbatch (they add up to kept_counts)
    microbatch_kept_counts: list[dict[int, np.ndarray]] = field(default_factory=list)
    # one dict per microbatch: layer -> (D, ep) pairs (token, ep rank) per data rank and destination
    # (expert parallelism's all-to-all rows; empty on one device, which sends none)
    microbatch_pair_counts: list[dict[int, np.ndarray]] = field(default_factory=list)
    # aux-free balancing: layer -> the (E,) expert bias this step chose with (empty otherwise)
    expert_bias: dict[int, list[float]] = field(default_factory=dict)

    @property
    def microbatch_counts(self) -> list[dict[int, tuple]]:
        """Per microbatch, layer -> (kept, pairs): what refpar.analysis.moe's closed forms read."""
        return [{i: (kept[i], pairs[i]) for i in kept}
                for kept, pairs in zip(self.microbatch_kept_counts, self.microbatch_pair_counts, strict=True)]


def router_shares(routings: list[dict]) -> tuple[float, float]:
    """(aux, z) of this process: the sum over microbatches and MoE layers of its shares."""
    return (sum(float(r["aux_loss"]) for rs in routings for r in rs.values()),
            sum(float(r["z_loss"]) for rs in routings for r in rs.values()))


def step_record(step, loss, routings: list[dict], start, totals=None, bias: dict | None = None) -> MoEStep:
    """A step's record from the routing of every MoE layer in each microbatch (one dict layer ->
    routing per microbatch); `totals` the (loss, aux, z) summed over ranks, else this process ran
    the whole batch; `bias` the aux-free expert biases the step routed with (routing.update_expert_bias)."""
    if totals is None:
        totals = (loss, *router_shares(routings))
    kept = [{i: backend.to_host(routing_kept(r)) for i, r in rs.items()} for rs in routings]
    layers = list(routings[0]) if routings else []  # a pipeline stage may hold no MoE block
    return MoEStep(
        step=step, loss=float(totals[0]), aux_loss=float(totals[1]), z_loss=float(totals[2]),
        tokens_per_expert={i: [int(c) for c in sum(backend.to_host(rs[i]["tokens_per_expert"])
                                                   for rs in routings)] for i in layers},
        dropped={i: sum(int(rs[i]["dropped"]) for rs in routings) for i in layers},
        kept_counts={i: sum(k[i] for k in kept) for i in layers},
        time_s=time.perf_counter() - start, microbatch_kept_counts=kept,
        microbatch_pair_counts=[{i: r["pairs"] for i, r in rs.items() if "pairs" in r} for rs in routings],
        expert_bias={i: [float(b) for b in backend.to_host(v)] for i, v in (bias or {}).items()
                     if i in layers})


@dataclass
class Run:
    """One rank's view of a finished run (the single device's is the whole run's)."""

    losses: list[float] = field(default_factory=list)  # the global batch's mean loss, before each update
    step_times: list[float] = field(default_factory=list)  # seconds of each step
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    lrs: list[float] = field(default_factory=list)  # the learning rate of each step
    grad_norms: list[float | None] = field(default_factory=list)  # clipping: the global norm (skipped: None)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # --eval-every: (steps done, loss)
    loss_scales: list[float] = field(default_factory=list)  # fp16-mixed: the scale of each step
    skipped_steps: list[int] = field(default_factory=list)  # fp16-mixed: 0-based steps that overflowed
    moe_steps: list[MoEStep] = field(default_factory=list)  # MoE: the routing of this rank's blocks
    # the single device's (refpar/trainer.py)
    params: dict = field(default_factory=dict)  # after the last step
    loss_floor: float | None = None  # the corpus's entropy rate in nats (None: text, unknown)
    # a mesh rank's measurements (refpar/engine/train.py)
    windows: list[tuple[float, float]] = field(default_factory=list)  # each step on the tracer's clock
    totals: dict = field(default_factory=dict)  # traced (axis, op) -> (sent, received) of the steps
    measured: Timeline | None = None  # the last step's executed actions, every pipeline rank
    simulated: Timeline | None = None  # the schedule simulated with their measured durations
    flops: list[int] = field(default_factory=list)  # the GEMM FLOPs this rank ran each step (model/gemm.py)

    @property
    def step_time_s(self) -> float:
        """Mean step time, leaving out the first step (warm-up) when there are others."""
        times = self.step_times[1:] or self.step_times
        return float(np.mean(times))

    @property
    def loss_scaling(self) -> dict | None:
        """The summary's `loss_scaling` field: the scale each step used, the last, the steps skipped
        (None: no loss scaling, every precision but fp16-mixed)."""
        if not self.loss_scales:
            return None
        return {"scales": list(self.loss_scales), "final_scale": self.loss_scales[-1],
                "skipped_steps": list(self.skipped_steps)}
