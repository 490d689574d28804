"""Tensor, sequence and context parallelism against the single device and the closed forms.

Two MPI jobs (2 and 4 ranks) each train several layouts for 3 AdamW steps with dropout on
(tests/jobs/intra_layer_job.py) and report, per rank: the loss and parameter differences from the single
device, the trace compared call by call with refpar.analysis.intra_layer, the collectives of one
block, and the peak of activation bytes next to refpar.analysis.activations.
"""

from __future__ import annotations

import json

import pytest

from refpar.analysis.activations import PAPER, korthikanti_layer_bytes, layer_bytes
from refpar.analysis.intra_layer import RankShape
from refpar.config import ConfigError, ModelConfig, model_preset
from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within

# float32 rounds at 6e-8 and the ranks sum in another order than one device, so its runs agree to
# about 1e-7 (losses) and 5e-7 (parameters); they use SGD, because AdamW's m / sqrt(v) turns that
# rounding on near-zero gradients into steps of order lr.
TOL_FLOAT32 = 1e-5


def _tol(spec: dict) -> float:
    return TOL_FLOAT32 if spec.get("model", {}).get("dtype") == "float32" else CONTRACT

# Each covers something the others do not: a vocabulary of 95 does not divide tp = 2 or 4, and
# sequences of 15 and 14 do not divide tp, cp or 2cp (the zig-zag chunks).
LAYOUTS = {
    2: [
        {"mesh": {"tp": 2}, "model": {"vocab_size": 95}},
        {"mesh": {"tp": 2}, "sp": True, "model": {"vocab_size": 95}},
        {"mesh": {"cp": 2}, "cp_algo": "ring", "seq_len": 15},
        {"mesh": {"cp": 2}, "cp_algo": "ulysses", "seq_len": 15},
        # Without dropout the caches keep less (no masks; the attention's dropped probabilities
        # are its probabilities): the closed forms must follow.
        {"mesh": {"tp": 2}, "sp": True, "seq_len": 15, "model": {"dropout": 0.0}},
        {"mesh": {"cp": 2}, "cp_algo": "ring", "seq_len": 15, "model": {"dropout": 0.0}},
        # float32: 4-byte activations in the closed forms, the loss still all-reduced as a float64.
        {"mesh": {"cp": 2}, "cp_algo": "ring", "seq_len": 15, "model": {"dtype": "float32"},
         "optimizer": "sgd"},
    ],
    4: [
        {"mesh": {"tp": 4}, "model": {"vocab_size": 95}},
        {"mesh": {"tp": 4}, "sp": True, "seq_len": 15},
        {"mesh": {"cp": 4}, "cp_algo": "ring", "seq_len": 15},
        # 6 heads over 4 ranks: Ulysses splits heads unevenly too (2, 2, 1, 1).
        {"mesh": {"cp": 4}, "cp_algo": "ulysses", "seq_len": 14, "model": {"n_embd": 48, "n_head": 6}},
        {"mesh": {"dp": 2, "tp": 2}, "model": {"vocab_size": 95}},
        {"mesh": {"tp": 2, "cp": 2}, "cp_algo": "ring", "seq_len": 15},
    ],
}


def _name(spec: dict) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in spec["mesh"].items())
    extra = [k for k in ("sp",) if spec.get(k)] + [spec.get("cp_algo")] * ("cp_algo" in spec)
    model = spec.get("model", {})
    return " ".join([mesh, *extra, f"T={spec.get('seq_len', 16)}", f"V={model.get('vocab_size', 96)}",
                     f"dropout={model.get('dropout', 0.1)}", model.get("dtype", "float64"),
                     spec.get("optimizer", "adamw")])


@pytest.fixture(scope="module")
def results() -> list[dict]:
    out = []
    for n, layouts in LAYOUTS.items():
        proc = mpiexec(n, "tests/jobs/intra_layer_job.py", json.dumps(layouts), timeout=240)
        out += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == sum(len(v) for v in LAYOUTS.values())
    return out


def test_tp_sp_ring_and_ulysses_run_unchanged_on_torch_tensors():
    pytest.importorskip("torch")
    layouts = [{**spec, "backend": "torch"} for spec in LAYOUTS[2][1:4]]  # tp+sp, ring, Ulysses
    proc = mpiexec(2, "tests/jobs/intra_layer_job.py", json.dumps(layouts), timeout=240)
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(layouts)
    for r in got:
        for x in r["ranks"]:
            assert within(x["loss_rel_diff"], CONTRACT), _name(r["spec"])
            assert within(x["param_rel_diff"], CONTRACT), _name(r["spec"])
            assert x["comm_mismatches"] == [] and x["activation_peak"] == x["activation_expected"]


def test_every_layout_matches_single_device_after_3_steps_with_dropout(results):
    for r in results:
        loss = max(x["loss_rel_diff"] for x in r["ranks"])
        param = max(x["param_rel_diff"] for x in r["ranks"])
        print(f"{_name(r['spec']):50s} loss rel diff {loss:.1e}  param rel diff {param:.1e}")
        assert within(loss, _tol(r["spec"])) and within(param, _tol(r["spec"])), _name(r["spec"])


def test_traced_bytes_equal_the_closed_form_call_by_call_on_every_rank(results):
    for r in results:
        for rank, x in enumerate(r["ranks"]):
            assert x["comm_mismatches"] == [], f"{_name(r['spec'])} rank {rank}: {x['comm_mismatches']}"


def test_peak_activation_bytes_equal_the_closed_form_on_every_rank(results):
    for r in results:
        for rank, x in enumerate(r["ranks"]):
            assert x["activation_peak"] == x["activation_expected"], f"{_name(r['spec'])} rank {rank}"
    tp, sp = (next(r["ranks"][0]["activation_peak"] for r in results if r["spec"] == s)
              for s in LAYOUTS[2][:2])
    print(f"tp=2, V=95, T=16: activations {tp:,} B per rank under TP, {sp:,} B with SP "
          f"({100 * (1 - sp / tp):.0f}% saved)")
    assert sp < tp


def test_a_block_does_four_tp_all_reduces_or_four_gather_scatter_pairs_with_sp(results):
    for r in results:
        if r["spec"]["mesh"].get("tp", 1) == 1:
            continue
        want = ({"all_gather": 4, "reduce_scatter": 4, "all_gather:regather": 2} if r["spec"].get("sp")
                else {"all_reduce": 4})
        for x in r["ranks"]:
            assert x["tp_calls_per_block"] == want, _name(r["spec"])


def test_sp_gather_scatter_pairs_move_exactly_the_bytes_of_tp_all_reduces(results):
    tp, sp = (next(r for r in results if r["spec"] == s) for s in LAYOUTS[2][:2])
    for a, b in zip(tp["ranks"], sp["ranks"], strict=True):
        assert a["tp_block_bytes"] == b["tp_block_bytes"] > 0


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_layer_bytes_with_the_papers_keep_list_are_korthikanti_eq_1_2_4(t, sp):
    s, b, h, a = 64, 3, 32, 4
    model = ModelConfig(n_embd=h, n_head=a, n_positions=s, dtype="float32")
    shape = RankShape(B=b, T=s, Ta=s, Tl=s // t if sp else s, t=t, c=1, nh=a // t, V=0, e=2,
                      cp_tokens=(s,), cp_rank=0)
    assert layer_bytes(model, shape, keep=PAPER) == korthikanti_layer_bytes(s, b, h, a, t, sp)


def test_layouts_that_cannot_work_raise_one_sentence_config_errors():
    from refpar.parallel.context_parallel import check_cp
    from refpar.parallel.tensor_parallel import check_tp

    tiny = model_preset("tiny")
    cases = [
        (lambda: check_tp(tiny, 3), "tp=3 does not divide n_head=4"),
        (lambda: check_cp(tiny, 7, 4, "ring", 1), "2*cp=8 zig-zag chunks"),
        (lambda: check_cp(tiny, 16, 8, "ulysses", 1), "cp <= n_head/tp=4"),
        (lambda: check_cp(tiny, 16, 2, "tree", 1), "unknown --cp-algo"),
    ]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            call()
        assert str(err.value).count(". ") == 0, str(err.value)


@pytest.mark.parametrize("kind,p", [("tp", 2), ("tp", 4), ("sp", 2), ("sp", 4), ("ring", 2), ("ring", 4),
                                    ("ulysses", 2), ("ulysses", 4)])
def test_bytes_of_one_layer_reduce_to_the_papers_formulas(kind, p):
    from refpar.analysis.intra_layer import expected_calls, paper_bytes_per_layer
    from refpar.config import TrainConfig

    model = ModelConfig(n_embd=32, n_head=4, n_layer=1, n_positions=32)
    train = TrainConfig(batch_size=2, seq_len=32)
    axis = "tp" if kind in ("tp", "sp") else "cp"
    algo = kind if axis == "cp" else None
    calls = expected_calls(model, train, {axis: p}, {axis: 1}, sp=kind == "sp", cp_algo=algo)
    layer = sum(c.bytes_sent for c in calls if c.tag.startswith("h.0."))
    assert layer == paper_bytes_per_layer(kind, 2, 32, 32, p, 8)


def test_zigzag_chunks_give_every_cp_rank_the_same_causal_work_and_contiguous_ones_do_not():
    from refpar.parallel.context_parallel import causal_work, contiguous_positions, zigzag_positions

    T, c = 64, 4
    zigzag = [causal_work(zigzag_positions(T, c, r)) for r in range(c)]
    contiguous = [causal_work(contiguous_positions(T, c, r)) for r in range(c)]
    print(f"causal (q, k) pairs per cp rank, T={T}, cp={c}: zig-zag {zigzag}, contiguous {contiguous}")
    assert len(set(zigzag)) == 1 and sum(zigzag) == T * (T + 1) // 2
    assert max(contiguous) > 3 * min(contiguous)
