"""Reruns every command of every lesson and writes its real output into the lesson.

    python lessons/regenerate.py          # every lesson
    python lessons/regenerate.py 8 8      # lessons 8 and 11

Each ```console block of lessons/NN-name.md holds `$ command` lines, each followed by its output;
this script replaces the outputs, so they never go stale. tests/test_lessons.py reruns the same
commands and compares (lessons/course.py says how: masks for timings, tolerances for numbers).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons import course  # noqa: E402


def main(numbers: list[int]) -> None:
    for path in course.lesson_files():
        if not numbers or int(path.name[:2]) in numbers:
            print(f"regenerating {path.name}", flush=True)
            course.regenerate(path)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
