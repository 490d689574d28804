"""`refpar lesson check N`: grades the learner's lessons/exercises/NN_name.py with its checker.

The checkers live in lessons/checkers/, one lesson per file (`check_NN`): each loads the learner's
file, calls the function(s) the learner wrote and compares them with refpar's own answer, raising
`Wrong("a sentence a learner can act on")` at the first difference. This module runs them: the
exercises about ranks under `mpiexec -n ranks`, where every rank runs the checker and rank 0 prints
the first problem any rank found, the rank that raised first with its traceback, or where each rank
waited when none raised.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lessons.checkers.attention_merge import check_07
from lessons.checkers.average_gradients import check_03
from lessons.checkers.capacity import check_10
from lessons.checkers.capstone import check_16
from lessons.checkers.common import Wrong, same_file, shown
from lessons.checkers.first_mpiexec import check_00
from lessons.checkers.loss_normalisation import check_12
from lessons.checkers.memory import check_02
from lessons.checkers.mesh import check_11
from lessons.checkers.mixed_precision import check_13
from lessons.checkers.overlap import check_09
from lessons.checkers.pipeline import check_08
from lessons.checkers.ring_all_reduce import check_01
from lessons.checkers.seconds import check_05
from lessons.checkers.step_flops import check_14
from lessons.checkers.tensor_parallel import check_06
from lessons.checkers.zero import check_04
from lessons.course import LESSONS, ROOT, argv, command_env
from refpar.comm.diagnosis import CollectiveTimeout, timeout_from_env
from refpar.config import ConfigError

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


@dataclass(frozen=True)
class Verdict:
    """One rank's result; rank 0 combines every rank's (`_combine`)."""

    ok: bool
    sentence: str
    raised_at: float | None = None  # time.time() when the learner's code raised
    waits_in: str | None = None  # timed out waiting: where in the learner's code ("" in the checker's)


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


def _verdict(ex: Exercise, path: Path, comm) -> Verdict:
    """This rank's Verdict: passed, wrong (Wrong, still blank), raised (with the learner's frames of
    the traceback) or timed out waiting for a message (with where it waited)."""
    try:
        return Verdict(True, ex.check(_load(path), comm))
    except NotImplementedError as err:
        return Verdict(False, f"the exercise is still blank: {err} (in {shown(path)})")
    except Wrong as err:
        return Verdict(False, str(err))
    except CollectiveTimeout as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if same_file(f.filename, path)]
        return Verdict(False, "", waits_in=f"line {frames[-1].lineno}, `{frames[-1].line}`" if frames else "")
    except Exception as err:  # the learner's code failed: its own frames, not the checker's
        return Verdict(False, f"your code raised {type(err).__name__}: {err}" + _your_traceback(err, path),
                       raised_at=time.time())


def _your_traceback(err: BaseException, path: Path) -> str:
    """The traceback's frames in the learner's file, as Python prints them, each line indented."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if same_file(f.filename, path)]
    lines = [f'  File "{shown(path)}", line {f.lineno}, in {f.name}\n    {f.line}' for f in frames]
    if isinstance(err, SyntaxError) and err.lineno is not None:
        lines.append(f'  File "{shown(path)}", line {err.lineno}\n    {(err.text or "").strip()}')
    return "".join("\n" + line for line in lines)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _combine(verdicts: list[Verdict], timeout: float, hint: str) -> tuple[bool, str]:
    """Every rank's Verdict -> (passed, the sentence rank 0 prints). An error comes first: the rank
    that raised first, with its traceback, since the others' waiting follows from it. Then a wrong
    answer (the first rank's, naming the rank only when the ranks disagree), which stops that rank's
    calls and may leave the others waiting for it. Only when no rank raised or answered wrong, a
    deadlock, saying where each rank waited."""
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
    if failed:  # a wrong answer comes before the waiting it caused: its rank stopped calling
        agree = len(failed) == len(verdicts) and len({s for _, s in failed}) == 1
        stuck = [r for r in waiting if verdicts[r].waits_in]  # waiting inside the learner's code
        after = f"\n({_ranks(stuck)} then waited for {_ranks([failed[0][0]])} in your code: fix its " \
            "answer first)" if stuck else ""
        return False, failed[0][1] + ("" if agree else f" (rank {failed[0][0]})") + after
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
