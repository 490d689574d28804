"""Serving DeepSeek-V3 from multi-head latent attention's compressed cache (refpar/serving/
latent_attention.py): the up-projections absorbed, against the single device recomputing every
sequence without a cache; the cache's bytes against MLA's closed form, written out here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import refpar.model as M
from refpar.analysis.serving import block_bytes, kv_bytes_per_rank, kv_ratio_to_multi_head, kv_shards
from refpar.config import ConfigError, model_preset
from refpar.memory import MemoryLedger
from refpar.serving.batching import check_serving, serve
from refpar.serving.paged import Paging
from refpar.serving.requests import make_requests, reference_generate
from refpar.serving.sampling import parse_sampling
from tests.mpi import mpiexec
from tests.numerics import CONTRACT, rel_diff, within

DEEPSEEK = model_preset("deepseek-tiny")  # float64; MLA rkv 32, dr 8; 4 heads of dn 16, dv 16; MoE dropless
ONE, AT = {"tp": 1, "cp": 1, "pp": 1}, {"tp": 0, "cp": 0, "pp": 0}
# DeepSeek-V3's rope_scaling, with a pretraining context of 8 so that it changes the tiny model's angles
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 8, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_bytes(config, layers: int, tokens: int) -> int:
    """MLA's cache: per token per layer the latent (kv_lora_rank) and the rotary key (qk_rope_head_dim),
    float64 (DeepSeek-V2, section 2.1.2)."""
    return layers * tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * 8


@pytest.fixture(scope="module")
def params():
    return M.init_params(DEEPSEEK, 2)


@pytest.mark.parametrize("paging, config", [
    pytest.param(None, DEEPSEEK, id="contiguous"), pytest.param(Paging(4), DEEPSEEK, id="paged"),
    pytest.param(None, replace(DEEPSEEK, rope_scaling=YARN), id="contiguous-yarn")])
def test_latent_cache_decoding_gives_the_recomputed_tokens_and_logits(params, paging, config):
    requests = make_requests(DEEPSEEK, [5, 9, 2], [4, 3, 5], [0, 0, 2], seed=4)
    greedy = parse_sampling("greedy", seed=9)
    ledger = MemoryLedger()
    out = serve(params, config, requests, greedy, max_batch=2, ledger=ledger, paging=paging)
    worst = 0.0
    for r in requests:
        tokens, logits = reference_generate(params, config, r, greedy)  # no cache, whole sequence
        assert out.tokens[r.rid] == tokens, f"request {r.rid}"
        worst = max(worst, *(rel_diff(a, b) for a, b in zip(out.logits[r.rid], logits, strict=True)))
    assert within(worst, CONTRACT), f"max logit rel diff {worst:.2e}"
    L = DEEPSEEK.n_layer
    if paging is None:
        for measured, cached in zip(out.kv_bytes, out.cached, strict=True):
            assert measured == mla_bytes(DEEPSEEK, L, sum(cached.values()))
            assert measured == kv_bytes_per_rank(DEEPSEEK, cached.values(), ONE, AT)
    else:  # every taken block holds B slots of every layer's entry
        assert block_bytes(DEEPSEEK, 4, ONE, AT) == mla_bytes(DEEPSEEK, L, 4)
        assert out.kv_bytes == [p["blocks"] * mla_bytes(DEEPSEEK, L, 4) for p in out.pool]
    assert max(out.kv_bytes) == ledger.peak["activations"] > 0 and ledger.current["activations"] == 0


def test_ratio_to_multi_head_kv_and_tp_replication_of_the_latent():
    # deepseek-tiny: (32 + 8) numbers against 4 heads' keys (16 + 8) and values (16)
    assert kv_ratio_to_multi_head(DEEPSEEK) == 40 / (4 * (16 + 8 + 16))
    assert kv_ratio_to_multi_head(model_preset("tiny")) == 1.0
    llama = model_preset("llama-tiny")
    assert kv_ratio_to_multi_head(llama) == llama.n_kv_head / llama.n_head
    # the latent is whole on every tp rank: tp divides nothing, cp and pp do
    assert kv_shards(DEEPSEEK, {"tp": 4, "cp": 2, "pp": 2}) == 4
    for r in range(2):
        sizes, coords = {"tp": 2, "cp": 1, "pp": 1}, {"tp": r, "cp": 0, "pp": 0}
        assert kv_bytes_per_rank(DEEPSEEK, [5, 3], sizes, coords) == mla_bytes(DEEPSEEK, DEEPSEEK.n_layer, 8)


def test_serving_refuses_what_it_cannot_serve_in_one_sentence():
    with pytest.raises(ConfigError, match="tp=3 does not divide n_head=4"):  # whole heads per tp rank
        check_serving(DEEPSEEK, {"tp": 3}, 3)
    capped = DEEPSEEK.__class__(**{**DEEPSEEK.to_dict(), "moe_dropless": False})
    with pytest.raises(ConfigError, match="dropless"):
        check_serving(capped, {}, 3)


def test_pp_cp_and_tp_serve_deepseek_as_one_device_with_their_closed_forms():
    proc = mpiexec(2, "tests/jobs/serving_job.py", "deepseek-tiny", timeout=240)
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["mesh"], r["paged"] is not None) for r in runs] == [
        ({"tp": 1, "cp": 1, "pp": 2}, False), ({"tp": 1, "cp": 2, "pp": 1}, False),
        ({"tp": 2, "cp": 1, "pp": 1}, False), ({"tp": 1, "cp": 2, "pp": 1}, True),
        ({"tp": 1, "cp": 1, "pp": 2}, True)]
    for run in runs:
        assert run["tokens_match_reference"], run["mesh"]
        assert within(run["max_logit_rel_diff"], CONTRACT), run["mesh"]
        assert run["comm_matches_closed_form"] and run["kv_matches_closed_form"], run["mesh"]
        assert run["kv_latent"] and run["kv_ratio_to_multi_head"] == 0.25
    # pp=2 contiguous: each stage's 2 layers of every cached token; cp=2: the striped half of them
    pp, cp = runs[0], runs[1]
    for k, cached in zip(pp["kv_cache"][0]["bytes_timeline"], pp["kv_cached_tokens"], strict=True):
        assert k == mla_bytes(DEEPSEEK, 2, cached)
    assert max(pp["kv_cache"][0]["bytes_timeline"]) == pp["kv_closed_form_at_peak"]
    for row in cp["kv_cache"]:
        for k, by_request in zip(row["bytes_timeline"], cp["kv_cached_by_request"], strict=True):
            held = sum((n - row["coords"]["cp"] + 1) // 2 for n in by_request.values())  # p % 2 == r
            assert k == mla_bytes(DEEPSEEK, DEEPSEEK.n_layer, held)
    # tp=2: each rank its 2 heads, the whole latent of every layer of every cached token
    tp = runs[2]
    for row in tp["kv_cache"]:
        for k, cached in zip(row["bytes_timeline"], tp["kv_cached_tokens"], strict=True):
            assert k == mla_bytes(DEEPSEEK, DEEPSEEK.n_layer, cached)
    assert runs[4]["paged"]["preemptions"], "3 blocks a rank cannot hold every request at once"


def test_generate_prints_the_latent_cache_and_its_ratio_to_multi_head_kv(capsys):
    from refpar.cli import main

    assert main(["generate", "--model", "deepseek-tiny", "--prompt-lens", "3", "--new-tokens", "2",
                 "--arrivals", "0", "--check"]) == 0
    out = capsys.readouterr().out
    # 4 cached tokens at the peak (the prompt's 3, the first new one fed back): 4 layers x 4 x 40 x 8 B
    assert f"(cp · pp; every tp rank keeps the whole latent) = {mla_bytes(DEEPSEEK, 4, 4)} B" in out
    assert "per token per layer 320 B; multi-head K/V of its 4 heads would take 1280 B: ratio 0.250" in out
    assert "tokens identical: yes" in out


def test_at_scale_deepseek_v3_caches_576_numbers_per_token_per_layer_on_every_tp_rank():
    from refpar.analysis.hardware import hardware
    from refpar.analysis.presets import preset
    from refpar.analysis.serving import decode_estimate

    # DeepSeek-V2, section 2.1.2: (d_c + d_h^R) l elements per token, d_c = 512, d_h^R = 64, l = 61
    row = decode_estimate(preset("deepseek-v3"), hardware("h100"), tp=8, pp=2, batch=4, context=1024)
    assert row["kv_bytes_per_token_per_gpu"] == 61 * (512 + 64) * 2 / 2  # fp16, pp=2 halves the layers
    assert row["kv_bytes_per_gpu"] == 4 * 1024 * row["kv_bytes_per_token_per_gpu"]
