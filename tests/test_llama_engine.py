"""Llama on the one engine (refpar/engine): each mesh it runs on against the single device, with
traced bytes and peak memory equal to the closed forms; the meshes it does not run on yet refused in
one sentence before any communication; its activation closed form against the planner's."""

from __future__ import annotations

import pytest

from refpar.analysis.activations import llama_layer_bytes
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes, memory_per_rank
from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.holdings import kv_heads, kv_replicas, tp_param_slices
from refpar.parallel.tensor_parallel import check_tp
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within


def _by_key(rows, key):
    return {tuple(r[k] for k in key): r for r in rows}


def assert_matches_one_device_and_closed_forms(s: dict) -> None:
    assert s["model"]["arch"] == "llama" and s["model"]["dtype"] == "float64"
    assert within(s["max_loss_rel_diff"], CONTRACT) and within(s["max_param_rel_diff"], CONTRACT)
    comm_key, mem_key = ("rank", "axis", "op"), ("rank", "category")
    assert _by_key(s["comm_bytes"], comm_key) == _by_key(s["expected_comm_bytes"], comm_key)
    assert _by_key(s["memory_peak_bytes"], mem_key) == _by_key(s["expected_memory_peak_bytes"], mem_key)


def test_llama_on_the_all_ones_mesh_is_the_single_device_bit_for_bit():
    s = refpar_json(1, "train", "--model", "llama-tiny", "--steps", "2", "--check")
    # the same pieces in the same order as trainer.train_single_device: bitwise
    assert s["max_loss_rel_diff"] == 0.0 and s["max_param_rel_diff"] == 0.0
    assert_matches_one_device_and_closed_forms(s)


@pytest.mark.parametrize("args", [
    ["--mesh", "dp=2", "--zero", "3"],
    ["--mesh", "dp=2", "--fsdp", "--prefetch"],
    ["--mesh", "pp=2", "--microbatches", "2", "--schedule", "1f1b"],
    ["--mesh", "pp=2", "--microbatches", "4", "--schedule", "interleaved-1f1b", "--chunks", "2"],
    ["--mesh", "pp=2", "--microbatches", "4", "--schedule", "dualpipev"],
], ids=["zero3", "fsdp-prefetch", "pp-1f1b", "pp-interleaved", "pp-dualpipev"])
def test_llama_on_two_ranks_matches_one_device_with_closed_form_bytes_and_memory(args):
    s = refpar_json(2, "train", "--model", "llama-tiny", "--steps", "2", "--check", *args, timeout=240)
    assert_matches_one_device_and_closed_forms(s)
    assert {r["axis"] for r in s["comm_bytes"]} == {"pp" if "pp=2" in args else "dp"}


@pytest.fixture(scope="module")
def tp4_run():
    # tp=4 over llama-tiny's 2 kv heads: each kv head on 2 ranks, its k and v gradients summed over them
    return refpar_json(4, "train", "--model", "llama-tiny", "--steps", "2", "--check", "--mesh", "tp=4",
                       timeout=300)


@pytest.mark.parametrize("args", [
    None,
    ["--mesh", "dp=2,tp=2", "--zero", "3"],
], ids=["tp4-kv-replicas", "dp2-tp2-zero3"])
def test_llama_tensor_parallel_on_four_ranks_matches_one_device_with_closed_form_bytes_and_memory(args,
                                                                                                  tp4_run):
    s = tp4_run if args is None else refpar_json(4, "train", "--model", "llama-tiny", "--steps", "2",
                                                 "--check", *args, timeout=300)
    assert_matches_one_device_and_closed_forms(s)
    assert ("tp", "all_reduce") in {(r["axis"], r["op"]) for r in s["comm_bytes"]}


def test_planner_prices_tp_past_n_kv_head_with_the_executed_runs_parameter_and_activation_bytes(tp4_run):
    """The planner (analysis/scale.memory_per_rank, what `refpar plan` searches with) on llama-tiny
    tp=4, where each of the 2 kv heads is whole on 2 ranks, against the tp=4 run's ledger peaks."""
    config, train = model_preset("llama-tiny"), TrainConfig()
    planned = memory_per_rank(from_model_config(config), micro_batch=train.batch_size, seq=train.seq_len,
                              tp=4, sp=False, precision=PRECISIONS["float64"])
    for rank in range(4):
        held = {r["category"]: r["bytes"] for r in tp4_run["memory_peak_bytes"] if r["rank"] == rank}
        assert held["params"] == planned["params"] and held["optimizer"] == planned["optimizer"]
        # refpar keeps, beyond the planner's Korthikanti et al. terms (float64, e = 8, N = B T tokens):
        # per block each RMSNorm's 1/rms (2 e N) and RoPE's cos and sin (2 e T hs); the vocab-parallel
        # embedding's int64 row ids and bool ownership flags (9 N); the final norm's 1/rms (e N); and
        # over the rank's V/4 vocabulary rows the probabilities and one-hot targets (2 e each) where
        # the planner prices one fp32 logits tensor (4).
        e, N, T, hs, V4 = 8, train.batch_size * train.seq_len, train.seq_len, config.head_size, 96 // 4
        beyond = config.n_layer * (2 * e * N + 2 * e * T * hs) + 9 * N + e * N + (2 * e - 4) * N * V4
        assert held["activations"] == planned["activations"] + beyond, rank


def test_llama_tp_slices_give_each_rank_its_heads_and_the_kv_head_they_read():
    config = model_preset("llama-tiny")  # 4 query heads over 2 kv heads, hs = 16
    assert [kv_heads(config, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads(config, 2, r) for r in range(2)] == [(0, 1), (1, 2)]
    assert kv_replicas(config, 4) == 2 and kv_replicas(config, 2) == 1
    k = "model.layers.0.self_attn.k_proj.weight"
    # rank 1's query head 1 reads kv head 1 // 2 = 0: rows 0..15 of k_proj, as rank 0's
    for r, rows in enumerate([range(0, 16), range(0, 16), range(16, 32), range(16, 32)]):
        axis, index = tp_param_slices(config, 4, r)[k]
        assert axis == 0 and list(index) == list(rows)
    with pytest.raises(ConfigError, match="tp=3 does not divide n_head=4"):
        check_tp(config, 3)
    with pytest.raises(ConfigError, match="tp=4 neither divides n_kv_head=3 nor is a multiple of it"):
        check_tp(model_preset("llama-tiny", n_head=12, n_kv_head=3, n_embd=96), 4)


@pytest.mark.parametrize(("args", "words"), [
    (["--mesh", "cp=2"], "Llama runs on dp, pp, tp, ZeRO and FSDP meshes so far, not with cp=2;"),
    (["--mesh", "tp=2", "--sp"], "not with --sp;"),
    (["--mesh", "dp=2", "--recompute", "full"], "not with --recompute full;"),
    (["--mesh", "dp=2", "--moe-experts", "4", "--moe-topk", "2"],
     "Mixtral's experts (arch='llama' with --moe-experts) run on one device"),
])
def test_llama_on_a_mesh_the_engine_cannot_run_it_on_is_one_sentence_on_every_rank(args, words):
    proc = mpiexec(2, "-m", "refpar", "train", "--model", "llama-tiny", *args, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr, proc.stderr  # every rank refuses; rank 0 says it (refpar.cli)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("t", [1, 2, 4])
def test_llama_block_activation_closed_form_is_the_planners_plus_what_refpar_keeps_beyond_it(t):
    config = model_preset("llama-tiny")
    b, T = 3, 16
    e = 8  # float64 activations, the planner's "float64" precision
    planner = layer_activation_bytes(from_model_config(config), b, T, tp=t, sp=False,
                                     precision=PRECISIONS["float64"])
    # a tp rank's query heads, the kv heads they read (one, whole, on 2 ranks at t=4), its SwiGLU columns
    kv = kv_heads(config, t, 0)
    mine = dict(heads=config.n_head // t, kv_heads=kv[1] - kv[0], ff=config.intermediate_size // t)
    assert llama_layer_bytes(config, b, T, **mine, keep_refpar=False) == planner
    # beyond it: 1/rms of both RMSNorms per token, and the block's RoPE cos and sin tables (T, hs)
    assert llama_layer_bytes(config, b, T, **mine) - planner == 2 * e * b * T + 2 * e * T * config.head_size
