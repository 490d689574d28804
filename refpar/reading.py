"""Reading files refpar is given (a checkpoint's manifest and shards, a conformance dump's layout, a
schedule CSV) without trusting them: each is checked for kind, size, depth and numbers before use,
and anything wrong is one sentence naming the file, raised as the caller's `error` (refpar.config.
ConfigError or a subclass, which the command line prints as one line; this module imports neither).

    from refpar.reading import read_bounded, load_json
    doc = load_json(read_bounded(path, "checkpoint manifest", 64 << 20, ConfigError), path,
                    "checkpoint manifest", ConfigError)

What each guard stops (issue 43): a FIFO or a device given as a file (`refpar check` waited on a FIFO
forever and read /dev/zero until memory ran out): only regular files are opened; a huge file: its
size is checked before reading, and no more than the limit is read; deep nesting (a RecursionError
in json): refused; `NaN` and `Infinity`, which Python's json accepts: refused; a path longer than
the system takes (a traceback of `File name too long`): one sentence; an .npz whose members inflate
to gigabytes: the sizes its zip directory declares are added up before any member is read.
"""

from __future__ import annotations

import json
import os
import stat
import zipfile

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path (Linux)


def shown(path) -> str:
    """`path` for a sentence: a path of thousands of characters is cut to its ends."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-40:]}"


def check_path_length(flag: str, path, error: type[Exception]) -> None:
    """Refuses a path the operating system would refuse with `File name too long`."""
    raw = os.fsencode(str(path))
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if len(raw) >= PATH_MAX or longest > NAME_MAX:
        raise error(f"{flag} {shown(path)} is too long ({len(raw)} bytes, a name of {longest}; the "
                    f"system takes {PATH_MAX - 1} and {NAME_MAX}); give a shorter path")


def regular_file(path, what: str, error: type[Exception]) -> os.stat_result:
    """The stat of `path` if it is a regular file (symlinks followed), else one sentence: missing,
    a folder, a FIFO, a device or a socket, none of which can be read as a file of a known size."""
    check_path_length(what, path, error)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {shown(path)} does not exist") from None
    except OSError as err:
        raise error(f"{what} {shown(path)} cannot be read ({os.strerror(err.errno or 0).lower()})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket")
        raise error(f"{what} {shown(path)} is {kind}, not a regular file; give the file itself")
    return st


def read_bounded(path, what: str, limit: int, error: type[Exception]) -> bytes:
    """The bytes of the regular file `path`, refused if it holds more than `limit` bytes (checked
    before reading, and no more than the limit is read if it grows meanwhile)."""
    size = regular_file(path, what, error).st_size
    if size > limit:
        raise error(f"{what} {shown(path)} is {size:,} bytes, more than the {limit:,} such a file can "
                    "be; it is not one refpar wrote")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise error(f"{what} {shown(path)} cannot be read ({os.strerror(err.errno or 0).lower()})") from None
    if len(data) > limit:
        raise error(f"{what} {shown(path)} grew past {limit:,} bytes while it was read; is another "
                    "program writing it?")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def load_json(data: bytes | str, path, what: str, error: type[Exception]):
    """JSON from a file's bytes; NaN, Infinity, nesting deeper than Python's stack, bad UTF-8 and
    bad JSON are each one sentence naming the file."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{what} {shown(path)} is nested too deeply to be one refpar wrote") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise error(f"{what} {shown(path)} is not valid JSON ({str(err)[:200]})") from None


def check_zip_sizes(z: zipfile.ZipFile, path, what: str, limit: int,
                    error: type[Exception]) -> None:
    """Refuses an .npz whose members would inflate past `limit` bytes (what its directory declares;
    zipfile stops a member that inflates past its declared size)."""
    total = sum(info.file_size for info in z.infolist())
    if total > limit:
        raise error(f"{what} {shown(path)} would inflate to {total:,} bytes, more than the {limit:,} "
                    "it can hold; refusing it")


def is_finite_int(x, low: int = 0) -> bool:
    """An int (not a bool, not a float) of at least `low`."""
    return type(x) is int and x >= low


def is_finite_number(x) -> bool:
    return type(x) in (int, float) and abs(x) < float("inf")

