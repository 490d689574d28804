"""A benchmark at another commit and at this checkout, side by side: each row's time and the ratio.

    python benchmarks/versus.py a5fe6b0 engine.py --models tiny --steps 3
    python benchmarks/versus.py HEAD~1 moe.py --rounds 5

The base commit is checked out into a temporary git worktree; the benchmark runs there and here
in turns, `--rounds` times each, so that a machine whose load drifts slows both alike. Each row
shows its fastest round on each side (the least disturbed one) and the median over rounds of the
ratio of a round's two runs, taken one right after the other (the paired ratio, which a load that
drifts between rounds affects least). A row is a line of the benchmark's table:
its label is the words before the first number, its time the first number with a decimal point,
in milliseconds (every benchmark here prints its step time that way). Prints a table, not
pass/fail: `here / base` above 1 is slower.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"^-?[\d,]*\d(\.\d+)?x?$")


def rows(output: str) -> dict[str, float]:
    """{label: milliseconds} of each table line of a benchmark's output."""
    found = {}
    for line in output.splitlines():
        words = line.split()
        # the label's first word may be a number ("1 process"): the figures start after it
        first = next((i for i, w in enumerate(words) if i > 0 and NUMBER.match(w)), None)
        if first is None:
            continue
        label = " ".join(words[:first])
        timed = next((w for w in words[first:] if NUMBER.match(w) and "." in w and not w.endswith("x")), None)
        if timed is not None and ":" not in label:  # "ZeRO-3 / DP step time: 1.02" is a summary
            found[label] = float(timed.replace(",", ""))
    return found


def run(checkout: Path, script: str, args: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, str(checkout / "benchmarks" / script), *args], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        sys.exit(f"{script} failed in {checkout}: {proc.stderr.strip().splitlines()[-1:]}")
    return rows(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit to compare with (anything git rev-parse takes)")
    parser.add_argument("script", help="a benchmark in benchmarks/, e.g. engine.py")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, taken in turns")
    args, rest = parser.parse_known_args()
    if not (ROOT / "benchmarks" / args.script).is_file():
        parser.error(f"benchmarks/{args.script} does not exist; give one of the files in benchmarks/")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT,
                       check=True)
        try:
            best: dict[str, dict[str, float]] = {"base": {}, "here": {}}
            paired: dict[str, list[float]] = {}  # label -> here / base of each round
            for _ in range(args.rounds):
                times = {side: run(checkout, args.script, rest) for side, checkout in (("base", base),
                                                                                      ("here", ROOT))}
                for side, found in times.items():
                    for label, ms in found.items():
                        best[side][label] = min(ms, best[side].get(label, ms))
                for label in times["base"].keys() & times["here"].keys():
                    if times["base"][label] > 0:
                        paired.setdefault(label, []).append(times["here"][label] / times["base"][label])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    width = max(map(len, best["here"] | best["base"]), default=10)
    print(f"{args.script} {' '.join(rest)}: fastest of {args.rounds} rounds, ms")
    print(f"{'row':<{width}} {args.base:>10} {'here':>10} {'here/base':>10} {'paired':>8}")
    for label in best["here"] | best["base"]:
        a, b = best["base"].get(label), best["here"].get(label)
        ratio = f"{b / a:.3f}" if a and b else "-"
        pairs = paired.get(label)
        median = f"{statistics.median(pairs):.3f}" if pairs else "-"
        shown = ["-" if t is None else f"{t:.1f}" for t in (a, b)]
        print(f"{label:<{width}} {shown[0]:>10} {shown[1]:>10} {ratio:>10} {median:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
