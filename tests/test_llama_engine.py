"""Llama on the one engine (refpar/engine): each mesh it runs on (dp, ZeRO, FSDP, pp, tp with GQA,
sp, cp ring and Ulysses, recomputation, Mixtral's experts over ep, bf16-mixed) against the single
device, with traced bytes and peak memory equal to the closed forms; resharding checkpoints; the
meshes it does not run on refused in one sentence before any communication; its activation closed
forms against the planner's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from refpar import checkpoint
from refpar.analysis.activations import llama_layer_bytes
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes, memory_per_rank
from refpar.commands.verify import judge
from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.holdings import kv_heads, kv_replicas, tp_param_slices
from refpar.parallel.tensor_parallel import check_tp
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, rel_diff, within
from tests.test_mixed_precision_strategies import BF16


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


@pytest.mark.parametrize(("n", "mesh"), [(2, "tp=2"), (4, "pp=2,tp=2")], ids=["tp2", "pp2-tp2"])
def test_llama_sequence_parallel_matches_one_device_with_closed_form_bytes_and_memory(n, mesh):
    # the RMSNorms on each rank's sequence shard: their gains' gradients summed over tp, the
    # regions entered by all-gathers and left by reduce-scatters, q/k/v and gate/up regathered
    s = refpar_json(n, "train", "--model", "llama-tiny", "--steps", "2", "--check", "--mesh", mesh, "--sp",
                    "--microbatches", "2", timeout=240)
    assert_matches_one_device_and_closed_forms(s)
    ops = {(r["axis"], r["op"]) for r in s["comm_bytes"]}
    assert {("tp", "all_gather"), ("tp", "reduce_scatter")} <= ops


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_llama_sequence_parallel_block_closed_form_is_the_planners(recompute):
    config = model_preset("llama-tiny")
    b, T, t = 2, 16, 2
    planner = layer_activation_bytes(from_model_config(config), b, T, tp=t, sp=True, recompute=recompute,
                                     precision=PRECISIONS["float64"])
    rank = llama_layer_bytes(config, b, T, config.n_head // t, config.n_kv_head // t,
                             config.intermediate_size // t, keep_refpar=False, Tl=T // t, recompute=recompute)
    assert rank == planner


@pytest.mark.parametrize(("n", "args"), [
    (2, ["--mesh", "cp=2", "--cp-algo", "ring"]),
    (2, ["--mesh", "cp=2", "--cp-algo", "ulysses"]),
    (4, ["--mesh", "cp=2,tp=2", "--cp-algo", "ring", "--sp"]),
], ids=["ring", "ulysses", "ring-tp2-sp"])
def test_llama_context_parallel_matches_one_device_with_closed_form_bytes_and_memory(n, args):
    # RoPE rotates each rank's tokens by their global positions (zig-zag chunks under ring); ring
    # passes the 2 kv heads alone, Ulysses gives each cp rank one query-head pair and its kv head
    s = refpar_json(n, "train", "--model", "llama-tiny", "--steps", "2", "--check", *args, timeout=240)
    assert_matches_one_device_and_closed_forms(s)
    assert "cp" in {r["axis"] for r in s["comm_bytes"]}


def test_llama_context_parallel_block_closed_forms_are_the_planners():
    config = model_preset("llama-tiny")
    b, T, c, e = 2, 16, 2, 8
    spec, f64 = from_model_config(config), PRECISIONS["float64"]
    planner = layer_activation_bytes(spec, b, T, cp=c, precision=f64)
    ulysses = [llama_layer_bytes(config, b, T, keep_refpar=False, Ta=T // c, attention="ulysses", cp=c,
                                 cp_rank=r) for r in range(c)]
    assert ulysses == [planner] * c  # the same numbers, split by heads over all T
    # ring keeps, instead of the (b, nh, Ta, T) scores, its output and the log-sum-exp
    ring = llama_layer_bytes(config, b, T, keep_refpar=False, Ta=T // c, attention="ring", cp=c)
    nh, Na = config.n_head, b * T // c
    assert ring == planner - e * nh * Na * T + e * Na * config.n_embd + e * nh * Na


def test_llama_ulysses_needs_each_tp_ranks_kv_heads_split_over_cp_in_one_sentence():
    proc = mpiexec(4, "-m", "refpar", "train", "--model", "llama-tiny", "--mesh", "cp=2,tp=2", "--cp-algo",
                   "ulysses", timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    words = "a rank of tp=2 holds 1 of n_kv_head=2, which cp=2 does not divide; use --cp-algo ring"
    assert words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(("args", "mode"), [
    (["--mesh", "pp=2", "--microbatches", "2"], "full"),
    (["--mesh", "cp=2", "--cp-algo", "ring"], "selective"),
], ids=["pp2-full", "cp2-ring-selective"])
def test_llama_recomputation_matches_the_run_without_and_keeps_less(args, mode):
    # full: a block keeps its input and runs its forward again in the backward (the Stage's, for
    # either family); selective: the attention core (here ring attention) keeps q, k, v only
    base = ("train", "--model", "llama-tiny", "--steps", "2", "--check", *args)
    without = refpar_json(2, *base, timeout=240)
    s = refpar_json(2, *base, "--recompute", mode, timeout=240)
    assert_matches_one_device_and_closed_forms(s)
    # the same function on the same arrays in the same order: the same numbers as without
    assert s["max_param_rel_diff"] == without["max_param_rel_diff"]
    assert s["max_loss_rel_diff"] == without["max_loss_rel_diff"]
    acts = [{r["rank"]: r["bytes"] for r in run["memory_peak_bytes"] if r["category"] == "activations"}
            for run in (without, s)]
    assert all(acts[1][r] < acts[0][r] for r in acts[0]), acts


def test_llama_bf16_mixed_tp_sp_agrees_with_one_bf16_device_and_the_closed_forms():
    # BF16 (u/2, derived in tests/test_mixed_precision_strategies.py): every op computes in float32
    # and rounds once to bf16 on both sides; the mesh differs only where tp's row-parallel partial
    # sums (o_proj, down_proj) and the f backward's gradients are rounded before they are added, and
    # sp's RMSNorm gains are summed over tp in 16 bits: one 16-bit rounding per element each.
    # Measured: 4.3e-4 after 3 AdamW steps.
    s = refpar_json(2, "train", "--model", "llama-tiny", "--steps", "3", "--check", "--mesh", "tp=2", "--sp",
                    "--precision", "bf16-mixed", timeout=240)
    assert s["precision"] == "bf16-mixed" and s["model"]["arch"] == "llama"
    assert within(s["max_loss_rel_diff"], BF16)
    verdict = judge(s)
    assert verdict["bytes_ok"] and verdict["memory_ok"]
    peak = {(r["rank"], r["category"]): r["bytes"] for r in s["memory_peak_bytes"]}
    for rank in range(2):  # float32 master weights beside the bf16 ones
        assert peak[rank, "master"] == 2 * peak[rank, "params"] > 0


def test_llama_checkpoint_saved_on_tp4_with_kv_replicas_resumes_on_tp4_and_on_a_pipeline(tmp_path):
    """Saved by tp=4 (each of llama-tiny's 2 kv heads on 2 ranks) after 2 of 4 steps, each element
    once; resumed on tp=4 (bit for bit the uninterrupted run) and on a 2-stage pipeline (whole
    tensors from the tp shards)."""
    common = ("train", "--model", "llama-tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "8")
    full = refpar_json(4, *common, "--mesh", "tp=4", "--save", str(tmp_path / "full"), "--save-every", "2",
                       timeout=240)["losses"]
    step2 = tmp_path / "full" / "step-00000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    written: dict = {}
    for f in manifest["files"]:
        for a in f["arrays"]:
            written[a["tensor"]] = written.get(a["tensor"], 0) + math.prod(hi - lo for lo, hi in a["box"])
    # every element once: the second replica of a kv head writes nothing
    assert written == {name: math.prod(t["shape"]) for name, t in manifest["tensors"].items()}
    # read as a run that would go on (a checkpoint at its last step is refused as a resume)
    model, train = model_preset("llama-tiny"), TrainConfig(steps=5, batch_size=4, seq_len=8)
    uninterrupted = checkpoint.load_whole(tmp_path / "full" / "step-00000004", model, train)[1]
    for n, mesh in ((4, ("tp=4",)), (2, ("pp=2", "--microbatches", "2"))):
        out = tmp_path / mesh[0]
        resumed = refpar_json(n, *common, "--mesh", *mesh, "--resume", str(step2), "--save", str(out),
                              timeout=240)["losses"]
        params = checkpoint.load_whole(out / "step-00000004", model, train)[1]
        if mesh[0] == "tp=4":  # the same operations in the same order as the uninterrupted run
            assert resumed == full[2:]
            assert all(np.array_equal(params[k], v) for k, v in uninterrupted.items())
        else:  # another mesh sums in another order: the float64 contract
            assert within(rel_diff(resumed, full[2:]), CONTRACT), (mesh, resumed, full[2:])
            assert all(within(rel_diff(params[k], v), CONTRACT) for k, v in uninterrupted.items()), mesh


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
        # embedding's int64 token ids (8 N); the final norm's 1/rms (e N); over the rank's V/4
        # vocabulary rows the probabilities (e each) where the planner prices one fp32 logits tensor
        # (4); and the cross-entropy's int64 targets (8 N).
        e, N, T, hs, V4 = 8, train.batch_size * train.seq_len, train.seq_len, config.head_size, 96 // 4
        beyond = config.n_layer * (2 * e * N + 2 * e * T * hs) + 8 * N + e * N + (e - 4) * N * V4 + 8 * N
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


def test_mixtral_experts_split_over_tp_are_refused_in_one_sentence_on_every_rank():
    proc = mpiexec(4, "-m", "refpar", "train", "--model", "llama-tiny", "--mesh", "ep=2,tp=2",
                   "--moe-experts", "4", "--moe-topk", "2", timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    # every rank refuses; rank 0 says it (refpar.cli)
    assert "Mixtral's experts run over ep, dp, cp and pp, not split over tp=2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(("n", "mesh"), [(2, "ep=2"), (4, "dp=2,ep=2")], ids=["ep2", "dp2-ep2"])
def test_llama_with_mixtral_experts_over_ep_matches_one_device_with_closed_form_bytes_and_memory(n, mesh):
    # HF's MixtralSparseMoeBlock routing (softmax, top-2, renormalised, dropless): SwiGLU experts
    # spread over ep, tokens dispatched and combined by all-to-all, the router and the dense weights
    # summed over dp x ep, each expert over dp
    s = refpar_json(n, "train", "--model", "llama-tiny", "--steps", "2", "--check", "--mesh", mesh,
                    "--moe-experts", "4", "--moe-topk", "2", "--dropless", "--microbatches", "2", timeout=240)
    assert_matches_one_device_and_closed_forms(s)
    assert s["moe"]["blocks"] == [0, 1, 2, 3] and s["moe"]["capacity"] is None
    # each ep rank holds 2 of the 4 SwiGLU experts (w1, w3 (F, C), w2 (C, F)) of every block
    config = model_preset("llama-tiny")
    per_rank = 8 * 3 * config.intermediate_size * config.n_embd * 2 * config.n_layer
    assert s["moe"]["expert_param_bytes_per_ep_rank"] == [per_rank, per_rank]
    assert {("ep", "all_to_all"), ("data", "all_gather")} <= {(r["axis"], r["op"]) for r in s["comm_bytes"]}


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
