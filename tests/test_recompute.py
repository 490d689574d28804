"""Activation recomputation (--recompute, refpar/parallel/recompute.py) on real MPI ranks: selective
and full reproduce one device and are bit for bit the run without recomputation; every rank's
activation peak is its closed form (refpar/analysis/closed_forms.py: the schedule's replay with the
rerun's working set); the reruns' collectives are traced under their own phase and counted in the
closed form of bytes; the GEMM FLOPs the ranks run are the planner's; the paper's per-layer forms;
the planner's pricing of what selective saves."""

from __future__ import annotations

import json

import pytest

from refpar.analysis.activations import PAPER, layer_bytes
from refpar.analysis.intra_layer import RankShape
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import Precision, memory_per_rank
from refpar.config import RECOMPUTE, model_preset
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within

# collectives a block's forward runs again in the backward (tests/jobs/recompute_check.py's meshes)
RERUNS = {("dp x tp+sp x pp", "full"), ("dp x cp ring x pp interleaved", "selective"),
          ("dp x cp ring x pp interleaved", "full"), ("dp x ep x tp (MoE)", "full")}


@pytest.fixture(scope="module")
def results():
    proc = mpiexec(8, "tests/jobs/recompute_check.py", timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4 * len(RECOMPUTE)
    return rows


def test_recomputation_reproduces_one_device_bit_for_bit_the_run_without(results):
    for r in results:
        # float64, the same weights and keyed masks: only the mesh's sums differ from one device
        assert within(r["max_diff"], CONTRACT), r
        # the rerun forward is the same function on the same arrays, in the same order, its dropout
        # masks drawn from the same keys: every gradient, so every parameter, is the same bits
        assert all(rank["bitwise"] for rank in r["ranks"]), (r["case"], r["recompute"])
        none = next(n for n in results if n["case"] == r["case"] and n["recompute"] == "none")
        assert r["losses"] == none["losses"]


def test_activation_peaks_traced_bytes_and_memory_are_the_closed_forms_on_every_rank(results):
    for r in results:
        assert r["bytes_ok"] and r["memory_ok"], (r["case"], r["recompute"])
        assert all(rank["activations"] == rank["closed_form"] for rank in r["ranks"]), r
        # the reruns' collectives run under the trace phase "recompute", and only where a rerun moves
        # something (tp's f/g and sp's gathers, cp's ring, ep's dispatch; nothing under FSDP's B)
        moved = (r["case"], r["recompute"]) in RERUNS
        assert all((rank["reruns"] > 0) == moved for rank in r["ranks"]), (r["case"], r["recompute"])


def test_each_recomputation_keeps_less_on_every_rank(results):
    for case in {r["case"] for r in results}:
        peaks = [[rank["activations"] for rank in r["ranks"]] for mode in RECOMPUTE
                 for r in results if r["case"] == case and r["recompute"] == mode]
        assert all(a > b > c for a, b, c in zip(*peaks, strict=True)), (case, peaks)


def test_the_ranks_run_together_the_gemm_flops_the_planner_prices_for_each_recomputation(results):
    # Every GEMM a rank runs is counted (refpar/model/gemm.py), recomputed forwards included; on
    # dense meshes nothing is computed twice, so the ranks' counts of a step add up to the planner's
    # closed form (analysis/flops.step_flops: Korthikanti et al.'s 72 B s L h^2 (1 + s/6h + V/12Lh)
    # and what selective, full and the ring's second QK^T add). MoE blocks compute what routing
    # kept (fewer where capacity drops tokens), so their case is left out.
    dense = [r for r in results if "MoE" not in r["case"]]
    assert {r["case"] for r in dense} >= {"dp x tp+sp x pp"}
    for r in dense:
        assert all(sum(step) == r["planned_flops"] for step in zip(*r["flops"], strict=True)), r["case"]
    for case in {r["case"] for r in dense}:
        planned = [r["planned_flops"] for mode in RECOMPUTE for r in dense
                   if r["case"] == case and r["recompute"] == mode]
        assert planned[0] < planned[1] < planned[2], case  # none, selective, full: more work rerun


def test_per_layer_forms_are_korthikantis_at_two_byte_activations():
    # Korthikanti et al. 2022, Table 2: TP + SP + selective sbh/t 34 per layer, full 2sbh/t (the
    # block's input, sharded by sp) at 2-byte activations and 1-byte masks
    model = model_preset("small")
    s, b, h, t = 256, 2, model.n_embd, 2
    shape = RankShape(B=b, T=s, Ta=s, Tl=s // t, t=t, c=1, nh=model.n_head // t, V=model.vocab_size // t, e=2,
                      cp_tokens=(s,), cp_rank=0)
    assert layer_bytes(model, shape, "local", True, PAPER, "selective") == s * b * h / t * 34
    assert layer_bytes(model, shape, "local", True, PAPER, "full") == 2 * s * b * h / t


def test_the_planner_prices_what_selective_recomputation_saves_as_the_ledger_measures():
    # tp=2 with sp, one microbatch of 8 sequences: the ledger's peak is every block's cache plus,
    # under selective, one attention core made again in its backward; the planner's memory_per_rank
    # with refpar's float64 activations and 8-byte masks (its scale arrays) prices the same saving,
    # (L - 1) cores: (B nh/t T^2)(e + mask + e) each
    peaks = {}
    for mode in ("none", "selective"):
        s = refpar_json(2, "train", "--mesh", "tp=2", "--sp", "--steps", "1", "--recompute", mode)
        peaks[mode] = max(r["bytes"] for r in s["memory_peak_bytes"] if r["category"] == "activations")
    model = model_preset("tiny")
    precision = Precision(param=8, grad=8, master=0, optimizer=16, activation=8, mask=8)
    spec = from_model_config(model)
    priced = {mode: float(memory_per_rank(spec, micro_batch=8, seq=16, tp=2, sp=True, recompute=mode,
                                          precision=precision)["activations"]) for mode in peaks}
    assert peaks["none"] - peaks["selective"] == priced["none"] - priced["selective"] > 0
