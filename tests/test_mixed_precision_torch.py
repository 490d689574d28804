"""bf16-mixed and fp16-mixed on `--backend torch`: the NumPy mixed runs' numbers, bytes and memory.

The two backends run the same ops in the same order on the same shapes: the parameters cross to
torch as their bits, every fp32 -> 16-bit rounding is the same round-to-nearest-even (tested bit for
bit below), and messages are reduced on the host in both (refpar/comm/communicator.py). They are
not bitwise equal runs, though: inside an op, torch's fp32 kernels are not NumPy's. GEMMs may sum
in another order (MKL or oneDNN against OpenBLAS), tanh, exp and log are other approximations, and
torch's AVX-512 fp32 sqrt is within one ulp where NumPy's is correctly rounded. Each such
difference is a few fp32 ulps of one element, which moves that element's 16-bit rounding by at most
one unit: the same size of difference, at the same kind of place, as a parallel run rounding a
partial sum where one device does not. So the mixed-precision loss bounds that hold a parallel run
to one device after 3 AdamW steps (refpar/commands/verify.py `tolerance`; derived in
tests/test_mixed_precision_strategies.py) hold a torch run to the NumPy run of the same mesh, and
to one device. Parameters are not compared elementwise, for the reason given there (AdamW turns a
flipped sign of a tiny gradient into a full lr step of one element); the measured differences are
recorded below. Bytes and memory do not depend on the array library: equal to NumPy's, row for
row, and to the closed forms.

Measured (3 AdamW steps, tiny, batch 4 x 16), torch against NumPy on the same mesh, largest
relative loss difference / largest relative parameter difference (max |a - b| / max |b| per tensor):
one device 1.1e-5 / 0.72 (the CLI test, 2 steps), dp=2 ZeRO-1 3.8e-5 / 0.65, tp=2 sp 4.2e-5 / 1.0, pp=2
4.2e-5 / 0.96, ep=2 1.1e-7 / 0 (every parameter bit equal), cp=2 ring 1.8e-5 / 1.1, dp=2 FSDP
fp32 grads 3.4e-5 / 0.90, fp16 tp=2 1.9e-6 / 0.46; 59-67% of the dense runs' 16-bit parameters
are bit-equal after 3 steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from refpar import backend
from refpar.cli import main
from refpar.commands.verify import judge, tolerance
from refpar.config import TrainConfig
from refpar.model.optim import mixed_adamw_update
from refpar.precision import dtype_of
from tests.mpi import mpiexec
from tests.numerics import within

torch = pytest.importorskip("torch")

U32 = 2.0 ** -24  # fp32's unit roundoff
BITS = {2: np.uint16, 4: np.uint32}


def _bits(a) -> np.ndarray:
    a = backend.to_host(a)
    return np.ascontiguousarray(a).view(BITS[a.dtype.itemsize])


def _rounding_inputs(sixteen: str) -> np.ndarray:
    """fp32 values that exercise every case of a rounding to `sixteen`: random over the whole
    exponent range, exact ties (halfway between two 16-bit neighbours, where round-to-nearest-even
    picks the even one), the largest finite values, subnormals, signed zeros and infinities."""
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(1 << 16) * np.exp2(rng.uniform(-140, 128, 1 << 16))
    with np.errstate(over="ignore"):
        spread = spread.astype(np.float32)
    low = (rng.standard_normal(4096) * 100).astype(dtype_of(sixteen))  # 16-bit values
    up = np.nextafter(low, np.inf) if sixteen == "float16" else _next_bf16(low)
    ties = ((low.astype(np.float64) + up.astype(np.float64)) / 2).astype(np.float32)  # exact in fp32
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 65504.0, 65520.0, 1e-45, 6e-8,
                        1.2e-38], np.float32)
    return np.concatenate([spread, ties, special])


def _next_bf16(a: np.ndarray) -> np.ndarray:
    """The next bfloat16 towards +inf of each (finite, non-zero) element."""
    b = a.view(np.uint16).astype(np.int32)
    return np.where(a > 0, b + 1, b - 1).astype(np.uint16).view(a.dtype)


@pytest.mark.parametrize("sixteen", ["bfloat16", "float16"])
def test_torch_rounds_fp32_to_16_bits_and_back_bit_for_bit_as_numpy_and_ml_dtypes_do(sixteen):
    """Both round to nearest, ties to even (IEEE 754's default, ml_dtypes' and NumPy's casts, torch's
    `to`), overflow to inf past the largest finite value's half ulp, and keep subnormals; and a
    16-bit value upcast to fp32 is exact in both. So the 16-bit arrays of the two backends differ only
    where the fp32 results they round differ. (Not so a Python scalar times a 16-bit array: NumPy
    rounds the scalar to 16 bits first, NEP 50, and torch keeps it in fp32. refpar meets scalars in
    fp32 only: a TorchFunctionMode spy on every op of bf16 and fp16 runs, one device and tp=2 sp,
    dense and MoE, found no 16-bit tensor beside a Python float but in zero-filling.)"""
    x = _rounding_inputs(sixteen)
    with np.errstate(over="ignore"):
        on_numpy = x.astype(dtype_of(sixteen))
    on_torch = torch.from_numpy(x).to(getattr(torch, sixteen))
    assert np.array_equal(_bits(on_torch), on_numpy.view(np.uint16))
    assert np.array_equal(_bits(on_torch.to(torch.float32)), on_numpy.astype(np.float32).view(np.uint32))
    # elementwise arithmetic of two 16-bit arrays (a residual add, a gradient sum): both compute in
    # fp32 and round once (ml_dtypes' casts, torch's opmath)
    finite = np.flatnonzero(np.isfinite(on_numpy))[:8192]  # no nan results (their bits are the CPU's)
    a, b = on_numpy[finite[:4096]], on_numpy[finite[4096:]]
    ta, tb = on_torch[torch.from_numpy(finite[:4096])], on_torch[torch.from_numpy(finite[4096:])]
    with np.errstate(over="ignore"):
        for ours, theirs in ((a + b, ta + tb), (a * b, ta * tb)):
            assert np.array_equal(_bits(theirs), ours.view(np.uint16))


def test_bf16_arrays_cross_between_numpy_and_torch_as_their_bits():
    """torch reads no ml_dtypes array: the backend moves a bfloat16 array as its 16-bit pattern, to
    torch (`from_host`, the run's initial parameters; `as_like`, a message arriving) and back
    (`to_host`, a message leaving, a parameter gathered for the report), with a copy kept apart."""
    tb = backend.get("torch")
    host = np.random.default_rng(1).standard_normal((5, 7)).astype(dtype_of("bfloat16"))
    drawn = host.copy()
    moved = tb.from_host(host)
    assert moved.dtype == torch.bfloat16 and np.array_equal(_bits(moved), drawn.view(np.uint16))
    arrived = backend.as_like(host, moved)
    assert arrived.dtype == torch.bfloat16 and np.array_equal(_bits(arrived), drawn.view(np.uint16))
    assert backend.host_dtype(moved) == dtype_of("bfloat16")
    moved += 1.0  # the run updates its parameters in place: the host draw stays as it was
    assert np.array_equal(host.view(np.uint16), drawn.view(np.uint16))


def test_a_mixed_adamw_step_on_torch_keeps_numpys_moments_bit_for_bit_and_its_master_within_the_sqrt():
    """One bf16 AdamW step of the same arrays on both backends. m and v are products and sums, each
    correctly rounded in fp32 in both libraries, in the same order: equal bit for bit. The update
    U = lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) takes five fp32 roundings (<= u each) in NumPy and
    the same in torch except its sqrt, within one ulp (2u): so the two U are within 11u|U| of each
    other, and master = round(p - U) within that plus one fp32 ulp of master (two half-ulp
    roundings). The bf16 parameters, master rounded once, are then at most one bf16 step apart."""
    tb, cfg, rng, n = backend.get("torch"), TrainConfig(), np.random.default_rng(2), 1 << 16
    bf16 = dtype_of("bfloat16")
    p16 = (rng.standard_normal(n) * 0.02).astype(bf16)
    g = (rng.standard_normal(n) * 1e-3).astype(bf16)
    master = p16.astype(np.float32) + (rng.standard_normal(n) * 1e-5).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    v = (rng.standard_normal(n) ** 2 * 1e-7).astype(np.float32)
    decay = np.arange(n) % 3 > 0  # a flat shard's per-element decay mask
    t = 3
    ours = mixed_adamw_update(p16, g, master, m, v, t, cfg, decay, cfg.lr)
    theirs = [backend.to_host(a) for a in mixed_adamw_update(*map(tb.from_host, (p16, g, master, m, v)), t,
                                                             cfg, tb.from_host(decay), cfg.lr)]
    for k in (2, 3):  # m, v
        assert np.array_equal(_bits(theirs[k]), _bits(ours[k]))
    m1, v1 = (a.astype(np.float64) for a in ours[2:])
    update = cfg.lr / (1 - cfg.beta1 ** t) * np.abs(m1) / (np.sqrt(v1 / (1 - cfg.beta2 ** t)) + cfg.eps)
    gap = np.abs(theirs[1].astype(np.float64) - ours[1].astype(np.float64))
    assert np.all(gap <= 11 * U32 * update + np.spacing(np.abs(ours[1])).astype(np.float64))
    steps = np.abs(_bits(theirs[0]).astype(np.int32) - _bits(ours[0]).astype(np.int32))
    assert steps.max() <= 1  # adjacent bf16 values (p16 is far from 0: no sign change)


# Each mesh in bf16-mixed unless it says otherwise: the meshes of the brief, FSDP with fp32
# gradients (the widest set of buffers: 16-bit and fp32 gradients, gathered units), ring attention
# (messages arriving as NumPy bf16) and fp16 from a scale that overflows at step 1.
MESHES = [
    {"mesh": {"dp": 2}, "plan": {"zero": 1}},
    {"mesh": {"tp": 2}, "plan": {"sp": True}},
    {"mesh": {"pp": 2}, "plan": {"microbatches": 2}},
    {"mesh": {"ep": 2}, "model": {"moe_experts": 4}},
    {"mesh": {"cp": 2}},
    {"mesh": {"dp": 2}, "plan": {"fsdp": True}, "train": {"fp32_grads": True}},
    {"mesh": {"tp": 2}, "dtype": "float16", "train": {"loss_scale": 2.0 ** 18}},
]


@pytest.fixture(scope="module")
def meshes() -> list[dict]:
    proc = mpiexec(2, "tests/jobs/mixed_torch_job.py", json.dumps(MESHES), timeout=300)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [o["spec"] for o in out] == MESHES
    return out


def _name(spec: dict) -> str:
    return json.dumps({k: v for k, v in spec.items()})


def test_torch_mixed_runs_hold_torch_arrays_and_match_the_numpy_run_of_their_mesh_and_one_device(meshes):
    for r in meshes:
        spec = r["spec"]
        sixteen = spec.get("dtype", "bfloat16")
        bound = tolerance("fp16-mixed" if sixteen == "float16" else "bf16-mixed", "moe_experts" in
                          spec.get("model", {}))
        worst = max(r["loss_rel_diffs"])
        print(f"{_name(spec):90s} torch vs numpy: loss {worst:.1e} (bound {bound:g}), parameters "
              f"{r['max_param_rel_diff']:.2f}, {r['param_bits_equal'] / r['param_elems']:.0%} bit-equal; "
              f"vs one device {r['torch']['max_loss_rel_diff']:.1e}")
        # every rank's strategy holds 16-bit parameters (and gradients) and fp32 master weights and
        # moments, in the run's own namespace
        assert r["torch_held"] == [[["torch", sixteen], ["torch", "float32"]]] * 2, spec
        assert r["numpy_held"] == [[["numpy", sixteen], ["numpy", "float32"]]] * 2, spec
        assert within(worst, bound), spec
        assert within(r["torch"]["max_loss_rel_diff"], bound), spec
        assert r["torch"]["precision"] == r["numpy"]["precision"] != "fp64"


def test_torch_mixed_runs_move_and_hold_numpys_bytes_which_are_the_closed_forms(meshes):
    for r in meshes:
        ours, theirs = r["torch"], r["numpy"]
        verdict = judge(ours)
        assert verdict["bytes_ok"] and verdict["memory_ok"], r["spec"]
        assert ours["comm_bytes"] == theirs["comm_bytes"], r["spec"]
        assert ours["memory_peak_bytes"] == theirs["memory_peak_bytes"], r["spec"]


def test_fp16_on_torch_skips_the_overflowed_step_as_numpy_does(meshes):
    (r,) = [r for r in meshes if r["spec"].get("dtype") == "float16"]
    assert r["torch"]["loss_scaling"] == r["numpy"]["loss_scaling"]
    assert r["torch"]["loss_scaling"]["skipped_steps"] == [0]
    assert r["torch"]["loss_scaling"]["scales"] == [2.0 ** 18, 2.0 ** 17, 2.0 ** 17]


@pytest.fixture
def numpy_after():
    """`refpar train --backend torch` in this process makes torch the process's backend: back to
    NumPy for the tests after it."""
    yield
    backend.use("numpy")


def test_refpar_train_checks_bf16_mixed_on_torch_on_the_all_ones_mesh_from_the_command_line(capsys,
                                                                                            numpy_after):
    """`--mesh dp=1,tp=1,pp=1`: the engine on torch against --check's reference, the NumPy
    bf16-mixed single device; the report's bytes (none) and memory equal the closed forms."""
    assert main(["train", "--mesh", "dp=1,tp=1,pp=1", "--backend", "torch", "--precision", "bf16-mixed",
                 "--steps", "2", "--check", "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    verdict = judge(summary)
    print(f"one device, torch vs numpy: loss {summary['max_loss_rel_diff']:.1e}, parameters "
          f"{summary['max_param_rel_diff']:.2f}")
    assert summary["precision"] == "bf16-mixed" and summary["world_size"] == 1
    assert within(summary["max_loss_rel_diff"], tolerance("bf16-mixed", False))
    assert verdict["bytes_ok"] and verdict["memory_ok"]
    peak = {x["category"]: x["bytes"] for x in summary["memory_peak_bytes"]}
    assert peak["master"] == 2 * peak["params"] > 0 and peak["optimizer"] == 4 * peak["params"]
    assert "largest relative difference from one device" in out
    assert "expected in bf16-mixed: one device runs it too, but" in out  # a large difference says why
