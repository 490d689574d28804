"""`refpar <command> ...`: one module per command under refpar/commands/.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
A `ConfigError` anywhere becomes one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import shlex
import sys


def one_blas_thread_unless_chosen() -> None:
    """One BLAS/OpenMP thread per process, as `make demo` runs every rank, unless the user set a thread
    count: set before NumPy loads OpenBLAS, which reads it once. On 2 cores `refpar train --steps 30`
    took 949-1409 ms a step with OpenBLAS's default threads and 143-154 ms with one (issue 38): the
    models' GEMMs are too small to share, and every MPI rank is already a process of its own."""
    chosen = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS")
    if not any(var in os.environ for var in chosen):
        for var in chosen[:3]:
            os.environ[var] = "1"


one_blas_thread_unless_chosen()

from refpar import interrupt  # noqa: E402
from refpar.config import ConfigError  # noqa: E402  (NumPy loads here: after the thread count is set)

# name -> module. Command modules import heavy dependencies (mpi4py, the model) inside run(),
# so `refpar schedule --help` starts instantly and never initialises MPI.
COMMANDS: dict[str, str] = {
    "train": "refpar.commands.train",
    "schedule": "refpar.commands.schedule",
    "plan": "refpar.commands.plan",
    "app": "refpar.commands.app",
    "verify": "refpar.commands.verify",
    "check": "refpar.commands.check",
    "generate": "refpar.commands.generate",
    "export": "refpar.commands.export",
    "lesson": "refpar.commands.lesson",
}


def launcher_rank() -> int:
    """This process's rank as the MPI launcher set it, read without initialising MPI."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `refpar <command>: error: <what is wrong>; see refpar
    <command> --help` (no usage block), printed by rank 0 only, exit status 2: the same form as a
    ConfigError's sentence."""

    def error(self, message: str):
        flag = re.fullmatch(r"argument ([^/:]+)(?:/[^:]*)?: expected one argument", message)
        if flag:  # e.g. `--lr -1e-3`: argparse takes a value that starts with '-' for a flag
            message += f" (a value that starts with '-' is written {flag.group(1)}=VALUE)"
        if launcher_rank() == 0:
            line = f"{self.prog}: error: {message}; see {self.prog} --help".replace("\n", " ")
            print(line, file=sys.stderr, flush=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="refpar",
                           description="Parallel training strategies in plain NumPy on real MPI ranks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run, _parser=command)
    return parser


def did_you_mean(word: str, known) -> str:
    """" (did you mean --steps?)" when `word` is close to one of `known`, else ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; arguments no option takes are refused by the command's own parser,
    so that the sentence points to `refpar <command> --help`, with the nearest flag it knows."""
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    commands = parser._subparsers._group_actions[0].choices  # name -> that command's parser
    if words and not words[0].startswith("-") and words[0] not in commands:
        parser.error(f"there is no command {words[0]!r}{did_you_mean(words[0], commands)}; the commands "
                     f"are {', '.join(commands)}")
    args, extra = parser.parse_known_args(words)
    if extra:
        unknown = next((w.split("=")[0] for w in extra if w.startswith("--")), "")
        hint = did_you_mean(unknown, args._parser._option_string_actions) if unknown else ""
        args._parser.error(f"unrecognized arguments: {shlex.join(extra)}{hint}")  # quoted: '' shows
    return args


def under_launcher() -> bool:
    """True when mpiexec started this process (its rank is in the environment)."""
    return any(var in os.environ for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def _run_reporting_config_errors(args) -> int:
    try:
        return int(args._run(args) or 0)
    except ConfigError as err:
        # Every rank raises the same ConfigError before any communication (DESIGN.md, "Errors"),
        # so every rank can return 2 on its own; one prints the sentence.
        if launcher_rank() == 0:
            print(f"refpar {args.command}: error: {err}", file=sys.stderr, flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `refpar schedule ... | head`: the reader has gone, so nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or Python's exit flush raises again
        return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe ended


def _main(argv: list[str] | None) -> int:
    if not (sys.argv[1:] if argv is None else argv):  # a bare `refpar`: what it can do, not an error
        build_parser().print_help()
        return 0
    args = parse(argv)
    if args.command == "app":  # a server: Ctrl-C is its normal end, and streamlit stops itself
        return _run_reporting_config_errors(args)
    # Ctrl-C and SIGTERM end every rank at once with one line (refpar/interrupt.py).
    with interrupt.watching(f"refpar {args.command}", getattr(args, "save", None), launcher_rank(),
                            under_launcher()):
        if not under_launcher():
            return _run_reporting_config_errors(args)
        from refpar import jobs

        jobs.announce(launcher_rank())  # a launching process can then say which rank died, if one does
        # A command whose ranks communicate ends every rank on any error past its checks, from its
        # first message on (refpar/engine/run.py:run_job, refpar/commands/generate.py:run): before
        # it, MPI is not running and the launcher ends the job at the first rank to exit.
        status = _run_reporting_config_errors(args)
        jobs.ended()
        return status
