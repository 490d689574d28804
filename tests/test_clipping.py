"""Clipping by the global norm on a mesh (refpar/parallel/clipping.py) against the single device:
the engine's norm is one device's on every rank and step, and each classic bug, computed from the
same gradients, is not (tests/jobs/clip_check.py). Every combination of the quick matrix clipping at
every step: tests/test_engine.py; one device's definitions: tests/test_train_options.py."""

from __future__ import annotations

import json

from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within


def test_the_global_norm_is_one_devices_and_each_classic_bug_is_not():
    proc = mpiexec(8, "tests/jobs/clip_check.py", timeout=240)
    meshes = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [m["sizes"] for m in meshes] == [{"pp": 2, "dp": 2, "tp": 2}] * 2 + [{"dp": 2, "ep": 2, "tp": 2}]
    bugs = set()
    for m in meshes:
        ref = m["reference"]
        assert len(ref) == 2 and min(ref) > 10 * 0.05  # every step clipped
        for rank in m["ranks"]:
            # the same function of the step on every rank and on one device
            assert rank["lrs"] == m["reference_lrs"]
            diffs = [abs(a - b) / b for a, b in zip(rank["engine"], ref, strict=True)]
            assert within(max(diffs), CONTRACT), (m["sizes"], diffs)
        # each bug on the last step's gradients: wrong on every rank, not only on some
        for name in m["ranks"][0]["bugs"]:
            wrong = [abs(rank["bugs"][name] - ref[-1]) / ref[-1] for rank in m["ranks"]]
            print(m["sizes"], name, f"differs from one device by {min(wrong):.1e} to {max(wrong):.1e}")
            assert min(wrong) > CONTRACT, (name, wrong)
            bugs.add(name)
    assert bugs == {"local pipeline stage only", "tp copies counted on every tp rank",
                    "tied wte counted on both ends", "ZeRO shards not summed over dp",
                    "experts not summed over ep", "dense copies counted on every ep rank",
                    "DualPipe copies counted on both mirror ranks"}
