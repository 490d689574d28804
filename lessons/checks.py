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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lessons.course import LESSONS, ROOT, argv, command_env
from refpar.comm.diagnosis import CollectiveTimeout
from refpar.config import ConfigError
from refpar.sharding import shard_range

# Seconds a rank of an exercise may wait for a message before it is told why: the exercises' messages
# are a few hundred bytes, which arrive in milliseconds even on 4 ranks sharing 2 busy cores.
WAIT_S = 4
# A learner's answer sums in its own order (on ranks, in its collective's order) and refpar's in
# another: float64 against one device, relative 1e-10 (DESIGN.md, "Numerics").
CONTRACT = 1e-10


class Wrong(Exception):
    """What is wrong with the learner's answer, in one or two plain sentences."""


@dataclass(frozen=True)
class Exercise:
    number: int
    file: str  # under lessons/exercises/ (the blank) and lessons/solutions/ (the reference)
    ranks: int  # 1: runs in this process; more: under mpiexec -n ranks
    check: Callable  # check(module, comm) -> a line saying what passed; raises Wrong


def _close(got, want, what: str) -> None:
    """got within CONTRACT of want, relative to want's largest entry or to 1 if that is smaller:
    the checks' numbers are O(1), and a sum that cancels to near 0 has no relative accuracy."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise Wrong(f"{what} has shape {got.shape}, it should be {want.shape}")
    diff = float(np.max(np.abs(got - want), initial=0.0))
    if diff > CONTRACT * max(1.0, float(np.max(np.abs(want), initial=0.0))):
        raise Wrong(f"{what} is off by up to {diff:.3g} from the right answer")


# ------------------------------------------------------------------------------------- 00
def check_00(mod, comm) -> str:
    for n in (10, 12, 3, 0):
        got = tuple(int(v) for v in mod.my_rows(n, comm.size, comm.rank))
        everyone = comm.comm.allgather(got)  # every rank judges the same list, so all raise together
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
        problems = [m for m in comm.comm.allgather(problem) if m]  # all ranks stop together
        if problems:
            raise Wrong(problems[0])
    return (f"ring_all_reduce sums exactly like MPI on {p} ranks and each rank sends 2(p-1) chunks, "
            "2(n - n/p) elements")


def _one_ring_result(x, before, got, want, link, n, p, r) -> None:
    from refpar.comm import cost

    if not np.array_equal(x, before):
        raise Wrong("ring_all_reduce changed its input x; work on a copy")
    _close(got, want, f"rank {r}'s sum of {n} elements")
    expect = cost.all_reduce_bytes(n, p, r, 8, "ring").sent
    if link.sent != expect:
        raise Wrong(f"rank {r} sent {link.sent} bytes for n={n} float64 elements on {p} ranks; a "
                        f"ring all-reduce sends 2 (p-1) chunks, {expect} bytes here: reduce-scatter "
                        "p-1 chunks, then all-gather p-1 chunks")


# ------------------------------------------------------------------------------------- 02
def _least_squares_grad(w, x, y):
    """Gradient of mean((x @ w - y)^2) over the rows of x."""
    return 2 * x.T @ (x @ w - y) / len(y)  # (C,)


def check_02(mod, comm) -> str:
    rng = np.random.default_rng(0)
    x, y, w = rng.standard_normal((8, 5)), rng.standard_normal(8), rng.standard_normal(5)
    a, b = shard_range(8, comm.size, comm.rank)
    local = {"w": _least_squares_grad(w, x[a:b], y[a:b]), "b": np.array([float(comm.rank + 1)])}
    got = mod.average_gradients(local, comm)
    if not isinstance(got, dict) or set(got) != {"w", "b"}:
        raise Wrong("average_gradients must return a dict with the same names as its input")
    _close(got["b"], [np.mean(np.arange(1, comm.size + 1))], "the average of gradients 1 and 2")
    _close(got["w"], _least_squares_grad(w, x, y),
           "the averaged gradient (it should equal the gradient of the whole batch)")
    return (f"average_gradients over {comm.size} ranks gives the whole batch's gradient: the mean of "
            "equal shards' mean losses is the mean loss")


# ------------------------------------------------------------------------------------- 03
def check_03(mod, comm) -> str:
    from refpar.analysis.memory import paper_model_state_bytes

    for psi in (54_976, 1_000_000):
        for n in (1, 2, 4, 8, 64):
            for stage in (0, 1, 2, 3):
                want = paper_model_state_bytes(psi, n, stage, k=16, param_bytes=8, grad_bytes=8)
                got = mod.model_state_bytes(psi, n, stage)
                if not math.isclose(got, want, rel_tol=CONTRACT):
                    raise Wrong(f"model_state_bytes({psi}, n={n}, stage={stage}) = {got}, expected "
                                f"{want:g}: parameters 8 bytes, gradients 8, AdamW's two moments 16 "
                                "per parameter; stage 1 shards the moments, 2 also the gradients, 3 "
                                "also the parameters, each over n ranks")
    return "model_state_bytes matches the ZeRO paper's closed forms for stages 0-3 in float64"


# ------------------------------------------------------------------------------------- 04
class _CountingComm:
    """A tp communicator that counts the learner's all-reduces."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.all_reduces = comm, comm.rank, comm.size, 0

    def all_reduce(self, x, *args, **kwargs):
        self.all_reduces += 1
        return self.comm.all_reduce(x, *args, **kwargs)


def check_04(mod, comm) -> str:
    B, C, tp, r = 6, 8, comm.size, comm.rank
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, C))  # (B, C) the same on every tp rank
    w_fc, w_proj = rng.standard_normal((C, 4 * C)), rng.standard_normal((4 * C, C))
    a, b = shard_range(4 * C, tp, r)
    counting = _CountingComm(comm)
    got = mod.tp_mlp_forward(x, w_fc[:, a:b], w_proj[a:b, :], counting)  # (B, C)
    _close(got, np.tanh(x @ w_fc) @ w_proj, f"rank {r}'s MLP output")
    if counting.all_reduces != 1:
        raise Wrong(f"your forward made {counting.all_reduces} all-reduces; Megatron's MLP needs "
                    "exactly one, after the row-parallel c_proj (the column-parallel c_fc needs none)")
    return f"tp_mlp_forward equals the unsharded MLP on {tp} ranks with one all-reduce"


# ------------------------------------------------------------------------------------- 05
def _attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])  # (Tq, Tk)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(axis=-1, keepdims=True), (m + np.log(e.sum(-1, keepdims=True)))[:, 0]


def check_05(mod, comm) -> str:
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((6, 4)) * 3 for _ in range(3))
    o_full, lse_full = _attention(q, k, v)
    for split in (1, 3, 5):
        o1, l1 = _attention(q, k[:split], v[:split])
        o2, l2 = _attention(q, k[split:], v[split:])
        got = mod.merge_attention(o1, l1, o2, l2)
        if not isinstance(got, tuple) or len(got) != 2:
            raise Wrong("merge_attention must return two arrays: (out, lse)")
        _close(got[1], lse_full, f"the merged log-sum-exp (keys split at {split})")
        _close(got[0], o_full, f"the merged attention output (keys split at {split})")
    return "merge_attention combines two blocks of keys exactly, as each step of ring attention does"


# ------------------------------------------------------------------------------------- 06
V_CSV = "06_v_schedule.csv"  # part 2 of exercise 6, next to the Python file
V_RANKS, V_MICROBATCHES = 2, 4


def check_06(mod, comm) -> str:
    from refpar.parallel.pipeline.builders import gpipe, one_f_one_b
    from refpar.parallel.pipeline.simulate import peak_inflight_microbatches, simulate

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
            + _check_v_schedule(Path(mod.__file__).with_name(V_CSV)))


def _check_v_schedule(path: Path) -> str:
    """Part 2: a zero-bubble V schedule for p = 2, m = 4, written by hand in torch's CSV."""
    from refpar.parallel.pipeline.builders_v import v_placement
    from refpar.parallel.pipeline.formats import from_csv
    from refpar.parallel.pipeline.schedules import ScheduleError
    from refpar.parallel.pipeline.simulate import Costs, peak_inflight_microbatches, simulate, validate

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


# ------------------------------------------------------------------------------------- 07
def check_07(mod, comm) -> str:
    from refpar.model.routing import kept_counts, selection_counts

    for n, e, k, f in ((16, 4, 2, 1.0), (10, 4, 1, 1.25), (7, 3, 2, 0.5)):
        want = math.ceil(n * k * f / e)
        if mod.capacity(n, e, k, f) != want:
            raise Wrong(f"capacity(n_tokens={n}, experts={e}, top_k={k}, factor={f}) = "
                        f"{mod.capacity(n, e, k, f)}; each expert takes ceil(n k f / E) = {want}")
    rng = np.random.default_rng(7)
    for n, e, k, cap in ((16, 4, 2, 8), (16, 4, 2, 3), (9, 3, 1, 2)):
        choices = np.stack([rng.permutation(e)[:k] for _ in range(n)])  # (N, k)
        kept = kept_counts(selection_counts(choices, e)[None], cap)[0]  # (E,)
        want = int(n * k - kept.sum())
        got = mod.dropped(choices, e, cap)
        if got != want:
            raise Wrong(f"dropped(...) = {got} for {n} tokens choosing {k} of {e} experts with "
                        f"capacity {cap}; {want} assignments are dropped (an expert keeps its first "
                        "`capacity` assignments; each drops the rest)")
    return "capacity and dropped agree with refpar's router"


# ------------------------------------------------------------------------------------- 08
def check_08(mod, comm) -> str:
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
            lines = {"pp": grid[:, dp, tp], "dp": grid[pp, :, tp], "tp": grid[pp, dp, :]}
            for axis, line in lines.items():
                got_group = [int(g) for g in mod.group(rank, axis, dict(sizes))]
                if got_group != [int(g) for g in line]:
                    raise Wrong(f"group({rank}, {axis!r}, {sizes}) = {got_group}, expected "
                                f"{[int(g) for g in line]}: the ranks that differ from rank {rank} "
                                f"only in their {axis} coordinate, in {axis} order")
    return "coords and group lay ranks out as refpar's DeviceMesh (and Megatron) do"


# ------------------------------------------------------------------------------------- 09
def check_09(mod, comm) -> str:
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


# ------------------------------------------------------------------------------------- 10
def check_10(mod, comm) -> str:
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


# ------------------------------------------------------------------------------------- 11
def check_11(mod, comm) -> str:
    from refpar.analysis.flops import step_flops
    from refpar.analysis.presets import from_model_config
    from refpar.config import RECOMPUTE, model_preset

    why = {"none": "forward 24 B s h^2 (linear layers) + 4 B s^2 h (QK^T, scores @ V) per block and "
                   "2 B s h V for the head; backward twice that: 72 B s L h^2 (1 + s/6h + V/12Lh)",
           "selective": "none's, plus each block's attention core once more: 4 B s^2 h per block",
           "full": "none's, plus each block's forward once more (24 B s h^2 + 4 B s^2 h), not the head's"}
    for (B, s), model in (((8, 16), model_preset("tiny")), ((8, 256), model_preset("small")),
                          ((2, 1024), model_preset("tiny", n_layer=12, n_embd=768, n_head=12,
                                                   vocab_size=50257, n_positions=1024))):
        L, h, V = model.n_layer, model.n_embd, model.vocab_size
        for mode in RECOMPUTE:  # none first: its terms are in the other two
            want = int(step_flops(from_model_config(model), B, s, mode))
            got = mod.step_flops(B, s, L, h, V, mode)
            if got != want:
                raise Wrong(f"step_flops(B={B}, s={s}, L={L}, h={h}, V={V}, {mode!r}) = {got}; refpar's "
                            f"ranks run {want} together: {why[mode]}")
    return "step_flops counts what refpar's GEMMs run, with and without recomputation, for three GPT-2 sizes"


EXERCISES = {e.number: e for e in (
    Exercise(0, "00_first_mpiexec.py", 3, check_00),
    Exercise(1, "01_ring_all_reduce.py", 4, check_01),
    Exercise(2, "02_average_gradients.py", 2, check_02),
    Exercise(3, "03_zero_memory.py", 1, check_03),
    Exercise(4, "04_tp_mlp.py", 2, check_04),
    Exercise(5, "05_merge_attention.py", 1, check_05),
    Exercise(6, "06_pipeline_bubbles.py", 1, check_06),
    Exercise(7, "07_capacity.py", 1, check_07),
    Exercise(8, "08_mesh_coords.py", 1, check_08),
    Exercise(9, "09_loss_normalisation.py", 1, check_09),
    Exercise(10, "10_mixed_precision_memory.py", 1, check_10),
    Exercise(11, "11_step_flops.py", 1, check_11),
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


def _verdict(ex: Exercise, path: Path, comm) -> tuple[bool, str]:
    """(passed, sentence) for this rank."""
    try:
        return True, ex.check(_load(path), comm)
    except NotImplementedError as err:
        return False, f"the exercise is still blank: {err} (in {_shown(path)})"
    except Wrong as err:
        return False, str(err)
    except Exception as err:  # the learner's code failed: say where, in one line
        if isinstance(err, CollectiveTimeout):
            # The same words on every rank, in the learner's terms: the stuck rank waits in their code,
            # the others in the checker's comparison, which is none of their business.
            return False, (f"your code did not finish on every rank: a rank waited more than "
                           f"{comm.timeout:g} s for a message no rank sent; every rank must make the same "
                           "calls in the same order (in a ring, each rank sends right exactly as often as "
                           "its right neighbour receives from the left)")
        return False, f"your code raised {type(err).__name__}: {err}"


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
        cmd = argv(f"mpiexec -n {ex.ranks} python -m refpar lesson check {n} --file {path.resolve()}")
        env = command_env()
        # a rank left waiting for a message that never comes says so, instead of hanging
        env.setdefault("REFPAR_COLLECTIVE_TIMEOUT", str(WAIT_S))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"lesson {n}: not yet: your code did not finish in {timeout:g} s on {ex.ranks} ranks; "
                  "a rank is probably waiting for a message no other rank sends (check that every "
                  "rank calls sendrecv the same number of times, with matching partners)", flush=True)
            return 1
        sys.stdout.write(proc.stdout)
        # A rank that gave up waiting leaves its message requests pending, which MPICH lists as it shuts
        # down; the verdict above has said what is wrong.
        sys.stderr.writelines(line for line in proc.stderr.splitlines(keepends=True)
                              if not line.startswith("MPICH: Builtin communicator"))
        return proc.returncode
    comm = None
    if ex.ranks > 1:
        from refpar.comm.communicator import world  # initialises MPI: only under mpiexec

        comm = world()
        if comm.size != ex.ranks:
            raise ConfigError(f"lesson {n}'s exercise runs on {ex.ranks} ranks, not {comm.size}; "
                              f"run refpar lesson check {n} without mpiexec")
    ok, sentence = _verdict(ex, path, comm)
    if comm is not None:
        # gathered on a communicator that waits longer than the learner's, so the ranks still
        # stuck in the learner's code time out and report before the gather gives up on them
        verdicts = world(timeout=3 * WAIT_S).gather_object((ok, sentence))
        if comm.rank != 0:
            return 0 if ok else 1
        failed = [(r, s) for r, (good, s) in enumerate(verdicts) if not good]
        ok = not failed
        if failed:  # name the rank only when the ranks disagree
            agree = len(failed) == len(verdicts) and len({s for _, s in failed}) == 1
            sentence = failed[0][1] + ("" if agree else f" (rank {failed[0][0]})")
    print(f"lesson {n}: {'passed' if ok else 'not yet'}: {sentence}", flush=True)
    return 0 if ok else 1
