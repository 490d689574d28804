"""The one `mpiexec` run the app may have going at a time: started from an argument list (never a
shell), its output read line by line, stopped by ending its process group. Its last good result is
kept in a file too (written whole, then renamed into place), so that a reload of the page, or a new
start of the app, finds it.

Kept out of the page so that tests can drive it without a browser.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

from refpar.comm.trace import chrome_trace, read_trace
from refpar.config import ConfigError
from refpar.jobs import RankWatch, how_it_ended

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
        self.watch: RankWatch | None = None  # the ranks of the run: their pids, which one died, if one did

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
            self.lines, self.started, self.error = [], time.monotonic(), None
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
    is none or it cannot be read."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {**result, "key": tuple(result["key"]) if result.get("key") is not None else None}


@cache
def shared() -> Launcher:
    """The launcher every page and every browser tab of this app process uses."""
    return Launcher()


def mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")
