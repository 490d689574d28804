"""refpar's MPI jobs launched from Python (`refpar verify`'s rows, the app's Run for real): which
process each rank is, which rank died if one did, and one sentence saying how a job ended that did
not end well.

    watch = RankWatch()
    proc = subprocess.Popen([mpiexec, "-n", "4", python, "-m", "refpar", "train", ...],
                            env={**os.environ, **watch.env()}, ...)
    watch.follow(proc)
    ...                      # proc ends
    watch.close()
    how_it_ended(proc.returncode, output, watch, steps)
    # "rank 3 was killed by signal 9 (SIGKILL) after 2 of 20 steps; mpiexec stopped the other ranks"

When a rank dies (the out-of-memory killer, a segfault, `kill -9`), MPICH's launcher (hydra) kills
the others within about 0.1 s, so no rank is left waiting in a collective; but it does not say which
rank died. Its "BAD TERMINATION ... PID n" names whichever process it reaped first, often one it
killed itself, and `-print-all-exitcodes` shows signal 9 for those too; the order in which the
processes then vanish does not tell either, as a killed rank may take longer to exit than the ones
killed after it (MPICH 5.0.2, 8 ranks on 2 cores: all seen). What is certain is the order of
causes: hydra acts when the dead rank's pipes close, and a process's files all close at once as it
dies. So each rank connects to a socket of the launching process (`REFPAR_WATCH`, done by
`refpar.cli.main`), says its rank and pid, and says "end" before it exits on its own; the first
connections that close without "end" include the rank that died, alone unless the watching thread
was kept off the CPU until hydra's kills had landed too (then the sentence names every candidate).
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

WATCH = "REFPAR_WATCH"
_told: socket.socket | None = None  # this rank's connection to the launching process, kept open


def announce(rank: int) -> None:
    """Tells the launching process's RankWatch, if it gave one (`REFPAR_WATCH`), this process's rank
    and pid; the connection stays open until the process ends, however it ends."""
    global _told
    path = os.environ.get(WATCH)
    if not path:
        return
    told = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        told.connect(path)
        told.sendall(f"{rank} {os.getpid()}\n".encode())
    except OSError:  # the watch is gone (its process ended): run unwatched
        told.close()
        return
    _told = told


def ended() -> None:
    """Tells the RankWatch that this rank is ending on its own (a rank that is killed cannot)."""
    if _told is not None:
        with contextlib.suppress(OSError):
            _told.sendall(b"end\n")


class RankWatch:
    """The ranks of one job: their pids, and which rank died first, if one did."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="refpar-watch-"))
        self.path: str | None = str(self.folder / "ranks.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._server.bind(self.path)
            self._server.listen(1024)
        except OSError:  # e.g. a temporary folder whose path is too long for a socket: no watching
            self.path = None
        self._pids: dict[int, int] = {}
        self.first_gone: list[int] = []  # the ranks whose connection closed first without "end"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def env(self) -> dict[str, str]:
        """What the job's environment needs for its ranks to report to this watch."""
        return {WATCH: self.path} if self.path else {}

    def pids(self) -> dict[int, int]:
        """rank -> pid, of the ranks that have started."""
        return dict(self._pids)

    def follow(self, proc) -> None:
        """Watches the ranks' connections until `proc` (the mpiexec process) has ended."""
        if self.path is None:
            return
        self._thread = threading.Thread(target=self._watch, args=(proc,), daemon=True)
        self._thread.start()

    def _watch(self, proc) -> None:
        events = selectors.DefaultSelector()
        events.register(self._server, selectors.EVENT_READ)
        said: dict[socket.socket, bytes] = {}  # each rank's connection -> what it has sent
        while proc.poll() is None and not self._stop.is_set():
            died = []
            for key, _ in events.select(timeout=0.05):
                if key.fileobj is self._server:
                    conn, _ = self._server.accept()
                    events.register(conn, selectors.EVENT_READ)
                    said[conn] = b""
                    continue
                conn = key.fileobj
                data = conn.recv(4096)
                said[conn] += data
                if b"\n" in said[conn]:  # "rank pid\n", then "end\n" if it ends on its own
                    rank, pid = said[conn].split(b"\n", 1)[0].split()
                    self._pids[int(rank)] = int(pid)
                if not data:  # closed: the rank's process has ended
                    events.unregister(conn)
                    if b"end\n" not in said[conn] and b"\n" in said[conn]:
                        died.append(int(said[conn].split()[0]))
            if died and not self.first_gone:
                self.first_gone = sorted(died)
        events.close()
        for conn in said:
            conn.close()

    def close(self) -> None:
        """Ends the watching (call once the job has ended) and removes the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def steps_done(lines: list[str]) -> int | None:
    """The last step rank 0 reported: its progress rows start with the step number (1-based), and
    each row's loss is the whole job's (every rank took part in reducing it); None if no row."""
    rows = [int(line.split()[0]) for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    return rows[-1] if rows else None


def how_it_ended(returncode: int, output: str, watch: RankWatch | None = None,
                 steps: int | None = None) -> str:
    """One sentence for a job that exited with `returncode` (non-zero) after printing `output`
    (its stdout and stderr): refpar's own error or interruption line if a rank printed one, else
    which rank died of which signal, and after how many steps, else the exit status and the last line."""
    lines = output.splitlines()
    for line in lines:  # refpar's error line, or its line for Ctrl-C / SIGTERM (refpar/interrupt.py)
        if line.startswith("refpar") and (": error" in line or ": interrupted" in line):
            return line.strip()
    if returncode < 0:
        return f"mpiexec was stopped by signal {-returncode} ({_signal_name(-returncode)})"
    done = steps_done(lines)
    when = "before rank 0 reported a step" if done is None else \
        f"after {done} of {steps} steps" if steps is not None else f"after step {done}"
    gone = watch.first_gone if watch is not None else []
    rank = (f"rank {gone[0]}" if len(gone) == 1 else f"one of ranks {', '.join(map(str, gone))}"
            if gone else "a rank")
    killed = re.search(r"\(signal (\d+)\)", output)  # hydra: "... EXIT STRING: Killed (signal 9)"
    if killed:
        number = int(killed.group(1))
        return (f"{rank} was killed by signal {number} ({_signal_name(number)}) {when}; mpiexec "
                f"stopped the other ranks")
    exited = re.search(r"EXIT CODE: (\d+)", output)
    if exited:
        return f"{rank} exited with status {exited.group(1)} {when}; mpiexec stopped the other ranks"
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return f"exit status {returncode}: {last}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unknown signal"
