"""Llama on the one engine (refpar/engine): each mesh it runs on against the single device, with
traced bytes and peak memory equal to the closed forms; the meshes it does not run on yet refused in
one sentence before any communication; its activation closed form against the planner's."""

from __future__ import annotations

import pytest

from refpar.analysis.activations import llama_layer_bytes
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import PRECISIONS, layer_activation_bytes
from refpar.config import model_preset
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


@pytest.mark.parametrize(("args", "words"), [
    (["--mesh", "tp=2"], "Llama runs on dp, pp, ZeRO and FSDP meshes so far, not with tp=2;"),
    (["--mesh", "cp=2"], "not with cp=2;"),
    (["--mesh", "tp=2", "--sp"], "not with tp=2, --sp;"),
    (["--mesh", "dp=2", "--moe-experts", "4", "--moe-topk", "2"],
     "Mixtral's experts (arch='llama' with --moe-experts) run on one device"),
])
def test_llama_on_a_mesh_the_engine_cannot_run_it_on_is_one_sentence_on_every_rank(args, words):
    proc = mpiexec(2, "-m", "refpar", "train", "--model", "llama-tiny", *args, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr, proc.stderr  # every rank refuses; rank 0 says it (refpar.cli)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_llama_block_activation_closed_form_is_the_planners_plus_what_refpar_keeps_beyond_it():
    config = model_preset("llama-tiny")
    b, T = 3, 16
    e = 8  # float64 activations, the planner's "float64" precision
    planner = layer_activation_bytes(from_model_config(config), b, T, precision=PRECISIONS["float64"])
    assert llama_layer_bytes(config, b, T, keep_refpar=False) == planner
    # beyond it: 1/rms of both RMSNorms per token, and the block's RoPE cos and sin tables (T, hs)
    assert llama_layer_bytes(config, b, T) - planner == 2 * e * b * T + 2 * e * T * config.head_size
