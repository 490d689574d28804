"""The docs name code that exists. docs/internals.md follows one training step through the engine
as `file.py:function` at each point; README.md and the lessons name files too. Every file named must
exist, and every name after `file.py:` (a function, a class, a constant, or `Class.member`) and
every `refpar.module.name` must be defined there, so a renamed or deleted function fails here instead
of leaving the page describing code that is gone (read with `ast`, nothing imported or run).

The docs' commands run as written. Every command in a fenced block of docs/ runs here, once however
many pages show it, and prints what its pages say: a shown output, "matches one device", a byte
count, a memory figure, a file written. The commands this machine cannot run (a scheduler, a
cluster's MPI, GPUs, the framework extras) carry a `# needs ...` mark the reader sees, and
NOT_RUN_HERE lists each. The whole commands that sentences name in backquotes run too."""

from __future__ import annotations

import ast
import io
import itertools
import re
import shlex
import subprocess
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lessons import course as lessons

ROOT = Path(__file__).resolve().parent.parent
INTERNALS = ROOT / "docs" / "internals.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "lessons").glob("*.md"))]

TOP = r"(?:refpar|tests|benchmarks|gpu_backend|app|lessons|docs)"
FILE = re.compile(rf"(?<![\w./]){TOP}/[\w/.-]*?\w\.(?:py|md)\b")  # a path from the repository root
NAMED = re.compile(rf"(?<![\w./])({TOP}/[\w/]+\.py):([A-Za-z_][\w.]*\w|[A-Za-z_])")  # file.py:name
DOTTED = re.compile(r"(?<![\w./])refpar(?:\.[A-Za-z_]\w*)+")  # refpar.module.name


def _targets(node) -> list:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _bound(node) -> list[str]:
    """The plain names an assignment binds."""
    return [t.id for t in _targets(node) if isinstance(t, ast.Name)]


def _self_attrs(method) -> set[str]:
    """The `self.x` a method assigns."""
    return {t.attr for n in ast.walk(method) if isinstance(n, ast.Assign | ast.AnnAssign) for t in _targets(n)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods and class attributes, and the `self.x` its methods assign."""
    out = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out |= {node.name} | _self_attrs(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            out |= set(_bound(node))
    return out


@cache
def definitions(path: Path) -> dict[str, set[str]]:
    """Names bound at a module's top level (functions, classes, assignments, imports), each class's
    with its members."""
    out: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = _members(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            out |= {name: set() for name in _bound(node)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0]: set() for a in node.names}
    return out


def defined(path: Path, name: str) -> bool:
    """Whether `name` (`f`, `Class` or `Class.member`) is defined in the Python file `path`."""
    if not path.is_file():
        return False
    top, _, member = name.partition(".")
    members = definitions(path).get(top)
    return members is not None and (not member or member in members)


def resolves(dotted: str) -> bool:
    """Whether `refpar.a.b.name` is a module or package of the repository, or a name defined in the
    longest such module it starts with."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[i:]
            return not rest or defined(module, ".".join(rest))
    return False


TEMPLATE = re.compile(r"(?<![A-Za-z])[A-Z]{2,}(?![a-z])")  # `lessons/NN-name.md` names a kind of file


def mentions(pattern: re.Pattern, path: Path) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in pattern.finditer(line) if not TEMPLATE.search(m.group(0))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc):
    missing = [f"{doc.name}:{n}: {p}" for n, p in mentions(FILE, doc) if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_function_a_doc_names_is_defined_in_its_file(doc):
    missing = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in NAMED.finditer(line):
            if not defined(ROOT / m.group(1), m.group(2)):
                missing.append(f"{doc.name}:{n}: {m.group(0)}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_refpar_module_name_a_doc_names_resolves(doc):
    missing = [f"{doc.name}:{n}: {d}" for n, d in mentions(DOTTED, doc) if not resolves(d)]
    assert not missing, "\n".join(missing)


def test_internals_names_every_step_of_the_engine_as_file_and_function():
    """The page follows the step: each of these must be named, as file.py:function, so a page that
    lost its path (or a regex that stopped matching) fails instead of checking nothing."""
    named = {m.group(0) for _, line in enumerate(INTERNALS.read_text().splitlines())
             for m in NAMED.finditer(line)}
    path = ["refpar/cli.py:main", "refpar/commands/train.py:run", "refpar/engine/validate.py:validate",
            "refpar/engine/run.py:run_job", "refpar/engine/parallelize.py:parallelize",
            "refpar/engine/train.py:train", "refpar/parallel/pipeline/executor.py:PipelineExecutor.step",
            "refpar/parallel/pipeline/stage.py:Stage.forward",
            "refpar/parallel/gpt2_pieces.py:block_forward",
            "refpar/parallel/zero.py:Zero.reduce", "refpar/parallel/zero.py:Zero.step",
            "refpar/model/optim.py:adamw_update", "refpar/engine/run.py:collect"]
    assert [p for p in path if p not in named] == []
    assert len(named) >= 100  # the walk-through and the interfaces name far more than the path


def test_the_checks_refuse_what_does_not_exist():
    """The checker itself: names that are not defined, members of the wrong class, and modules that
    are gone are refused; what is defined (a method, an attribute set in __init__, an import) passes."""
    zero = ROOT / "refpar" / "parallel" / "zero.py"
    assert defined(zero, "Zero.reduce") and defined(zero, "Zero.grad_shards")
    assert defined(zero, "ModelStates")
    assert not defined(zero, "Zero.no_such_method") and not defined(zero, "ZeroOne")
    assert not defined(ROOT / "refpar" / "engine_zero3.py", "ShardedGrads")  # deleted in issue 21
    assert resolves("refpar.engine.train") and resolves("refpar.mesh.DeviceMesh.axis")
    assert not resolves("refpar.parallel.dp_runner") and not resolves("refpar.mesh.NoSuchMesh")
    assert [p for _, p in mentions(FILE, INTERNALS) if "dp_runner" in p or "pipeline/runner" in p] == []


SOURCES = sorted((ROOT / "refpar").rglob("*.py"))
# `engine/parallelize.microbatch_samples`: a module named by its path inside the repository, then a name
PATH_NAME = re.compile(r"(?<![\w./-])((?:[A-Za-z_]\w*/)+[A-Za-z_]\w*)\.(?!(?:py|md)\b)([A-Za-z_][\w.]*\w)")
CODE = [f for top in ("refpar", "tests", "benchmarks", "gpu_backend", "app", "lessons")
        for f in (ROOT / top).rglob("*.py")]  # the repository's Python files
DIRECTORIES = {part for f in CODE for part in f.relative_to(ROOT).parts[:-1]}


def prose(path: Path) -> list[tuple[int, str]]:
    """The docstrings (of the module, its classes and functions) and the comments of a Python file,
    as (line number, text) per line: what a reader takes for a description of the code."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    out += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]
    return out


def path_name_exists(module: str, name: str) -> bool:
    """Whether `a/b` + `.name` names a module of the repository (the files whose path ends in
    a/b.py) that defines `name`. A path whose first folder is none of the repository's (another
    project's, `megatron/core/...`) is left alone."""
    if module.split("/")[0] not in DIRECTORIES:
        return True
    return any(defined(f, name) for f in CODE if f.as_posix().endswith(f"/{module}.py"))


def unknown_names(path: Path) -> list[str]:
    """Every path from the repository root, `file.py:name`, `refpar.x.y` and `a/b.name` that the
    docstrings and comments of `path` name and the repository lacks: `file.py:123` (a line) needs
    the file, `refpar.x.y` a module, or a name defined in the longest module it starts with."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    out = []
    for n, line in prose(path):
        out += [f"{where}:{n}: {m.group(0)}" for m in FILE.finditer(line)
                if not TEMPLATE.search(m.group(0)) and not (ROOT / m.group(0)).exists()]
        out += [f"{where}:{n}: {m.group(0)}" for m in NAMED.finditer(line)
                if not defined(ROOT / m.group(1), m.group(2))]
        out += [f"{where}:{n}: {m.group(0)}" for m in DOTTED.finditer(line) if not resolves(m.group(0))]
        out += [f"{where}:{n}: {m.group(0)}" for m in PATH_NAME.finditer(line)
                if not path_name_exists(m.group(1), m.group(2))]
    return out


def test_every_file_and_name_refpar_s_docstrings_and_comments_name_exists():
    """Docstrings are checked like docs: a renamed module or function fails here instead of leaving
    a comment that points a reader at code that is gone."""
    missing = [m for path in SOURCES for m in unknown_names(path)]
    assert not missing, "\n".join(missing)


def test_the_docstring_check_reads_docstrings_and_comments_and_refuses_what_is_gone(tmp_path):
    """The checker itself, on a file written here: each kind of name is found in a docstring or a
    comment, and refused when it does not exist; code outside them is not read."""
    fake = tmp_path / "probe.py"
    lines = ['"""refpar/schedules/__init__.py:StageMap, refpar/no_such_file.py:12, and',
             'refpar.schedules.simulate.simulate, refpar.comm.diagnosis.NoSuchError."""',
             "# engine/parallelize.parallelize, engine/parallelize.no_such_step, megatron/core.whatever",
             "x = 'refpar/not_a_docstring.py'",
             "def f():",
             '    """refpar/parallel/ring.py:Ring.no_such_method"""']
    fake.write_text("\n".join(lines) + "\n")
    found = [m.split(": ", 1)[1] for m in unknown_names(fake)]
    assert sorted(found) == sorted(["refpar/no_such_file.py", "refpar.comm.diagnosis.NoSuchError",
                                    "engine/parallelize.no_such_step",
                                    "refpar/parallel/ring.py:Ring.no_such_method"])


LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link or image: [text](target)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_points_inside_the_clone_to_something_there(doc):
    """A reader has the clone and nothing else: no web address, no shared folder, every relative link a
    file of the repository (an anchor after # is left to the renderer)."""
    for n, target in mentions(LINK, doc):
        target = LINK.fullmatch(target).group(1).split("#")[0]
        assert "://" not in target and not target.startswith("/"), f"{doc.name}:{n}: {target}"
        if target:
            assert (doc.parent / target).resolve().is_relative_to(ROOT), f"{doc.name}:{n}: {target}"
            assert (doc.parent / target).exists(), f"{doc.name}:{n}: {target} does not exist"
    assert "shared folder" not in doc.read_text(), doc.name


def test_the_readme_is_one_screen_with_the_start_here_path_in_order():
    """The Home page shows the same path: tests/test_app.py test_home_lists_every_page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 60
    assert "make demo" in readme and "make test" in readme and "](docs/app-sharding.png)" in readme
    path = ["Lesson 0", "Sharding", "Pipeline", "Whole mesh", "Run for real"]
    start = readme.index("## Start here")
    assert [readme.index(f"**{step}**", start) for step in path] == sorted(
        readme.index(f"**{step}**", start) for step in path)


COMMAND_WORDS = {"python", "mpiexec", "srun", "refpar"}  # how a command line in a fenced block starts
NEEDS = re.compile(r"^#\s*(needs\b.*)$")  # a page's mark on what a command needs that the tests lack
COMMENT = re.compile(r"\s+#.*$")  # a command's trailing comment (no command of docs/ has a # of its own)


@dataclass(frozen=True)
class DocCommand:
    """One command a docs page shows in a fenced block, as a reader types it."""

    page: str  # relative to docs/
    line: int
    text: str  # less its trailing comment
    needs: str | None  # what the page says it needs (`# needs ...` after it, or alone above it in its block)
    before: tuple[str, ...]  # the block's commands above it: it may read what they write (a checkpoint)
    shown: str | None = None  # a ```console block's output after the command, as the page shows it
    varies: tuple[str, ...] = ()  # that block's `<!-- varies: REGEX -->` masks (lessons/course.py)

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)


def doc_commands() -> list[DocCommand]:
    """Every command in a fenced block of docs/ but app.md's (`make app` starts a server; the app's own
    tests drive it): in a ```console block the `$ ` lines, each followed by its output, read as the
    lessons' are (lessons/course.py blocks); in any other, each line that starts with python, mpiexec,
    srun or refpar."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name == "app.md":
            continue
        name, text = str(page.relative_to(ROOT / "docs")), page.read_text()
        console = {block.start: block for block in lessons.blocks(text)}
        lines = text.splitlines()
        n = 0
        while n < len(lines):
            if not lines[n].startswith("```"):
                n += 1
                continue
            end = next(k for k in range(n + 1, len(lines)) if lines[k].startswith("```"))
            if block := console.get(n):
                numbers = [k + 1 for k in range(n + 1, end) if lines[k].startswith("$ ")]
                for i, (number, command, shown) in enumerate(zip(numbers, block.commands, block.outputs,
                                                                 strict=True)):
                    out.append(DocCommand(name, number, command, None, tuple(block.commands[:i]), shown,
                                          tuple(block.varies)))
                n = end + 1
                continue
            block_needs, before = None, []
            for number, line in enumerate(lines[n + 1:end], n + 2):
                assert not line.startswith("$ "), f"{name}:{number}: a `$ ` command needs ```console"
                if mark := NEEDS.match(line.strip()):
                    block_needs = mark.group(1)
                    continue
                if not line or line.split()[0] not in COMMAND_WORDS:
                    continue
                comment = COMMENT.search(line)
                mark = NEEDS.match(comment.group(0).strip()) if comment else None
                command = COMMENT.sub("", line)
                out.append(DocCommand(name, number, command, mark.group(1) if mark else block_needs,
                                      tuple(before)))
                before.append(command)
            n = end + 1
    return out


DOCS_COMMANDS = doc_commands()


def refpar_args(command: DocCommand) -> tuple[int, list[str]] | None:
    """(ranks, refpar's arguments) of a `refpar ...` or `python -m refpar ...` command, `mpiexec -n N`
    (or `srun ... -N 2 --ntasks-per-node=8`) giving the ranks; None for any other command."""
    words = command.words
    if words[0] == "refpar":
        return 1, words[1:]
    at = words.index("python") if "python" in words else None
    if at is None or words[at + 1:at + 3] != ["-m", "refpar"]:
        return None
    launcher, args = words[:at], words[at + 3:]
    ranks = 1
    if "-n" in launcher:
        ranks = int(launcher[launcher.index("-n") + 1])
    elif "srun" in launcher:
        per_node = next(w for w in launcher if w.startswith("--ntasks-per-node="))
        ranks = int(launcher[launcher.index("-N") + 1]) * int(per_node.split("=")[1])
    return ranks, args


INLINE = re.compile(r"`((?:mpiexec -n \d+ )?python -m refpar[ .][^`]*)`")  # a whole command in a sentence
PLACEHOLDER = re.compile(r"\[|\.\.\.|<|\b[A-Z]{2,}\b")  # `verify [--quick]`, `refpar ...`, `check DUMP`


def inline_commands() -> list[DocCommand]:
    """The whole commands that sentences of docs/ name in backquotes (what-works.md's table,
    command-line.md), outside fenced blocks and less those with a placeholder (`verify [--quick]`):
    they run as the fenced ones do."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            fenced = fenced != line.startswith("```")
            if page.name != "app.md" and not fenced:
                out += [DocCommand(str(page.relative_to(ROOT / "docs")), n, m.group(1), None, ())
                        for m in INLINE.finditer(line) if not PLACEHOLDER.search(m.group(1))]
    return out


INLINE_COMMANDS = inline_commands()
REFPAR_COMMANDS = [(c, *refpar_args(c)) for c in DOCS_COMMANDS + INLINE_COMMANDS if refpar_args(c)]


@pytest.mark.parametrize("command, ranks, args", REFPAR_COMMANDS,
                         ids=[f"{c.page}:{c.line} {shlex.join(a[:3])}" for c, _, a in REFPAR_COMMANDS])
def test_every_refpar_command_in_docs_is_one_refpar_takes(command, ranks, args):
    """Each refpar command a docs page shows parses, and a `refpar train` one passes every check a run
    makes before its first message (refpar/engine/validate.py validate) on a mesh of as many ranks as its
    launcher starts: a renamed flag or a mesh the engine refuses fails here, the cluster's and GPUs'
    commands too, which cannot run here."""
    from refpar.cli import parse
    from refpar.commands.train import configs, plan_of
    from refpar.config import ConfigError
    from refpar.engine import validate

    parsed = parse(args)
    # a run from weights that a command above it exports (docs/weights.md) takes its model from them:
    # it is checked where it runs, in test_every_command_in_docs_runs_and_prints_what_its_pages_say
    if parsed.command == "train" and parsed.init_from is None:
        model, train, sizes = configs(parsed)
        try:
            validate(model, train, sizes, plan_of(parsed, sizes, model))
        except ConfigError:  # a page that shows this command's error (internals.md's `$ refpar ...`)
            assert command.shown and command.shown.startswith("refpar train: error: "), command
            return
        assert np.prod(list(sizes.values())) == ranks, f"{command}: the mesh {sizes} on {ranks} ranks"


# Running them: every command above that this machine can run, once however many pages show it, in one
# directory (a checkpoint a command saves is there for the next), with the lessons' launcher
# (lessons/course.py run: this environment's python and mpiexec, the suite's MPI variables).

HOSTS = "localhost:4\n"  # cluster.md's file `hosts`: both of its nodes this machine, for Hydra's 4 ranks
NOT_RUN_HERE = [  # (page, how the command starts, its page's mark): each command a page marks, and why
    ("checking-a-framework.md", "mpiexec -n 2 python -m refpar.conformance --table megatron-tp",
     "needs the megatron and deepspeed extras (make conformance)"),
    ("cluster.md", "srun --mpi=pmix", "needs Slurm"),
    ("cluster.md", "python -m pip uninstall -y mpich mpi4py", "needs the cluster's MPI and its mpicc"),
    ("cluster.md", "python -m pip install --no-binary mpi4py", "needs the cluster's MPI and its mpicc"),
    ("cluster.md", "python -m pip install -e", "needs the cluster's MPI and its mpicc"),
    ("cluster.md", "mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 "
     "--backend torch --device cuda", "needs GPUs"),
    ("what-works.md", "mpiexec -n 2 python -m refpar train --mesh dp=2 --zero 3 --steps 2 --check "
     "--backend torch --device cuda", "needs a GPU"),
    ("what-works.md", "python benchmarks/gpu_check.py", "needs a GPU: the equivalence matrix, then TFLOP/s"),
]
RUN_ELSEWHERE = {  # a command a sentence names that another test runs, with more: not run twice
    "mpiexec -n 2 python -m refpar.conformance ddp fsdp2 tp pp-1F1B": "tests/test_conformance_torch.py",
}


def test_the_commands_not_run_here_are_the_ones_their_pages_mark():
    """A command the tests cannot run says so where the reader sees it (`# needs ...`), and only those:
    a mark on a command this machine could run, or a new one, fails here until it is listed above."""
    marked = [(c.page, c.text, c.needs) for c in DOCS_COMMANDS if c.needs]
    assert len(marked) == len(NOT_RUN_HERE)
    for (page, text, needs), (want_page, start, want_needs) in zip(marked, NOT_RUN_HERE, strict=True):
        assert (page, needs) == (want_page, want_needs) and text.startswith(start), (page, text, needs)


def _places() -> dict[str, list[DocCommand]]:
    """Each runnable command's text -> every place a page shows it (a fenced block, or a sentence)."""
    out: dict[str, list[DocCommand]] = {}
    for c in DOCS_COMMANDS + INLINE_COMMANDS:
        if c.needs is None and c.text not in RUN_ELSEWHERE:
            out.setdefault(c.text, []).append(c)
    return out


SHOWN_AT = _places()
RUNNABLE = [places[0] for places in SHOWN_AT.values()]
_RUNS: dict[tuple[str, Path], subprocess.CompletedProcess] = {}


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    (folder / "hosts").write_text(HOSTS)
    (folder / "docs").symlink_to(ROOT / "docs")  # the corpus of the pages' `--data docs`, as from the clone
    return folder


def ran(text: str, folder: Path) -> str:
    """stdout then stderr of a docs command run once in `folder`, after the ones above it in its block
    (a resume reads the checkpoint the line above saved); asserts the exit status its page implies."""
    if (text, folder) not in _RUNS:
        for earlier in SHOWN_AT[text][0].before:
            if earlier in SHOWN_AT:  # not one marked `# needs ...`
                ran(earlier, folder)
        _RUNS[text, folder] = lessons.run(text, timeout=240, cwd=folder)
    proc = _RUNS[text, folder]
    want = EXIT_STATUS.get(text, 0)
    out = proc.stdout + proc.stderr
    assert proc.returncode == want, f"`{text}` exited {proc.returncode}, not {want}:\n{out}"
    return out


EXIT_STATUS = {  # what a page shows failing: a mistake's one line (exit 2), an untouched exercise (exit 1)
    "refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 5": 2,
    "refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4 --overlap": 2,
    "python -m refpar lesson check 1": 1,
}
CLAIMS: dict[str, list] = {}


def claims(*texts: str):
    """Registers a check of what the pages say about the commands `texts` print."""
    def register(check):
        for text in texts:
            CLAIMS.setdefault(text, []).append(check)
        return check
    return register


@pytest.mark.parametrize("command", RUNNABLE,
                         ids=[", ".join(f"{c.page}:{c.line}" for c in SHOWN_AT[r.text])
                              + f" {shlex.join(refpar_args(r)[1][:3])}" for r in RUNNABLE])
def test_every_command_in_docs_runs_and_prints_what_its_pages_say(command, docs_dir):
    """The command exits as its page implies and prints what every page that shows it says: the
    output under it, a `--check`'s match with one device, and the CLAIMS below."""
    out = ran(command.text, docs_dir)
    for place in SHOWN_AT[command.text]:
        if place.shown is not None:  # the output a page prints under the command
            problem = lessons.compare(place.shown, out, place.varies)
            assert problem is None, f"{place.page}:{place.line}: `{place.text}`: {problem}"
    words = command.words
    if "train" in words and "--check" in words:
        matches_one_device(words, out)
    for check in CLAIMS.get(command.text, ()):
        check(out, docs_dir)


def test_every_claim_checks_a_command_a_page_shows():
    """A page's command edited away must take its claims with it, not leave them checking nothing."""
    assert set(CLAIMS) <= set(SHOWN_AT) and set(EXIT_STATUS) <= set(SHOWN_AT)
    assert set(RUN_ELSEWHERE) <= {c.text for c in INLINE_COMMANDS}
    assert len(CLAIMS) >= 15


def number(text: str) -> float:
    return float(text.replace(",", ""))


def line_of(out: str, start: str) -> str:
    """The one line of `out` that starts with `start` (leading spaces ignored)."""
    found = [line.strip() for line in out.splitlines() if line.strip().startswith(start)]
    assert len(found) == 1, f"{len(found)} lines start with {start!r}:\n{out}"
    return found[0]


def section(out: str, start: str) -> list[str]:
    """The indented lines right under the line of `out` that starts with `start`."""
    lines = out.splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith(start))
    return list(itertools.takewhile(lambda line: line.startswith("  "), lines[k + 1:]))


def bytes_rows(out: str) -> dict[tuple[str, str], list[int]]:
    """(axis, op) -> the measured bytes sent of each group of ranks in the bytes table, which the
    generic check holds equal to the closed form."""
    rows: dict[tuple[str, str], list[int]] = {}
    for m in re.finditer(r"^    (\w+) +(\w+) +([\d,]+) \([\d,]+\) \| ", out, re.M):
        rows.setdefault((m.group(1), m.group(2)), []).append(int(number(m.group(3))))
    return rows


def parameters(out: str) -> int:
    """Ψ, as the header's first line gives it."""
    return int(number(re.search(r"([\d,]+) parameters,", out).group(1)))


def matches_one_device(words: list[str], out: str) -> None:
    """What every `--check` prints (command-line.md, troubleshooting.md, "A mismatch"): the largest
    relative difference from one device, at most 1e-10 in float64 (DESIGN.md, "Numerics") and within
    `refpar verify`'s loss bound in bf16 (what-works.md quotes it); bytes and memory next to their closed
    forms, equal (a row that is not says MISMATCH); an MoE run's drops the single device's."""
    m = re.search(r"largest relative difference from one device: loss (\S+), parameters (\S+) after", out)
    assert m, out
    loss, params = float(m.group(1)), float(m.group(2))
    if "--precision" in words:
        from refpar.commands.verify import LOSS_TOLERANCES

        assert words[words.index("--precision") + 1] == "bf16-mixed" and LOSS_TOLERANCES["bf16-mixed"] == 2e-3
        assert loss <= 2e-3, out
    else:
        assert loss <= 1e-10 and params <= 1e-10, out
    assert "measured | closed form" in line_of(out, "bytes sent (received) per rank")
    assert "measured | closed form" in line_of(out, "peak memory per rank")
    sent = re.findall(r"([\d,]+ \([\d,]+\)) \| ([\d,]+ \([\d,]+\))",
                      "\n".join(section(out, "bytes sent (received) per rank")))
    count = r"(\d+(?:,\d{3})*)"  # 1,234,567 (a greedy [\d,]+ would take the comma after it)
    held = re.findall(rf"[a-z]+ {count} \| {count}", "\n".join(section(out, "peak memory per rank")))
    assert sent and held and all(m == c for m, c in sent + held), out
    assert "MISMATCH" not in out, out
    if "--moe-experts" in words:
        assert line_of(out, "dropped assignments per block").endswith("; one device's: the same"), out


# What the pages say about their commands' output.

@claims("mpiexec -n 2 python -m refpar train --mesh dp=2 --steps 3 --check")
def _dp_sends_twice_the_gradient_bytes_over_n(out, _):
    """data-parallel.md: a ring all-reduce sends 2(N-1)/N of the gradient bytes per rank per step (8
    bytes a float64 parameter), and the loss's all-reduce one float64 more (internals.md, section 11)."""
    n, steps, psi = 2, 3, parameters(out)
    assert bytes_rows(out) == {("dp", "all_reduce"): [steps * (2 * (n - 1) * 8 * psi // n + 8)]}


@claims("mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --microbatches 2 --steps 3 --check")
def _zero3_model_states_fall_as_one_over_n(out, _):
    """zero-and-fsdp.md: (2 + 2 + K)Ψ bytes of model states per rank for DP, that over N for ZeRO-3;
    what-works.md: ZeRO-3's fall as 1/N. In float64: 8-byte parameters and gradients, AdamW's two 8-byte
    moments, 32Ψ."""
    n, psi = 4, parameters(out)
    m = re.search(r"ZeRO-3 measured ([\d, ]+); closed forms on this mesh: DP ([\d,]+), ", out)
    assert [number(b) for b in m.group(1).split(", ")] == [32 * psi / n] * n
    assert number(m.group(2)) == 32 * psi


@claims("mpiexec -n 2 python -m refpar train --mesh tp=2 --sp --steps 2 --check")
def _sp_trades_each_all_reduce_for_a_reduce_scatter_and_an_all_gather(out, _):
    """tensor-and-sequence-parallel.md: a block's two all-reduces forward and two backward (the f and g
    pairs) become a reduce-scatter and an all-gather each under sp."""
    block = line_of(out, "tp collectives of block 0 in one step")
    assert block.endswith(": 4 all_gather, 4 reduce_scatter, 2 all_gather (re-gather)"), block
    assert ("tp", "all_reduce") in bytes_rows(out)  # the vocabulary's, outside the blocks


@claims("mpiexec -n 2 python -m refpar train --mesh cp=2 --cp-algo ulysses --steps 2 --check")
def _ulysses_all_to_alls(out, _):
    """context-parallel.md: Ulysses all-to-alls the sequence split into a head split and back."""
    assert [op for axis, op in bytes_rows(out) if axis == "cp"] == ["all_to_all"]


@claims("mpiexec -n 2 python -m refpar train --mesh ep=2 --moe-experts 4 --steps 2 --check")
def _ep_all_to_alls_and_drops(out, _):
    """expert-parallel.md: an all-to-all dispatches and another combines; capacity drops tokens."""
    assert [op for axis, op in bytes_rows(out) if axis == "ep"] == ["all_to_all"]
    dropped = re.findall(r"\d+: (\d+)", line_of(out, "dropped assignments per block").split(";")[0])
    assert len(dropped) == 4 and sum(map(int, dropped)) > 0


@claims("mpiexec -n 2 python -m refpar train --mesh pp=2 --schedule 1f1b --microbatches 4 --steps 2 --check")
def _1f1b_bubble_is_the_published_fraction(out, _):
    """pipeline.md: 1F1B's published bubble, (p-1)/(m+p-1), next to the simulation of the schedule."""
    p, m = 2, 4
    unit = re.search(r"with unit costs ([\d.]+)%", line_of(out, "bubble of the last step")).group(1)
    assert float(unit) == round(100 * (p - 1) / (m + p - 1), 1)


def _text_block(page: str, first: str) -> list[str]:
    """The lines of the fenced block of docs/`page` that starts with the line `first`."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(first) and lines[k - 1].startswith("`"))
    return lines[start:next(k for k in range(start, len(lines)) if lines[k].startswith("```"))]


@claims("mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4 --steps 1 "
        "--check")
def _internals_shows_this_commands_output(out, _):
    """internals.md: "Every figure below is this command's output": its header (up to the page's
    `...`) and its report, the bubble's measured percentages masked (they are timings)."""
    lines = out.splitlines()
    header = _text_block("internals.md", "GPT-2 tiny:")
    assert header[-1] == "  ..."
    assert lessons.compare("\n".join(header[:-1]), "\n".join(lines[:len(header) - 1])) is None
    shown = _text_block("internals.md", "bytes sent (received) per rank")
    start = next(k for k, line in enumerate(lines) if line.startswith("bytes sent (received)"))
    timed = [r"measured [\d.]+% of rank-time, simulated with the measured action times [\d.]+%"]
    problem = lessons.compare("\n".join(shown), "\n".join(lines[start:start + len(shown)]), timed)
    assert problem is None, problem


@claims("python -m refpar lesson list")
def _seventeen_lessons(out, _):
    """lessons.md: seventeen lessons, each but serving (15) with its exercise, the capstone (16) last."""
    titles = [lessons.title(p) for p in lessons.lesson_files()]
    assert len(titles) == 17 and len(out.splitlines()) == 17
    assert [line.split("  ")[1] for line in out.splitlines()] == titles
    exercises = ["(exercise: lessons/exercises/" in line for line in out.splitlines()]
    assert exercises == [True] * 15 + [False, True]


@claims("python -m refpar lesson show 1")
def _one_lessons_text(out, _):
    """lessons.md: one lesson's text (its comparison markers left out, tests/test_lessons.py)."""
    source = (ROOT / "lessons" / "01-collectives.md").read_text().splitlines()
    assert out.splitlines() == [line for line in source if not line.startswith("<!-- ")]


@claims("python -m refpar lesson check 1")
def _grades_the_exercise(out, _):
    """lessons.md: grades lessons/exercises/01_ring_all_reduce.py, here untouched."""
    assert out.startswith("lesson 1: not yet: the exercise is still blank") and "01_ring_all_reduce.py" in out


def _step_losses(out: str) -> dict[int, str]:
    """step -> the loss the progress table prints."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^ +(\d+) +(\d+\.\d{4}) ", out, re.M)}


SAVE = "mpiexec -n 2 python -m refpar train --mesh dp=2 --zero 3 --steps 4 --save ckpt --save-every 2"


@claims(SAVE)
def _each_rank_writes_its_npz_and_rank_0_the_manifest(out, folder):
    """what-works.md: each rank writes its own .npz, rank 0 the manifest, every 2 steps."""
    assert sorted(_step_losses(out)) == [1, 2, 3, 4]
    for step in ("step-00000002", "step-00000004"):
        assert sorted(p.name for p in (folder / "ckpt" / step).iterdir()) == [
            "manifest.json", "rank00000.npz", "rank00001.npz"]


@claims("mpiexec -n 4 python -m refpar train --mesh tp=2,pp=2 --steps 4 --resume ckpt/step-00000002")
def _resumes_under_another_mesh(out, folder):
    """what-works.md: save under one mesh, resume under another: steps 3 and 4 again, on tp x pp, with the
    losses the saving run printed (float64 is the single device's on every mesh)."""
    saved = _step_losses(ran(SAVE, folder))
    assert _step_losses(out) == {3: saved[3], 4: saved[4]}


@claims("python -m refpar train --steps 6 --resume ckpt")
def _resumes_from_the_newest_complete_step(out, _):
    """what-works.md: `--resume ckpt` takes the newest complete step, 4: steps 5 and 6 on one process."""
    assert sorted(_step_losses(out)) == [5, 6] and "1 device" in out.splitlines()[0]


@claims("mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 2 "
        "--capacity-factor 1.0 --steps 2 --check")
def _moe_prints_router_losses_drops_loads_and_uniform_bytes(out, _):
    """what-works.md: per step the loss, the router losses, the dropped assignments and the tokens each
    expert kept; then the ep all-to-all next to what uniform routing would send."""
    header = line_of(out, "step ")
    assert all(column in header.split() for column in ("loss", "aux", "z", "dropped", "expert"))
    rows = [line for line in out.splitlines() if re.match(r" +[12] +\d+\.\d{4} ", line)]
    assert len(rows) == 2 and all(re.search(r"\[\d+, \d+, \d+, \d+\]", row) for row in rows)
    assert re.fullmatch(r"ep all-to-all per data rank and step, every MoE block: [\d,]+ bytes; "
                        r"uniform routing would send [\d,]+", line_of(out, "ep all-to-all per data rank"))


@claims("mpiexec -n 4 python -m refpar train --mesh pp=2,ep=2 --moe-experts 4 --schedule 1f1b "
        "--microbatches 2 --steps 2 --check")
def _every_ranks_activations_next_to_their_closed_form(out, _):
    """what-works.md: inside pipeline stages, every rank's peak memory next to its closed form,
    activations included."""
    ranks = section(out, "peak memory per rank")
    assert ranks and all(re.search(r"activations ([\d,]+) \| \1,", line) for line in ranks)
    covered = {r for line in ranks for r in _ranks(line.split(":")[0].split()[1])}
    assert covered == {0, 1, 2, 3}


def _ranks(who: str) -> list[int]:
    if "-" in who:
        first, last = map(int, who.split("-"))
        return list(range(first, last + 1))
    return [int(r) for r in who.split(",")]


@claims("mpiexec -n 4 python -m refpar train --mesh ep=2,tp=2 --sp --moe-experts 4 --steps 2 --check",
        "mpiexec -n 8 python -m refpar train --mesh ep=2,cp=2,tp=2 --sp --cp-algo ulysses --moe-experts 4 "
        "--steps 2 --check")
def _expert_tp_all_reduces_the_expert_buffer_once_each_way(out, _):
    """what-works.md: each expert's c_fc split by columns and c_proj by rows over tp, one all-reduce of
    the expert buffer forward and one backward (block 0 is an MoE block; under sp its attention's are
    reduce-scatters and all-gathers)."""
    assert ", 2 all_reduce," in line_of(out, "tp collectives of block 0 in one step")


@claims("python -m refpar schedule zb-h1 --stages 4 --microbatches 8")
def _a_schedule_as_data_simulated_on_a_grid(out, _):
    """what-works.md: schedules as data, simulated, on a ranks x ticks grid: each of the 4 ranks runs
    every microbatch's F, I (the input's backward) and W once, and ZB-H1's bubble with unit costs is
    Qi et al.'s (2023) (p-1)(F+B-W) idle ticks a rank against m(F+B+W) busy ones."""
    p, m = 4, 8
    rows = [line.split()[2:] for line in out.splitlines() if re.match(r"rank \d ", line)]
    assert len(rows) == p
    for r, row in enumerate(rows):
        assert sorted(a for a in row if a != ".") == sorted(f"{r}{k}{i}" for k in "FIW" for i in range(m))
    idle = (p - 1) * (1 + 1 - 1)
    bubble = re.match(r"bubble: ([\d.]+)% of all rank-time", line_of(out, "bubble:")).group(1)
    assert float(bubble) == round(100 * idle / (m * 3 + idle), 2)


@claims("python -m refpar plan --model megatron-1t --gpus 4096 --hardware h100")
def _plans_ranked_by_step_time_with_memory_time_and_collectives(out, _):
    """what-works.md: ranks every mesh by predicted step time, with memory per GPU by category, time
    by cause and every collective."""
    steps = [float(s) for s in re.findall(r"^   step ([\d.]+) s ", out, re.M)]
    assert len(steps) >= 3 and steps == sorted(steps)
    memory = re.findall(r"^   memory GB: (.*)$", out, re.M)
    assert len(memory) == len(steps) and all(
        re.findall(r"([a-z]+) [\d.]+", m) == ["params", "grads", "master", "optimizer", "activations", "comm",
                                              "total"] for m in memory)
    causes = re.findall(r"^   time s: +(.*)$", out, re.M)
    assert len(causes) == len(steps) and all("compute" in c and "bubble" in c for c in causes)
    assert len(re.findall(r"^   collectives: \w+\.\w+ ", out, re.M)) == len(steps)


@claims("mpiexec -n 4 python -m refpar generate --mesh tp=2,cp=2 --check")
def _serving_exact_with_bytes_and_kv_next_to_closed_forms(out, _):
    """what-works.md: decode exact against recomputing every sequence; bytes per token and KV bytes per
    rank next to their closed forms; the same closed forms for a 70B model on H100s."""
    exact = re.fullmatch(r"check against one device recomputing every sequence: max logit rel diff (\S+), "
                         r"tokens identical: yes", line_of(out, "check against one device"))
    assert exact and float(exact.group(1)) <= 1e-10
    assert line_of(out, "traced bytes == closed forms").endswith(": yes")
    kv = line_of(out, "KV cache per rank")
    assert kv.endswith("matches the closed form after every pass and step: yes"), kv
    assert line_of(out, "at scale, llama2-70b").startswith("at scale, llama2-70b in float16 on h100")


@claims("mpiexec -n 4 python -m refpar train --mesh pp=4 --schedule interleaved-1f1b --microbatches 4 "
        "--n-layer 8 --steps 2 --check")
def _measured_bubble_next_to_the_simulated_one(out, _):
    """what-works.md: the measured bubble next to the simulated one; with unit costs, interleaving's
    published (p-1)/(v m + p-1) (Narayanan et al. 2021), v = 2 chunks a rank here."""
    p, m, v = 4, 4, 2
    assert f"schedule interleaved-1f1b over pp={p} (v={v})" in out
    bubble = re.fullmatch(r"bubble of the last step: measured [\d.]+% of rank-time, simulated with the "
                          r"measured action times [\d.]+%, with unit costs ([\d.]+)%",
                          line_of(out, "bubble of the last"))
    assert bubble and float(bubble.group(1)) == round(100 * (p - 1) / (v * m + p - 1), 1)


@claims("python -m refpar train --model small --data docs --seq-len 64 --steps 30 --eval-every 10 --save "
        "runs/docs")
def _text_run_reads_docs_and_reports_validation_losses(out, folder):
    """command-line.md, "Real text in, text out": the header says what was read and the unigram
    entropy, the table a val loss column, the closing lines the last validation loss; the tokenizer is
    kept beside the checkpoints."""
    data = line_of(out, "data: text:")
    assert "files of docs" in data and "bytes tokenizer (256)" in data and "unigram entropy" in data
    assert "val loss" in line_of(out, "step ")
    val = re.fullmatch(r"validation loss ([\d.]+) after 30 steps, [\d.]+ before the first "
                       r"\(held-out windows, evaluation mode\)", line_of(out, "validation loss"))
    first = float(re.search(r"^loss ([\d.]+) at step 1", out, re.M).group(1))
    assert val and float(val.group(1)) < first
    assert (folder / "runs" / "docs" / "tokenizer.json").is_file()


@claims("python -m refpar generate --from runs/docs --prompt \"Pipeline parallelism\" --max-new-tokens 40")
def _generate_from_the_run_writes_text(out, _):
    """command-line.md: generate --from reads the run's checkpoint and tokenizer and prints the prompt
    and what followed it as text (40 bytes)."""
    assert out.splitlines()[0] == "weights: runs/docs; tokenizer: bytes"
    assert line_of(out, "request 0:").endswith("40 new tokens:")
    assert out.splitlines()[out.splitlines().index(line_of_raw(out, "request 0:")) + 1].startswith(
        "    Pipeline parallelism")


def line_of_raw(out: str, start: str) -> str:
    """The line of `out` that starts with `start` after its leading spaces, as printed."""
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def test_the_command_make_demo_runs_is_the_one_the_page_names():
    """command-line.md says what `make demo` runs and then what it prints; the Makefile's recipe is that
    command (with this environment's python and mpiexec), so the page describes the demo one gets."""
    page = " ".join((ROOT / "docs" / "command-line.md").read_text().split())
    named = re.search(r"`make demo` runs `([^`]+)`", page).group(1)
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    shown = recipe.replace("$(VENV)/bin/mpiexec", "mpiexec").replace("$(PY)", "python").split()
    assert shown[shown.index("mpiexec"):] == named.split()
