"""`refpar check` on dumps PyTorch made (refpar/conformance/dump.py, one 2-rank MPI job): the
correct ones agree, each planted bug is a mismatch with its cause named, and a malformed dump gets
one sentence."""

import json
import subprocess
import sys

import numpy as np
import pytest

from refpar.commands.check import CheckError, check
from tests.mpi import ROOT, mpi_env, mpiexec

pytest.importorskip("torch")

CORRECT = ["tp", "tp-float32", "fsdp2", "ddp", "zero-flat", "ddp-dropout"]
PLANTED = {  # scenario -> words of the cause refpar must name
    "tp-vocab-pad": "vocabulary padding",
    "ddp-per-rank-loss": "normalised per rank",
    "sp-layernorm": "not all-reduced",
    "ddp-dropout-rng": "different dropout RNG",
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("dumps")
    mpiexec(2, "-m", "refpar.conformance.dump", str(out), timeout=600)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", CORRECT)
def test_correct_torch_dump_agrees_tensor_by_tensor(dumps, scenario):
    report = check(str(dumps / scenario))
    bad = {k: r for k, r in report["tensors"].items() if r["verdict"] == "mismatch"}
    assert report["ok"] and not bad, bad
    if scenario == "tp-float32":  # float32 against the float64 recomputation: rounding, not exact
        assert report["dtype"] == "float32"
        assert any(r["verdict"] == "noise" and r["ulp"] > 0 for r in report["tensors"].values())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", sorted(PLANTED))
def test_planted_bug_is_a_mismatch_with_its_cause(dumps, scenario):
    report = check(str(dumps / scenario))
    bad = {k: r for k, r in report["tensors"].items() if r["verdict"] == "mismatch"}
    assert not report["ok"] and bad
    for name, r in bad.items():
        assert PLANTED[scenario] in r["cause"], (name, r["cause"])
    if scenario == "sp-layernorm":  # only the LayerNorm gradients are wrong
        assert all(".ln_" in f".{name}" for name in bad), sorted(bad)


def copy_dump(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.timeout(900)
def test_malformed_dumps_get_one_sentence(dumps, tmp_path):
    good = dumps / "ddp"
    cases = {}
    cases["missing directory"] = tmp_path / "absent"
    d = copy_dump(good, tmp_path / "nolayout")
    (d / "layout.json").unlink()
    cases["no layout"] = d
    d = copy_dump(good, tmp_path / "badjson")
    (d / "layout.json").write_text("{not json")
    cases["bad json"] = d
    d = copy_dump(good, tmp_path / "pickled")
    np.savez(d / "rank1.npz", tokens=np.array([object()], dtype=object))
    cases["pickled"] = d
    d = copy_dump(good, tmp_path / "truncated")
    (d / "rank0.npz").write_bytes((d / "rank0.npz").read_bytes()[:100])
    cases["truncated"] = d
    d = copy_dump(good, tmp_path / "missingrank")
    (d / "rank1.npz").unlink()
    cases["missing rank"] = d
    d = copy_dump(good, tmp_path / "badsplit")
    lay = json.loads((d / "layout.json").read_text())
    lay["tensors"] = {"wte.weight": {"split": "diagonal"}}
    (d / "layout.json").write_text(json.dumps(lay))
    cases["bad split"] = d
    for what, path in cases.items():
        with pytest.raises(CheckError) as err:
            check(str(path))
        assert "\n" not in str(err.value), what
    # and on the command line: one line on stderr, no traceback, exit status 2
    proc = subprocess.run([sys.executable, "-m", "refpar", "check", str(cases["pickled"])], cwd=ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "pickled" in proc.stderr, proc.stderr
