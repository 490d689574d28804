"""Ctrl-C and SIGTERM (refpar/interrupt.py): every rank gone within 5 s, one line, exit status 130 /
143 (mpiexec's too), no traceback, nothing half written, and a resume from the last complete
checkpoint that continues bit for bit. Each job runs in a session of its own, as under a terminal
or Slurm, and under a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from refpar import checkpoint, jobs
from tests.mpi import MPIEXEC, ROOT, mpi_env, refpar_json

ROW = re.compile(r"\s*(\d+)\s+\d+\.\d+")  # rank 0's progress row: step, loss, ...
SAID = re.compile(r"refpar (train|verify): interrupted at (step|run) (\d+) of (\d+)"
                  r"(?:; the last complete checkpoint is (\S+)"
                  r"|; there is no complete checkpoint in \S+ yet)?")
HYDRA = re.compile(r"\[mpiexec@[^]]+\] (Sending Ctrl-C to processes as requested|Press Ctrl-C again to "
                   r"force abort)")  # mpiexec's own lines on its stdout after SIGINT (not a rank's)
GONE_S = 5  # the bound: every rank gone within 5 s of the signal
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def ended_with(job, number) -> bool:
    """The shell's status for the signal: 130 or 143. mpiexec reports the bitwise OR of its ranks' wait
    statuses and kills the ranks left at the first exit, so a rank it kills while its own exit is under
    way reads as signal 9: seen in 2 to 4 of 10 tries at 8 ranks on 2 cores, never at 2 (refpar/interrupt.py
    docstring); an 8-rank job may end 9, every rank's line and clean-up checked all the same."""
    argv = list(job.proc.args)
    ranks = int(argv[argv.index("-n") + 1]) if "-n" in argv else 1
    allowed = {EXIT[number]} | ({9} if ranks > 2 else set())
    return job.proc.returncode in allowed
TINY = ("--n-layer", "2", "--batch-size", "4", "--seq-len", "8")

# A job whose shard writes of one step take a minute: a signal sent once every rank is inside one
# lands in the middle of a save, every time. The bytes are written first; the file is not renamed yet.
SLOW_SAVE = """
import os, sys, time
from pathlib import Path
import numpy as np
from refpar.cli import main
write = np.savez
def slow(f, **arrays):
    write(f, **arrays)
    if os.environ["SLOW_STEP"] in f.name:
        Path(os.environ["SAVING"], str(os.getpid())).touch()
        time.sleep(60)
np.savez = slow
sys.exit(main(sys.argv[1:]))
"""


class Job:
    """One command in a session of its own, its stdout and stderr read as they come."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.watch = jobs.RankWatch()  # the ranks' pids (refpar.cli announces them)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=mpi_env({**self.watch.env(), **(env or {})}),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.watch.follow(self.proc)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=lambda s=s, to=to: to.extend(s), daemon=True)
                         for s, to in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    def wait_for(self, condition, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                said = "".join(self.out + self.err)
                raise AssertionError(f"not seen (exit {self.proc.returncode}):\n{said}")
            time.sleep(0.05)

    def interrupt(self, number: int, whole_group: bool, pids: list[int]) -> float:
        """Sends `number` to the job's process group (a terminal's Ctrl-C, Slurm) or to its first
        process alone; the seconds until every process in `pids` and the job have ended."""
        sent = time.monotonic()
        if whole_group:
            os.killpg(self.proc.pid, number)
        else:
            self.proc.send_signal(number)
        try:
            while any(_alive(pid) for pid in pids) or self.proc.poll() is None:
                if time.monotonic() - sent > 60:
                    raise AssertionError("still running 60 s after the signal")
                time.sleep(0.01)
            return time.monotonic() - sent
        finally:
            self.kill()
            for reader in self._readers:
                reader.join(timeout=30)
            self.watch.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its parent to reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [d for c in map(int, children) for d in (c, *_descendants(c))]


def _train(ranks: int, *args: str, script: Path | None = None) -> list[str]:
    program = [str(script)] if script else ["-m", "refpar"]
    return [str(MPIEXEC), "-n", str(ranks), sys.executable, *program, "train", *args]


def _one_line(job: Job) -> re.Match:
    """The ranks said exactly one line, the interruption's (stderr), and no traceback anywhere;
    stdout holds rank 0's rows and, after SIGINT, mpiexec's own two lines."""
    said = "".join(job.err)
    assert len(job.err) == 1 and "Traceback" not in said + "".join(job.out), said + "".join(job.out)
    assert not [line for line in job.out if "interrupted" in line or "error" in line.lower()], job.out
    match = SAID.fullmatch(job.err[0].rstrip("\n"))
    assert match, job.err
    return match


def _resumes_bit_for_bit(ranks: int, args: tuple, root: Path, k: int) -> None:
    """`--resume root` continues the run from its newest complete step k: two more steps, their
    losses equal (==) to those of the run that was never interrupted."""
    assert not list(root.rglob(".*.tmp-*")), list(root.rglob("*"))  # no half-written file
    assert checkpoint.find(root).name == f"step-{k:08d}"
    checkpoint.read_manifest(root)  # every file of it whole: sizes and sha256 as the manifest says
    resumed = refpar_json(ranks, "train", *args, "--steps", str(k + 2), "--resume", str(root), timeout=300)
    full = refpar_json(ranks, "train", *args, "--steps", str(k + 2), timeout=300)
    assert resumed["losses"] == full["losses"][k:], (resumed["losses"], full["losses"])


# (ranks, mesh): 2 ranks, and 8 on three axes whose pipeline ranks wait in sends and receives
MESHES = {2: ("--mesh", "dp=2", *TINY), 8: ("--mesh", "dp=2,tp=2,pp=2", "--microbatches", "2", *TINY)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks, number", [(2, signal.SIGINT), (8, signal.SIGTERM)],
                         ids=["2-SIGINT", "8-SIGTERM"])
def test_a_signal_to_the_process_group_mid_step_ends_every_rank_with_one_line_and_resume_continues(
        tmp_path, ranks, number):
    root, args = tmp_path / "ckpt", MESHES[ranks]
    job = Job(_train(ranks, *args, "--steps", "120", "--save", str(root), "--save-every", "1"))
    job.wait_for(lambda: len(job.watch.pids()) == ranks and any(ROW.match(x) and int(x.split()[0]) >= 10
                                                                for x in job.out), timeout=300)
    seconds = job.interrupt(number, whole_group=True, pids=list(job.watch.pids().values()))
    assert seconds < GONE_S and ended_with(job, number), (seconds, job.proc.returncode, job.err)
    said = _one_line(job)
    assert said.group(2) == "step" and int(said.group(4)) == 120 and said.group(5), said.group(0)
    banner = [line for line in job.out if HYDRA.search(line)]  # mpiexec's own lines, verbatim
    assert all(HYDRA.fullmatch(line.strip()) for line in banner), banner
    assert len(banner) == (2 if number == signal.SIGINT else 0), banner  # SIGTERM: hydra is silent
    step, k = int(said.group(3)), int(said.group(5).rsplit("-", 1)[1])
    assert said.group(5) == str(root / f"step-{k:08d}") and step - 1 <= k <= step, said.group(0)
    _resumes_bit_for_bit(ranks, args, root, k)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks, number, whole_group", [(2, signal.SIGINT, True), (8, signal.SIGTERM, False)],
                         ids=["2-SIGINT-to-the-group", "8-SIGTERM-to-mpiexec-alone"])
def test_a_signal_mid_save_ends_every_rank_and_leaves_no_half_checkpoint(tmp_path, ranks, number,
                                                                         whole_group):
    script, saving, root = tmp_path / "job.py", tmp_path / "saving", tmp_path / "ckpt"
    script.write_text(SLOW_SAVE)
    saving.mkdir()
    args = MESHES[ranks]
    job = Job(_train(ranks, *args, "--steps", "6", "--save", str(root), "--save-every", "2", script=script),
              env={"SLOW_STEP": "step-00000004", "SAVING": str(saving)})
    job.wait_for(lambda: len(list(saving.iterdir())) == ranks, timeout=300)  # every rank inside its write
    seconds = job.interrupt(number, whole_group=whole_group, pids=list(job.watch.pids().values()))
    assert seconds < GONE_S and ended_with(job, number), (seconds, job.proc.returncode, job.err)
    assert _one_line(job).group(0) == (f"refpar train: interrupted at step 4 of 6; the last complete "
                                       f"checkpoint is {root / 'step-00000002'}")
    assert list((root / "step-00000004").iterdir()) == []  # the abandoned save: no file, whole or half
    _resumes_bit_for_bit(ranks, args, root, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_one_process_ends_with_one_line_and_the_shells_status(number):
    job = Job([sys.executable, "-m", "refpar", "train", *TINY, "--steps", "2000"])
    job.wait_for(lambda: any(ROW.match(line) for line in job.out))
    seconds = job.interrupt(number, whole_group=True, pids=[job.proc.pid])
    assert seconds < GONE_S and ended_with(job, number), (seconds, job.proc.returncode, job.err)
    said = _one_line(job)
    assert said.group(2) == "step" and int(said.group(4)) == 2000 and said.group(5) is None, said.group(0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("number, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["Ctrl-C", "SIGTERM-to-verify-alone"])
def test_verify_ends_its_mpi_job_and_says_one_line(number, whole_group):
    job = Job([sys.executable, "-m", "refpar", "verify", "--quick"])
    # the first run's job: mpiexec, its proxy and both ranks, which have started training
    job.wait_for(lambda: len(_descendants(job.proc.pid)) >= 4, timeout=120)
    time.sleep(2)  # most often the ranks are training by then; either way verify must end them
    tree = _descendants(job.proc.pid)
    seconds = job.interrupt(number, whole_group=whole_group, pids=tree)
    assert seconds < GONE_S and ended_with(job, number), (seconds, job.proc.returncode, job.err)
    assert not any(_alive(pid) for pid in tree)
    said = _one_line(job)  # the run in progress: one after those in the table (below its header)
    assert said.group(0) == f"refpar verify: interrupted at run {len(job.out)} of {len(_quick())}", job.out


def _quick() -> tuple:
    from refpar.commands.verify import QUICK

    return QUICK


@pytest.mark.timeout(300)
def test_the_apps_stop_button_ends_a_run_with_its_one_line():
    sys.path.insert(0, str(ROOT / "app"))
    from launcher import Launcher

    run = Launcher()
    run.start(_train(2, "--mesh", "dp=2", *TINY, "--steps", "2000"), "stopped", None, 2000)
    try:
        deadline = time.monotonic() + 120
        while not any(ROW.match(line) for line in run.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        run.stop()  # SIGTERM to the job's process group
        run.reader.join(timeout=60)
    finally:
        if run.running():
            os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.proc.returncode == 143 and SAID.fullmatch(run.error.splitlines()[0]), run.error
