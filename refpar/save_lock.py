"""The advisory lock of a --save DIR: one job writes a checkpoint directory at a time, and no job
resumes from the step another is writing.

    lock = save_lock.take("ckpt")          # rank 0, before the run: ckpt/.refpar-writer.lock
    save_lock.mark("ckpt", "step-00000004")  # rank 0, before each save (checkpoint.save does it)
    save_lock.release(lock)                # at the end of the run (Ctrl-C removes it too)

The lock is a small JSON file, {"host", "pid", "step"}, created with O_EXCL (two jobs cannot both
create it) and kept for the whole run; "step" names the step directory being written, or is null
between saves. A lock whose process is gone (same host, no such pid: a job killed with SIGKILL) is
stale and taken over; one from another host cannot be checked, so the sentence says which file to
delete if that job is gone. It is advisory: it stops refpar jobs, not `rm`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

from refpar import interrupt
from refpar.config import ConfigError
from refpar.files import write_atomically
from refpar.reading import read_bounded, shown

LOCK = ".refpar-writer.lock"


def lock_path(root) -> Path:
    return Path(root) / LOCK


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def holder(root) -> dict | None:
    """{"host", "pid", "step"} of the live job that holds `root`'s lock, or None: no lock, a stale
    one, or this process's own."""
    file = lock_path(root)
    if not file.exists():
        return None
    try:
        doc = json.loads(read_bounded(file, "lock file", 4096, ConfigError))
        host, pid = str(doc["host"]), int(doc["pid"])
    except (ConfigError, ValueError, KeyError, TypeError):
        return {"host": "?", "pid": "?", "step": None}  # unreadable: someone's, not ours to judge
    if {"host": host, "pid": pid} == _me():
        return None
    if host == socket.gethostname() and not _alive(pid):
        return None  # its job was killed without removing it
    return {"host": host, "pid": pid, "step": doc.get("step")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or a pid no process can have: not ours to take over
    return True


def describe(root, who: dict) -> str:
    return (f"process {who['pid']} on {who['host']} (its lock is {shown(lock_path(root))}; delete it "
            "only if that job is gone)")


def take(root) -> Path:
    """Creates `root` and its lock for this process; refuses if a live job holds it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    file = lock_path(root)
    for _ in range(2):  # a stale lock is removed, then created again
        who = holder(root)
        if who is not None:
            raise ConfigError(f"--save {shown(root)} is being written by {describe(root, who)}; wait for "
                              "that run to end or pass another --save DIR")
        with interrupt.file_operation():
            try:
                fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if lock_path(root).exists() and holder(root) is None:
                    file.unlink(missing_ok=True)  # stale or our own from an earlier run in this process
                continue
            interrupt.created_temporary(file)  # an interruption removes it
        with os.fdopen(fd, "w") as f:
            json.dump({**_me(), "step": None}, f)
        return file
    raise ConfigError(f"--save {shown(root)}: another job took its lock {shown(file)} at the same "
                      "moment; pass another --save DIR")


def mark(root, step: str | None) -> None:
    """Says in this process's lock of `root`, if it holds one, which step it is writing (None: none)."""
    file = lock_path(root)
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict) or {"host": doc.get("host"), "pid": doc.get("pid")} != _me():
        return
    write_atomically(file, lambda f: f.write(json.dumps({**_me(), "step": step}).encode()))


def release(file: Path) -> None:
    with interrupt.file_operation(), contextlib.suppress(OSError):
        file.unlink(missing_ok=True)
        interrupt.removed_temporary(file)
