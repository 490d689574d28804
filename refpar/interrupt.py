"""Ctrl-C and SIGTERM end a refpar command on every rank within a second, with one line and nothing
half written.

    mpiexec -n 2 refpar train --mesh dp=2 --steps 1000 --save ckpt --save-every 50    # then Ctrl-C:
    refpar train: interrupted at step 137 of 1000; the last complete checkpoint is ckpt/step-00000100
    mpiexec -n 2 refpar train --mesh dp=2 --steps 1000 --resume ckpt                # goes on bit for bit

The exit status is 130 after SIGINT and 143 after SIGTERM (128 + the signal, as a shell reports it);
mpiexec exits with the same. `refpar.cli.main` watches every command this way but `refpar app` (a
server, whose Ctrl-C is its normal end); the training loops say where they are with `at(step,
steps)`, `refpar verify` hands over the jobs it launches with `adopt(proc)`, and a checkpoint save
takes each of its file operations through `file_operation()`, as every writer of refpar/files.py does.

Why a thread, and not Python's signal handler: Python runs a handler only in the main thread,
between bytecodes, so a rank waiting inside an MPI call for a peer (or inside a long NumPy call)
never runs it. That is how Ctrl-C hung a job: the ranks that were running Python raised
KeyboardInterrupt and left, the ones in a collective never noticed, and the job waited until a
second Ctrl-C. Here the handler Python runs does nothing; what acts is `signal.set_wakeup_fd`, whose
byte the C-level handler writes at once, whatever the main thread is doing, and a small thread that
reads it and ends the process itself:

1. it takes the file-operation lock and never gives it back: a save's file operation in progress
   (creating a temporary file, renaming it into place, clearing a step directory; each takes
   microseconds) finishes, and none starts after it;
2. rank 0 writes the line on stderr (what this rank was doing, from `progress`, and with --save
   what `--resume DIR` would load: `checkpoint.find`, final now that no manifest can come or go);
   then stdout and stderr go to /dev/null, so nothing the main thread still prints follows it;
3. it removes the temporary files and folders this process is writing (refpar/files.py writes
   every whole file under a temporary name and renames it into place, each step a file operation,
   and lists the temporary name here in between): an interrupted write leaves the old file or the
   whole new one and no temporary file; a save that did not finish leaves a step directory without
   `manifest.json`, which is never loaded (`checkpoint.find` passes over it);
4. it sends SIGTERM to the jobs handed to it and waits up to `CHILDREN_S` for them to end, then
   kills the rest;
5. under mpiexec it waits `GRACE_S`, then `os._exit(128 + signal)` (no MPI_Finalize, no clean-up
   that could block).

Why not let a save in progress finish: each rank's save ends in a gather and rank 0's manifest, so
it finishes only if every rank goes on saving, and MPICH's launcher (hydra) kills every other rank
(SIGKILL) the moment one exits. With no message between the watchers (the main threads may be
inside MPI calls), a rank cannot know whether the others will finish; and a save of a large model
takes longer than the seconds a user, or Slurm, waits. So an interrupted save is abandoned cleanly.

What MPICH 5.0.2's hydra does (measured, 2 and 8 ranks): it forwards SIGINT and SIGTERM, sent to
mpiexec or to its process group, to every rank (the ranks run in sessions of their own, so a
terminal's Ctrl-C reaches them only this way); on SIGINT it prints, on its stdout,
"[mpiexec@HOST] Sending Ctrl-C to processes as requested" and "[mpiexec@HOST] Press Ctrl-C again
to force abort"; SIGTERM it forwards silently. When the first rank exits it kills the others
(SIGKILL) and, that rank having exited with a status rather than died of a signal, prints no "BAD
TERMINATION" box and exits with that status, 130 or 143, the same on every rank (mostly: it
reports the bitwise OR of its ranks' wait statuses, so a rank it kills while that rank's own exit is
still under way reads as killed by signal 9, and mpiexec returns 9; seen in 2 to 4 of 10 tries of 8
ranks on 2 cores, whether the ranks exit GRACE_S after their own signal or meet first, never with 2).
Hence `GRACE_S`:
every rank gets the signal at about the same time, but each must have removed its temporary files
before the first exit ends it. Measured on 2 cores under a load of 12, `dp=2,tp=2,pp=2` (8 ranks):
the 8 watchers woke 0.5-24 ms after the signal, and the job had ended 0.59-0.62 s after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
GRACE_S = 0.5  # under mpiexec: time for every rank's watcher to run before the first exit ends them
CHILDREN_S = 3.0  # how long the jobs handed over (adopt) may take to end after SIGTERM


@dataclass
class Progress:
    """What the one line says: `command` ("refpar train"), and, once a loop has begun, the
    `unit` ("step", "run") in progress, 1-based, `at` of `of`; `save`: the --save DIR, if any."""

    command: str = "refpar"
    save: str | None = None
    unit: str | None = None
    at: int | None = None
    of: int | None = None
    # the newest complete checkpoint under a --save DIR, or None: refpar/checkpoint.py sets it when it
    # loads (this module imports nothing of refpar's, so every module that writes files may import it)
    latest: Callable[[str], Path | None] | None = None

    def sentence(self) -> str:
        where = f" at {self.unit} {self.at} of {self.of}" if self.at is not None else ""
        return f"{self.command}: interrupted{where}{self._checkpoint()}"

    def _checkpoint(self) -> str:
        if self.save is None or self.latest is None:
            return ""
        found = self.latest(self.save)
        if found is None:
            return f"; there is no complete checkpoint in {self.save} yet"
        return f"; the last complete checkpoint is {found}"


progress = Progress()
_file_operations = threading.Lock()  # held by a file operation (refpar/files.py), and for good by the watcher
_temporary: set[Path] = set()  # the temporary files and folders being written (refpar/files.py)
_children: list = []  # subprocess.Popen of the jobs handed over that may still run
_interrupted = threading.Event()


def at(index: int, total: int, unit: str = "step") -> None:
    """A loop's progress: it is working on `unit` `index` (0-based) of `total`."""
    progress.unit, progress.at, progress.of = unit, index + 1, total


@contextlib.contextmanager
def file_operation():
    """Around one file operation that must not be cut short (module docstring, 1; refpar/files.py): an
    interruption waits for it, and a thread that asks after the interruption waits until the
    process has ended."""
    with _file_operations:
        yield


def created_temporary(path: Path) -> None:
    """Said inside the `file_operation()` that created `path`, a temporary file or folder: an
    interruption removes it (module docstring, 3) until `removed_temporary(path)`."""
    _temporary.add(path)


def removed_temporary(path: Path) -> None:
    """Said inside the `file_operation()` that renamed `path` into place or removed it."""
    _temporary.discard(path)


def remove(path: Path) -> None:
    """Removes a temporary file or folder, whatever is left of it."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            aside = path.with_name(f"{path.name}.removed")
            os.replace(path, aside)  # first: a writer that opens files by the folder's name adds none now
            shutil.rmtree(aside, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def adopt(proc) -> None:
    """Hands a launched job (a subprocess.Popen) to the watcher: an interruption ends it too."""
    _children[:] = [p for p in _children if p.poll() is None] + [proc]  # one assignment: the watcher
    # may be copying the list at the same moment


@contextlib.contextmanager
def watching(command: str, save: str | None = None, rank: int = 0, launched: bool = False):
    """Ends this process on SIGINT or SIGTERM as the module docstring says, from anywhere inside;
    `rank` 0 says the line; `launched`: mpiexec started this process. Outside the main thread
    (where signals cannot be handled) it watches nothing. On leaving, the handlers and the wakeup fd
    that were there before come back, so calling it again (tests call `refpar.cli.main`) is fine."""
    if threading.current_thread() is not threading.main_thread():
        yield progress
        return
    progress.command, progress.save, progress.unit, progress.at, progress.of = command, save, None, None, None
    read, write = os.pipe()
    os.set_blocking(write, False)
    before_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    before = {number: signal.signal(number, _nothing) for number in EXIT_STATUS}
    watcher = threading.Thread(target=_watch, args=(read, rank, launched), name="refpar-interrupt",
                               daemon=True)
    watcher.start()
    try:
        yield progress
    finally:
        if _interrupted.is_set():  # the watcher ends the process: nothing more from this thread
            threading.Event().wait()
        os.write(write, b"\0")  # not a signal number: the watcher returns
        watcher.join()
        signal.set_wakeup_fd(before_fd)
        for number, handler in before.items():
            signal.signal(number, handler)
        os.close(read)
        os.close(write)


def _nothing(number, frame) -> None:
    """The Python-level handler: the watcher acts (module docstring); the main thread goes on."""


def _watch(read: int, rank: int, launched: bool) -> None:
    while True:
        number = os.read(read, 1)[0]
        if number == 0:
            return
        if number in EXIT_STATUS:
            break
    _interrupted.set()
    try:
        _stop(rank, launched)
    finally:
        os._exit(EXIT_STATUS[number])


def _stop(rank: int, launched: bool) -> None:
    _file_operations.acquire()  # for good (module docstring, 1)
    children = [proc for proc in list(_children) if proc.poll() is None]
    for proc in children:
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    if rank == 0:
        try:
            line = progress.sentence()
        except Exception:  # noqa: BLE001 - the line without the checkpoint rather than none
            line = f"{progress.command}: interrupted"
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode())
    os.dup2(quiet, 2)
    _remove_temporary_files()
    deadline = time.monotonic() + CHILDREN_S
    while any(proc.poll() is None for proc in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in children:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
    if launched:
        time.sleep(GRACE_S)


def _remove_temporary_files() -> None:
    """What refpar/files.py is writing now: with the lock held for good, the list can no longer change."""
    for path in list(_temporary):
        remove(path)
