"""How long each page of the app takes to become interactive: the script run that draws it, first
in a fresh session (its caches cold) and then again (the widgets' next change, caches warm).

    python benchmarks/app_pages.py [--repeat 3]

Each page is opened through `streamlit.testing.v1.AppTest` (app/Home.py's navigation, as a user's
click), which runs the page's script as Streamlit's server does and serialises every element as
the browser receives it: the time a user waits, less the network and the browser's drawing. Issue
44 asks for 2 s or less per page; a page above it is marked. Time it on a quiet machine: under load
the figures are inflated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("views/sharding.py", "views/pipeline.py", "views/mesh.py", "views/communication.py",
         "views/memory.py", "views/plan.py", "views/run.py", "views/serving.py", "views/lessons.py")
TARGET_S = 2.0


def page_times(path: str, repeat: int) -> tuple[float, float]:
    """(the first run's seconds, the median of `repeat` further runs' seconds) for one page."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app" / "Home.py"), default_timeout=300)
    at.run()
    at.switch_page(path)
    start = time.perf_counter()
    at.run()
    first = time.perf_counter() - start
    if at.exception:
        raise SystemExit(f"{path}: {at.exception[0].value}")
    again = []
    for _ in range(repeat):
        start = time.perf_counter()
        at.run()
        again.append(time.perf_counter() - start)
    return first, statistics.median(again)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="warm runs per page (default 3)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more")
    sys.path.insert(0, str(ROOT))
    print(f"{'page':28} {'first (s)':>10} {'again (s)':>10}")
    slow = 0
    for path in PAGES:
        first, again = page_times(path, args.repeat)
        slow += first > TARGET_S
        print(f"{path:28} {first:10.2f} {again:10.2f}{'  over 2 s' if first > TARGET_S else ''}", flush=True)
    print(f"{slow} of {len(PAGES)} pages over {TARGET_S:g} s on first open")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
