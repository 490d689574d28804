"""`refpar lesson list | show N | check N [--file PATH]`: the course in lessons/ from a terminal.

    refpar lesson list                 # the lessons, one line each
    refpar lesson show 1               # lesson 1's markdown
    refpar lesson check 1              # grade lessons/exercises/01_ring_all_reduce.py
    refpar lesson check 1 --file my_ring.py
"""

from __future__ import annotations

HELP = "the course in lessons/: list the lessons, show one, check your answer to its exercise"


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=("list", "show", "check"), help="list, show N or check N")
    parser.add_argument("number", nargs="?", type=int, default=None, help="the lesson's number")
    parser.add_argument("--file", default=None,
                        help="your answer to check (default lessons/exercises/<the exercise>.py)")


def run(args) -> int:
    from refpar.config import ConfigError

    try:  # the course lives in the repository's lessons/ (lessons/course.py, lessons/checks.py)
        from lessons import checks, course
    except ModuleNotFoundError as err:
        if err.name != "lessons":
            raise
        raise ConfigError("no lessons/ folder beside refpar/; the course comes with a clone of the "
                          "repository (pip install -e . there)") from None
    if args.action == "list" and args.number is not None:
        raise ConfigError("refpar lesson list takes no number; drop it, or show one lesson with refpar "
                          f"lesson show {args.number}")
    if args.file is not None and args.action != "check":
        raise ConfigError(f"--file names your answer for refpar lesson check; drop it from refpar lesson "
                          f"{args.action}")
    if args.action == "list":
        exercises = checks.EXERCISES
        for path in course.lesson_files():
            n = int(path.name[:2])
            exercise = f"  (exercise: lessons/exercises/{exercises[n].file})" if n in exercises else ""
            print(f"{n:2d}  {course.title(path)}{exercise}", flush=True)
        return 0
    if args.number is None:
        raise ConfigError(f"refpar lesson {args.action} needs the lesson's number, e.g. "
                          f"refpar lesson {args.action} 1")
    if args.action == "show":
        print(course.reader_text(args.number), end="", flush=True)
        return 0
    return checks.check(args.number, args.file)
