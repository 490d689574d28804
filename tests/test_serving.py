"""Serving: KV-cache decoding with continuous batching, on one device and on tp, cp and pp meshes,
against the single device recomputing every sequence; bytes and KV memory against closed forms."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

import refpar.model as M
from refpar.analysis.hardware import hardware
from refpar.analysis.presets import preset
from refpar.analysis.serving import decode_estimate, kv_bytes_per_rank, kv_cache_bytes
from refpar.comm import cost
from refpar.commands.generate import add_arguments, paging_from_args
from refpar.config import ConfigError, model_preset
from refpar.memory import MemoryLedger
from refpar.model import gpt
from refpar.serving.batching import serve
from refpar.serving.requests import Request, check_requests, make_requests, reference_generate
from refpar.serving.sampling import Sampling, parse_sampling, sample_token
from tests.mpi import ROOT, mpi_env, mpiexec
from tests.numerics import CONTRACT, rel_diff, within

CONFIG = model_preset("tiny")
LLAMA = model_preset("llama-tiny")  # 4 query heads, 2 kv heads: tp=4 replicates each kv head twice


@pytest.mark.parametrize("sampling", ["greedy", "temperature=0.7,top_k=8"])
def test_kv_cache_decoding_with_continuous_batching_matches_full_recompute(sampling):
    params = gpt.init_params(CONFIG, 2)
    requests = make_requests(CONFIG, [6, 15, 2, 10], [7, 3, 9, 4], [0, 0, 2, 3], seed=4)
    smp = parse_sampling(sampling, seed=9)
    ledger = MemoryLedger()
    out = serve(params, CONFIG, requests, smp, max_batch=2, ledger=ledger)
    worst = 0.0
    for r in requests:
        tokens, logits = reference_generate(params, CONFIG, r, smp)
        assert out.tokens[r.rid] == tokens, f"request {r.rid}"
        worst = max(worst, *(rel_diff(a, b) for a, b in zip(out.logits[r.rid], logits, strict=True)))
    assert within(worst, CONTRACT), f"max logit rel diff {worst:.2e}"
    one = {"tp": 1, "cp": 1, "pp": 1}
    expected = [kv_bytes_per_rank(CONFIG, c.values(), one, {"tp": 0, "cp": 0, "pp": 0}) for c in out.cached]
    assert out.kv_bytes == expected
    assert ledger.current["activations"] == 0, "finished requests free their KV cache slots"
    assert max(out.kv_bytes) == ledger.peak["activations"]


def job_runs(*args: str) -> list[dict]:
    proc = mpiexec(4, "tests/jobs/serving_job.py", *args, timeout=240)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def gpt2_job():
    runs = job_runs()
    assert len(runs) == 4 + 3, [r["mesh"] for r in runs]
    return runs


@pytest.fixture(scope="module")
def parallel_runs(gpt2_job):
    return [r for r in gpt2_job if r["paged"] is None]


def test_every_parallel_decoding_mode_gives_the_single_device_tokens_and_logits(parallel_runs):
    for run in parallel_runs:
        assert run["tokens_match_reference"], run["mesh"]
        assert within(run["max_logit_rel_diff"], CONTRACT), f"{run['mesh']}: {run['max_logit_rel_diff']:.2e}"
        assert run["tokens_generated"] == 5 + 8 + 3 + 6 + 2


def test_traced_bytes_and_ledger_kv_bytes_equal_the_closed_forms_on_every_rank(parallel_runs):
    for run in parallel_runs:
        assert run["comm_matches_closed_form"], run["mesh"]
        assert run["kv_matches_closed_form"], run["mesh"]
        assert all(max(k["bytes_timeline"]) == k["peak_bytes"] > 0 for k in run["kv_cache"])


def test_tp_decode_moves_two_all_reduces_per_layer_per_token(parallel_runs):
    run = next(r for r in parallel_runs if r["mesh"] == {"tp": 2, "cp": 2, "pp": 1})
    C, L, V, b = CONFIG.n_embd, CONFIG.n_layer, CONFIG.vocab_size, 8
    # per decoded token: the embedding's g, two g per block, and the (V/2, 1) logits gathered
    per_token = (2 * L + 1) * cost.all_reduce_bytes(C, 2, 0, b).sent + (V // 2) * b
    assert run["bytes_per_token"]["tp:decode"] == per_token


def argmax_continuation(params, config, prompt, n: int) -> list[int]:
    """Greedy decoding written out: the single-device forward over the whole sequence, argmax."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(M.forward(params, np.asarray([tokens]), config)[0, -1])))
    return tokens[len(prompt):]


def gqa_kv_bytes(config, layers: int, tp: int, tokens: int) -> int:
    """K and V of `tokens` positions on one rank: max(1, n_kv_head / tp) kv heads of each layer, as
    Llama's tp layout holds them (one whole kv head, replicated, once tp > n_kv_head), float64."""
    return 2 * layers * max(1, config.n_kv_head // tp) * config.head_size * tokens * 8


def test_llama_greedy_serving_is_the_forwards_argmax_continuation_and_caches_n_kv_head_heads():
    params = M.init_params(LLAMA, 2)
    requests = make_requests(LLAMA, [6, 15, 2, 10], [7, 3, 9, 4], [0, 0, 2, 3], seed=4)
    ledger = MemoryLedger()
    out = serve(params, LLAMA, requests, parse_sampling("greedy", seed=9), max_batch=2, ledger=ledger)
    for r in requests:
        assert out.tokens[r.rid] == argmax_continuation(params, LLAMA, r.prompt, r.max_new_tokens), r.rid
    L, nh, hs = LLAMA.n_layer, LLAMA.n_head, LLAMA.head_size
    for measured, cached in zip(out.kv_bytes, out.cached, strict=True):
        tokens = sum(cached.values())
        assert measured == gqa_kv_bytes(LLAMA, L, 1, tokens)
        # n_kv_head / n_head of the cache multi-head attention (GPT-2's) would keep
        assert measured * nh == LLAMA.n_kv_head * kv_cache_bytes(L, nh, hs, tokens, 8)
    assert max(out.kv_bytes) == ledger.peak["activations"] > 0 and ledger.current["activations"] == 0


@pytest.fixture(scope="module")
def llama_job():
    runs = job_runs("llama-tiny")
    assert len(runs) == 3 + 2, [r["mesh"] for r in runs]
    return runs


@pytest.fixture(scope="module")
def llama_runs(llama_job):
    return [r for r in llama_job if r["paged"] is None]


def test_llama_on_tp_cp_pp_gives_the_single_device_tokens_logits_and_closed_form_bytes(llama_runs):
    for run in llama_runs:
        assert run["tokens_match_reference"], run["mesh"]
        assert within(run["max_logit_rel_diff"], CONTRACT), f"{run['mesh']}: {run['max_logit_rel_diff']:.2e}"
        assert run["comm_matches_closed_form"] and run["kv_matches_closed_form"], run["mesh"]


def test_llama_kv_bytes_per_rank_keep_max_1_or_n_kv_head_over_tp_kv_heads(llama_runs):
    """At every moment of every run, the ranks of one (tp, pp) coordinate (the cp ranks, which split
    the positions) hold together the GQA closed form: tp=2 one of the two kv heads, tp=4 one too
    (each kv head kept whole on the two ranks whose query heads read it), never a fraction."""
    for run in llama_runs:
        t, p = run["mesh"]["tp"], run["mesh"]["pp"]
        for i, tokens in enumerate(run["kv_cached_tokens"]):
            held: dict = {}
            for k in run["kv_cache"]:
                key = (k["coords"]["tp"], k["coords"]["pp"])
                held[key] = held.get(key, 0) + k["bytes_timeline"][i]
            assert held == {(tr, s): gqa_kv_bytes(LLAMA, LLAMA.n_layer // p, t, tokens)
                            for tr in range(t) for s in range(p)}, (run["mesh"], run["kv_moments"][i])
        if t == 4:  # past n_kv_head: every rank holds as much as GPT-2's rank of tp=4 (one head)
            peak = run["kv_peak_tokens"]
            assert all(k["peak_bytes"] == kv_cache_bytes(LLAMA.n_layer, LLAMA.n_head, LLAMA.head_size,
                                                         peak, 8, shards=4) for k in run["kv_cache"])


def test_kv_closed_form_per_rank_adds_up_and_splits_evenly():
    cached = [13, 4, 22]
    L, nh, hs, b = CONFIG.n_layer, CONFIG.n_head, CONFIG.head_size, 8
    total = kv_cache_bytes(L, nh, hs, sum(cached), b)
    for sizes in ({"tp": 2, "cp": 2, "pp": 1}, {"tp": 4, "cp": 1, "pp": 2}, {"tp": 1, "cp": 3, "pp": 4}):
        ranks = [{"tp": t, "cp": c, "pp": p} for t in range(sizes["tp"]) for c in range(sizes["cp"])
                 for p in range(sizes["pp"])]
        assert sum(kv_bytes_per_rank(CONFIG, cached, sizes, r) for r in ranks) == total
    even = {"tp": 2, "cp": 2, "pp": 2}
    assert kv_bytes_per_rank(CONFIG, [16, 8], even, {"tp": 1, "cp": 0, "pp": 1}) == \
        kv_cache_bytes(L, nh, hs, 24, b, shards=8)


def test_sampling_is_keyed_by_request_and_position_and_top_1_is_greedy():
    logits = np.linspace(-1.0, 2.0, CONFIG.vocab_size)[::-1].copy()
    s = Sampling(temperature=1.0, seed=3)
    assert sample_token(logits, s, 4, 9) == sample_token(logits.copy(), s, 4, 9)
    draws = {sample_token(logits, s, rid, 9) for rid in range(40)}
    assert len(draws) > 5, "different requests draw different numbers"
    assert sample_token(logits, Sampling(temperature=2.0, top_k=1), 0, 1) == int(np.argmax(logits))


def test_70b_on_8_gpus_holds_about_17_gb_each_and_tp_beats_pp_on_latency():
    spec, hw = preset("llama2-70b"), hardware("h100")
    tp = decode_estimate(spec, hw, tp=8)
    pp = decode_estimate(spec, hw, pp=8)
    assert 16.5e9 < tp["weights_bytes_per_gpu"] == pp["weights_bytes_per_gpu"] < 17.6e9
    # 8 KV heads of 128 over tp=8: 2 * 80 layers * 1 head * 128 * 2 bytes per cached token
    assert tp["kv_bytes_per_token_per_gpu"] == 2 * 80 * 1 * 128 * 2
    assert tp["decode_s_per_token"] < pp["decode_s_per_token"]
    assert pp["decode_tokens_per_s"] > tp["decode_tokens_per_s"], "pp's requests in flight"
    across = decode_estimate(spec, hw, tp=16)
    assert across["tp_link"] == "infiniband" and across["decode_comm_s"] > tp["decode_comm_s"]


def test_bad_requests_get_one_sentence():
    with pytest.raises(ConfigError, match="longer than the context"):
        check_requests(CONFIG, [Request(0, tuple(range(40)), 1)])
    with pytest.raises(ConfigError, match="at most 3 new tokens"):
        check_requests(CONFIG, [Request(0, tuple(range(30)), 5)])
    with pytest.raises(ConfigError, match="unknown sampling option"):
        parse_sampling("temperature=0.5,nucleus=0.9")
    for args in (["--prompt-lens", "40"], ["--sampling", "temp=0.5"], ["--mesh", "dp=2"],
                 ["--paged", "--block-size", "4", "--kv-blocks", "3"]):  # 20 + 6 - 1 positions: 7 blocks
        proc = subprocess.run([sys.executable, "-m", "refpar", "generate", *args], cwd=ROOT,
                              env=mpi_env(), capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("refpar generate: error: ")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for args, says in ((["--paged", "--block-size", "0"], "1 to 32 token slots"),
                       (["--paged", "--block-size", "33"], "1 to 32 token slots"),
                       (["--paged", "--kv-blocks", "0"], "at least 1 block per rank"),
                       (["--prefix-sharing"], "add --paged or leave --prefix-sharing out")):
        with pytest.raises(ConfigError, match=says):
            paging_from_args(parser.parse_args(args), CONFIG.n_positions)


def test_generate_command_reports_and_checks_on_one_device():
    proc = subprocess.run([sys.executable, "-m", "refpar", "generate", "--check", "--json"], cwd=ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tokens_match_reference"] and within(summary["max_logit_rel_diff"], CONTRACT)
    assert summary["kv_cache"][0]["peak_bytes"] == summary["kv_closed_form_at_peak"]
    assert "ms per token" in proc.stdout and "llama2-70b" in proc.stdout


def test_kv_cache_figure_stacks_each_ranks_ledger_bytes_by_request(parallel_runs):
    from refpar.viz.serving import kv_cache_figure

    run = next(r for r in parallel_runs if r["mesh"] == {"tp": 1, "cp": 4, "pp": 1})
    fig = kv_cache_figure(run)
    for k in run["kv_cache"]:
        bars = [t for t in fig.data if t.type == "bar" and t.xaxis == ("x" if k["rank"] == 0
                                                                         else f"x{k['rank'] + 1}")]
        assert len(bars) == len(run["requests"])
        stacked = [sum(int(b.y[i]) for b in bars) for i in range(len(run["kv_moments"]))]
        assert stacked == k["bytes_timeline"] == k["expected_bytes_timeline"]


def test_comm_figure_bars_are_traced_bytes_per_token_and_diamonds_the_closed_form(parallel_runs):
    from refpar.viz.serving import comm_per_token_figure

    run = next(r for r in parallel_runs if r["mesh"] == {"tp": 2, "cp": 1, "pp": 2})
    fig = comm_per_token_figure(run)
    bars = [t for t in fig.data if t.type == "bar"]
    marks = [t for t in fig.data if t.type == "scatter"]
    assert {b.name for b in bars} >= {"decode tp all_reduce", "decode pp send", "prefill pp broadcast"}
    for bar, mark in zip(bars, marks, strict=True):
        assert list(bar.y) == list(mark.y), bar.name
    decode = run["latency"]["decode"]["tokens"]
    sent = sum(r["bytes_sent"] for r in run["comm_bytes"]
               if (r["rank"], r["phase"], r["axis"], r["op"]) == (0, "decode", "tp", "all_reduce"))
    assert next(b for b in bars if b.name == "decode tp all_reduce").y[0] == sent / decode


# ---------------------------------------------------------------------------------- the paged cache
def paged_pairs(runs):
    """(contiguous run, paged run of the same mesh and requests) of a serving job."""
    contiguous = [r for r in runs if r["paged"] is None]
    return [(next(c for c in contiguous if c["mesh"] == p["mesh"]), p) for p in runs
            if p["paged"] is not None and not p["paged"]["prefix_sharing"]]


@pytest.mark.parametrize("job", ["gpt2_job", "llama_job"])
def test_paged_cache_gives_the_contiguous_caches_tokens_and_logits_on_tp_cp_and_pp(job, request):
    """The attention reads the same keys in the same order through the block tables, so without
    preemption the logits are bitwise those of the contiguous cache (equal sha256 of every row); a
    preempted request's recomputed prefill sums in another batch, so there: the float64 contract."""
    pairs = paged_pairs(request.getfixturevalue(job))
    assert {(p["mesh"]["tp"], p["mesh"]["cp"], p["mesh"]["pp"]) for _, p in pairs} == {(2, 2, 1), (2, 1, 2)}
    for contiguous, paged in pairs:
        assert [r["tokens"] for r in paged["requests"]] == [r["tokens"] for r in contiguous["requests"]]
        assert paged["tokens_match_reference"] and within(paged["max_logit_rel_diff"], CONTRACT)
        if not paged["paged"]["preemptions"]:
            assert paged["logits_sha256"] == contiguous["logits_sha256"], paged["mesh"]
    assert any(p["paged"]["preemptions"] for _, p in pairs) == (job == "llama_job")


@pytest.mark.parametrize("job", ["gpt2_job", "llama_job"])
def test_paged_pool_holds_ceil_positions_over_block_size_per_request_on_every_rank(job, request):
    """After every pass and step, each rank's pool holds sum ceil(n_r / 4) blocks for the positions
    n each request has blocks for (n_r: the rank's striped share), the ledger counts those blocks'
    bytes, and the waste is each request's last block: below 4 slots per request."""
    for _, paged in paged_pairs(request.getfixturevalue(job)):
        c = paged["mesh"]["cp"]
        for rank in paged["paged"]["pool"]:
            cr = rank["coords"]["cp"]
            kv = next(k for k in paged["kv_cache"] if k["rank"] == rank["rank"])
            for i, held in enumerate(rank["reserved"]):
                slots = [len(range(cr, n, c)) for n in held.values()]  # positions p % c == cr
                assert rank["blocks"][i] == sum(-(-n // 4) for n in slots), (paged["mesh"], i)
                assert kv["bytes_timeline"][i] == rank["blocks"][i] * rank["block_bytes"]
                assert rank["wasted_slots"][i] == 4 * rank["blocks"][i] - sum(slots) < 4 * max(len(held), 1)
        assert paged["kv_matches_closed_form"]


def test_prefix_sharing_saves_the_system_prompts_whole_blocks_and_preemption_keeps_the_tokens(gpt2_job):
    """Four requests start with the same 10 tokens (5 positions on each cp rank: one whole block of 4
    and a partly filled one). k live requests hold the whole block once: (k - 1) blocks saved on
    every rank at every moment; each one's first write into the partly filled block copies it. The
    pool of 5 blocks makes requests wait and be preempted; tokens and logits are still the single
    device's."""
    run = next(r for r in gpt2_job if r["paged"] is not None and r["paged"]["prefix_sharing"])
    prompts = {str(r["rid"]): r for r in run["requests"]}
    assert run["tokens_match_reference"] and within(run["max_logit_rel_diff"], CONTRACT)
    assert run["paged"]["preemptions"], "the pool of 5 blocks is too small for every request at once"
    chat = make_requests(CONFIG, [3, 5, 2, 6], [8, 4, 5, 3], [0, 1, 2, 2], seed=5, system_prompt=10)
    for a in chat:
        for b in chat:
            if a.rid != b.rid:  # the prompts share exactly the system prompt
                assert a.prompt[:10] == b.prompt[:10] and a.prompt[10] != b.prompt[10]
    assert len(prompts) == 4
    for rank in run["paged"]["pool"]:
        cr = rank["coords"]["cp"]
        for i, held in enumerate(rank["reserved"]):
            unshared = sum(-(-len(range(cr, n, 2)) // 4) for n in held.values())
            saved = max(len(held) - 1, 0) * (len(range(cr, 10, 2)) // 4)
            assert rank["blocks"][i] == unshared - saved, (rank["rank"], run["kv_moments"][i])
            assert rank["blocks"][i] <= run["paged"]["kv_blocks"] == 5
        assert rank["copies"] > 0, "the partly filled block is copied on write"


def test_block_pool_figure_colours_each_block_by_a_holder_and_names_every_holder(gpt2_job):
    from refpar.viz.serving import block_pool_figure

    run = next(r for r in gpt2_job if r["paged"] is not None and r["paged"]["prefix_sharing"])
    heat = block_pool_figure(run, rank=1).data[0]
    tables = next(p for p in run["paged"]["pool"] if p["rank"] == 1)["tables"]
    shared_seen = False
    assert len(heat.z[0]) == 1 + max(b for held in tables for t in held.values() for b in t)
    for i, held in enumerate(tables):
        for b in range(len(heat.z[i])):
            holders = [int(rid) for rid, table in held.items() if b in table]
            assert (heat.z[i][b] in holders) if holders else heat.z[i][b] is None
            assert heat.text[i][b].count("request") == len(holders) if holders else heat.text[i][b] == "free"
            shared_seen |= len(holders) > 1
    assert shared_seen, "the system prompt's block is drawn with its holders"
