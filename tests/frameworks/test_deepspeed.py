"""DeepSpeed ZeRO-1/2/3 against refpar's `dp=2 --zero S` (refpar/conformance/deepspeed_cases.py): one
2-rank MPI job, 3 steps per case; each rank's partition of the master weights and of Adam's moments
compared element by element, both ways. `make conformance` runs this folder (not `make test`)."""

import json

import pytest

from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within

pytest.importorskip("deepspeed")

FLOAT64 = ["deepspeed-zero1-noclip@float64", "deepspeed-zero2-noclip@float64"]
CLIPPED64 = ["deepspeed-zero1@float64", "deepspeed-zero2@float64"]
FLOAT32 = ["deepspeed-zero1@float32", "deepspeed-zero2@float32", "deepspeed-zero3@float32",
           "deepspeed-zero3-noclip@float32"]
MISMATCH = "deepspeed-zero1-default@float32"


@pytest.fixture(scope="module")
def runs():
    proc = mpiexec(2, "-m", "refpar.conformance", *FLOAT64, *CLIPPED64, *FLOAT32, MISMATCH, timeout=900)
    # DeepSpeed logs to stdout too: the cases' lines are the JSON ones
    return {row["case"]: row for row in map(json.loads, (line for line in proc.stdout.splitlines()
                                                         if line.startswith('{"case"')))}


def worst(s):
    return max(s["loss"], s["params"], s["m"], s["v"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FLOAT64)
def test_float64_zero1_and_2_unclipped_are_refpar_to_the_contract(runs, case):
    """With the three float64 patches (deepspeed_cases.patched) nothing is rounded to float32, so
    the master weights and both moments agree to refpar's float64 contract on every step."""
    for k, s in enumerate(runs[case]["steps"]):
        assert within(worst(s), CONTRACT), (case, k, s)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CLIPPED64)
def test_float64_clipping_carries_deepspeeds_float32_norm(runs, case):
    """Clipped at 1.0 (DeepSpeed's default and refpar's --clip-grad-norm 1.0), float64 agrees to
    2e-7 only: DeepSpeed's get_grad_norm_direct returns the norm as float32 (`.sum().float()`), so
    the coefficient 1/(‖g‖ + 1e-6) is rounded to float32 (relative 2^-24 = 6e-8, a few times over
    the sum of squares of ~1e4 float32-cast elements): m inherits it, v = (1-β2)Σ(c g)² twice, the
    weights ~ lr x m/sqrt(v), the same relative order. The unclipped float64 case agreeing to 1e-10
    shows that nothing else differs. The loss of step 0 precedes any update: the contract."""
    steps = runs[case]["steps"]
    assert within(steps[0]["loss"], CONTRACT), steps[0]
    for k, s in enumerate(steps):
        assert within(max(s["m"], s["params"]), 1e-6) and within(s["v"], 2e-6), (case, k, s)
    assert any(s["m"] > 1e-9 for s in steps), "the float32 norm left no trace: was clipping active?"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FLOAT32)
def test_float32_zero_stages_differ_by_rounding_only(runs, case):
    """float32 on both sides (refpar --dtype float32), which sum in other orders: the loss within
    1e-6, the moments within 1e-4 (float32 sums of ~1e3 terms: ~1e3 epsilons), the master weights
    within 1e-2 relative to each tensor's largest entry and worst in attn.c_attn.bias, whose key
    third has a true gradient of exactly 0: both sides hold rounding noise there, which AdamW's
    m/sqrt(v) turns into steps of +-lr (tests/test_conformance_torch.py measures the same for torch)."""
    for k, s in enumerate(runs[case]["steps"]):
        assert within(s["loss"], 1e-6) and within(max(s["m"], s["v"]), 1e-4), (case, k, s)
        assert within(s["params"], 1e-2), (case, k, s)
        assert s["params"] < 1e-5 or s["param_worst"].endswith("attn.c_attn.bias"), (case, k, s)


@pytest.mark.timeout(900)
def test_deepspeeds_default_clipping_is_a_different_run_from_unclipped_refpar(runs):
    """DeepSpeed clips to 1.0 unless `gradient_clipping` is set; refpar (and torch) do not clip
    unless asked. This model's gradient norm is above 1 at every step, so from the first update
    the moments are off by O(1) and the loss parts by the third step."""
    steps = runs[MISMATCH]["steps"]
    assert within(steps[0]["loss"], 1e-6)  # the first loss precedes any update
    assert all(s["m"] > 0.1 and s["v"] > 0.1 and s["params"] > 1e-2 for s in steps), steps
    assert steps[2]["loss"] > 1e-4, steps[2]
