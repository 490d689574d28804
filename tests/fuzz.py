"""Running `refpar <command>` in-process, as one rank of a job, and telling a refusal from a run that
proceeds, without MPI: the fuzz tests (tests/test_fuzz_*.py) drive the command line through this.

A run *proceeds* when it gets as far as communicating or training. Both are stopped at their door,
so that proceeding costs microseconds:

- `refpar.comm.communicator.world()` returns a `CommunicatorStub` of the job's size and this rank.
  Reading its `rank` and `size` is free (the checks that compare the mesh with the job do that);
  anything else, the first `split` of a DeviceMesh or the first collective, raises `Communicates`.
- the single-device run raises `Trains` where it draws its training corpus (`refpar.trainer.
  corpus_for`, the first step of `train_single_device` and of refpar/engine/run.py) or starts it;
- the lesson checker's loading of a learner's file raises `RunsExercise`, and launching mpiexec for
  it raises `Communicates`.

The stops are BaseExceptions, so no `except Exception` in refpar can take one for a failure.
`abort_on_error` is replaced by a plain pass-through, so that an error under the pretended launcher
fails the test instead of calling MPI Abort on the test process.

    outcome = run_as_rank(["train", "--mesh", "dp=3"], rank=0, size=3)
    outcome.kind, outcome.code, outcome.stderr   # "refused", 2, "refpar train: error: ..."
"""

from __future__ import annotations

import contextlib
import io
import traceback
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

LAUNCHER_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


class Proceeds(BaseException):  # noqa: N818 - a stop, not an error
    """The run got past every check to the point named by the subclass."""


class Communicates(Proceeds):
    """The run called its first collective (or split the world for a mesh)."""


class Trains(Proceeds):
    """The single-device run started training."""


class RunsExercise(Proceeds):
    """`refpar lesson check` started running the learner's code."""


class CommunicatorStub:
    """What `world()` gives the command: the job's size and this rank; every other use communicates."""

    def __init__(self, size: int, rank: int, tracer=None):
        self.size, self.rank, self.world_rank, self.axis = size, rank, rank, "world"
        self.group = tuple(range(size))
        self.tracer = tracer
        if tracer is not None and getattr(tracer, "rank", 0) is None:
            tracer.rank = rank

    def __getattr__(self, name: str):
        raise Communicates(name)


@dataclass
class Outcome:
    kind: str  # "refused" (exit 2), "finished" (0 or 1, in-process commands), "proceeds", "crashed"
    code: int | None
    stdout: str
    stderr: str
    where: str = ""  # proceeds: the stop that caught it; crashed: the traceback
    warned: tuple[str, ...] = ()  # the warnings the run raised (a terminal shows them on stderr)

    def describe(self) -> str:
        return (f"{self.kind} (exit {self.code}) {self.where}\nstderr: {self.stderr!r}\n"
                f"warnings: {self.warned}")


@contextlib.contextmanager
def _stops(size: int, rank: int, launched: bool):
    """Every stop of the module docstring in place, the environment of rank `rank` of `size`
    (or of no launcher), and the run's backend restored afterwards."""
    from lessons import checks as lesson_checks
    from refpar import backend, trainer
    from refpar.comm import communicator
    from refpar.engine import run as engine_run  # now: its own names for the trainer's are stopped too

    def world(tracer=None, **_options):
        return CommunicatorStub(size, rank, tracer)

    def trains(*_args, **_kwargs):
        raise Trains("single device")

    def runs_exercise(path):
        raise RunsExercise(str(path))

    def launches(*_args, **_kwargs):
        raise Communicates("mpiexec")

    @contextlib.contextmanager
    def pass_through(*_args, **_kwargs):
        yield

    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCHER_VARS:
            mp.delenv(var, raising=False)
        if launched:
            mp.setenv("PMI_RANK", str(rank))
            mp.setenv("PMI_SIZE", str(size))
        mp.setattr(communicator, "world", world)
        mp.setattr(communicator, "abort_on_error", pass_through)
        mp.setattr(trainer, "corpus_for", trains)
        mp.setattr(trainer, "train_single_device", trains)
        mp.setattr(engine_run, "corpus_for", trains)
        mp.setattr(engine_run, "train_single_device", trains)
        mp.setattr(lesson_checks, "_load", runs_exercise)
        mp.setattr(lesson_checks, "subprocess",
                   SimpleNamespace(run=launches, TimeoutExpired=TimeoutError))
        mp.setattr(backend, "_current", backend.current())
        yield


def run_as_rank(argv: list[str], rank: int = 0, size: int = 1, launched: bool | None = None) -> Outcome:
    """`refpar *argv` on rank `rank` of a job of `size` ranks (launched: as mpiexec would start it;
    by default when size > 1 or rank > 0)."""
    from refpar.cli import main

    launched = size > 1 or rank > 0 if launched is None else launched
    out, err = io.StringIO(), io.StringIO()
    with _stops(size, rank, launched), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as warned:
        # What a user's terminal shows (pytest would collect it out of sight): every warning but the
        # categories Python itself hides by default.
        warnings.simplefilter("always")
        for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", hidden)
        try:
            code = main(argv)
            kind = "refused" if code == 2 else "finished"
            where = ""
        except SystemExit as stop:  # argparse
            code = stop.code if isinstance(stop.code, int) else 1
            kind, where = ("refused" if code == 2 else "finished"), "SystemExit"
        except Proceeds as stop:
            code, kind, where = None, "proceeds", f"{type(stop).__name__}({stop})"
        except Exception:  # noqa: BLE001 - what the fuzz looks for
            code, kind, where = None, "crashed", traceback.format_exc()
    return Outcome(kind, code, out.getvalue(), err.getvalue(), where,
                   tuple(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in warned))


def assert_one_sentence(outcome: Outcome, command: str) -> None:
    """A refusal is one line on stderr, `refpar <command>: error: <what to change>`, and nothing
    else."""
    text = outcome.stderr
    assert text.endswith("\n") and text.count("\n") == 1, outcome.describe()
    prefix = f"refpar {command}: error: "
    assert text.startswith(prefix), outcome.describe()
    sentence = text[len(prefix):].strip()
    assert len(sentence) > 10, outcome.describe()
    assert "Traceback" not in sentence and "usage:" not in sentence, outcome.describe()



# ----------------------------------------------------------- files and environments (issue 43)
# What a hand-edited, truncated or hostile file holds where refpar expects a number, a name or a
# list: drawn into manifests, layouts and schedule CSVs by tests/test_reliability_fuzz.py.
HOSTILE_VALUES = (None, True, -1, 0, 1.5, 10 ** 400, float("nan"), float("inf"), -float("inf"), "", "two",
                  "x" * 5000, [], {}, [1e999], {"a": None}, [[[[[]]]]])


def hostile_json():
    """A JSON value a user's file might hold: any of HOSTILE_VALUES, small numbers and names, and
    lists and objects of them, a few levels deep."""
    from hypothesis import strategies as st

    leaf = st.one_of(st.sampled_from(HOSTILE_VALUES), st.integers(-3, 10), st.floats(allow_nan=True),
                     st.text(max_size=8))
    def nested(inner):
        return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3))

    return st.recursive(leaf, nested, max_leaves=6)


def mutate_json(data, doc, paths: int = 3):
    """`doc` with up to `paths` drawn places replaced by hostile values, removed, or (once in a
    while) nested 100,000 deep. Returns the new document as text (json.dumps writes NaN and
    Infinity, as a hand edit might)."""
    import copy
    import json

    from hypothesis import strategies as st

    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, paths))):
        parent, key = _drawn_place(data, doc)
        if parent is None:
            break
        how = data.draw(st.sampled_from(["replace", "replace", "remove", "deep"]))
        if how == "remove" and isinstance(parent, dict):
            del parent[key]
        elif how == "deep":
            parent[key] = "DEEP"
        else:
            parent[key] = data.draw(hostile_json())
    text = json.dumps(doc)
    return text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000, 1)


def _drawn_place(data, doc):
    """(container, key) of a place inside `doc`, walked down from the top by drawn steps."""
    from hypothesis import strategies as st

    parent, key = None, None
    node = doc
    while isinstance(node, dict | list) and len(node):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, data.draw(st.sampled_from(keys))
        node = node[key]
        if not data.draw(st.booleans()):
            break
    return parent, key


def hostile_csv_cell():
    """A cell of a schedule CSV: actions refpar and torch write, and what a broken or hostile file
    holds instead (huge numbers, long or quoted cells, NUL, separators)."""
    from hypothesis import strategies as st

    return st.one_of(
        st.sampled_from(["", "", "0F0", "0B0", "0W0", "0I0", "1F0", "1B0", "(0F1;1B0)OVERLAP_F_B",
                         "0SEND_F0"]),
        st.sampled_from(["9" * 5000 + "F0", "0F" + "9" * 5000, "x" * 200_000, '"a,b"', '"', "\x00",
                         "0F0\n1F0", "-1F0", "0f0", "１F0"]),
        st.text(max_size=6))
