"""The docs name code that exists. docs/internals.md follows one training step through the engine
as `file.py:function` at each point; README.md and the lessons name files too. Every file named must
exist, and every name after `file.py:` (a function, a class, a constant, or `Class.member`) and
every `refpar.module.name` must be defined there, so a renamed or deleted function fails here instead
of leaving the page describing code that is gone. Read with `ast`, nothing imported or run."""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path

import numpy as np
import pytest

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
    path = ["refpar/cli.py:main", "refpar/commands/train.py:run", "refpar/engine/plan.py:validate",
            "refpar/engine/report.py:run", "refpar/engine/parallelize.py:parallelize",
            "refpar/engine/train.py:train", "refpar/parallel/pipeline/executor.py:PipelineExecutor.step",
            "refpar/parallel/pipeline/stage.py:Stage.forward",
            "refpar/parallel/tensor_parallel.py:parallel_block_forward",
            "refpar/parallel/zero.py:Zero.reduce", "refpar/parallel/zero.py:Zero.step",
            "refpar/model/optim.py:adamw_update", "refpar/engine/report.py:collect"]
    assert [p for p in path if p not in named] == []
    assert len(named) >= 100  # the walk-through and the interfaces name far more than the path


def test_the_checks_refuse_what_does_not_exist():
    """The checker itself: names that are not defined, members of the wrong class, and modules that
    are gone are refused; what is defined (a method, an attribute set in __init__, an import) passes."""
    zero = ROOT / "refpar" / "parallel" / "zero.py"
    assert defined(zero, "Zero.reduce") and defined(zero, "Zero.grad_shards") and defined(zero, "Hooks")
    assert not defined(zero, "Zero.no_such_method") and not defined(zero, "ZeroOne")
    assert not defined(ROOT / "refpar" / "engine_zero3.py", "ShardedGrads")  # deleted in issue 21
    assert resolves("refpar.engine.train") and resolves("refpar.mesh.DeviceMesh.axis")
    assert not resolves("refpar.parallel.dp_runner") and not resolves("refpar.mesh.NoSuchMesh")
    assert [p for _, p in mentions(FILE, INTERNALS) if "dp_runner" in p or "pipeline/runner" in p] == []


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


def doc_commands() -> list[tuple[str, int, int, list[str]]]:
    """(page, line, ranks, refpar's arguments) of each `python -m refpar ...` line in a fenced block of
    docs/ (the lessons' run in tests/test_lessons.py), `mpiexec -n N` (or `srun ... -N 2
    --ntasks-per-node=8`) giving the ranks."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            elif fenced and "python -m refpar " in line:
                words = shlex.split(line, comments=True)
                launcher, args = words[:words.index("python")], words[words.index("python") + 3:]
                ranks = 1
                if "-n" in launcher:
                    ranks = int(launcher[launcher.index("-n") + 1])
                elif "srun" in launcher:
                    per_node = next(w for w in launcher if w.startswith("--ntasks-per-node="))
                    ranks = int(launcher[launcher.index("-N") + 1]) * int(per_node.split("=")[1])
                out.append((page.name, n, ranks, args))
    return out


DOC_COMMANDS = doc_commands()


@pytest.mark.parametrize("page, line, ranks, args", DOC_COMMANDS,
                         ids=[f"{p}:{n}" for p, n, _, _ in DOC_COMMANDS])
def test_every_refpar_command_in_docs_is_one_refpar_takes(page, line, ranks, args):
    """Each command a docs page shows parses, and a `refpar train` one passes every check a run makes
    before its first message (refpar/engine/plan.py validate) on a mesh of as many ranks as its
    launcher starts: a renamed flag or a mesh the engine refuses fails here. Running them is the
    lessons' job (their commands run in tests/test_lessons.py); these are 8-rank jobs, clusters and GPUs."""
    from refpar.cli import parse
    from refpar.commands.train import configs, plan_of
    from refpar.engine import validate

    parsed = parse(args)
    if parsed.command == "train":
        model, train, sizes = configs(parsed)
        validate(model, train, sizes, plan_of(parsed, sizes, model))
        assert np.prod(list(sizes.values())) == ranks, f"{page}:{line}: the mesh {sizes} on {ranks} ranks"
