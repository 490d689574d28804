"""The one `mpiexec` run the app may have going at a time: started from an argument list (never a
shell), its output read line by line, stopped by ending its process group. Its last good result is
kept in a file too (written whole, then renamed into place), so that a reload of the page, or a new
start of the app, finds it.

Kept out of the page so that tests can drive it without a browser.
"""

import atexit
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

from refpar.comm.trace import chrome_trace, read_trace
from refpar.config import MESH_AXES, ConfigError
from refpar.jobs import RankWatch, how_it_ended
from refpar.viz.timeline import check_trace

MAX_STEPS, TIME_LIMIT_S = 20, 300
ROOT = Path(__file__).resolve().parents[1]


class Launcher:
    """The one run this app may have going at a time (shared by every browser tab)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.lines: list[str] = []
        self.started = 0.0
        self.label, self.key, self.steps = "", None, 1
        self.kind = "train"  # which command the last run ran: "train" or "generate"
        self.trace: str | None = None  # where the run writes its Chrome trace
        # {"key", "label", "summary", "trace", "timeline"} of the last good run: "trace" every message,
        # "timeline" the last step's Chrome trace (its actions and messages)
        self.result: dict | None = None
        self.error: str | None = None  # how the last run that failed ended, in one line, then its output tail
        self.stopped = False  # whether the last run ended by Stop (or the time limit), not by itself
        self.watch: RankWatch | None = None  # the ranks of the run: their pids, which one died, if one did
        self.private: str | None = None  # the directory `trace_path` made

    def trace_path(self) -> str:
        """Where the next run writes its trace (PATH and PATH.jsonl): in a directory of this app's
        own, made once by mkdtemp (mode 0700, a fresh random name), so no other local user can plant
        a symlink where the run writes, as they could at a fixed name in /tmp (issue 43)."""
        with self.lock:
            if self.private is None or not Path(self.private).is_dir():
                self.private = tempfile.mkdtemp(prefix="refpar-app-")
                atexit.register(shutil.rmtree, self.private, True)
            return str(Path(self.private) / "trace")  # no suffix: PATH.jsonl and with_suffix agree

    def running(self) -> bool:
        """True until the run has ended and its output, result or error have been taken in."""
        return self.reader is not None and self.reader.is_alive()

    def start(self, argv: list[str], label: str, key: tuple, steps: int, trace: str | None = None,
              kind: str = "train") -> None:
        with self.lock:
            if self.running():
                raise ConfigError("a run is already going; wait for it or stop it first")
            self.watch = RankWatch()
            env = {**os.environ, **self.watch.env(),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            # A list, never a shell; a session of its own so that Stop ends mpiexec and its ranks.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
                                         cwd=ROOT, env=env, start_new_session=True)
            self.watch.follow(self.proc)
            self.lines, self.started, self.error, self.stopped = [], time.monotonic(), None, False
            self.label, self.key, self.steps, self.trace, self.kind = label, key, steps, trace, kind
            self.reader = threading.Thread(target=self._read, args=(self.proc, self.watch), daemon=True)
            self.reader.start()

    def _read(self, proc: subprocess.Popen, watch: RankWatch) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
        proc.wait()
        watch.close()
        with self.lock:
            trace, events, last_step = (Path(self.trace) if self.trace else None), None, None
            if proc.returncode == 0 and trace is not None and Path(f"{trace}.jsonl").exists():
                # every message of the run (the Chrome trace beside it holds the last step only)
                events = chrome_trace(read_trace(Path(f"{trace}.jsonl")))
                last_step = json.loads(trace.read_text()) if trace.exists() else None
            if trace is not None:  # a stopped run may have left half a file
                trace.unlink(missing_ok=True)
                Path(f"{trace}.jsonl").unlink(missing_ok=True)
            summary = next((json.loads(x) for x in reversed(self.lines) if x.startswith('{"mesh"')), None)
            if proc.returncode == 0 and summary is not None:
                self.result = {"key": self.key, "label": self.label, "summary": summary, "trace": events,
                               "timeline": last_step}
                if self.kind == "train":
                    try:
                        save_result(self.result, cache_file())
                    except OSError as err:  # the result stays in memory; only a restart would lose it
                        self.lines.append(f"(the result could not be kept in {cache_file()}: {err})")
            else:
                how = how_it_ended(proc.returncode, "\n".join(self.lines), watch, self.steps)
                tail = "\n".join(self.lines[-25:])
                self.error = f"{how}\n{tail}"

    def last(self) -> dict | None:
        """The last good training run of this app process, else the one kept in the cache file."""
        return self.result if self.result is not None and self.kind == "train" else load_result(cache_file())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stopped = True
            os.killpg(self.proc.pid, signal.SIGTERM)


def cache_file() -> Path:
    """Where the app keeps its last good run: $REFPAR_APP_CACHE, else ~/.cache/refpar/app-last-run.json."""
    return Path(os.environ.get("REFPAR_APP_CACHE") or Path.home() / ".cache" / "refpar" / "app-last-run.json")


def save_result(result: dict, path: Path) -> None:
    """Writes the result beside its place and renames it there: a reader sees the old file or the
    new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(result))
    os.replace(partial, path)


def load_result(path: Path) -> dict | None:
    """The result `save_result` wrote, its key a tuple again (the pages compare keys); None if there
    is none or it cannot be read (`cache_problem` says why)."""
    try:
        return read_result(path)
    except ConfigError:
        return None


def cache_problem(path: Path) -> str | None:
    """Why the kept run in `path` cannot be shown, in one sentence; None if there is none or it is good."""
    try:
        read_result(path)
    except ConfigError as err:
        return str(err)
    return None


def read_result(path: Path) -> dict | None:
    """The kept result, checked for every field a page reads, or None where there is no file; a
    ConfigError naming the file and what to do for one cut short, of the wrong shape, or not a file."""
    redo = f"delete {path} or start a new run on the Run for real page, which replaces it"
    try:
        if not path.is_file():
            if path.exists():
                raise ConfigError(f"the kept run {path} is not a regular file; {redo}")
            return None
        if path.stat().st_size > MAX_RESULT_BYTES:
            raise ConfigError(f"the kept run {path} is larger than any run of this app writes; {redo}")
        result = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise ConfigError(f"the kept run {path} cannot be read as JSON (cut short, or not this app's); "
                          f"{redo}") from None
    try:
        wrong = result_problem(result)
    except ConfigError as err:  # a trace in it that is not this refpar's
        wrong = str(err).split(";")[0]
    if wrong:
        raise ConfigError(f"the kept run {path} is not one this app wrote ({wrong}); {redo}")
    return {**result, "key": tuple(result["key"]) if result.get("key") is not None else None}


MAX_RESULT_BYTES = 256 << 20
MAX_RESULT_RANKS = 64
BYTES_ROW = {"rank": int, "axis": str, "op": str, "bytes_sent": int, "bytes_recv": int}


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _rows(rows, fields: dict) -> bool:
    """A list of dicts whose `fields` have the types given (int: a non-negative int)."""
    return isinstance(rows, list) and all(
        isinstance(r, dict) and all(
            isinstance(r.get(f), t) and not isinstance(r.get(f), bool) and (t is not int or r[f] >= 0)
            for f, t in fields.items()) for r in rows)


def result_problem(result) -> str | None:
    """What in a result (as `Launcher` keeps it) a page could not draw, in a few words; None if it
    holds everything the pages read with the types they read it as."""
    if not isinstance(result, dict) or not isinstance(result.get("summary"), dict):
        return "it has no summary"
    s = result["summary"]
    checks = {
        "key": result.get("key") is None or isinstance(result["key"], list | tuple),
        "label": isinstance(result.get("label"), str),
        "steps": isinstance(s.get("steps"), int) and not isinstance(s["steps"], bool) and s["steps"] >= 1,
        "losses": isinstance(s.get("losses"), list) and len(s["losses"]) > 0
        and all(map(_number, s["losses"])),
        "step_time_s": _number(s.get("step_time_s")),
        "dtype": isinstance(s.get("dtype", ""), str),
        "max_loss_rel_diff": s.get("max_loss_rel_diff") is None or _number(s["max_loss_rel_diff"]),
        "max_param_rel_diff": s.get("max_param_rel_diff") is None or _number(s["max_param_rel_diff"]),
        "comm_bytes": _rows(s.get("comm_bytes"), BYTES_ROW),
        "memory_peak_bytes": s.get("memory_peak_bytes") is None or _rows(
            s["memory_peak_bytes"], {"rank": int, "category": str, "bytes": int}),
        "expected_memory_peak_bytes": s.get("expected_memory_peak_bytes") is None or _rows(
            s["expected_memory_peak_bytes"], {"rank": int, "category": str, "bytes": int}),
        "expected_comm_bytes": s.get("expected_comm_bytes") is None or _rows(
            s["expected_comm_bytes"], BYTES_ROW),
        "moe": s.get("moe") is None or isinstance(s["moe"], dict),
        # the pages draw a world x world matrix of the run's traffic: the app runs at most 16 ranks
        "mesh": isinstance(s.get("mesh"), dict) and all(
            isinstance(s["mesh"].get(a), int) and not isinstance(s["mesh"][a], bool) and s["mesh"][a] >= 1
            for a in MESH_AXES) and math.prod(s["mesh"][a] for a in MESH_AXES) <= MAX_RESULT_RANKS,
    }
    wrong = next((field for field, good in checks.items() if not good), None)
    if wrong:
        return f"its {wrong} is missing or of the wrong type"
    for field in ("trace", "timeline"):
        if result.get(field) is not None:
            check_trace(f"its {field}", result[field], whole_run=field == "trace")
    return None


@cache
def shared() -> Launcher:
    """The launcher every page and every browser tab of this app process uses."""
    return Launcher()


def mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")
