"""`refpar lesson check 8`: lesson 8's checker, the bubble formulas, the hand-written V schedule and the
1F1B executor."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lessons.checkers.common import CONTRACT, Wrong, close, shown
from refpar.config import ConfigError

V_CSV = "08_v_schedule.csv"  # part 2 of exercise 8, next to the Python file
V_RANKS, V_MICROBATCHES = 2, 4


def check_08(mod, comm) -> str:
    from refpar.schedules.builders import gpipe, one_f_one_b
    from refpar.schedules.simulate import peak_inflight_microbatches, simulate

    for p, m in ((2, 1), (4, 4), (4, 8), (8, 3)):
        want = simulate(gpipe(p, m)).bubble_fraction
        got = mod.gpipe_bubble(p, m)
        if not math.isclose(got, want, rel_tol=CONTRACT):
            raise Wrong(f"gpipe_bubble({p}, {m}) = {got}, the simulated GPipe schedule idles "
                        f"{want:.6f} of its rank-time")
        peaks = peak_inflight_microbatches(one_f_one_b(p, m))
        for rank in range(p):
            if mod.one_f_one_b_peak(p, m, rank) != peaks[rank]:
                raise Wrong(f"one_f_one_b_peak({p}, {m}, rank={rank}) = "
                            f"{mod.one_f_one_b_peak(p, m, rank)}, but rank {rank} of a 1F1B "
                            f"schedule holds at most {peaks[rank]} microbatches' activations")
    return ("gpipe_bubble and one_f_one_b_peak agree with refpar's simulated schedules; "
            + _check_v_schedule(Path(mod.__file__).with_name(V_CSV)) + "; " + _check_executor(mod, comm))


class _Stage:
    """Stage r of a pipeline of tanh(x @ W_s) layers, as exercise 8's part 3 drives it: it records
    the order of its forwards and backwards, holds each microbatch's activations from its forward to
    its backward, and accumulates its weight gradient. The last stage's loss is the sum of
    y * target over the microbatches, divided by m."""

    def __init__(self, r: int, p: int, m: int, inputs, targets, w):
        self.r, self.p, self.m, self.inputs, self.targets, self.w = r, p, m, inputs, targets, w
        self.shape = inputs[0].shape  # (B, D) every activation and gradient
        self.kept: dict[int, tuple] = {}  # microbatch -> (x, y) until its backward
        self.order: list[str] = []
        self.peak = 0
        self.dw = np.zeros_like(w)  # (D, D)

    def forward(self, j: int, x):
        if j in self.kept or not 0 <= j < self.m:
            raise Wrong(f"stage {self.r} ran the forward of microbatch {j} "
                        + ("twice" if j in self.kept else f"of m={self.m}"))
        x = self.inputs[j] if self.r == 0 else np.asarray(x, dtype=np.float64)  # (B, D)
        y = np.tanh(x @ self.w)  # (B, D)
        self.kept[j] = (x, y)
        self.order.append(f"F{j}")
        self.peak = max(self.peak, len(self.kept))
        return y

    def backward(self, j: int, dy):
        if j not in self.kept:
            raise Wrong(f"stage {self.r} ran the backward of microbatch {j} before its forward")
        x, y = self.kept.pop(j)
        dy = self.targets[j] / self.m if self.r == self.p - 1 else np.asarray(dy, dtype=np.float64)
        dpre = dy * (1 - y * y)  # (B, D)
        self.dw += x.T @ dpre  # (D, D)
        self.order.append(f"B{j}")
        return dpre @ self.w.T  # (B, D)


def _check_executor(mod, comm) -> str:
    """Part 3: a 1F1B step on the pp ranks, against refpar's 1F1B order and one device's gradients."""
    from refpar.schedules.builders import one_f_one_b

    p, r = comm.size, comm.rank
    for m, (B, D) in ((4, (3, 5)), (1, (2, 4))):  # m=1 < p: no steady state at all
        rng = np.random.default_rng([6, m])
        ws = [rng.standard_normal((D, D)) / np.sqrt(D) for _ in range(p)]  # (D, D) each stage's
        inputs, targets = rng.standard_normal((m, B, D)), rng.standard_normal((m, B, D))
        stage = _Stage(r, p, m, inputs, targets, ws[r])
        mod.one_f_one_b(stage, m, comm)
        want_order = [f"{a.kind}{a.microbatch}" for a in one_f_one_b(p, m)[r] if a is not None]
        if stage.order != want_order:
            raise Wrong(f"with m={m} microbatches on {p} stages, rank {r} ran {' '.join(stage.order)}; "
                        f"1F1B runs {len(want_order)} passes, at most {min(p - r, m)} microbatches held at "
                        f"once here: how many forwards before the first backward, and then?")
        whole = [_Stage(s, p, m, inputs, targets, ws[s]) for s in range(p)]  # one device: stage by stage
        for j in range(m):
            x = None
            for s in whole:
                x = s.forward(j, x)
            dy = None
            for s in reversed(whole):
                dy = s.backward(j, dy)
        close(stage.dw, whole[r].dw, f"rank {r}'s weight gradient with m={m}",
               lambda i: f"row {i[0]}, column {i[1]}")
    return f"one_f_one_b runs 1F1B's order on {p} ranks and accumulates one device's gradients"


def _check_v_schedule(path: Path) -> str:
    """Part 2: a zero-bubble V schedule for p = 2, m = 4, written by hand in torch's CSV."""
    from refpar.schedules import ScheduleError
    from refpar.schedules.builders_v import v_placement
    from refpar.schedules.formats import from_csv
    from refpar.schedules.simulate import Costs, peak_inflight_microbatches, simulate, validate

    p, m = V_RANKS, V_MICROBATCHES
    where = shown(path)
    if not path.exists():
        raise Wrong(f"part 2 goes in {where}, next to your Python file: a V schedule as a CSV")
    text = path.read_text()
    if not text.strip():
        raise NotImplementedError(f"write part 2, {where} (a V schedule for p={p} ranks and m={m} "
                                  "microbatches as torch's CSV, one row per rank), next to part 1")
    try:
        schedule = from_csv(text)
        lay = validate(schedule)
    except ScheduleError as err:
        raise Wrong(f"{err} (refpar schedule --from-csv {where} marks it in the grid)") from None
    if len(schedule) != p or lay.stage_rank != v_placement(p) or lay.n_microbatches != m:
        where = ", ".join(f"stage {s} on rank {r}" for s, r in sorted(lay.stage_rank.items()))
        raise Wrong(f"{where} has {where} and {lay.n_microbatches} microbatches; the V puts stages 0 "
                    f"and 3 on rank 0, 1 and 2 on rank 1, and runs m={m} microbatches")
    copied = _builder_that_prints(schedule, p, m)
    if copied:
        raise Wrong(f"{where} is the schedule `refpar schedule {copied} -p {p} -m {m} --csv` prints; "
                    "part 2 asks for one you build yourself, tick by tick, from the V's dependencies "
                    "(there are several that pass)")
    timeline = simulate(schedule, Costs(1, 1, 1))
    for rank in range(p):
        idle = timeline.inner_idle_time(rank)
        if idle:
            raise Wrong(f"rank {rank} idles {idle:g} tick{'s' * (idle != 1)} between its first and its "
                        "last action (every pass 1 tick); split each backward into I and W and put a W "
                        "where the rank would wait")
    peak = max(peak_inflight_microbatches(schedule).values())
    if peak > 2 * p:
        raise Wrong(f"a rank holds {peak} stage-microbatches at once; 1F1B's memory is {2 * p} of these "
                    "half stages: run a microbatch's B and W sooner")
    return (f"your V schedule validates, holds at most {peak} stage-microbatches per rank and never "
            "idles between a rank's first and last action")


def _builder_that_prints(schedule, p: int, m: int) -> str | None:
    """The refpar builder whose schedule for (p, m) this one is, action for action, or None."""
    from refpar.schedules.builders import BUILDERS, build
    from refpar.schedules.formats import to_csv

    mine = to_csv(schedule)
    for name in BUILDERS:
        try:
            if to_csv(build(name, p, m)) == mine:
                return name
        except (ConfigError, ValueError):  # a builder that does not take this p and m
            continue
    return None
