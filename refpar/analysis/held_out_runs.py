"""Published measured runs the step-time model was never fitted to: the held-out set.

    refpar plan --validate --held-out

Kept apart from published_runs.RUNS (the calibration set, some of whose rows calibration.fit()
uses) so that nothing here can reach a fit: calibration.fit() and fit_error() read RUNS only, these
rows were chosen after the fractions of efficiency.CALIBRATED were fixed, and the pricing rules
(efficiency.Software presets) were written from what each framework documents, not tuned to them.
Each row says where its figure is written, what the source states and what is assumed
(`assumed`); `source_group` names the independent source, for leave-one-source-out summaries.

What stays out, and why: torchtitan's "selective layer" rows (activation checkpointing of every
other block) cannot be described by the planner's recomputation modes; its "selective op" rows are
priced with its per-op policy (recompute="selective-op", efficiency.op_checkpoint_gemms). Its H100
rows ran on 500 W, 96 GB HBM2e H100s whose peak its own note says is unknown, and most of them in
Float8.
"""

from __future__ import annotations

from dataclasses import replace

from refpar.analysis.efficiency import COMPOSER_FSDP_2023, DEEPSPEED_2022, TORCHTITAN_FSDP2
from refpar.analysis.presets import PRESETS, ModelSpec
from refpar.analysis.published_runs import Run

TORCHTITAN = ("torchtitan, docs/performance.md (github.com/pytorch/torchtitan, commit 0413364, 2024): "
              "\"Llama 3 performance numbers\" and \"Llama 2 performance numbers\", FSDP2 on 64 A100 (80GB)")
MT_NLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
          "(arXiv:2201.11990), Section 2.4 (system throughput: 60.1, 50.2 and 44.4 s per iteration, "
          "126, 121 and 113 TFLOP/s per GPU, on 280, 350 and 420 DGX A100 servers)")

# Llama 2 13B (Touvron et al. 2023, Table 1; Llama-2-13b config.json): 40 blocks, h = 5120, 40
# heads (no GQA), SwiGLU of width 13824, vocabulary 32,000, 4k context.
LLAMA2_13B = ModelSpec("llama2-13b", 40, 5120, 40, vocab_size=32000, seq_len=4096, global_batch=128,
                       d_ff=13824, mlp="swiglu", norm="rmsnorm", bias=False, tied_embeddings=False,
                       learned_positions=False, dropout=False,
                       source="Touvron et al. 2023, Table 1; Llama-2-13b config.json")
# MT-NLG 530B (Smith et al. 2022, its model configuration): 105 blocks, h = 20480, 128 heads,
# sequence 2048, batch 1920; GPT-2's BPE vocabulary of 50,257, which Megatron pads to a multiple of
# 128 x t = 1,024: 51,200 (as the GPT presets, Narayanan et al. 2021, Section 5.1). The shape of
# megatron-529.6b, with the batch of this run.
MT_NLG_530B = ModelSpec("mt-nlg-530b", 105, 20480, 128, vocab_size=51200, seq_len=2048, global_batch=1920,
                        source="Smith et al. 2022 (arXiv:2201.11990), model configuration")

TT_SOFTWARE = ("software torchtitan-fsdp2: SDPA's flash kernel, FSDP2 prefetching all-gathers and "
               "overlapping reduce-scatters, bf16 parameters with fp32 reduction (torchtitan's defaults); "
               "sequence 8192 for Llama 3 and 4096 for Llama 2 (the page: Llama 2's default sequence is "
               "half Llama 3's); A100 nodes taken as DGX A100 (8 GPUs, one 200 Gb/s adapter each), "
               "not stated; \"selective op\" checkpointing priced as refpar's selective (it saves the "
               "matmul and attention outputs and recomputes the cheap ops between them)")
MT_SOFTWARE = ("software deepspeed-2022: Megatron's tensor parallelism with its unfused attention, "
               "DeepSpeed's pipeline engine (1F1B, blocking sends, gradients reduced after the drain), "
               "bf16 with fp32 gradient accumulation and reduction; mesh tensor 8 x pipeline 35 with "
               "8, 10 and 12 replicas (Section 2: 8-way tensor and 35-way pipeline slicing); micro-batch "
               "not published (the best that fits); full activation checkpointing assumed (the paper "
               "names it; without it no micro-batch fits 80 GB)")


# Why rows are outside 15%, with the numbers (tests/test_planner_held_out.py recomputes them).
TORCHTITAN_OUTSIDE = (
    "outside 15%: the Llama 2 70B \"selective op\" row at local batch 1 is priced 25% fast (9.26 s "
    "against a measured 11.54 s). Its published throughput equals the full-recomputation row's at batch 2 "
    "(355 against 353 tokens/s/GPU), where per-op checkpointing reruns a third of the forward matmuls "
    "and full recomputation all of them; the page's footnote says batch 2 ran out of memory under it. "
    "The model prices the run at 63.0 GB and has no cost for running near the limit (the allocator's "
    "retries and frees), which is the likeliest difference, not shown.")
MPT_OUTSIDE = (
    "outside 15%, priced fast with nothing exposed but compute: MPT 7B on 8 A100 is priced at 4.36 s of "
    "compute against a measured 5.30 s step, on 8 H100 at 0.81 s against 1.15 s. Measured, this stack "
    "reached a near-constant fraction of the peak at every size from 1B to 70B (MFU 48-64% on A100, "
    "36-46% on H100); the model's GEMMs at the measured matmul rate (MAMF) give more, and the gap grows "
    "with the GPU's speed: A100 rows 9-26% fast, H100 rows 24-59%, as a cost that a faster GPU does not "
    "shrink would (per-kernel launch and synchronisation, or this stack's kernels short of the MAMF "
    "on Hopper). The source says nothing that tells them apart.")
MT_NLG_OUTSIDE = (
    "outside 15%: the three MT-NLG rows are priced 14-17% fast. The measured steps are 12.7 s a step "
    "plus 0.197 s a micro-batch (240, 192 and 160 of them on 8, 10 and 12 replicas), the model's 7.4 s "
    "plus 0.185 s: most of what is missing is per step, outside the pipeline's micro-batches (the "
    "bubble is priced 5.95 s, the data-parallel all-reduce 0.9 s).")
# Each row's bound: 15%, or where the model is outside it the error reached at this commit rounded
# up to the next 5% (a regression guard beside the note that says why, not a claim).
BOUNDS = {
    "torchtitan llama2-70b b=1 selective op on 64 A100": 0.25,
    "MT-NLG 530B on 3360": 0.20,
    "MPT 70b on 64 a100 mb=8 x 4 ckpt": 0.20,
    "MPT 70b on 32 a100 mb=2 x 16 ckpt": 0.25,
    "MPT 13b on 8 a100 mb=2 x 3": 0.30,
    "MPT 7b on 8 a100 mb=6 x 2": 0.25,
    "MPT 3b on 8 a100 mb=10 x 2": 0.25,
    "MPT 1b on 8 a100 mb=14 x 4": 0.25,
    "MPT 70b on 64 h100 mb=8 x 4 ckpt": 0.30,
    "MPT 70b on 32 h100 mb=2 x 16 ckpt": 0.45,
    "MPT 30b on 32 h100 mb=14 x 3 ckpt": 0.25,
    "MPT 30b on 16 h100 mb=10 x 3 ckpt": 0.30,
    "MPT 30b on 8 h100 mb=3 x 21 ckpt": 0.40,
    "MPT 13b on 64 h100 mb=2 x 1": 0.60,
    "MPT 13b on 32 h100 mb=2 x 1": 0.60,
    "MPT 13b on 16 h100 mb=2 x 1": 0.60,
    "MPT 13b on 8 h100 mb=2 x 1": 0.55,
    "MPT 7b on 8 h100 mb=6 x 1": 0.45,
    "MPT 3b on 64 h100 mb=6 x 3": 0.50,
    "MPT 3b on 32 h100 mb=6 x 3": 0.50,
    "MPT 3b on 16 h100 mb=10 x 3": 0.45,
    "MPT 1b on 64 h100 mb=20 x 1": 0.45,
    "MPT 1b on 32 h100 mb=20 x 1": 0.45,
    "MPT 1b on 16 h100 mb=20 x 1": 0.40,
    "MPT 1b on 8 h100 mb=14 x 1": 0.40,
}


def _bounded(runs: list[Run], note: str) -> list[Run]:
    """The runs with their bound (BOUNDS, else 15%), and `note` on those outside 15%."""
    return [replace(r, tolerance=BOUNDS.get(r.name, 0.15), outside=note if r.name in BOUNDS else "")
            for r in runs]


def _torchtitan() -> list[Run]:
    # (model, sequence, local batch, checkpointing, published tokens/s per GPU); global batch =
    # local batch x 64 FSDP ranks.
    rows = [(PRESETS["llama3-8b"], 8192, 1, "selective op", 2973),
            (PRESETS["llama3-70b"], 8192, 1, "full", 331),
            (LLAMA2_13B, 4096, 2, "no", 2162),
            (LLAMA2_13B, 4096, 2, "selective op", 1904),
            (PRESETS["llama2-70b"], 4096, 1, "selective op", 355),
            (PRESETS["llama2-70b"], 4096, 2, "full", 353)]
    recompute = {"no": "none", "selective op": "selective-op", "full": "full"}
    return [Run(f"torchtitan {spec.name} b={local} {ac} on 64 A100", TORCHTITAN, spec, "a100",
                {"dp": 64, "tp": 1, "pp": 1, "cp": 1}, 64 * local, seq, recompute[ac], False,
                TORCHTITAN_FSDP2, "tokens_per_gpu_s", tokens, fit=False, micro_batch=local, zero=3,
                precision="bf16", tolerance=0.15, assumed=TT_SOFTWARE, source_group="torchtitan")
            for spec, seq, local, ac, tokens in rows]


def _mt_nlg() -> list[Run]:
    rows = [(8, 60.1), (10, 50.2), (12, 44.4)]
    return [Run(f"MT-NLG 530B on {8 * 35 * dp}", MT_NLG, MT_NLG_530B, "a100",
                {"dp": dp, "tp": 8, "pp": 35, "cp": 1}, 1920, 2048, "full", False, DEEPSPEED_2022,
                "step_s", seconds, fit=False, schedule="1f1b", tolerance=0.15, assumed=MT_SOFTWARE,
                source_group="mt-nlg")
            for dp, seconds in rows]


MPT = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md (github.com/mosaicml/llm-foundry, "
       "commit 061f2c7, 2023): \"MPT Training Benchmarks\", tables \"H100 80GB BF16\" and \"A100 80GB with "
       "1600 Gbps node-node interconnect (RoCE)\", column Throughput (T/s/GPU)")
# The MPT shapes of llm-foundry's yamls (d_model, heads, layers; vocabulary 50,368; GELU MLP of
# width 4h, LayerNorm and biases, tied head, no dropout) with learned positions: with these,
# flops.param_counts gives each row's published NumParams exactly (tests/test_planner_held_out.py).
MPT_SHAPES = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
              "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_SOFTWARE = ("software composer-fsdp-2023: PyTorch FSDP FULL_SHARD (ZeRO-3 over every GPU, as the "
                "table states) with backward prefetch, flash attention (the README: \"our models use Flash "
                "Attention\"), gradients reduced in bf16 (\"PURE\" states it; for \"DEFAULT\" assumed), "
                "no fused gradient accumulation; Activation Checkpointing True priced as full "
                "recomputation; the H100 nodes' network not stated (DGX H100 assumed)")


def mpt_spec(size: str, seq: int, batch: int) -> ModelSpec:
    """An MPT benchmark model of llm-foundry's yamls at the row's sequence (its learned positions)."""
    h, a, L = MPT_SHAPES[size]
    return ModelSpec(f"mpt-{size}", L, h, a, vocab_size=50368, seq_len=seq, global_batch=batch, dropout=False,
                     source="llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml")


def _mpt() -> list[Run]:
    # Every row at sequence 2048 of a model of 1B parameters or more (the planner's scale), from the
    # two BF16 tables: (hardware, size, GPUs, micro-batch, accumulation, checkpointing, tokens/s/GPU,
    # published NumParams). Global batch = micro-batch x accumulation x GPUs, as the table's column.
    rows = [("a100", "70b", 64, 8, 4, True, 410), ("a100", "70b", 32, 2, 16, True, 373),
            ("a100", "30b", 8, 3, 21, True, 916), ("a100", "13b", 8, 2, 3, False, 2262),
            ("a100", "7b", 8, 6, 2, False, 4641), ("a100", "3b", 8, 10, 2, False, 10811),
            ("a100", "1b", 8, 14, 4, False, 20513),
            ("h100", "70b", 64, 8, 4, True, 1039), ("h100", "70b", 32, 2, 16, True, 882),
            ("h100", "30b", 32, 14, 3, True, 2308), ("h100", "30b", 16, 10, 3, True, 2263),
            ("h100", "30b", 8, 3, 21, True, 2002), ("h100", "13b", 64, 2, 1, False, 4800),
            ("h100", "13b", 32, 2, 1, False, 4811), ("h100", "13b", 16, 2, 1, False, 4767),
            ("h100", "13b", 8, 2, 1, False, 4792), ("h100", "7b", 8, 6, 1, False, 10643),
            ("h100", "3b", 64, 6, 3, False, 22525), ("h100", "3b", 32, 6, 3, False, 23021),
            ("h100", "3b", 16, 10, 3, False, 24142), ("h100", "1b", 64, 20, 1, False, 44402),
            ("h100", "1b", 32, 20, 1, False, 45130), ("h100", "1b", 16, 20, 1, False, 46037),
            ("h100", "1b", 8, 14, 1, False, 45455)]
    return [Run(f"MPT {size} on {gpus} {hw} mb={micro} x {accum}{' ckpt' if ckpt else ''}", MPT,
                mpt_spec(size, 2048, micro * accum * gpus), hw, {"dp": gpus, "tp": 1, "pp": 1, "cp": 1},
                micro * accum * gpus, 2048, "full" if ckpt else "none", False, COMPOSER_FSDP_2023,
                "tokens_per_gpu_s", tokens, fit=False, micro_batch=micro, zero=3, precision="bf16",
                tolerance=0.15, assumed=MPT_SOFTWARE, source_group="llm-foundry")
            for hw, size, gpus, micro, accum, ckpt, tokens in rows]


HELD_OUT: list[Run] = (_bounded(_torchtitan(), TORCHTITAN_OUTSIDE) + _bounded(_mt_nlg(), MT_NLG_OUTSIDE)
                       + _bounded(_mpt(), MPT_OUTSIDE))
