"""The checkers of the course's exercises (lessons/exercises/NN_name.py): `refpar lesson check N`.

Each checker loads the learner's file, calls the function(s) the learner wrote and compares them
with refpar's own answer, raising `Wrong("a sentence a learner can act on")` at the first
difference. Exercises about ranks run under `mpiexec -n ranks`: every rank runs the checker and
rank 0 prints the first problem any rank found.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lessons.checkers.capstone import check_16
from lessons.checkers.common import CONTRACT, Wrong
from lessons.checkers.common import close as _close
from lessons.checkers.memory import check_02
from lessons.checkers.overlap import check_09
from lessons.checkers.seconds import check_05
from lessons.course import LESSONS, ROOT, argv, command_env
from refpar.comm.diagnosis import CollectiveTimeout, timeout_from_env
from refpar.config import ConfigError
from refpar.sharding import shard_range

# Seconds a rank of an exercise may wait for a message before it is told why: the exercises' messages
# are a few hundred bytes, which arrive in milliseconds even on 4 ranks sharing 2 busy cores.
WAIT_S = 4


@dataclass(frozen=True)
class Exercise:
    number: int
    file: str  # under lessons/exercises/ (the blank) and lessons/solutions/ (the reference)
    ranks: int  # 1: runs in this process; more: under mpiexec -n ranks
    check: Callable  # check(module, comm) -> a line saying what passed; raises Wrong
    hint: str = ""  # what a deadlock in this exercise usually is, after "in the same order"


def _allgather(comm, obj) -> list:
    """Every rank's small object, on every rank, under `comm`'s timeout (MPI's own allgather would
    wait for a rank that stopped for ever)."""
    return comm.broadcast_object(comm.gather_object(obj))


def _learner_line(path: Path) -> str:
    """'line N, `code`' of the innermost frame of the learner's file now on the stack."""
    frames = [f for f in traceback.extract_stack() if _same_file(f.filename, path)]
    return f"line {frames[-1].lineno}, `{frames[-1].line}`" if frames else "your code"


def _same_file(filename: str, path: Path) -> bool:
    try:
        return Path(filename).resolve() == path.resolve()
    except OSError:
        return False


class _Teaching:
    """The communicator a learner's exercise gets: refpar's, except that before each collective the
    ranks compare what they are about to call (the op, the array's shape and dtype, and which of the
    checker's arrays it is when it is one) and stop with the difference named, instead of summing
    different arrays into silently wrong numbers. It counts the calls, too."""

    def __init__(self, comm, path: Path, known: dict[str, np.ndarray] | None = None):
        self.comm, self.rank, self.size, self.path = comm, comm.rank, comm.size, path
        self.known = known or {}
        self.calls: list[tuple[str, tuple]] = []  # (op, the input's shape) of each call, in order

    def all_reduce(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        self._agree("all_reduce", x, op)
        return self.comm.all_reduce(x, op=op, algo=algo, tag=tag)

    def reduce_scatter(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        self._agree("reduce_scatter", x, op)
        return self.comm.reduce_scatter(x, op=op, algo=algo, tag=tag)

    def all_gather(self, x, algo: str = "native", tag: str = "", counts=None):
        self._agree("all_gather", x, "", rows_may_differ=True)  # uneven shards are legitimate
        return self.comm.all_gather(x, algo=algo, tag=tag, counts=counts)

    def _agree(self, name: str, x, op: str, rows_may_differ: bool = False) -> None:
        x = np.asarray(x)
        which = next((k for k, v in self.known.items() if v.shape == x.shape and np.array_equal(v, x)), None)
        self.calls.append((name, tuple(x.shape)))
        shape = ("*", *x.shape[1:]) if rows_may_differ and x.ndim else tuple(x.shape)
        mine = (name, op, shape, x.dtype.name, which)
        every = _allgather(self.comm, (mine, _learner_line(self.path)))
        if len({call for call, _ in every}) == 1:
            return
        k = len(self.calls)
        said = "; ".join(f"rank {r} {c[0]}({c[4] or 'an array'} of shape {c[2]}, {c[3]}"
                         + (f", op={c[1]!r}" if c[1] else "") + f") at {line}"
                         for r, (c, line) in enumerate(every))
        raise Wrong(f"your ranks' collective number {k} differs: {said}. Every rank must call the same "
                    "collectives in the same order on matching arrays, or MPI combines the wrong ones")


@dataclass(frozen=True)
class Verdict:
    """One rank's result; rank 0 combines every rank's (`_combine`)."""

    ok: bool
    sentence: str
    raised_at: float | None = None  # time.time() when the learner's code raised
    waits_in: str | None = None  # timed out waiting: where in the learner's code ("" in the checker's)


# ------------------------------------------------------------------------------------- 00
def check_00(mod, comm) -> str:
    for n in (10, 12, 3, 0):
        got = tuple(int(v) for v in mod.my_rows(n, comm.size, comm.rank))
        everyone = _allgather(comm, got)  # every rank judges the same list, so all raise together
        stops = [0] + [b for _, b in everyone]
        if any(a != s for (a, _), s in zip(everyone, stops, strict=False)) or stops[-1] != n:
            raise Wrong(f"with n={n} rows on {comm.size} ranks the ranks got {everyone}: together "
                        f"they must cover rows 0..{n} once, in rank order, with no gap or overlap")
        sizes = [b - a for a, b in everyone]
        if max(sizes) - min(sizes) > 1 or sizes != sorted(sizes, reverse=True):
            raise Wrong(f"with n={n} rows on {comm.size} ranks the sizes are {sizes}: they should "
                        "differ by at most one, the extra rows going to the first ranks")
        for rank, rows in enumerate(everyone):
            if rows != shard_range(n, comm.size, rank):
                raise Wrong(f"rank {rank} got rows {rows} of n={n}, expected "
                            f"{shard_range(n, comm.size, rank)}")
    return f"my_rows splits rows evenly over {comm.size} ranks, the first ranks taking the extra ones"


# ------------------------------------------------------------------------------------- 01
def check_01(mod, comm) -> str:
    from refpar.comm.communicator import _Link

    p, r = comm.size, comm.rank
    for n in (p * 5, p * 5 + 3, 1):
        x = np.random.default_rng([n, r]).standard_normal(n)  # (n,) a different vector per rank
        before = x.copy()
        link = _Link(comm)
        got = mod.ring_all_reduce(link, x)
        want = comm.all_reduce(before)
        problem = None
        try:
            _one_ring_result(x, before, got, want, link, n, p, r)
        except Wrong as err:
            problem = str(err)
        problems = [m for m in _allgather(comm, problem) if m]  # all ranks stop together
        if problems:
            raise Wrong(problems[0])
    return (f"ring_all_reduce sums exactly like MPI on {p} ranks and each rank sends 2(p-1) chunks, "
            "2(n - n/p) elements")


def _chunk_of(i: int, n: int, p: int) -> str:
    """Which of the ring's p chunks element i of n is in (the exercise's `chunks`: shard_range's)."""
    c = next(c for c in range(p) if shard_range(n, p, c)[0] <= i < shard_range(n, p, c)[1])
    a, b = shard_range(n, p, c)
    return f"in chunk {c} of {p}, elements {a}..{b - 1}"


def _one_ring_result(x, before, got, want, link, n, p, r) -> None:
    from refpar.comm import cost

    if not np.array_equal(x, before):
        raise Wrong("ring_all_reduce changed its input x; work on a copy")
    _close(got, want, f"rank {r}'s sum of {n} elements", lambda i: _chunk_of(i, n, p))
    expect = cost.all_reduce_bytes(n, p, r, 8, "ring").sent
    if link.sent != expect:
        raise Wrong(f"rank {r} sent {link.sent} bytes for n={n} float64 elements on {p} ranks; a "
                        f"ring all-reduce sends 2 (p-1) chunks, {expect} bytes here: reduce-scatter "
                        "p-1 chunks, then all-gather p-1 chunks")


# ------------------------------------------------------------------------------------- 03
def _least_squares_grad(w, x, y):
    """Gradient of mean((x @ w - y)^2) over the rows of x."""
    return 2 * x.T @ (x @ w - y) / len(y)  # (C,)


def check_03(mod, comm) -> str:
    rng = np.random.default_rng(0)
    x, y, w = rng.standard_normal((8, 5)), rng.standard_normal(8), rng.standard_normal(5)
    a, b = shard_range(8, comm.size, comm.rank)
    local = {"w": _least_squares_grad(w, x[a:b], y[a:b]), "b": np.array([float(comm.rank + 1)])}
    got = mod.average_gradients(local, _Teaching(comm, Path(mod.__file__),
                                                 {f"grads[{k!r}]": v for k, v in local.items()}))
    if not isinstance(got, dict) or set(got) != {"w", "b"}:
        raise Wrong("average_gradients must return a dict with the same names as its input")
    _close(got["b"], [np.mean(np.arange(1, comm.size + 1))], "the average of gradients 1 and 2")
    _close(got["w"], _least_squares_grad(w, x, y),
           "the averaged gradient (it should equal the gradient of the whole batch)")
    return (f"average_gradients over {comm.size} ranks gives the whole batch's gradient: the mean of "
            "equal shards' mean losses is the mean loss")


# ------------------------------------------------------------------------------------- 04
# AdamW's settings in exercise 4's file, repeated: the learner's file must not set the checker's answer
ADAMW_03, LR_03 = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}, 0.01


def check_04(mod, comm) -> str:
    from types import SimpleNamespace

    from refpar.model.optim import adamw_update

    P, r, path = comm.size, comm.rank, Path(mod.__file__)
    for n, t in ((10, 1), (7, 3)):  # 7 rows: uneven shards; t = 3: moments from earlier steps
        rng = np.random.default_rng([3, n])
        param = rng.standard_normal(n)  # (n,) the same on every rank
        grads = rng.standard_normal((P, n))  # (P, n) every rank's gradient: the checker knows them all
        m0, v0 = (0.1 * rng.standard_normal(n), 0.01 * rng.random(n)) if t > 1 else (np.zeros(n), np.zeros(n))
        # the single device: one AdamW step of the whole parameter on the whole batch's mean gradient
        want = adamw_update(param.copy(), grads.mean(axis=0), m0.copy(), v0.copy(), t,
                            SimpleNamespace(**ADAMW_03), decay=True, lr=LR_03)
        a, b = shard_range(n, P, r)
        dp = _Teaching(comm, path, {"grad": grads[r], "param": param})
        got = mod.zero2_step(param.copy(), grads[r].copy(), m0[a:b].copy(), v0[a:b].copy(), t, dp)
        if not isinstance(got, tuple) or len(got) != 3:
            raise Wrong("zero2_step must return three arrays: (param, m, v)")
        ops = [op for op, _ in dp.calls]
        if "all_reduce" in ops:
            raise Wrong(f"your step calls {', '.join(ops)}: an all-reduce leaves every rank the whole "
                        "summed gradient, which ZeRO-2 never holds; which collective gives each rank "
                        "only its rows of the sum?")
        def row(i, a=a):
            return f"row {a + i}"

        def owner(i, n=n):
            return f"row {i}, which rank {next(q for q in range(P) if i < shard_range(n, P, q)[1])} updates"

        _close(got[1], want[1][a:b], f"rank {r}'s new m, rows {a}..{b - 1} of n={n}, step t={t}", row)
        _close(got[2], want[2][a:b], f"rank {r}'s new v, rows {a}..{b - 1} of n={n}, step t={t}", row)
        _close(got[0], want[0], f"rank {r}'s new parameter (n={n}, step t={t})", owner)
        if dp.calls != [("reduce_scatter", (n,)), ("all_gather", (b - a,))]:
            raise Wrong(f"your step calls {', '.join(f'{op}{shape}' for op, shape in dp.calls)}; ZeRO-2 "
                        f"moves exactly an all-reduce's bytes, 2 (n - n/{P}) elements per rank: one "
                        "collective of the whole gradient, one of this rank's rows")
    return (f"zero2_step equals one AdamW step on one device over {P} ranks, uneven rows included, "
            "each rank holding only its rows' moments and sending an all-reduce's bytes")


# ------------------------------------------------------------------------------------- 06
def check_06(mod, comm) -> str:
    B, C, tp, r = 6, 8, comm.size, comm.rank
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, C))  # (B, C) the same on every tp rank
    w_fc, w_proj = rng.standard_normal((C, 4 * C)), rng.standard_normal((4 * C, C))
    a, b = shard_range(4 * C, tp, r)
    counting = _Teaching(comm, Path(mod.__file__), {"x": x})
    got = mod.tp_mlp_forward(x, w_fc[:, a:b], w_proj[a:b, :], counting)  # (B, C)
    _close(got, np.tanh(x @ w_fc) @ w_proj, f"rank {r}'s MLP output", lambda i: f"row {i} of the batch")
    if len(counting.calls) != 1:
        raise Wrong(f"your forward made {len(counting.calls)} collectives; Megatron's MLP needs "
                    "exactly one all-reduce: which of the two products leaves each rank a partial sum?")
    return f"tp_mlp_forward equals the unsharded MLP on {tp} ranks with one all-reduce"


# ------------------------------------------------------------------------------------- 07
def _attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])  # (Tq, Tk)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(axis=-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[:, 0]


def check_07(mod, comm) -> str:
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((6, 4)) * 3 for _ in range(3))
    o_full, lse_full = _attention(q, k, v)
    for split in (1, 3, 5):
        o1, l1 = _attention(q, k[:split], v[:split])
        o2, l2 = _attention(q, k[split:], v[split:])
        # Scores 800 higher give the same attention and every lse 800 higher: exp(800) overflows float64
        for shift in (0.0, 800.0):
            _merged_matches(mod, (o1, l1 + shift, o2, l2 + shift), (o_full, lse_full + shift),
                            f"keys split at {split}" + (", every score and lse 800 higher" if shift else ""))
    # A causal mask hides a whole block from some queries (ring attention's blocks of later keys):
    # there the block's output is 0 and its lse -inf, and the merge must give the other block's own.
    o1, l1 = _attention(q, k[:3], v[:3])
    o2, l2 = _attention(q, k[3:], v[3:])
    hidden1, hidden2 = np.array([0, 1, 0, 0, 0, 0], bool), np.array([0, 0, 0, 1, 1, 0], bool)  # (Tq,)
    o1, l1 = np.where(hidden1[:, None], 0.0, o1), np.where(hidden1, -np.inf, l1)
    o2, l2 = np.where(hidden2[:, None], 0.0, o2), np.where(hidden2, -np.inf, l2)
    want_o = np.where(hidden1[:, None], o2, np.where(hidden2[:, None], o1, o_full))  # (Tq, D)
    want_lse = np.where(hidden1, l2, np.where(hidden2, l1, lse_full))  # (Tq,)
    for shift in (0.0, 800.0):
        _merged_matches(mod, (o1, l1 + shift, o2, l2 + shift), (want_o, want_lse + shift),
                        "query 1 sees no key of block 1, queries 3 and 4 none of block 2 (o 0, lse -inf "
                        "there)" + (", every score and lse 800 higher" if shift else ""))
    return ("merge_attention combines two blocks of keys exactly, at scores of 800 and with blocks a query "
            "cannot see; " + _check_ring(mod, comm))


class _CountingP2P:
    """The cp communicator exercise 7's ring gets: refpar's point-to-point calls, counting the bytes
    this rank sends."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.sent = comm, comm.rank, comm.size, 0

    def isend(self, x, dest: int, tag: str = ""):
        self.sent += np.asarray(x).nbytes
        return self.comm.isend(x, dest, tag=tag)

    def irecv(self, shape, dtype, source: int, tag: str = ""):
        return self.comm.irecv(shape, dtype, source, tag=tag)

    def send(self, x, dest: int, tag: str = ""):
        self.sent += np.asarray(x).nbytes
        return self.comm.send(x, dest, tag=tag)

    def recv(self, shape, dtype, source: int, tag: str = ""):
        return self.comm.recv(shape, dtype, source, tag=tag)


def _causal_attention(q, k, v):
    """(T, D) each, one sequence -> (o (T, D), lse (T,)) of causal attention, on one device."""
    T = q.shape[0]
    s = np.where(np.tril(np.ones((T, T), bool)), q @ k.T / np.sqrt(q.shape[-1]), -np.inf)  # (T, T)
    m = s.max(axis=-1, keepdims=True)  # (T, 1): finite, every query sees itself
    e = np.exp(s - m)
    return e @ v / e.sum(axis=-1, keepdims=True), m[:, 0] + np.log(e.sum(axis=-1))


def _check_ring(mod, comm) -> str:
    """Part 2: ring attention over the cp ranks with zig-zag chunks, against one device's."""
    from refpar.parallel.context_parallel import zigzag_positions

    P, r = comm.size, comm.rank
    for T, D in ((8, 4), (14, 3)):  # 14: chunks of 4 and 3 positions
        rng = np.random.default_rng([5, T])
        q, k, v = (rng.standard_normal((T, D)) * 3 for _ in range(3))  # (T, D) each, the whole sequence
        want_o, want_lse = _causal_attention(q, k, v)
        pos = zigzag_positions(T, P, r)  # (T_local,) chunks r and 2P - 1 - r
        cp = _CountingP2P(comm)
        got = mod.ring_attention(q[pos].copy(), k[pos].copy(), v[pos].copy(), pos.copy(), cp)
        if not isinstance(got, tuple) or len(got) != 2:
            raise Wrong("ring_attention must return two arrays: (out, lse)")

        def at(i, pos=pos):
            return f"the query at position {pos[i if isinstance(i, int) else i[0]]}"

        case = f"T={T} over {P} ranks, rank {r} holding positions {pos.tolist()}"
        _close(got[1], want_lse[pos], f"rank {r}'s log-sum-exp ({case})", at)
        _close(got[0], want_o[pos], f"rank {r}'s attention output ({case})", at)
        most = (P - 1) * (2 * k[pos].nbytes + pos.size * 8)
        if cp.sent > most:
            raise Wrong(f"rank {r} sent {cp.sent} bytes for T={T}; passing each other rank's keys, values "
                        f"and their positions once around the ring takes {most}: what else travels?")
    return f"ring_attention over {P} ranks with zig-zag chunks equals causal attention on one device"


def _merged_matches(mod, blocks, want, case: str) -> None:
    got = mod.merge_attention(*(b.copy() for b in blocks))
    if not isinstance(got, tuple) or len(got) != 2:
        raise Wrong("merge_attention must return two arrays: (out, lse)")
    def query(i):
        return f"query {i if isinstance(i, int) else i[0]}"
    _close(got[1], want[1], f"the merged log-sum-exp ({case})", query)
    _close(got[0], want[0], f"the merged attention output ({case})", query)


# ------------------------------------------------------------------------------------- 08
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
        _close(stage.dw, whole[r].dw, f"rank {r}'s weight gradient with m={m}",
               lambda i: f"row {i[0]}, column {i[1]}")
    return f"one_f_one_b runs 1F1B's order on {p} ranks and accumulates one device's gradients"


def _check_v_schedule(path: Path) -> str:
    """Part 2: a zero-bubble V schedule for p = 2, m = 4, written by hand in torch's CSV."""
    from refpar.schedules import ScheduleError
    from refpar.schedules.builders_v import v_placement
    from refpar.schedules.formats import from_csv
    from refpar.schedules.simulate import Costs, peak_inflight_microbatches, simulate, validate

    p, m = V_RANKS, V_MICROBATCHES
    shown = _shown(path)
    if not path.exists():
        raise Wrong(f"part 2 goes in {shown}, next to your Python file: a V schedule as a CSV")
    text = path.read_text()
    if not text.strip():
        raise NotImplementedError(f"write part 2, {shown} (a V schedule for p={p} ranks and m={m} "
                                  "microbatches as torch's CSV, one row per rank), next to part 1")
    try:
        schedule = from_csv(text)
        lay = validate(schedule)
    except ScheduleError as err:
        raise Wrong(f"{err} (refpar schedule --from-csv {shown} marks it in the grid)") from None
    if len(schedule) != p or lay.stage_rank != v_placement(p) or lay.n_microbatches != m:
        where = ", ".join(f"stage {s} on rank {r}" for s, r in sorted(lay.stage_rank.items()))
        raise Wrong(f"{shown} has {where} and {lay.n_microbatches} microbatches; the V puts stages 0 "
                    f"and 3 on rank 0, 1 and 2 on rank 1, and runs m={m} microbatches")
    copied = _builder_that_prints(schedule, p, m)
    if copied:
        raise Wrong(f"{shown} is the schedule `refpar schedule {copied} -p {p} -m {m} --csv` prints; "
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


# ------------------------------------------------------------------------------------- 10
def _queue_positions(choices: np.ndarray, n_experts: int) -> np.ndarray:
    """(N, k) the whole batch's choices -> (N, k) each assignment's place in its expert's queue:
    slot 0 of every token in token order, then slot 1, ... (an independent loop, not refpar's router)."""
    seen, place = np.zeros(n_experts, dtype=int), np.zeros(choices.shape, dtype=int)
    for j in range(choices.shape[1]):
        for t in range(choices.shape[0]):
            place[t, j] = seen[choices[t, j]]
            seen[choices[t, j]] += 1
    return place


def check_10(mod, comm) -> str:
    P, r = comm.size, comm.rank
    for n, e, k, f in ((16, 4, 2, 1.0), (10, 4, 1, 1.25), (7, 3, 2, 0.5)):
        want = math.ceil(n * k * f / e)
        if mod.capacity(n, e, k, f) != want:
            raise Wrong(f"capacity(n_tokens={n}, experts={e}, top_k={k}, factor={f}) = "
                        f"{mod.capacity(n, e, k, f)}, expected {want}")
    rng = np.random.default_rng(7)
    for n, e, k, cap in ((16, 4, 2, 3), (9, 3, 1, 2), (16, 4, 2, 8), (12, 4, 2, 4)):
        choices = np.stack([rng.permutation(e)[:k] for _ in range(n)])  # (N, k) the whole batch's
        place = _queue_positions(choices, e)  # (N, k)
        a, b = shard_range(n, P, r)
        ep = _Teaching(comm, Path(mod.__file__), {"choices": choices[a:b]})
        got = np.asarray(mod.kept(choices[a:b].copy(), e, cap, ep))
        if got.shape != (b - a, k):
            raise Wrong(f"kept(...) returned shape {got.shape} on rank {r}; it should be {(b - a, k)}, "
                        "one entry per assignment of this rank's tokens")
        wrong = np.argwhere(got.astype(bool) != (place[a:b] < cap))  # (w, 2)
        if len(wrong):
            t, j = (int(i) for i in wrong[0])
            said = "keep" if got[t, j] else "drop"
            raise Wrong(f"rank {r}'s kept(...) is wrong for {len(wrong)} of {got.size} assignments ({n} "
                        f"tokens on {P} ranks, {e} experts, top-{k}, capacity {cap}); the first is token "
                        f"{a + t}'s choice {j + 1}, expert {choices[a + t, j]}: you {said} it, but "
                        f"{place[a + t, j]} assignments are ahead of it in that expert's queue")
        sent = sum(math.prod(shape) for _, shape in ep.calls)
        if sent > k * e:
            raise Wrong(f"kept(...) exchanged {sent} numbers per rank for {b - a} tokens; {k * e} suffice "
                        "whatever the number of tokens: what does a rank need to know about the others?")
    return ("capacity and kept agree with the queue order over the whole batch on "
            f"{P} ranks, exchanging a few counts per rank")


# ------------------------------------------------------------------------------------- 11
def check_11(mod, comm) -> str:
    for sizes in ({"pp": 2, "dp": 2, "tp": 2}, {"pp": 4, "dp": 1, "tp": 2}, {"pp": 2, "dp": 3, "tp": 4}):
        grid = np.arange(sizes["pp"] * sizes["dp"] * sizes["tp"]).reshape(
            sizes["pp"], sizes["dp"], sizes["tp"])
        for rank in range(grid.size):
            pp, dp, tp = (int(c) for c in np.unravel_index(rank, grid.shape))
            want = {"pp": pp, "dp": dp, "tp": tp}
            got = mod.coords(rank, dict(sizes))
            if got != want:
                raise Wrong(f"coords({rank}, {sizes}) = {got}, expected {want}: tp varies fastest, "
                            "then dp, and pp slowest (ranks = arange(world).reshape(pp, dp, tp))")
    r = comm.rank
    for sizes in ({"pp": 1, "dp": 2, "tp": 2}, {"pp": 2, "dp": 1, "tp": 2}, {"pp": 2, "dp": 2, "tp": 1}):
        grid = np.arange(comm.size).reshape(sizes["pp"], sizes["dp"], sizes["tp"])
        pp, dp, tp = (int(c) for c in np.unravel_index(r, grid.shape))
        lines = {"pp": grid[:, dp, tp], "dp": grid[pp, :, tp], "tp": grid[pp, dp, :]}
        groups = mod.mesh_groups(comm, dict(sizes))
        if not isinstance(groups, dict) or set(groups) != set(lines):
            raise Wrong("mesh_groups must return a dict with a communicator for each of pp, dp and tp")
        problem = None
        for axis, line in lines.items():
            g, want = groups[axis], tuple(int(x) for x in line)
            if problem is None and (g is None or tuple(g.group) != want):
                problem = (f"on mesh {sizes}, rank {r}'s {axis} group holds world ranks "
                           f"{None if g is None else list(g.group)} in that order; it should hold "
                           f"{list(want)}: which ranks share a color, and what orders them?")
        problems = [m for m in _allgather(comm, problem) if m]  # all ranks stop before talking in groups
        if problems:
            raise Wrong(problems[0])
        for axis, line in lines.items():
            g, want = groups[axis], tuple(int(x) for x in line)
            total = g.all_reduce(np.array([float(r)]), tag=f"{axis}:check")  # (1,) it really talks
            if total[0] != sum(want):
                raise Wrong(f"rank {r}'s {axis} communicator summed {total[0]:g}, not {sum(want)}")
    return ("coords and mesh_groups lay ranks out as refpar's DeviceMesh (and Megatron) do, each "
            "group a working communicator made by Comm_split")


# ------------------------------------------------------------------------------------- 12
def check_12(mod, comm) -> str:
    rng = np.random.default_rng(9)
    for counts in ([16, 16, 16], [16, 3, 9, 1], [5]):
        losses = [rng.random(c) * 4 for c in counts]  # per-token losses of each microbatch
        sums = [float(v.sum()) for v in losses]
        want = float(np.concatenate(losses).mean())
        got = mod.global_mean_loss(sums, list(counts))
        if not math.isclose(got, want, rel_tol=CONTRACT):
            raise Wrong(f"global_mean_loss = {got:.6f} for microbatches of {counts} tokens; the mean "
                        f"over every token is {want:.6f} (the mean of the microbatches' means "
                        "weights a token of a short microbatch more)")
    return "global_mean_loss weights every token once, however the microbatches are cut"


# ------------------------------------------------------------------------------------- 13
def check_13(mod, comm) -> str:
    from refpar.analysis.memory import Options, model_state_bytes, precision_options, unit_sizes
    from refpar.config import model_preset

    for model in (model_preset("tiny"), model_preset("tiny", n_layer=2, n_embd=48, vocab_size=101)):
        sizes = unit_sizes(model)
        for fp32_grads in (False, True):
            fields = precision_options("bfloat16", fp32_grads)
            for stage in (0, 1, 2, 3):
                opts = Options(strategy="dp" if stage == 0 else f"zero{stage}", **fields)
                for n in (1, 2, 3, 4, 7):
                    for rank in range(n):
                        want = model_state_bytes(model, n, rank, opts)
                        got = mod.model_state_bytes(dict(sizes), n, rank, stage, fp32_grads)
                        if not isinstance(got, dict) or set(got) != set(want):
                            raise Wrong("model_state_bytes must return a dict with the keys params, "
                                        "grads, master and optimizer")
                        for category, value in want.items():
                            if got[category] != value:
                                raise Wrong(
                                    f"{category} on rank {rank} of n={n}, ZeRO-{stage}"
                                    f"{' with fp32_grads' if fp32_grads else ''}, units {sizes}: "
                                    f"{got[category]}, the ledger measures {value}. Bytes per "
                                    "element: params 2, grads 2 (4 with fp32_grads, and DP/ZeRO-1 "
                                    "then keep the bf16 gradient too), master 4, optimizer 8; a "
                                    "sharded category holds this rank's part of every unit")
    return ("model_state_bytes equals the bytes refpar's ledger measures for DP and ZeRO-1/2/3 in "
            "bf16-mixed, uneven shards and fp32 gradients included")


# ------------------------------------------------------------------------------------- 14
def check_14(mod, comm) -> str:
    from refpar.analysis.flops import step_flops
    from refpar.analysis.presets import from_model_config
    from refpar.config import RECOMPUTE, model_preset

    why = {"none": "count each product of the docstring's list once in the forward and twice in the "
                   "backward; is the attention core's s x s square in, and the head?",
           "selective": "what runs again is each block's attention core, nothing else",
           "full": "what runs again is each block's whole forward, not the head's"}
    for (B, s), model in (((8, 16), model_preset("tiny")), ((8, 256), model_preset("small")),
                          ((2, 1024), model_preset("tiny", n_layer=12, n_embd=768, n_head=12,
                                                   vocab_size=50257, n_positions=1024))):
        L, h, V = model.n_layer, model.n_embd, model.vocab_size
        for mode in RECOMPUTE:  # none first: its terms are in the other two
            want = int(step_flops(from_model_config(model), B, s, mode))
            got = mod.step_flops(B, s, L, h, V, mode)
            if got != want:
                others = [m for m in RECOMPUTE if m != mode and
                          got == int(step_flops(from_model_config(model), B, s, m))]
                like = f", the count for {others[0]!r}" if others else ""
                raise Wrong(f"step_flops(B={B}, s={s}, L={L}, h={h}, V={V}, {mode!r}) = {got}{like}; "
                            f"refpar's ranks run {want} together ({got / want:.4f} of it): {why[mode]}")
    return "step_flops counts what refpar's GEMMs run, with and without recomputation, for three GPT-2 sizes"


EXERCISES = {e.number: e for e in (
    Exercise(0, "00_first_mpiexec.py", 3, check_00),
    Exercise(1, "01_ring_all_reduce.py", 4, check_01,
             " (in a ring, each rank sends right exactly as often as its right neighbour receives from "
             "the left)"),
    Exercise(2, "02_step_memory.py", 1, check_02),
    Exercise(3, "03_average_gradients.py", 2, check_03),
    Exercise(4, "04_zero_memory.py", 2, check_04),
    Exercise(5, "05_seconds.py", 1, check_05),
    Exercise(6, "06_tp_mlp.py", 2, check_06),
    Exercise(7, "07_merge_attention.py", 2, check_07),
    Exercise(8, "08_pipeline_bubbles.py", 2, check_08),
    Exercise(9, "09_overlap.py", 1, check_09),
    Exercise(10, "10_capacity.py", 2, check_10),
    Exercise(11, "11_mesh_coords.py", 4, check_11),
    Exercise(12, "12_loss_normalisation.py", 1, check_12),
    Exercise(13, "13_mixed_precision_memory.py", 1, check_13),
    Exercise(14, "14_step_flops.py", 1, check_14),
    Exercise(16, "16_capstone.py", 1, check_16),
)}


def exercise(n: int) -> Exercise:
    if n not in EXERCISES:
        raise ConfigError(f"lesson {n} has no exercise; exercises: {', '.join(map(str, EXERCISES))}")
    return EXERCISES[n]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"lesson_exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shown(path: Path) -> str:
    """The path as a learner in the repository root would type it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _verdict(ex: Exercise, path: Path, comm) -> Verdict:
    """This rank's Verdict: passed, wrong (Wrong, still blank), raised (with the learner's frames of
    the traceback) or timed out waiting for a message (with where it waited)."""
    try:
        return Verdict(True, ex.check(_load(path), comm))
    except NotImplementedError as err:
        return Verdict(False, f"the exercise is still blank: {err} (in {_shown(path)})")
    except Wrong as err:
        return Verdict(False, str(err))
    except CollectiveTimeout as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if _same_file(f.filename, path)]
        return Verdict(False, "", waits_in=f"line {frames[-1].lineno}, `{frames[-1].line}`" if frames else "")
    except Exception as err:  # the learner's code failed: its own frames, not the checker's
        return Verdict(False, f"your code raised {type(err).__name__}: {err}" + _your_traceback(err, path),
                       raised_at=time.time())


def _your_traceback(err: BaseException, path: Path) -> str:
    """The traceback's frames in the learner's file, as Python prints them, each line indented."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _same_file(f.filename, path)]
    lines = [f'  File "{_shown(path)}", line {f.lineno}, in {f.name}\n    {f.line}' for f in frames]
    if isinstance(err, SyntaxError) and err.lineno is not None:
        lines.append(f'  File "{_shown(path)}", line {err.lineno}\n    {(err.text or "").strip()}')
    return "".join("\n" + line for line in lines)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _combine(verdicts: list[Verdict], timeout: float, hint: str) -> tuple[bool, str]:
    """Every rank's Verdict -> (passed, the sentence rank 0 prints). An error comes first: the rank
    that raised first, with its traceback, since the others' waiting follows from it. Then a wrong
    answer (the first rank's, naming the rank only when the ranks disagree), unless a rank is stuck
    inside the learner's code: then a deadlock, saying where each rank waited."""
    raised = sorted((v.raised_at, r) for r, v in enumerate(verdicts) if v.raised_at is not None)
    if raised:
        first = raised[0][1]
        head, _, frames = verdicts[first].sentence.partition("\n")
        if len(raised) == len(verdicts) and len({v.sentence for v in verdicts}) == 1:
            return False, verdicts[first].sentence  # every rank raised the same: no rank to name
        waited = [r for r, v in enumerate(verdicts) if v.waits_in is not None]
        after = f"\n({_ranks(waited)} then waited for {_ranks([first])}: fix its error first)" \
            if waited else ""
        return False, f"{head} ({_ranks([first])})" + (f"\n{frames}" if frames else "") + after
    waiting = [r for r, v in enumerate(verdicts) if v.waits_in is not None]
    failed = [(r, v.sentence) for r, v in enumerate(verdicts) if not v.ok and v.waits_in is None]
    if failed and not any(verdicts[r].waits_in for r in waiting):  # the others wait in the checker only
        agree = len(failed) == len(verdicts) and len({s for _, s in failed}) == 1
        return False, failed[0][1] + ("" if agree else f" (rank {failed[0][0]})")
    if waiting:
        places: dict[str, list[int]] = {}
        for r, v in enumerate(verdicts):
            places.setdefault(v.waits_in or "", []).append(r)
        said = "; ".join(f"{_ranks(ranks)} waited at {where}" if where else
                         f"{_ranks(ranks)} had returned from your code" for where, ranks in places.items())
        return False, (f"your code did not finish on every rank and no rank raised: after {timeout:g} s "
                       f"without the message it waited for, {said}. Every rank must make the same "
                       f"calls in the same order{hint}")
    return True, verdicts[0].sentence


def check(n: int, path: Path | None = None, timeout: float = 120) -> int:
    """Grades the learner's file for lesson n; prints one verdict; 0 when it passes, else 1."""
    from refpar.cli import under_launcher

    ex = exercise(n)
    path = Path(path) if path else LESSONS / "exercises" / ex.file
    if not path.is_file() or path.suffix != ".py":
        what = "is not a Python file (.py)" if path.is_file() else \
            "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{path} {what}; give --file PATH to your copy of {ex.file}")
    if ex.ranks > 1 and not under_launcher():
        return _launch(n, ex, path, timeout)
    if ex.ranks == 1:
        ok, sentence = _combine([_verdict(ex, path, None)], 0, ex.hint)
        print(f"lesson {n}: {'passed' if ok else 'not yet'}: {sentence}", flush=True)
        return 0 if ok else 1
    from refpar.comm.communicator import abort_on_error, world  # initialises MPI: only under mpiexec

    # Every wait of the learner's code is under a timeout, launched by `check` or by hand: a rank
    # left waiting for a message that never comes says where it waits, instead of hanging.
    wait_s = timeout_from_env() or WAIT_S
    comm = world(timeout=wait_s)
    if comm.size != ex.ranks:
        raise ConfigError(f"lesson {n}'s exercise runs on {ex.ranks} ranks, not {comm.size}; "
                          f"run refpar lesson check {n} without mpiexec")
    mine = _verdict(ex, path, comm)
    try:
        # gathered on a communicator that waits longer than the learner's, so the ranks still
        # stuck in the learner's code time out and report before the gather gives up on them
        verdicts = world(timeout=3 * wait_s).gather_object(mine)
    except CollectiveTimeout:
        if comm.rank == 0:
            print(f"lesson {n}: not yet: a rank was still busy in your code {3 * wait_s:g} s after the "
                  "others had finished: does a loop of yours never end on it?", flush=True)
            with abort_on_error(grace_s=0.1):  # ends the rank still running, and the job
                raise SystemExit(1) from None
        return 1
    if comm.rank != 0:
        return 0 if mine.ok else 1
    ok, sentence = _combine(verdicts, wait_s, ex.hint)
    print(f"lesson {n}: {'passed' if ok else 'not yet'}: {sentence}", flush=True)
    return 0 if ok else 1


def _launch(n: int, ex: Exercise, path: Path, timeout: float) -> int:
    """`refpar lesson check n` outside mpiexec: runs itself under `mpiexec -n ranks` and passes on
    the verdict, without the shutdown noise of ranks that gave up waiting."""
    cmd = argv(f"mpiexec -n {ex.ranks} python -m refpar lesson check {n} --file {path.resolve()}")
    env = command_env()
    env.setdefault("REFPAR_COLLECTIVE_TIMEOUT", str(WAIT_S))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # every wait is under a timeout; this is the last net
        said = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        verdict = [line for line in said.splitlines() if line.startswith(f"lesson {n}: ")]
        print(verdict[0] if verdict else
              f"lesson {n}: not yet: your code did not finish in {timeout:g} s on {ex.ranks} ranks, and no "
              "rank said why: is a rank still computing?", flush=True)
        return 1
    sys.stdout.write(proc.stdout)
    # A rank that gave up waiting leaves its message requests pending, which MPICH lists as it shuts
    # down, and the abort that ends a rank still looping says so: the verdict above has said why.
    sys.stderr.writelines(line for line in proc.stderr.splitlines(keepends=True)
                          if not line.startswith(("MPICH: Builtin communicator", "refpar: error on rank 0")))
    return proc.returncode
