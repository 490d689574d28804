"""`refpar check` on dumps that refpar.conformance.dump.from_megatron and from_deepspeed wrote from
Megatron-Core and DeepSpeed steps (one 2-rank MPI job: `python -m refpar.conformance.dump OUT
--frameworks`): the correct runs agree tensor by tensor, and each planted bug is a mismatch whose
cause refpar check names."""

import pytest

from refpar.commands.check import check
from tests.mpi import mpiexec

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

CORRECT = {"megatron-tp": "float32", "megatron-tp-sp": "float32", "deepspeed-zero2": "float64",
           "deepspeed-zero3@float32": "float32"}
PLANTED = {"megatron-qkv-gpt2-order": "fused QKV in the wrong layout",
           "deepspeed-clip-default": "clipped by their global norm"}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("framework-dumps")
    mpiexec(2, "-m", "refpar.conformance.dump", str(out), "--frameworks", timeout=900)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", sorted(CORRECT))
def test_correct_framework_dump_agrees_tensor_by_tensor(dumps, scenario):
    """Megatron's dumps are float32 (its cross-entropy is): judged at float32's noise. DeepSpeed's
    float64 ZeRO-2 (patched to float64 throughout, unclipped) at float64's contract."""
    report = check(str(dumps / scenario))
    bad = {k: r for k, r in report["tensors"].items() if r["verdict"] == "mismatch"}
    assert report["ok"] and not bad, bad
    assert report["dtype"] == CORRECT[scenario]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", sorted(PLANTED))
def test_planted_framework_bug_is_named(dumps, scenario):
    report = check(str(dumps / scenario))
    bad = {k: r for k, r in report["tensors"].items() if r["verdict"] == "mismatch"}
    assert not report["ok"] and bad
    for name, r in bad.items():
        assert PLANTED[scenario] in r["cause"], (name, r["cause"])
    if scenario == "deepspeed-clip-default":  # the loss precedes clipping: only the gradients differ
        assert "loss" not in bad and len(bad) == len(report["tensors"]) - 1, sorted(bad)
