"""Llama's configuration, initialisation, state-dict checks and single-device training, and the one
refpar.model API that serves both families."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

import refpar.model as M
from refpar.checkpoint import CheckpointError
from refpar.config import ConfigError, ModelConfig, TrainConfig, model_preset
from refpar.engine.report import SUMMARY_FIELDS
from refpar.model import gpt, llama
from refpar.model.data import MarkovCorpus
from refpar.trainer import train_single_device
from tests.mpi import ROOT, mpi_env

LLAMA = dict(arch="llama", n_embd=32, n_head=4, intermediate_size=48, dropout=0.0)


@pytest.mark.parametrize("fields, words", [
    (dict(arch="mamba"), "unknown arch 'mamba'; choose one of gpt2, llama"),
    (dict(n_kv_head=2), "n_kv_head is a Llama field but arch='gpt2'"),
    (dict(LLAMA, n_kv_head=3), "n_kv_head=3 must divide n_head=4"),
    (dict(LLAMA, n_head=32), "n_embd / n_head = 1 must be even (RoPE rotates pairs of channels)"),
    (dict(LLAMA, intermediate_size=None), "needs a positive intermediate_size"),
    (dict(LLAMA, rope_theta=0.0), "rope_theta=0.0 must be positive"),
    (dict(LLAMA, norm_eps=-1e-6), "norm_eps=-1e-06 must be positive"),
    (dict(LLAMA, dropout=0.1), "Llama trains without dropout but dropout=0.1"),
    (dict(LLAMA, moe_experts=4), "use moe_top_k=2"),
])
def test_each_bad_llama_field_is_one_sentence_saying_what_to_change(fields, words):
    with pytest.raises(ConfigError, match=None) as err:
        ModelConfig(**fields)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_llama_fields_default_to_llama_and_gpt2_leaves_them_unset():
    config = ModelConfig(**LLAMA)
    defaults = (config.n_kv_head, config.rope_theta, config.norm_eps, config.tie_embeddings)
    assert defaults == (4, 1e4, 1e-6, False)
    tiny = model_preset("llama-tiny")
    assert (tiny.n_layer, tiny.n_embd, tiny.n_head, tiny.n_kv_head) == (4, 64, 4, 2)
    assert all(getattr(model_preset("tiny"), f) is None for f in ("n_kv_head", "intermediate_size",
                                                                  "rope_theta", "norm_eps", "tie_embeddings"))
    # a config written out and read back (checkpoints, --json) is the same config
    for config in (tiny, model_preset("tiny")):
        assert ModelConfig(**config.to_dict()) == config


def test_params_are_named_and_shaped_as_hf_llama_and_drawn_full_by_name():
    config = model_preset("llama-tiny")
    params = M.init_params(config, seed=3)
    assert list(params)[:5] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                "model.layers.0.self_attn.k_proj.weight",
                                "model.layers.0.self_attn.v_proj.weight",
                                "model.layers.0.self_attn.o_proj.weight"]
    assert list(params)[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # (n_kv_head * hs, C)
    assert params["model.layers.3.mlp.down_proj.weight"].shape == (64, 176)  # (out, in)
    assert all(np.array_equal(p, np.ones(64)) for n, p in params.items() if n.endswith("norm.weight"))
    # normal(0, 0.02), one key per name: another layer count leaves the common tensors as they were
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std() - 0.02) < 0.002 and abs(q.mean()) < 0.002  # 4096 draws: std error ~2e-4
    fewer = M.init_params(model_preset("llama-tiny", n_layer=2), seed=3)
    up = "model.layers.1.mlp.up_proj.weight"
    assert np.array_equal(fewer[up], params[up])
    assert not np.array_equal(M.init_params(config, seed=4)["lm_head.weight"], params["lm_head.weight"])
    tied = M.init_params(model_preset("llama-tiny", tie_embeddings=True), seed=3)
    assert "lm_head.weight" not in tied


def test_from_hf_state_dict_names_the_first_missing_unknown_or_misshapen_tensor():
    config = model_preset("llama-tiny")
    state = M.to_hf_state_dict(M.init_params(config, seed=0), config)
    bad_cases = [
        ({k: v for k, v in state.items() if k != "model.norm.weight"}, "lacks model.norm.weight"),
        ({**state, "model.layers.9.mlp.up_proj.weight": state["lm_head.weight"]},
         "has model.layers.9.mlp.up_proj.weight"),
        ({**state, "lm_head.weight": state["lm_head.weight"].T}, "lm_head.weight has shape (64, 96)"),
    ]
    for bad, words in bad_cases:
        with pytest.raises(ValueError, match=None) as err:
            M.from_hf_state_dict(bad, config)
        assert words in str(err.value)
    tied = model_preset("llama-tiny", tie_embeddings=True)
    tied_state = M.to_hf_state_dict(M.init_params(tied, seed=0), tied)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        M.from_hf_state_dict({**tied_state, "lm_head.weight": state["lm_head.weight"]}, tied)
    # older checkpoints saved the rotary inv_freq buffers: ignored
    old = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8)}
    assert list(M.from_hf_state_dict(old, config)) == list(state)


def test_one_api_dispatches_gpt2_to_gpt_py_unchanged():
    config = model_preset("tiny")
    params = M.init_params(config, seed=2)
    assert M.param_shapes(config) == gpt.param_shapes(config)
    assert all(np.array_equal(params[n], p) for n, p in gpt.init_params(config, seed=2).items())
    tokens, targets = MarkovCorpus(config.vocab_size, 0).batch(0, range(2), 8)
    kw = dict(seed=5, step=1, sample_ids=[3, 4])
    loss, grads = M.loss_and_grads(params, tokens, targets, config, **kw)
    want_loss, want_grads = gpt.loss_and_grads(params, tokens, targets, config, **kw)
    # bitwise: the same function on the same arrays
    assert loss == want_loss and all(np.array_equal(grads[n], want_grads[n]) for n in params)
    assert np.array_equal(M.forward(params, tokens, config), gpt.forward(params, tokens, config))


def test_gpt2_paths_refuse_a_llama_config_in_one_sentence_and_checkpoints_keep_the_family(tmp_path):
    with pytest.raises(ConfigError, match="this path runs GPT-2 .* arch='llama': use refpar.model's"):
        gpt.init_params(model_preset("llama-tiny"), seed=0)
    train = TrainConfig(steps=1, batch_size=2, seq_len=4)
    train_single_device(model_preset("tiny", n_layer=1), train, save=str(tmp_path))
    llama_tiny = model_preset("llama-tiny", n_layer=1)
    with pytest.raises(CheckpointError, match="was written with model .* resume with the settings"):
        train_single_device(llama_tiny, replace(train, steps=2), resume=str(tmp_path))


def test_llama_loss_is_the_mean_over_shards_and_ignores_gpt2_dropout_keys():
    config = model_preset("llama-tiny")
    params = M.init_params(config, seed=1)
    tokens, targets = MarkovCorpus(config.vocab_size, 2).batch(0, range(4), 16)
    full, g_full = M.loss_and_grads(params, tokens, targets, config)
    a, g_a = M.loss_and_grads(params, tokens[:1], targets[:1], config, normalizer=tokens.size)
    b, g_b = M.loss_and_grads(params, tokens[1:], targets[1:], config, normalizer=tokens.size)
    # two shards' sums added against one sum over the batch: the float64 contract
    from tests.numerics import CONTRACT, rel_diff, within

    assert within(rel_diff(a + b, full), CONTRACT)
    assert all(within(rel_diff(g_a[n] + g_b[n], g_full[n]), CONTRACT) for n in params)
    # no dropout: the keys that draw GPT-2's masks change no bit
    keyed, _ = M.loss_and_grads(params, tokens, targets, config, seed=9, step=4, sample_ids=[7, 6, 5, 4])
    assert keyed == full


def test_training_llama_tiny_on_one_device_gets_halfway_to_the_floor():
    result = train_single_device(model_preset("llama-tiny"), TrainConfig(steps=60, seed=7))
    first, floor = result.losses[0], result.loss_floor
    last = float(np.mean(result.losses[-10:]))  # the last ten, so one lucky batch does not pass it
    print(f"initial {first:.3f}, last ten {last:.3f}, floor {floor:.3f}")
    assert abs(first - np.log(96)) < 0.1  # normal(0, 0.02) weights predict nearly uniformly
    assert last < floor + 0.5 * (first - floor)
    assert set(result.params) == set(llama.param_shapes(model_preset("llama-tiny")))


def refpar(*args):
    return subprocess.run([sys.executable, "-m", "refpar", *args], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=120)


def test_refpar_train_llama_tiny_runs_the_single_device_reference_and_refuses_dropout_in_one_sentence():
    proc = refpar("train", "--model", "llama-tiny", "--steps", "3", "--seed", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("Llama llama-tiny: 4 layers, 64 channels, 4 heads over 2 kv heads, 197,184 "
                              "parameters")
    summary = json.loads(lines[-1])
    assert list(summary) == list(SUMMARY_FIELDS) and summary["model"]["arch"] == "llama"
    expected = train_single_device(model_preset("llama-tiny"), TrainConfig(steps=3, seed=3)).losses
    assert summary["losses"] == expected  # the CLI runs exactly the reference loop
    proc = refpar("train", "--model", "llama-tiny", "--dropout", "0.1")
    assert proc.returncode != 0 and "Llama trains without dropout" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
