"""DeepSeek-V3 on the engine's pieces (refpar/parallel/deepseek_pieces.py, its latent attention split by
refpar/parallel/mla_tensor_parallel.py): expert parallelism with ZeRO-3 over the data ranks, tensor
parallelism with and without sequence parallelism, context parallelism (ring and Ulysses), and tp x
ep with sp, each equal to one device
within the float64 contract, every byte moved and every byte held (MLA's caches included) equal to
refpar/analysis's closed forms."""

from __future__ import annotations

import json

import pytest

from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within


def _moved(rows):
    return {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in rows}


def _held(rows):
    return {(r["rank"], r["category"]): r["bytes"] for r in rows}


def test_deepseek_tiny_over_ep_and_zero3_matches_one_device_and_the_closed_forms():
    s = refpar_json(4, "train", "--model", "deepseek-tiny", "--mesh", "dp=2,ep=2", "--zero", "3",
                    "--steps", "2", "--check", timeout=300)
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    assert _moved(s["comm_bytes"]) == _moved(s["expected_comm_bytes"])
    assert _held(s["memory_peak_bytes"]) == _held(s["expected_memory_peak_bytes"])  # activations too


def test_deepseek_tiny_over_tp_ep_with_sp_matches_one_device_and_the_closed_forms():
    """tp=2 x ep=2 with sp and ZeRO-1 in two microbatches: the heads and the routed experts' columns
    over tp, the experts over ep, the latents gathered over tp; bytes per rank, axis and op, and every
    peak, activations included, as the closed forms say."""
    s = refpar_json(4, "train", "--model", "deepseek-tiny", "--n-layer", "2", "--mesh", "tp=2,ep=2", "--sp",
                    "--zero", "1", "--microbatches", "2", "--steps", "2", "--check", timeout=300)
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    assert {k[1] for k in _moved(s["comm_bytes"])} == {"tp", "ep", "data"}
    assert _moved(s["comm_bytes"]) == _moved(s["expected_comm_bytes"])
    assert _held(s["memory_peak_bytes"]) == _held(s["expected_memory_peak_bytes"])


@pytest.fixture(scope="module")
def tp_rows():
    proc = mpiexec(2, "tests/jobs/deepseek_tp_check.py", timeout=300)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(r)
    return out


def test_deepseek_latent_attention_over_tp_and_cp_matches_one_device_and_the_closed_forms(tp_rows):
    """tests/jobs/deepseek_tp_check.py on 2 ranks: tp=2 (a dense and a MoE block), tp=2 with sp and
    selective recomputation in two microbatches, a dense DeepSeek-V3 without a query latent (q_proj)
    under tp=2 with sp and full recomputation, and on pp=2 under zb-h1 (B keeps the weight halves
    for W); cp=2 by ring attention in two microbatches and by Ulysses with selective recomputation:
    losses and parameters within the float64 contract of one device, each step's bytes per (axis,
    op) and every memory peak equal to the closed forms on every rank."""
    assert len(tp_rows) == 6
    for r in tp_rows:
        assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
        assert r["bytes_ok"] and r["memory_ok"], r
