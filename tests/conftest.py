"""Fixtures shared by test files: one real traced MoE pipeline run, which the app's tests draw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The files that take longest (pytest --durations, summed per file), collected first: `make test`
# hands whole files to two workers in collection order (pytest-xdist's --dist loadfile), so a long
# file collected last would run alone at the end while the other worker idles.
SLOWEST_FIRST = ("test_lessons.py", "test_fuzz_app.py", "test_real_use.py", "test_docs.py", "test_engine.py",
                 "test_app.py", "test_engine_sharded.py", "test_fuzz_cli.py", "test_interrupt.py",
                 "test_reliability.py", "test_conformance_torch.py", "test_moe_tp.py", "test_moe_zero.py",
                 "test_comm.py", "test_mixed_precision_strategies.py", "test_moe_pipeline.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's own order kept


@pytest.fixture(scope="session")
def moe_pipeline_run(tmp_path_factory) -> dict:
    """`refpar train` on pp=2 x ep=2 (4 experts, top-2, tiny, 1 step of 2 microbatches) with --json
    and --trace, as the Run for real page launches it (any mesh mode), and its result as that page
    keeps it (app/launcher.py): {"key", "label", "summary", "trace", "timeline"}. Also "trace_path":
    the Chrome trace file the run wrote, and "cache": a launcher cache file holding the result."""
    from refpar.comm.trace import chrome_trace, read_trace
    from refpar.config import Plan
    from refpar.viz import mesh_grid
    from tests.mpi import mpiexec

    sys.path.insert(0, str(ROOT / "app"))
    from launcher import save_result

    folder = tmp_path_factory.mktemp("moe-pipeline-run")
    trace = folder / "trace.json"
    sizes = {"pp": 2, "dp": 1, "ep": 2, "cp": 1, "tp": 1}
    args = mesh_grid.train_args(sizes, Plan(schedule="1f1b", microbatches=2), "tiny", 1, moe=True)  # --check
    proc = mpiexec(4, "-m", "refpar", "train", *args, "--json", "--trace", str(trace), timeout=180)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {"key": ("mesh", *args), "label": "pp=2 x ep=2 dp (tiny)", "summary": summary,
              "trace": chrome_trace(read_trace(f"{trace}.jsonl")),
              "timeline": json.loads(trace.read_text())}
    save_result(result, folder / "last-run.json")
    return {**result, "trace_path": trace, "cache": folder / "last-run.json"}
