"""`refpar generate`: serve GPT-2, Llama or DeepSeek-V3 with a KV cache and continuous batching, on one
device or a mesh.

    refpar generate --from runs/text --prompt "Data parallelism" --max-new-tokens 200
    mpiexec -n 2 python -m refpar generate --from runs/text --mesh tp=2 --prompt "ZeRO" --check
    refpar generate --check
    mpiexec -n 2 python -m refpar generate --mesh tp=2 --check
    mpiexec -n 4 python -m refpar generate --model llama-tiny --mesh tp=4 --check
    mpiexec -n 2 python -m refpar generate --model deepseek-tiny --mesh pp=2 --check
    mpiexec -n 2 python -m refpar generate --mesh cp=2 --prompt-lens 24,30 --new-tokens 3
    mpiexec -n 2 python -m refpar generate --mesh pp=2 --sampling temperature=0.8,top_k=20 --json
    mpiexec -n 2 python -m refpar generate --mesh tp=2 --paged --block-size 4 --kv-blocks 12 \
        --system-prompt 10 --prompt-lens 3,5,2,6 --prefix-sharing --check

--from loads trained weights (a refpar checkpoint, or a Hugging Face model folder: refpar/weights.py)
and the tokenizer saved beside them, so --prompt is text and the output is text; without --from the
weights are random (the first line says so). Without --prompt, requests get prompts of token ids from
the Markov corpus; each arrives at an engine step (--arrivals) and takes one of --max-batch slots
until its tokens are out. The report gives tokens, per-token latency of
prefill and decode, bytes per token by axis, the KV cache each rank holds (measured by the
MemoryLedger) next to its closed form and to what multi-head K/V would take (DeepSeek-V3's latent
cache: refpar/serving/latent_attention.py), and the same closed forms for a large model on real GPUs.
--paged keeps the cache in blocks (refpar/serving/paged.py): one progress line per engine step,
then the pool's blocks, used and wasted slots per rank.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from contextlib import nullcontext

HELP = ("generate tokens with a KV cache (tp, cp or pp decoding, continuous batching); report latency, "
        "bytes, KV memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None, help="tp=T,cp=C,pp=P (default: one device)")
    parser.add_argument("--from", dest="source", default=None, metavar="CKPT_OR_HF_DIR",
                        help="trained weights: a refpar checkpoint (DIR or DIR/step-N, from refpar train "
                             "--save) or a Hugging Face model folder (config.json + model.safetensors); "
                             "default: random weights drawn from --seed")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a prompt in words, tokenized by the weights' tokenizer (the tokenizer.json "
                             "beside them, or --tokenizer); repeat it for several requests")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help="tokens to generate for every request (default: --new-tokens)")
    parser.add_argument("--tokenizer", default=None, metavar="KIND",
                        help="for --prompt where the weights carry no tokenizer: bytes, gpt2 or the path "
                             "of a tokenizer.json")
    parser.add_argument("--model", default=None,
                        help="model preset: tiny, small, llama-tiny, llama-small, deepseek-tiny or "
                             "deepseek-small (default tiny); with --from, only for a bare .safetensors file")
    parser.add_argument("--dtype", default=None, help="float64 or float32 (default: the preset's)")
    parser.add_argument("--prompt-lens", default="12,5,20,8", help="prompt length of each request")
    parser.add_argument("--system-prompt", type=int, default=0,
                        help="tokens every prompt starts with, before its own --prompt-lens (0)")
    parser.add_argument("--new-tokens", default="6",
                        help="tokens to generate: one for all, or one per request")
    parser.add_argument("--arrivals", default="0,0,1,3", help="engine step each request arrives at")
    parser.add_argument("--max-batch", type=int, default=3, help="requests served at once (default 3)")
    parser.add_argument("--sampling", default="greedy", help="greedy or temperature=T,top_k=K")
    parser.add_argument("--seed", type=int, default=1234, help="seeds the weights, prompts and sampling")
    parser.add_argument("--check", action="store_true",
                        help="compare with one device recomputing the whole sequence for every token")
    parser.add_argument("--paged", action="store_true",
                        help="keep the KV cache in blocks with block tables (vLLM's PagedAttention)")
    parser.add_argument("--block-size", type=int, default=None, help="--paged: token slots per block (16)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="--paged: blocks per rank (default: enough for every request at once); a "
                             "smaller pool preempts requests and recomputes them")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="--paged: requests starting with cached tokens share their blocks")
    parser.add_argument("--hardware", default="h100", help="GPU of the at-scale estimate (a100, h100, h200)")
    parser.add_argument("--scale-model", default="llama2-70b", help="model preset of the at-scale estimate")
    parser.add_argument("--scale-gpus", type=int, default=8, help="GPUs of one node in the estimate (8)")
    parser.add_argument("--scale-batch", type=int, default=1, help="requests decoded together (1)")
    parser.add_argument("--scale-context", type=int, default=4096, help="cached tokens per request (4096)")
    parser.add_argument("--figure", metavar="PATH", default=None,
                        help="also write each rank's KV cache over the run as an HTML figure")
    from refpar.config import add_overwrite_argument

    add_overwrite_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary last")


def int_list(text: str, what: str) -> list[int]:
    from refpar.config import ConfigError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} {text!r} must be whole numbers separated by commas, e.g. 12,5") from None
    if not values:
        raise ConfigError(f"{what} is empty; give at least one number")
    return values


def weights_and_tokenizer(args):
    """(ModelConfig, whole parameters or None for random ones, tokenizer or None) of --from, --model,
    --dtype and --tokenizer; every rank reads the same files, so every rank refuses alike."""
    from refpar.config import ConfigError, model_preset

    params, tokenizer = None, None
    if args.source is not None:
        from refpar.data.tokenizers import load_tokenizer
        from refpar.weights import find_tokenizer, load_model

        config, params = load_model(args.source, preset=args.model, dtype=args.dtype)
        found = find_tokenizer(args.source)
        tokenizer = load_tokenizer(found) if found is not None else None
    else:
        dtype = {"dtype": args.dtype} if args.dtype is not None else {}
        config = model_preset(args.model or "tiny", **dtype)
    if args.tokenizer is not None:
        from refpar.data.tokenizers import make_tokenizer

        if args.tokenizer == "bpe":
            raise ConfigError("--tokenizer bpe is trained on a corpus by refpar train; give the "
                              "tokenizer.json that run saved beside its checkpoints")
        tokenizer = make_tokenizer(args.tokenizer, tuple, None)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} tokens but the model "
                          f"only {config.vocab_size}; give the tokenizer these weights were trained with")
    return config, params, tokenizer


def trained_seq_len(source) -> int | None:
    """The sequence length a refpar checkpoint's run trained on (None: random weights or an HF folder)."""
    from refpar.weights import is_refpar_checkpoint

    if source is None or not is_refpar_checkpoint(source):
        return None
    from refpar.checkpoint import read_manifest

    return int(read_manifest(source)["train"]["seq_len"])


def requests_of(args, config, tokenizer) -> list:
    """The requests: each --prompt tokenized, arriving at once; else --prompt-lens prompts drawn from
    the Markov corpus, arriving at --arrivals. --max-new-tokens, if given, for every request."""
    from refpar.config import ConfigError
    from refpar.serving.requests import Request, check_requests, make_requests

    new = int_list(args.new_tokens, "--new-tokens") if args.max_new_tokens is None else [args.max_new_tokens]
    if not args.prompt:
        return make_requests(config, int_list(args.prompt_lens, "--prompt-lens"), new,
                             int_list(args.arrivals, "--arrivals"), args.seed, args.system_prompt)
    if tokenizer is None:
        where = (f"the weights at {args.source} have no tokenizer.json beside them (a run on the Markov "
                 "corpus trains on token ids)" if args.source else "random weights have no tokenizer")
        raise ConfigError(f"--prompt is text, but {where}; give --tokenizer bytes, gpt2 or a tokenizer.json, "
                          "or --prompt-lens for prompts of token ids")
    if len(new) != 1:
        raise ConfigError("with --prompt give one number of new tokens (--max-new-tokens N) for every prompt")
    requests = [Request(i, tuple(int(t) for t in tokenizer.encode(text)), new[0], 0)
                for i, text in enumerate(args.prompt)]
    check_requests(config, requests)
    return requests


def paging_from_args(args, n_positions: int):
    """--paged and its options as a Paging (None: the contiguous cache); its options alone are refused."""
    from refpar.config import ConfigError
    from refpar.serving.paged import Paging

    if not args.paged:
        for flag, given in (("--block-size", args.block_size is not None),
                            ("--kv-blocks", args.kv_blocks is not None),
                            ("--prefix-sharing", args.prefix_sharing)):
            if given:
                raise ConfigError(f"{flag} sets up the paged cache; add --paged or leave {flag} out")
        return None
    paging = Paging(16 if args.block_size is None else args.block_size, args.kv_blocks, args.prefix_sharing)
    paging.check(n_positions)
    return paging


def run(args) -> int:
    from refpar.analysis.hardware import hardware
    from refpar.analysis.presets import preset
    from refpar.analysis.serving import serving_table
    from refpar.checkpoint import decide_resume
    from refpar.comm.communicator import abort_on_error, world
    from refpar.config import ConfigError, ParallelConfig, check_output_path, parse_mesh
    from refpar.mesh import check_job_size
    from refpar.serving.batching import check_serving
    from refpar.serving.paged import pool_blocks
    from refpar.serving.runner import ServeOptions, run_serving
    from refpar.serving.sampling import parse_sampling
    from refpar.weights import is_refpar_checkpoint

    sizes = ParallelConfig(parse_mesh(args.mesh) if args.mesh is not None else {}).sizes
    comm = world()
    if args.source is not None and comm.size > 1 and is_refpar_checkpoint(args.source):
        # rank 0 picks the step of a run directory, as train's --resume does: each rank listing the
        # directory itself while a save lands could load another step (issue 43)
        args.source = decide_resume(args.source, comm)
    config, params, tokenizer = weights_and_tokenizer(args)
    paging = paging_from_args(args, config.n_positions)
    check_serving(config, sizes, args.max_batch)
    sampling = parse_sampling(args.sampling, args.seed)  # first: it checks the seed the prompts use
    requests = requests_of(args, config, tokenizer)
    if paging is not None:
        pool_blocks(paging, requests, sizes["cp"])  # refuses a pool too small for the longest request
    spec, hw = preset(args.scale_model), hardware(args.hardware)
    for name in ("scale_gpus", "scale_batch", "scale_context"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.figure is not None:
        check_output_path("--figure", args.figure, overwrite=args.overwrite)
    scale = serving_table(spec, hw, gpus=args.scale_gpus, batch=args.scale_batch,
                          context=args.scale_context)
    check_job_size(sizes, comm.size)  # the last check every rank makes alike, before any message
    # From the first message on, an error on one rank must end every rank, not leave the others
    # waiting in a collective (refpar.cli returns 2 from each rank only for the checks above).
    with abort_on_error() if comm.size > 1 else nullcontext():
        summary = run_serving(comm, sizes, config, requests, sampling,
                              ServeOptions(args.max_batch, args.seed, args.check, paging,
                                           progress=paging is not None), params)
    if summary is None:
        return 0
    summary["weights"] = {"from": args.source, "seed": None if args.source else args.seed,
                          "tokenizer": None if tokenizer is None else tokenizer.name,
                          "trained_seq_len": trained_seq_len(args.source)}
    if tokenizer is not None:  # the text of each prompt and of what followed it
        prompts = {r.rid: r.prompt for r in requests}
        for r in summary["requests"]:
            r["prompt_text"] = tokenizer.decode(list(prompts[r["rid"]]))
            r["text"] = tokenizer.decode(r["tokens"])
    summary["scale"] = {"model": spec.name, "hardware": hw.name, "precision": "float16",
                        "batch": args.scale_batch, "context": args.scale_context, "layouts": scale}
    print_report(summary)
    if args.figure:
        from refpar.files import write_atomically
        from refpar.viz.serving import kv_cache_figure

        figure = kv_cache_figure(summary)
        write_atomically(args.figure, lambda f: f.write(figure.to_html(include_plotlyjs=True).encode()))
    # float32 logits differ from the single device's in the reduction order of the merged heads,
    # partial sums and log-sum-exp merges: ~1e-7 relative, so the check allows 1e-4 there.
    tol = 1e-10 if config.dtype == "float64" else 1e-4
    ok = not args.check or (summary["tokens_match_reference"] and summary["max_logit_rel_diff"] <= tol)
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def print_report(s: dict) -> None:
    from refpar.holdings import FAMILIES

    w = s["weights"]
    if w["from"] is None:
        print(f"weights: random, drawn from --seed {w['seed']} (untrained: give --from CKPT_OR_HF_DIR, a "
              "checkpoint refpar train --save wrote or a Hugging Face folder, for trained ones)", flush=True)
    else:
        print(f"weights: {w['from']}; tokenizer: " + (w["tokenizer"] or "none (prompts and output are "
                                                        "token ids)"), flush=True)
    longest = max(r["prompt_len"] + len(r["tokens"]) - 1 for r in s["requests"])
    trained = w["trained_seq_len"]
    family = FAMILIES[s["model"]["arch"]]
    if trained is not None and longest > trained and family.positions:  # a learned position table
        print(f"note: a sequence here reaches {longest} positions; the run trained on {trained}, so "
              f"{family.title}'s learned position embeddings past those are untrained (ask for fewer tokens, "
              "or train with a longer --seq-len)", flush=True)
    mesh = "-".join(f"{a.upper()}({n})" for a, n in s["mesh"].items() if n > 1) or "one device"
    print(f"refpar generate: {len(s['requests'])} requests on {mesh} ({s['world_size']} ranks), "
          f"{s['sampling']}, at most {s['max_batch']} at once, {s['steps']} engine steps", flush=True)
    for r in s["requests"]:
        head = f"  request {r['rid']}: prompt {r['prompt_len']} tokens, arrives at step {r['arrival']}"
        if "text" not in r:
            print(f"{head} -> " + " ".join(map(str, r["tokens"])))
            continue
        print(f"{head}, {len(r['tokens'])} new tokens:")  # the prompt, then what the model wrote
        print(textwrap.indent(r["prompt_text"] + r["text"], "    ", lambda line: True))
    pre, dec = s["latency"]["prefill"], s["latency"]["decode"]
    print(f"tokens generated: {s['tokens_generated']}")
    print(f"latency: prefill {pre['prompt_tokens']} prompt tokens in {pre['passes']} passes, "
          f"{1e3 * pre['s_per_token']:.2f} ms per prompt token; decode {dec['passes']} passes, "
          f"{1e3 * dec['s_per_step']:.2f} ms per token of each running request")
    per = ", ".join(f"{k} {v:.0f} B" for k, v in sorted(s["bytes_per_token"].items())) or "none (one device)"
    print(f"bytes sent per token (busiest rank, by axis:phase): {per}")
    print(f"traced bytes == closed forms (every rank, phase, axis, op): "
          f"{'yes' if s['comm_matches_closed_form'] else 'NO'}")
    kv = s["kv_cache"]
    print("KV cache per rank, measured by the ledger (peak): "
          + ", ".join(f"rank {k['rank']} {k['peak_bytes']} B" for k in kv)
          + "; matches the closed form after every pass and step: "
          + ("yes" if s["kv_matches_closed_form"] else "NO"))
    if s["kv_latent"]:  # MLA: one entry per token per layer, whole on every tp rank
        m = s["model"]
        print(f"  layers · (kv_lora_rank + qk_rope_head_dim) · tokens · bytes / shards at the peak of "
              f"{s['kv_peak_tokens']} cached tokens, {m['kv_lora_rank']} + {m['qk_rope_head_dim']} numbers "
              f"over {s['kv_shards']} shards (cp · pp; every tp rank keeps the whole latent) = "
              f"{s['kv_closed_form_at_peak']:.0f} B")
    else:
        print(f"  2 · layers · kv_heads · head_dim · tokens · bytes / shards at the peak of "
              f"{s['kv_peak_tokens']} cached tokens, {s['kv_heads']} kv heads over {s['kv_shards']} shards "
              f"(min(tp, kv_heads) · cp · pp) = {s['kv_closed_form_at_peak']:.0f} B")
    print(f"  per token per layer {s['kv_bytes_per_token_per_layer']} B; multi-head K/V of its "
          f"{s['model']['n_head']} heads would take {s['kv_multi_head_bytes_per_token_per_layer']} B: "
          f"ratio {s['kv_ratio_to_multi_head']:.3f}")
    if s["max_logit_rel_diff"] is not None:
        print(f"check against one device recomputing every sequence: max logit rel diff "
              f"{s['max_logit_rel_diff']:.1e}, tokens identical: "
              f"{'yes' if s['tokens_match_reference'] else 'NO'}")
    if s["paged"] is not None:
        print_pool(s)
    sc = s["scale"]
    print(f"at scale, {sc['model']} in {sc['precision']} on {sc['hardware']} (closed forms; batch "
          f"{sc['batch']}, context {sc['context']}):")
    print(f"  {'layout':30} {'GPUs':>4} {'weights/GPU':>12} {'KV/GPU':>9} {'B/token':>9} "
          f"{'prefill ms/tok':>14} {'decode ms/tok':>13} {'tokens/s':>9}")
    for row in sc["layouts"]:
        moved = row["tp_bytes_per_token"] + row["pp_bytes_per_token"]
        print(f"  {row['layout'] + ' (' + row['tp_link'] + ')':30} {row['gpus']:>4} "
              f"{row['weights_bytes_per_gpu'] / 1e9:>9.1f} GB {row['kv_bytes_per_gpu'] / 1e9:>6.2f} GB "
              f"{moved:>9.0f} {1e3 * row['prefill_s_per_token']:>14.3f} "
              f"{1e3 * row['decode_s_per_token']:>13.2f} {row['decode_tokens_per_s']:>9.0f}")
    print("  tp divides each token's weight read by the GPUs; pp only pipelines requests (more "
          "tokens/s, same latency); tp across nodes pays 2 · layers all-reduces per token over "
          "InfiniBand", flush=True)


def print_pool(s: dict) -> None:
    p = s["paged"]
    print(f"paged KV cache: blocks of {p['block_size']} slots, {p['kv_blocks']} blocks per rank"
          + (", prefix sharing" if p["prefix_sharing"] else "")
          + f"; {len(p['preemptions'])} preemption{'s' * (len(p['preemptions']) != 1)}"
          + "".join(f" (step {step}: request {rid})" for step, rid in p["preemptions"]))
    for r in p["pool"]:
        peak = max(range(len(r["blocks"])), key=lambda i: r["blocks"][i])
        print(f"  rank {r['rank']}: at most {r['blocks'][peak]} blocks "
              f"({r['blocks'][peak] * r['block_bytes']} B), "
              f"{r['used_slots'][peak]} slots used and {r['wasted_slots'][peak]} wasted then; "
              f"{r['copies']} copy-on-write copies; ceil(positions / block) per request would take "
              f"{r['blocks_closed_form_unshared'][peak]} blocks")
    shared = {k: v for k, v in p["shared_positions"].items() if v}
    if shared:
        print("  shared prefixes (positions taken from a cached request): "
              + ", ".join(f"request {k} {v}" for k, v in shared.items()), flush=True)
