"""The run's backend (refpar/backend.py, gpu_backend/): every strategy and the N-D engine give the
NumPy single-device numbers on torch CPU tensors, and a backend that cannot run here is refused
with one sentence. Float64 throughout: only summation order differs, hence 1e-10.

Strategies are trained in two MPI jobs (tests/jobs/backend_job.py): 2 ranks for ZeRO-3, tp+sp, Ulysses
cp, the 1F1B pipeline and expert parallelism (torch, then array-api-strict), 8 ranks for the
dp=2, tp=2, pp=2 engine (torch).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from refpar import backend
from refpar.config import ConfigError
from tests.mpi import ROOT, mpi_env, mpiexec
from tests.numerics import CONTRACT, within


def test_unknown_or_unavailable_backends_are_refused_with_one_sentence():
    cases = [("jax", None), ("numpy", "cuda")]
    try:
        import cupy  # noqa: F401
    except ImportError:
        cases.append(("cupy", None))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        cases.append(("torch", "cuda"))
    cases.append(("torch", "tpu"))
    for name, device in cases:
        with pytest.raises(ConfigError) as err:
            backend.get(name, device)
        message = str(err.value)
        assert "\n" not in message and message.count(". ") == 0 and "; " in message, message


def test_cli_refuses_a_missing_cupy_in_one_line_with_status_2():
    pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy is installed here")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "-m", "refpar", "train", "--backend", "cupy", "--steps", "1"],
                          cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "cupy" in proc.stderr.lower(), proc.stderr


def test_torch_backend_moves_the_host_draw_exactly_and_keeps_the_host_copy():
    torch = pytest.importorskip("torch")
    tb = backend.get("torch")
    host = {"w": np.random.default_rng(0).normal(size=(3, 4)), "ids": np.arange(5)}
    moved = tb.from_host(host)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in moved.values())
    assert np.array_equal(backend.to_host(moved["w"]), host["w"])
    moved["w"] += 1.0  # the run updates in place; the host draw must not change with it
    assert np.array_equal(backend.to_host(moved["w"]), host["w"] + 1.0)
    assert not np.shares_memory(backend.to_host(moved["w"]), host["w"])
    assert backend.to_host(moved["ids"]).dtype == host["ids"].dtype
    assert backend.host_dtype(moved["w"]) == np.float64 and not backend.on_device(moved["w"])


TWO_RANKS = ["zero3", "tp_sp", "cp_ulysses", "pp_1f1b", "ep"]


def _jobs(spec: str, n: int, names: list[str]) -> list[dict]:
    proc = mpiexec(n, "tests/jobs/backend_job.py", spec, json.dumps(names), timeout=300)
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(g["backend"], g["strategy"]) for g in got] == [(b, x) for b in spec.split(",") for x in names]
    return got


def test_every_strategy_and_the_3d_engine_match_the_numpy_single_device_on_torch_cpu_and_strict():
    """torch CPU for every strategy and the engine; array-api-strict, which refuses anything outside
    the standard, for every strategy on two ranks."""
    pytest.importorskip("torch")
    pytest.importorskip("array_api_strict")
    results = _jobs("torch,array-api-strict", 2, TWO_RANKS) + _jobs("torch", 8, ["3d"])
    for r in results:
        loss = max(x["loss_rel_diff"] for x in r["ranks"])
        param = max(x["param_rel_diff"] for x in r["ranks"])
        print(f"{r['backend']:17s} {r['strategy']:10s} loss rel diff {loss:.1e}  param rel diff {param:.1e}")
        assert within(loss, CONTRACT) and within(param, CONTRACT), (r["backend"], r["strategy"])
        module = r["backend"].replace("-", "_")
        for x in r["ranks"]:
            assert x["namespaces"] == [module], r  # the strategy really held the backend's arrays
            assert x["events"] > 0 and x["staged"] == [False], r  # CPU arrays: no device staging


def test_gpu_check_says_in_one_sentence_that_no_gpu_is_present():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run benchmarks/gpu_check.py itself")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "no NVIDIA GPU is present" in line, line


def test_torch_distributed_transport_gives_the_same_numbers_and_says_so_in_the_trace():
    """The device-aware transport's code on CPU tensors (gloo stands in for NCCL): the collectives
    it takes are traced as "gloo", the rest still go through MPI, and the runs stay exact."""
    pytest.importorskip("torch")
    proc = mpiexec(2, "tests/jobs/backend_job.py", "torch", json.dumps(["zero3", "tp_sp"]),
                   "torch.distributed", timeout=240)
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [g["strategy"] for g in got] == ["zero3", "tp_sp"]
    for r in got:
        for x in r["ranks"]:
            assert within(x["loss_rel_diff"], CONTRACT) and within(x["param_rel_diff"], CONTRACT), r
            assert "gloo" in x["algos"] and x["staged"] == [False], r


def test_an_unavailable_or_unknown_transport_is_refused_with_one_sentence():
    torch = pytest.importorskip("torch")
    from gpu_backend.transport import TorchDistributed, check_transport

    if torch.cuda.is_available():
        pytest.skip("NCCL may be available on this machine")
    with pytest.raises(ConfigError, match="no nccl backend here") as err:
        TorchDistributed.start(None, "nccl")  # refused before any rank talks
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown transport 'carrier-pigeon'; choose mpi or"):
        check_transport("carrier-pigeon")  # what world(transport=...) checks first
