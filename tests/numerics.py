"""The bounds the numeric tests hold float results to, and the one measure of difference they use.

A float comparison in tests/ is one of three kinds:
- `CONTRACT`, relative 1e-10 in float64 (DESIGN.md, "Numerics"): two float64 computations of the
  same quantity that differ in the order of their sums: another mesh, another microbatch split,
  another array namespace, or another BLAS kernel (OpenBLAS picks its kernels by CPU and each
  blocks its sums differently, so a result moves by a few ulps from one machine to the next).
- bitwise (`==`, `np.array_equal`): the same operations run in the same order on the same shapes;
  the test says why. A GEMM on other shapes is not the same order.
- a bound derived from the computation, with the derivation beside it: `sum_error` for a sum of n
  terms against its exact value, or the 16-bit unit roundoffs in the mixed-precision tests.
Closed forms checked against a simulation or a second formula in plain Python floats (schedules,
bytes, times: tests/test_pipeline_schedules.py, test_analysis_*.py, test_planner.py) use no BLAS
and have no order that changes with the CPU: a few dozen correctly rounded operations, so within
~100 u = 1e-14 of each other, and `pytest.approx(rel=1e-12)` there is that bound with a margin.

`rel_diff(a, b)` is max |a - b| / max |b|: relative to the reference's largest entry, since an
entry that is zero up to rounding has no meaningful relative error of its own.

`within(measured, bound)` is `measured <= bound`. With REFPAR_BOUND_RATIOS=FILE in the environment it
also appends "test-id measured/bound" to FILE, so that benchmarks/bound_ratios.py can show how close
each test file comes to its bounds under each BLAS kernel; without it, it only compares.
"""

from __future__ import annotations

import os

import numpy as np

CONTRACT = 1e-10  # float64 against one device, relative (DESIGN.md, "Numerics")
U64 = 2.0**-53  # float64's unit roundoff: every basic operation is exact to within a factor 1 +- u


def rel_diff(a, b) -> float:
    """max |a - b| / max |b| over every entry; 0 when both are zero."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = float(np.max(np.abs(b), initial=0.0))
    return float(np.max(np.abs(a - b), initial=0.0)) / max(scale, 1e-300)


def sum_error(n: int, abs_sum: float) -> float:
    """How far a float64 sum of n terms, summed in any order, can be from the exact sum:
    gamma_(n-1) * sum |x_i| with gamma_k = k u / (1 - k u) (Higham, "Accuracy and Stability of
    Numerical Algorithms", 2nd ed., eq. 4.4). Two orders of the same sum differ by at most twice this."""
    k = max(n - 1, 0)
    return k * U64 / (1 - k * U64) * abs_sum


def within(measured: float, bound: float) -> bool:
    """measured <= bound, recording measured / bound when REFPAR_BOUND_RATIOS names a file."""
    path = os.environ.get("REFPAR_BOUND_RATIOS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test} {float(measured) / bound:.6g}\n")
    return float(measured) <= bound
