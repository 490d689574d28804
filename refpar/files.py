"""Files written whole or not at all: a reader, or the next run, finds the old file or the whole new
one, never a part, whether the write fails (a full disk), raises, or is interrupted (Ctrl-C, SIGTERM).
Every file refpar writes in one go goes through here: checkpoints, --trace, the tokenizer.json
beside --save, --figure, refpar export's folder, the conformance dumps.

    from refpar.files import write_atomically
    write_atomically(path, lambda f: f.write(text.encode()))   # f: a binary file under a temporary name

How: `write(f)` fills `.NAME.tmp-PID` beside the target (beside, so that the rename stays inside one
filesystem, where POSIX makes it atomic), which is flushed, fsynced and renamed over the target,
then the folder is fsynced (the new name is the folder's data). A write that raises removes its
temporary file and leaves the target as it was. Interruption (refpar/interrupt.py): creating the
temporary file and renaming it are each a `file_operation()`, which an interruption waits for, and
in between the temporary file is on the watcher's list, which it removes before the process ends;
so an interrupted write too leaves the old file or the whole new one, and no temporary file.
`make_folder_atomically` does the same for a folder that must appear whole (refpar export's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from refpar import interrupt


def temporary_name(target: Path) -> Path:
    """`.NAME.tmp-PID` beside `target`: hidden, and this process's own (ranks on one node write
    side by side)."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def write_atomically(target, write: Callable[[BinaryIO], object]) -> Path:
    """`write(f)` into a temporary file beside `target`, fsynced, then renamed over `target` (module
    docstring). Returns `target` as a Path."""
    target = Path(target)
    tmp = temporary_name(target)
    try:
        with interrupt.file_operation():
            f = open(tmp, "wb")
            interrupt.created_temporary(tmp)
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove(tmp)
        raise
    return _into_place(tmp, target)


def make_folder_atomically(target, fill: Callable[[Path], object]) -> Path:
    """`fill(folder)` writes the files of a temporary folder beside `target`, each then fsynced, and the
    folder is renamed to `target`, which must be absent or an empty folder: `target` is then the whole
    folder or absent. Returns `target` as a Path."""
    target = Path(target)
    tmp = temporary_name(target)
    try:
        with interrupt.file_operation():
            tmp.mkdir()
            interrupt.created_temporary(tmp)
        fill(tmp)
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_folder(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return _into_place(tmp, target)  # onto a missing or empty folder: atomic


def _into_place(tmp: Path, target: Path) -> Path:
    """The complete, fsynced temporary `tmp` renamed to `target` in one file operation, the rename
    then made durable; on failure `tmp` is removed."""
    try:
        with interrupt.file_operation():
            os.replace(tmp, target)
            interrupt.removed_temporary(tmp)
    except BaseException:
        _remove(tmp)
        raise
    fsync_folder(target.parent)
    return target


def fsync_folder(path) -> None:
    """Makes a rename in `path` durable (POSIX: the folder's entries are the folder's data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(tmp: Path) -> None:
    """After a write that raised: its temporary file or folder goes (under the lock, so an
    interruption that came meanwhile has removed it already, or waits)."""
    with interrupt.file_operation():
        interrupt.remove(tmp)
        interrupt.removed_temporary(tmp)
