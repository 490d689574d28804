"""The course in lessons/: listing, showing, running and comparing the lessons' commands.

A lesson is `lessons/NN-name.md`. Every fenced ```console block in it is *generated*: its lines
that start with `$ ` are commands, everything after a command up to the next one is that command's
output as `lessons/regenerate.py` last wrote it. HTML comments on the lines right above a block,
`<!-- varies: REGEX -->`, name text that differs from run to run (timings); it is masked in both
outputs before they are compared. `<!-- tolerance: X; why -->` there widens the block's tolerance for
non-integers to X, relative and absolute, and says where X comes from: for float32 and 16-bit runs,
whose last digits depend on the order in which the CPU's BLAS sums (a one-bit difference in fp32
can flip a bf16 rounding).

Comparison (`compare`): the text between numbers must be equal; integers (bytes, counts, 12,345)
must be equal; other numbers must agree to `REL_TOL` relative (or `ABS_TOL` absolute, so rounding
noise like 1e-16 vs 2e-16 passes): float64 losses, printed to 4 or more digits, to 1e-10, the
float64 contract (DESIGN.md, "Numerics"): another CPU's BLAS kernel sums in another order.
Exercises and their checkers: lessons/checks.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
REL_TOL = 1e-10
ABS_TOL = 1e-10
# Always masked: wall-clock times and throughputs.
# Timings, with the spaces that pad them into a column: a slower run's wider number shifts the padding.
ALWAYS_VARIES = (r" *[\d,]+(?:\.\d+)? ?(?:ms|s)\b *", r" *[\d,]+(?:\.\d+)? tokens/s *")
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
VARIES_LINE = re.compile(r"<!--\s*varies:\s*(.*?)\s*-->")
TOLERANCE_LINE = re.compile(r"<!--\s*tolerance:\s*([^\s;]+)\s*(?:;[^>]*)?-->")  # "; why" may follow


@dataclass
class Block:
    """One ```console block: its commands, each with its output, and the masks that apply."""

    start: int  # line index of the opening fence
    stop: int  # line index of the closing fence
    commands: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    varies: list[str] = field(default_factory=list)
    tolerance: float | None = None  # non-integers, relative and absolute; None: REL_TOL, ABS_TOL


def lesson_files() -> list[Path]:
    return sorted(LESSONS.glob("[0-9][0-9]-*.md"))


def lesson_path(n: int) -> Path:
    for path in lesson_files():
        if int(path.name[:2]) == n:
            return path
    numbers = ", ".join(str(int(p.name[:2])) for p in lesson_files())
    from refpar.config import ConfigError

    raise ConfigError(f"there is no lesson {n}; the lessons are {numbers}")


def title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def reader_text(n: int) -> str:
    """Lesson n as a reader sees it (the app's Lessons page, `refpar lesson show`): its markdown without
    the varies and tolerance markers, which are for the comparison and would show as literal text."""
    lines = lesson_path(n).read_text().splitlines(keepends=True)
    return "".join(line for line in lines
                   if not (VARIES_LINE.fullmatch(line.strip()) or TOLERANCE_LINE.fullmatch(line.strip())))


def blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```console":
            block = Block(start=i, stop=i)
            k = i - 1
            while k >= 0 and ((m := VARIES_LINE.search(lines[k]))  # the comments right above it
                              or (t := TOLERANCE_LINE.search(lines[k]))):
                if m:
                    block.varies.append(m.group(1))
                else:
                    block.tolerance = float(t.group(1))
                k -= 1
            j = i + 1
            while lines[j].strip() != "```":
                if lines[j].startswith("$ "):
                    block.commands.append(lines[j][2:])
                    block.outputs.append("")
                elif block.commands:
                    block.outputs[-1] += lines[j] + "\n"
                j += 1
            block.stop = j
            out.append(block)
            i = j
        i += 1
    return out


def command_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["COLUMNS"] = "100"
    return env


def argv(command: str) -> list[str]:
    """A lesson's command as the learner types it -> what runs: `python`, `mpiexec` and a leading
    `refpar` are this environment's."""
    words = shlex.split(command)
    bin_dir = Path(sys.executable).parent
    out = []
    for k, w in enumerate(words):
        if w == "python":
            out.append(sys.executable)
        elif (w == "mpiexec" or (w == "refpar" and k == 0)) and (bin_dir / w).exists():
            out.append(str(bin_dir / w))
        else:
            out.append(w)
    return out


def run(command: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Runs one command as a learner types it (in the repository root unless `cwd` says where)."""
    return subprocess.run(argv(command), cwd=cwd, env=command_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_command(command: str, timeout: float = 300) -> str:
    """Runs one lesson command in the repository root; stdout then stderr, as the learner sees."""
    proc = run(command, timeout)
    return proc.stdout + proc.stderr


def _mask(text: str, varies: list[str]) -> str:
    for pattern in (*ALWAYS_VARIES, *varies):
        text = re.sub(pattern, "<varies>", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _number(s: str) -> float | int:
    s = s.replace(",", "")
    return int(s) if re.fullmatch(r"-?\d+", s) else float(s)


def compare(expected: str, actual: str, varies: list[str] = (), tolerance: float | None = None) -> str | None:
    """None when `actual` matches `expected` (masks and tolerances in the module docstring), else a
    sentence naming the first difference."""
    rel, absolute = (REL_TOL, ABS_TOL) if tolerance is None else (tolerance, tolerance)
    want, got = _mask(expected, list(varies)), _mask(actual, list(varies))
    want_lines, got_lines = want.splitlines(), got.splitlines()
    if len(want_lines) != len(got_lines):
        return f"{len(got_lines)} lines of output, the lesson shows {len(want_lines)}:\n{got}"
    for k, (w, g) in enumerate(zip(want_lines, got_lines, strict=True), 1):
        if NUMBER.sub("#", w) != NUMBER.sub("#", g):
            return f"line {k} differs:\n  lesson: {w}\n  now:    {g}"
        for a, b in zip(NUMBER.findall(w), NUMBER.findall(g), strict=True):
            x, y = _number(a), _number(b)
            if isinstance(x, int) and isinstance(y, int):
                if x != y:
                    return f"line {k}: {b} where the lesson shows {a} (integers must be equal):\n  {g}"
            elif abs(x - y) > max(absolute, rel * max(abs(x), abs(y))):
                return f"line {k}: {b} where the lesson shows {a} (tolerance {rel:g}):\n  {g}"
    return None


def regenerate(path: Path, timeout: float = 300) -> None:
    """Reruns every command of one lesson and rewrites its outputs in place."""
    lines = path.read_text().splitlines()
    found = blocks("\n".join(lines))
    bodies = []
    for block in found:  # in reading order: a later command may read what an earlier one wrote
        body = []
        for command in block.commands:
            output = run_command(command, timeout)
            if "Traceback (most recent call last)" in output:
                raise RuntimeError(f"{path.name}: `{command}` failed:\n{output}")
            body.append(f"$ {command}")
            body.extend(output.rstrip("\n").splitlines())
        bodies.append(body)
    for block, body in reversed(list(zip(found, bodies, strict=True))):  # later lines first
        lines[block.start + 1:block.stop] = body
    path.write_text("\n".join(lines) + "\n")
