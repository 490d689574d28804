"""The numeric tests under several OpenBLAS kernel families, and how close each test file comes to
its bounds under each (`make test-kernels` runs it on the single-process numeric tests).

    python benchmarks/bound_ratios.py [--kernels SkylakeX,Haswell,Sandybridge,Prescott] TEST_PATH...

The numpy wheel's OpenBLAS picks its kernels by CPU, and each family blocks its sums in its own
order, so a float64 result moves by a few ulps from one machine to the next (ENVIRONMENT.md,
"OpenBLAS kernels"). OPENBLAS_CORETYPE forces a family: this runs pytest once per family, prints
the family threadpoolctl reports in use, and, from the measured / bound ratios that every
`tests/numerics.py` `within` records under REFPAR_BOUND_RATIOS, a table of the largest ratio per
test file and family (1.0: a test at its bound; bitwise claims record nothing). A family whose
instructions this CPU lacks is skipped, saying so; fewer than three families run is a failure.
Exit status 1 if any pytest run fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CPU flags each OPENBLAS_CORETYPE family's kernels execute (Prescott is reported as "Katmai";
# "Zen" runs the Haswell kernels in this OpenBLAS, so it is not a family of its own).
NEEDS = {"SkylakeX": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "Haswell": {"avx2", "fma"},
         "Sandybridge": {"avx"}, "Prescott": {"sse3"}}
SHOWN = "import numpy, threadpoolctl; print(threadpoolctl.threadpool_info()[0]['architecture'])"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return flags | ({"sse3"} if "pni" in flags else set())  # /proc/cpuinfo calls SSE3 pni
    return set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(NEEDS),
                        help=f"OPENBLAS_CORETYPE families, comma-separated (default {','.join(NEEDS)})")
    parser.add_argument("tests", nargs="+", help="test files or node ids, as pytest takes them")
    args = parser.parse_args()
    flags, ran, failed = cpu_flags(), [], []
    ratios: dict[str, dict[str, float]] = defaultdict(dict)  # test file -> kernel -> largest ratio
    for kernel in args.kernels.split(","):
        missing = NEEDS.get(kernel, set()) - flags
        if missing:
            print(f"{kernel}: skipped, this CPU lacks {' '.join(sorted(missing))}", flush=True)
            continue
        env = dict(os.environ, OPENBLAS_CORETYPE=kernel, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        in_use = subprocess.run([sys.executable, "-c", SHOWN], env=env, capture_output=True, text=True,
                                check=True).stdout.strip()
        with tempfile.NamedTemporaryFile("r", suffix=".txt") as record:
            env["REFPAR_BOUND_RATIOS"] = record.name
            print(f"OPENBLAS_CORETYPE={kernel}: threadpoolctl reports {in_use}", flush=True)
            code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   *args.tests], cwd=ROOT, env=env).returncode
            for line in record:
                test, ratio = line.rsplit(" ", 1)
                path = test.split("::")[0]
                ratios[path][kernel] = max(ratios[path].get(kernel, 0.0), float(ratio))
        ran.append(kernel)
        if code != 0:
            failed.append(kernel)
    print(f"\nlargest measured / bound per test file and kernel ({len(ran)} kernels)")
    width = max((len(p) for p in ratios), default=10)
    print(f"{'test file':{width}s}  " + "  ".join(f"{k:>11s}" for k in ran))
    for path in sorted(ratios):
        print(f"{path:{width}s}  " + "  ".join(f"{ratios[path].get(k, float('nan')):11.2e}" for k in ran))
    if failed:
        print(f"failed under {', '.join(failed)}")
    if len(ran) < 3:
        print(f"only {len(ran)} kernel families ran; a bound must be shown to hold under at least three")
    return 1 if failed or len(ran) < 3 else 0


if __name__ == "__main__":
    sys.exit(main())
