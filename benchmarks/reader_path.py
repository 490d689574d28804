"""The files and functions of refpar one training step passes through, measured: every rank of
`mpiexec -n 8 refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4` runs its second step
under a profiler that records each refpar function called (the first step is left out: it also
builds what later steps reuse). What a reader must follow to understand a step, counted.

    python benchmarks/reader_path.py                       # this checkout
    python benchmarks/reader_path.py --against ../old      # side by side with another checkout

Prints the number of files and functions, and each file's functions; not timed, not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["train", "--mesh", "dp=2,tp=2,pp=2", "--zero", "1", "--microbatches", "4", "--steps", "3"]
PROFILED_STEP = 1  # 0-based: the second step


def worker(out: str) -> None:
    """One rank: the refpar command with its step PROFILED_STEP profiled; writes the calls to `out`."""
    from refpar import cli, interrupt

    package, seen = str(Path(cli.__file__).resolve().parent), set()

    def record(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and not code.co_name.startswith("<"):
            seen.add((os.path.relpath(code.co_filename, Path(package).parent), code.co_qualname))

    at = interrupt.at

    def at_step(index: int, total: int, unit: str = "step") -> None:  # each step starts here
        if index == PROFILED_STEP:  # the loop itself, already running, is one of the step's functions
            record(sys._getframe(1), "call", None)
        sys.setprofile(record if index == PROFILED_STEP else None)
        at(index, total, unit)

    interrupt.at = at_step
    try:
        cli.main(COMMAND)
    finally:
        sys.setprofile(None)
        rank = os.environ.get("PMI_RANK", "0")
        Path(f"{out}.{rank}").write_text(json.dumps(sorted(seen)))


def measure(checkout: Path, ranks: int = 8) -> dict[str, set[str]]:
    """file -> functions, over every rank of a run from `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        script = checkout / "benchmarks" / "reader_path.py"
        if not script.exists():
            script = Path(__file__).resolve()
        subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(script), "--worker", f"{tmp}/calls"],
                       env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
        files: dict[str, set[str]] = {}
        for f in Path(tmp).glob("calls.*"):
            for file, name in json.loads(f.read_text()):
                files.setdefault(file, set()).add(name)
        return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout of refpar, side by side")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    runs = {"this checkout": measure(ROOT)}
    if args.against:
        runs = {str(args.against): measure(args.against.resolve()), **runs}
    for label, files in runs.items():
        print(f"{label}: {len(files)} files, {sum(map(len, files.values()))} functions")
        for file in sorted(files):
            print(f"  {file} ({len(files[file])}): {', '.join(sorted(files[file]))}")
    if len(runs) == 2:
        (a, fa), (b, fb) = runs.items()
        print(f"\nfiles {len(fa)} -> {len(fb)}, functions {sum(map(len, fa.values()))} -> "
              f"{sum(map(len, fb.values()))}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
