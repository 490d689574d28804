"""Faults a user can cause or suffer, each under a timeout: a rank killed in the middle of training,
a rank stuck in a computation (REFPAR_COLLECTIVE_TIMEOUT), a checkpoint save killed at every one of
its file operations, a full disk during a save. README.md, "Troubleshooting", says what each looks
like to the user; these tests hold the exact sentences.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from refpar import checkpoint, files, jobs
from refpar.checkpoint import CheckpointError
from refpar.commands import verify
from refpar.config import TrainConfig, model_preset
from refpar.trainer import train_single_device
from tests.mpi import MPIEXEC, ROOT, mpiexec

sys.path.insert(0, str(ROOT / "app"))
from launcher import Launcher  # noqa: E402

# A 4-rank pipeline of tensor-parallel stages: the N-D engine, whose rank 0 prints a row per step as
# the step ends (the row's loss is reduced over every rank, so row k means every rank finished step k).
KILLED_MESH = ("--mesh", "pp=2,tp=2", "--microbatches", "2", "--n-layer", "2")
KILLED_STEPS = 300  # far more than the test lets it run
KILLED_SENTENCE = r"rank 3 was killed by signal 9 \(SIGKILL\) {when}; mpiexec stopped the other ranks"
STEP_ROW = re.compile(r"\s*(\d+)\s+\d+\.\d+")  # the engine's progress row: step, loss, ...


# --------------------------------------------------------------------------- a rank killed
def test_a_rank_killed_mid_run_ends_the_job_within_10_s_and_the_app_says_which_rank():
    run = Launcher()
    run.start([str(MPIEXEC), "-n", "4", sys.executable, "-m", "refpar", "train", *KILLED_MESH, "--steps",
               str(KILLED_STEPS)], "killed", None, KILLED_STEPS)
    try:
        _wait_for(lambda: 3 in run.watch.pids() and any(STEP_ROW.match(line) for line in run.lines), 120)
        killed_at = time.monotonic()
        os.kill(run.watch.pids()[3], signal.SIGKILL)
        run.reader.join(timeout=60)
        seconds = time.monotonic() - killed_at
    finally:
        run.stop()
    assert not run.running() and run.proc.returncode == 9 and seconds < 10, (seconds, run.error)
    rows = [int(m.group(1)) for m in map(STEP_ROW.match, run.lines) if m]
    assert 1 <= rows[-1] < KILLED_STEPS, rows  # killed in the middle of the run
    when = f"after {rows[-1]} of {KILLED_STEPS} steps"  # the last row rank 0 printed
    assert re.fullmatch(KILLED_SENTENCE.format(when=when), run.error.splitlines()[0]), run.error


def test_refpar_verify_says_which_rank_was_killed_in_its_one_line(monkeypatch):
    watches: list[jobs.RankWatch] = []

    class Recorded(jobs.RankWatch):  # verify.launch makes its own; this one lets the test find the pids
        def __init__(self):
            super().__init__()
            watches.append(self)

    monkeypatch.setattr(jobs, "RankWatch", Recorded)
    result: list = []
    launching = threading.Thread(target=lambda: result.append(verify.launch(
        4, KILLED_MESH, KILLED_STEPS, timeout=120)))
    launching.start()
    _wait_for(lambda: watches and 3 in watches[0].pids(), timeout=120)
    time.sleep(1.0)  # well inside the run: rank 0's single-device reference alone takes longer
    os.kill(watches[0].pids()[3], signal.SIGKILL)
    launching.join(timeout=60)
    sentence, _ = result[0]
    when = rf"(after \d+ of {KILLED_STEPS} steps|before rank 0 reported a step)"
    assert re.fullmatch(KILLED_SENTENCE.format(when=when), sentence), sentence


def _wait_for(condition, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout} s")


# ------------------------------------------------------------- a rank stuck in a computation
STUCK_S = 300  # far longer than the test may take: the job must end because the others time out


def _stuck_job(tmp_path, ranks: int, source: str):
    script = tmp_path / "job.py"
    script.write_text(source)
    start = time.monotonic()
    proc = mpiexec(ranks, str(script), timeout=120, env={"REFPAR_COLLECTIVE_TIMEOUT": "1"}, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("refpar: error")]
    return proc, time.monotonic() - start, lines


def test_ranks_waiting_for_a_rank_stuck_in_a_computation_name_it_op_and_axis(tmp_path):
    proc, seconds, lines = _stuck_job(tmp_path, 4, f"""
import time
import numpy as np
from refpar.comm.communicator import abort_on_error, world
from refpar.mesh import DeviceMesh
with abort_on_error():
    mesh = DeviceMesh(world(), {{"dp": 2, "tp": 2}})  # tp groups [0, 1] [2, 3]; dp groups [0, 2] [1, 3]
    if mesh.world.rank == 3:
        time.sleep({STUCK_S})  # a computation that does not end
    mesh.axis("tp").all_reduce(np.ones(4), tag="h.0.attn.c_proj:fwd")
    mesh.axis("dp").all_reduce(np.ones(4), tag="grads")
""")
    assert proc.returncode != 0 and seconds < STUCK_S, proc.stderr
    tail = "which has not reached it (still computing, stuck, or waiting in another call)"
    said = {
        2: "world rank 2 (tp rank 0 of 2, group [2, 3]) waited more than 1 s in all_reduce on axis tp with "
           f"tag 'h.0.attn.c_proj:fwd' for world rank 3, {tail}",
        1: "world rank 1 (dp rank 0 of 2, group [1, 3]) waited more than 1 s in all_reduce on axis dp with "
           f"tag 'grads' for world rank 3, {tail}",
        0: "world rank 0 (dp rank 0 of 2, group [0, 2]) waited more than 1 s in all_reduce on axis dp with "
           f"tag 'grads' for world rank 2, {tail}",
    }
    # Rank 2 is sure to time out; ranks 0 and 1 do too, but the first abort may end them before
    # they print on a machine this busy. Each line is one of these sentences, and none is repeated.
    expected = {f"refpar: error on rank {r} of 4: {text}" for r, text in said.items()}
    assert f"refpar: error on rank 2 of 4: {said[2]}" in lines, proc.stderr
    assert set(lines) <= expected and len(lines) == len(set(lines)), proc.stderr


def test_a_rank_waiting_for_a_message_names_the_sender_and_the_tag(tmp_path):
    proc, seconds, lines = _stuck_job(tmp_path, 3, f"""
import time
import numpy as np
from refpar.comm.communicator import abort_on_error, world
from refpar.mesh import DeviceMesh
with abort_on_error():
    pp = DeviceMesh(world(), {{"pp": 3}}).axis("pp")
    if pp.rank == 1:
        time.sleep({STUCK_S})  # stage 1 never finishes its forward
    if pp.rank == 2:
        pp.irecv((4,), np.float64, source=1, tag="pp:act:s1:mb0").wait()
    if pp.rank == 0:
        pp.barrier(tag="schedule:end")  # stage 0 is done and waits for the others
""")
    assert proc.returncode != 0 and seconds < STUCK_S, proc.stderr
    assert ("refpar: error on rank 2 of 3: world rank 2 (pp rank 2 of 3, group [0, 1, 2]) waited more than "
            "1 s for world rank 1's 'pp:act:s1:mb0' (irecv on axis pp), which that rank has not sent "
            "(still computing, stuck, or waiting elsewhere)") in lines, proc.stderr
    # A group waiting for two ranks names both.
    assert ("refpar: error on rank 0 of 3: world rank 0 (pp rank 0 of 3, group [0, 1, 2]) waited more than "
            "1 s in barrier on axis pp with tag 'schedule:end' for world ranks 1, 2, which have not "
            "reached it (still computing, stuck, or waiting in another call)") in lines, proc.stderr


# ---------------------------------------------------------- a save killed at every operation
MODEL, TRAIN = model_preset("tiny", n_layer=2), TrainConfig(steps=6, batch_size=4, seq_len=8)
STEP2, STEP4 = "step-00000002", "step-00000004"
# Python's audit events for what a save does to the file system (mkdir, open for writing or
# reading, rename, unlink, listing); the save of step 4 is killed just before one of them.
FILE_EVENTS = ("os.mkdir", "open", "os.rename", "os.remove", "os.scandir")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that never crashes (6 steps), and its checkpoints of steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return train_single_device(MODEL, TRAIN, save=str(root), save_every=2), root


def _save_step4(root: Path, kill: tuple[str, int, int] | None):
    """In a forked child: resumes from `root`/step-2 and trains steps 3 and 4, saving step 4 into
    `root`. Returns that save's file-system calls (audit events under root/step-4, each as "event
    name size", the size of the file a rename renames) and the child's wait status. `kill`:
    ("before", k, _) SIGKILLs the child just before call k; ("torn", k, size), where call k opens
    a file of `size` bytes for writing, limits the child's files to half that size, so the kernel
    kills it (SIGXFSZ) in the middle of writing it. A real death either way: nothing in Python runs
    after it (no flush, no finally, no clean-up)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its audit hook lives and dies with it
        os.close(read)
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXFSZ death writes no core file
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it, making writes fail instead
            calls: list[str] = []
            target = str(root / STEP4)

            def hook(event, args):
                if event not in FILE_EVENTS or not str(args[0]).startswith(target):
                    return
                if kill is not None and kill[:2] == ("before", len(calls)):
                    os.kill(os.getpid(), signal.SIGKILL)
                if kill is not None and kill[:2] == ("torn", len(calls)):
                    resource.setrlimit(resource.RLIMIT_FSIZE, (kill[2] // 2, resource.RLIM_INFINITY))
                size = os.path.getsize(args[0]) if event == "os.rename" else ""
                calls.append(f"{event} {Path(str(args[0])).name} {size}")

            sys.addaudithook(hook)
            train_single_device(MODEL, replace(TRAIN, steps=4), save=str(root), save_every=2,
                                resume=str(root / STEP2))
            os.write(write, "\n".join(calls).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        calls = f.read().splitlines()
    _, status = os.waitpid(pid, 0)
    return calls, status


def _kill_points(calls: list[str]) -> list[tuple[str, int, int]]:
    """Before every call, and in the middle of writing each file (between its open and rename)."""
    points = [("before", k, 0) for k in range(len(calls))]
    for k, call in enumerate(calls):
        event, name = call.split()[:2]
        if event == "open" and ".tmp-" in name:  # the temporary file a write goes to
            rename = next(c for c in calls[k:] if c.startswith(f"os.rename {name} "))
            points.append(("torn", k, int(rename.split()[2])))
    return points


@pytest.fixture(scope="module")
def step4_of_two_ranks(tmp_path_factory):
    """Step 4 of the same run saved by dp=2: a valid checkpoint for it, in other files (one per
    rank) holding other bytes (two ranks sum the gradients in another order than one process),
    and the one-process run resumed from it. A save of step 4 over it that left its manifest over a
    mix of its files and the new ones would be refused as corrupt instead of passed over."""
    root = tmp_path_factory.mktemp("dp2")
    mpiexec(2, "-m", "refpar", "train", "--mesh", "dp=2", "--steps", "4", "--n-layer", "2", "--batch-size",
            "4", "--seq-len", "8", "--save", str(root), timeout=120)
    return root / STEP4, train_single_device(MODEL, TRAIN, resume=str(root / STEP4))


@pytest.mark.parametrize("over_a_finished_save", [False, True], ids=["fresh", "over-a-finished-step-4"])
def test_a_save_killed_at_any_file_operation_resumes_bit_for_bit_from_the_newest_complete_step(
        tmp_path, request, uninterrupted, over_a_finished_save):
    full, saved = uninterrupted
    setup = tmp_path / "setup"
    shutil.copytree(saved / STEP2, setup / STEP2)
    if over_a_finished_save:
        other4, from_other4 = request.getfixturevalue("step4_of_two_ranks")
        shutil.copytree(other4, setup / STEP4)
    root = tmp_path / "count"
    shutil.copytree(setup, root)
    calls, status = _save_step4(root, kill=None)
    assert os.waitstatus_to_exitcode(status) == 0 and checkpoint.find(root).name == STEP4, calls
    # Where, by the protocol, the new step 4 becomes complete, and the old one stops being complete.
    renamed = next(k for k, c in enumerate(calls) if c.startswith("os.rename .manifest.json"))
    removed = next((k for k, c in enumerate(calls) if c.startswith("os.remove manifest.json")), None)
    assert (removed is not None) == over_a_finished_save, calls
    points = _kill_points(calls)
    for kind, k, size in points:
        root = tmp_path / f"{kind}-{k}"
        shutil.copytree(setup, root)
        _, status = _save_step4(root, kill=(kind, k, size))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == (
            signal.SIGKILL if kind == "before" else signal.SIGXFSZ), (kind, k, calls[k])
        done = k if kind == "before" else k + 1  # how many of the calls had happened
        new4, old4 = done > renamed, removed is not None and done <= removed
        torn = kind == "torn"  # a temporary file is left: the resumed run's saves must clear it
        resumed = train_single_device(MODEL, TRAIN, resume=str(root), **(
            {"save": str(root), "save_every": 2} if torn else {}))
        where = f"killed {kind} {calls[k]!r} (call {k} of {len(calls)})"
        assert resumed.first_step == (4 if new4 or old4 else 2), where
        # Bitwise: the resumed run performs the operations of the run it continues in the same
        # order on the same values (the checkpoint holds the parameters, AdamW's moments and step
        # count exactly; the data and dropout of step s are keyed by (seed, s, sample id)).
        same = from_other4 if old4 else full
        assert resumed.losses == same.losses[resumed.first_step - same.first_step:], where
        for name, p in same.params.items():
            assert np.array_equal(resumed.params[name], p), (where, name)
        if torn:  # the resumed run saved step 4 again, and 6, over what the crash left
            assert checkpoint.find(root).name == "step-00000006" and not list(root.rglob(".*.tmp-*")), where
    print(f"{len(points)} kill points: {sorted(set(c.split()[0] for c in calls))}")


def test_a_rank_killed_while_saving_leaves_the_previous_step_for_resume(tmp_path):
    """On 2 ranks, rank 1 dies just before renaming its shard of step 4 into place, while rank 0
    goes on to wait for it: the job ends, and the directory resumes from step 2."""
    script = tmp_path / "job.py"
    script.write_text(f"""
import os, signal, sys
from refpar.cli import main, launcher_rank
def hook(event, args):
    if launcher_rank() == 1 and event == "os.rename" and str(args[1]).endswith("{STEP4}/rank00001.npz"):
        os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
sys.exit(main(sys.argv[1:]))
""")
    root = tmp_path / "ckpt"
    start = time.monotonic()
    proc = mpiexec(2, str(script), "train", "--mesh", "dp=2", "--steps", "4", "--batch-size", "4",
                   "--seq-len", "8", "--save", str(root), "--save-every", "2", timeout=120, check=False)
    assert proc.returncode == 9 and time.monotonic() - start < 120, proc.stderr
    assert not (root / STEP4 / "manifest.json").exists()
    assert checkpoint.find(root).name == STEP2
    model, train = model_preset("tiny"), TrainConfig(steps=4, batch_size=4, seq_len=8)
    assert train_single_device(model, train, resume=str(root)).first_step == 2


# ------------------------------------------------------------------------- a full disk
class _FillingDisk:
    """A file being written that takes `room` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int, path):
        self._f, self._room, self._path = f, room, str(path)

    def write(self, data):
        if self._f.tell() + len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
        return self._f.write(data)

    def __getattr__(self, name):  # tell, seek, flush, fileno, ...: the real file's
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _disk_full_after(room: int, failing: str):
    """`open` for refpar/files.py (which writes the checkpoint's files): a file whose path contains
    `failing`, opened for writing, takes `room` bytes and then fails with ENOSPC."""
    def full_disk_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FillingDisk(f, room, path) if "w" in mode and failing in str(path) else f
    return full_disk_open


@pytest.mark.parametrize("failing", ["rank00000.npz", "manifest.json"])
def test_a_full_disk_fails_the_save_in_one_sentence_and_keeps_the_previous_step(
        tmp_path, monkeypatch, uninterrupted, failing):
    full, _ = uninterrupted
    shutil.copytree(uninterrupted[1] / STEP2, tmp_path / STEP2)
    monkeypatch.setattr(files, "open", _disk_full_after(100, f"{STEP4}/.{failing}"), raising=False)
    with pytest.raises(CheckpointError) as err:
        train_single_device(MODEL, replace(TRAIN, steps=4), save=str(tmp_path), save_every=2,
                            resume=str(tmp_path / STEP2))
    assert str(err.value) == (f"no space left on device writing checkpoint {tmp_path / STEP4 / failing}; "
                              "free space or pass another --save DIR")
    assert list((tmp_path / STEP4).iterdir()) == []  # what the failed save wrote is given back
    monkeypatch.undo()
    resumed = train_single_device(MODEL, TRAIN, resume=str(tmp_path))
    assert resumed.first_step == 2 and resumed.losses == full.losses[2:]  # bitwise, as above


def test_a_full_disk_on_one_rank_stops_every_rank_with_one_sentence_and_no_traceback(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(f"""
import errno, os, sys
from refpar import files
from refpar.cli import main, launcher_rank
if launcher_rank() == 1:  # only rank 1's disk is full (say, another node's)
    real_open = open
    def full_disk_open(path, mode="r", *args, **kwargs):
        if "w" in mode and "{STEP4}/.rank00001.npz" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)
    files.open = full_disk_open
sys.exit(main(sys.argv[1:]))
""")
    root = tmp_path / "ckpt"
    proc = mpiexec(2, str(script), "train", "--mesh", "dp=2", "--steps", "4", "--batch-size", "4",
                   "--seq-len", "8", "--save", str(root), "--save-every", "2", timeout=120, check=False)
    sentence = (f"no space left on device writing checkpoint {root / STEP4 / 'rank00001.npz'}; free "
                "space or pass another --save DIR")
    # Every rank raises it; rank 0 speaks for them (abort_on_error), and MPI_Abort ends the job.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("refpar")]
    assert said == [f"refpar: error on rank 0 of 2: {sentence}"], proc.stderr
    assert list((root / STEP4).iterdir()) == []
    checkpoint.read_manifest(root)  # step 2 whole: every file's size and sha256 as its manifest says
    assert checkpoint.find(root).name == STEP2
