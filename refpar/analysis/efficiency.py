"""How long the work of one transformer block takes on one GPU: the planner's efficiency model.

Legend as in refpar/analysis/scale.py: h = d_model, kv K/V width, f MLP width, a heads, hd = h / a,
b micro-batch, s sequence, c context-parallel size, t tensor-parallel size, n = b s / c tokens on
a rank, e bytes per activation element.

One model prices every plan of a search and every published run of refpar/analysis/published_runs.py
(calibration.py holds them against it).
Its ingredients, each with its source or measurement:

- GEMMs run at the accelerator's measured maximum achievable matmul rate (`Hardware.matmul_rate`,
  the MAMF table) times `Efficiency.matmul`, the fraction of it a training job sustains (fitted).
  The shape enters twice. A GEMM's output is cut into 256 x 128 tiles (the typical cuBLAS tile,
  NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, Section 2.3) that the SMs
  take in waves, the last one partly empty (Section 3.2, "Wave Quantization"); the model charges
  half a wave for it, its average over tile counts. A GEMM whose operands take longer to move than
  its FLOPs to compute is memory bound (the roofline, Williams et al. 2009).
- The attention core: fused (FlashAttention, Dao et al. 2022) it computes the causal half of the
  scores at `Hardware.flash_fraction` of the peak, backward 2.5 times the forward (five matmuls
  against two: FlashAttention-2, Dao 2023, Algorithm 2); unfused (Megatron-LM 2021-22:
  Narayanan et al. 2021, Section 4.2) QK^T and the scores times V are batched GEMMs over the
  full square and the b a s^2 / t scores go through HBM between kernels: written by QK^T, read and
  written by the fused scale-mask-softmax, by the dropout (with its 1-byte mask), read by the
  product with V; backward reads and writes them once more per kernel.
- Norms, activation functions, bias-dropout-add and rotary embeddings are memory bound: each reads
  its inputs and writes its output once at `Efficiency.memory` of the HBM bandwidth (fitted);
  backward moves twice the forward's bytes.
- Gradient accumulation: unless fused into the weight-gradient GEMM (Megatron-LM's
  gradient_accumulation_fusion), each micro-batch's weight gradient is added to the step's
  gradient buffer, a read-modify-write of it.

What overlaps what (Software, set per run) and the collectives are in step_time.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from refpar.analysis.flops import layer_params
from refpar.analysis.hardware import Hardware
from refpar.analysis.presets import ModelSpec
from refpar.analysis.scale import Precision
from refpar.config import ConfigError

TILE = (256, 128)  # a cuBLAS output tile (Matrix Multiplication Background, Section 2.3)
ATTENTION = ("flash", "unfused")
CP_COMMS = ("ring", "all_gather")


@dataclass(frozen=True)
class Efficiency:
    """The fitted fractions of the hardware the parts of a step reach (calibration.fit)."""

    matmul: float  # of the measured maximum achievable matmul rate (MAMF), in a training job
    memory: float  # of the HBM bandwidth, for memory-bound kernels
    network: float  # of a link's bandwidth, for NCCL's collectives


# calibration.fit() (its grid, then its pattern search) on the 16 runs of published_runs.RUNS marked
# fit, and on nothing else: no held-out row (held_out_runs.py) reaches it. Their largest relative
# error, 7.8%, is as small as these three can make it (tests/test_calibration.py checks no step from
# here lowers it). Refitted when groups spanning nodes got every member's adapter (step_time.link);
# before, one adapter per GPU made the fit put collectives at half the link's bandwidth and memory-
# bound kernels at 83% of HBM. The GEMMs sustain the measured MAMF once their last wave is priced;
# memory-bound kernels reach 63% of HBM; collectives 67% of the links' bandwidth, below what NCCL's
# own tests reach alone (the fit also lays on them what the model leaves out: NCCL's kernels taking
# SMs from the compute, and the ranks' skew at every synchronous collective).
CALIBRATED = Efficiency(matmul=1.0, memory=0.63125, network=0.671875)


@dataclass(frozen=True)
class Software:
    """How the framework runs the step: which kernels, and what overlaps what.

    attention: "flash" (fused, causal half) or "unfused" (materialized scores). tp_overlap: the
    backward's tensor-parallel collectives run behind its weight-gradient GEMMs (Korthikanti et
    al. 2022, Section 6.2); forward ones never do. dp_overlap: the data-parallel gradient reduction
    and ZeRO's gathers run behind the backward (PyTorch DDP buckets, Li et al. 2020; FSDP
    prefetching); otherwise they follow it. cp: "ring" passes K and V around behind the attention
    core (Liu et al. 2023, refpar's context parallelism); "all_gather" gathers them first, exposed
    (Llama 3, Section 3.3.2). fused_grad_accumulation: the weight-gradient GEMM adds into the
    gradient buffer itself. scatter_gather: without sequence parallelism a pipeline transfer sends
    a t-th of the activation over InfiniBand and all-gathers it over NVLink on arrival (Narayanan
    et al. 2021, Section 4.1); otherwise every tensor-parallel rank sends all of it (refpar's).
    fp32_grad_reduce: the data-parallel reduction moves fp32 gradients, 4 bytes per parameter
    (Megatron-LM with bf16 forces accumulate_allreduce_grads_in_fp32; torchtitan's FSDP2 default
    mixed_precision_reduce="float32"; DeepSpeed's bf16 optimizer); otherwise `Precision.grad`.
    p2p_overlap: the pipeline's sends and receives run behind the next micro-batch's compute
    (Megatron-Core's overlap_p2p_comm), so only those of the pipeline's fill and drain are exposed.
    fused_kernels: norms, rotary embeddings and the SwiGLU product run as one kernel each (Megatron's
    and Transformer Engine's fused kernels, or torch.compile); otherwise as PyTorch eager runs the
    module code, one kernel per operation, in fp32 where the code upcasts (`_elementwise_bytes`).
    """

    attention: str = "flash"
    tp_overlap: bool = False
    dp_overlap: bool = True
    cp: str = "ring"
    fused_grad_accumulation: bool = True
    scatter_gather: bool = False
    fp32_grad_reduce: bool = False
    p2p_overlap: bool = False
    fused_kernels: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ConfigError(f"unknown attention kernel {self.attention!r}; choose one of "
                              f"{', '.join(ATTENTION)}")
        if self.cp not in CP_COMMS:
            raise ConfigError(f"unknown context-parallel exchange {self.cp!r}; choose one of "
                              f"{', '.join(CP_COMMS)}")


MODERN = Software()  # the planner's default: what current frameworks do
# The software of the published runs (refpar/analysis/calibration.py says which sentence of each
# paper every field comes from, and which are assumptions).
MEGATRON_2021 = Software(attention="unfused", dp_overlap=False, fused_grad_accumulation=False,
                         scatter_gather=True)
MEGATRON_2022 = replace(MEGATRON_2021, tp_overlap=True)
LLAMA3 = Software(cp="all_gather", fused_grad_accumulation=False)
# Megatron-Core / NeMo as their 2024 performance recipes run it: Transformer Engine's fused
# (flash) attention, tensor-parallel communication overlapped (tp_comm_overlap), overlapped p2p
# (overlap_p2p_comm), gradient reduce-scatter and parameter all-gather of the distributed optimizer
# overlapped with the backward and forward (overlap_grad_reduce, overlap_param_gather), fused
# gradient accumulation into fp32 main_grad, reduced in fp32; ring (p2p) context parallelism.
MEGATRON_CORE_2024 = Software(attention="flash", tp_overlap=True, dp_overlap=True, cp="ring",
                              fused_grad_accumulation=True, fp32_grad_reduce=True, p2p_overlap=True)
# Megatron-DeepSpeed of 2022 (BLOOM, MT-NLG): Megatron's unfused attention with its fused
# softmax, DeepSpeed's pipeline engine (blocking sends, the data-parallel reduction after the
# pipeline has drained), its bf16 optimizer accumulating and reducing fp32 gradients, no overlap of
# tensor-parallel collectives.
DEEPSPEED_2022 = Software(attention="unfused", tp_overlap=False, dp_overlap=False, cp="ring",
                          fused_grad_accumulation=False, fp32_grad_reduce=True)
# torchtitan's FSDP2 (2024): PyTorch SDPA's flash kernel, FSDP2 prefetching its all-gathers and
# overlapping its reduce-scatters with the backward, bf16 parameters and fp32 reduction
# (mixed_precision_reduce="float32"), no fused gradient accumulation, tensor parallelism without
# async TP (eager), all-gather context parallelism (context_parallel_rotate_method="allgather"),
# the model's code run eagerly (torch.compile off, its default in 2024's train configs): RMSNorm,
# rotary embeddings and SwiGLU as the module's sequence of PyTorch operations.
TORCHTITAN_FSDP2 = Software(attention="flash", tp_overlap=False, dp_overlap=True, cp="all_gather",
                            fused_grad_accumulation=False, fp32_grad_reduce=True, fused_kernels=False)
# MosaicML Composer's PyTorch FSDP (2023, llm-foundry's MPT benchmarks): flash attention, FULL_SHARD
# with backward prefetch, bf16 gradient reduction, no fused gradient accumulation.
COMPOSER_FSDP_2023 = Software(attention="flash", tp_overlap=False, dp_overlap=True,
                              fused_grad_accumulation=False, fp32_grad_reduce=False)
SOFTWARE = {"modern": MODERN, "megatron-2021": MEGATRON_2021, "megatron-2022": MEGATRON_2022,
            "llama3": LLAMA3, "megatron-core-2024": MEGATRON_CORE_2024, "deepspeed-2022": DEEPSPEED_2022,
            "torchtitan-fsdp2": TORCHTITAN_FSDP2, "composer-fsdp-2023": COMPOSER_FSDP_2023}


def gemm_seconds(hw: Hardware, M, N, K, *, batch=1, dtype="bfloat16", eff=CALIBRATED, itemsize=2):
    """Seconds of `batch` products (M, K) @ (K, N) in one kernel: whole waves of output tiles at
    the sustained matmul rate plus half a wave of tail, or the time its operands take through HBM."""
    rate = hw.matmul_rate(dtype) * eff.matmul
    tiles = np.ceil(M / TILE[0]) * np.ceil(N / TILE[1]) * batch
    wave = 2 * TILE[0] * TILE[1] * K * hw.sm_count / rate  # every SM computing one tile
    compute = wave * np.maximum(1, tiles / hw.sm_count + 0.5)
    moved = itemsize * (M * K + K * N + M * N) * batch / (hw.hbm_bandwidth * eff.memory)
    return np.maximum(compute, moved)


def memory_seconds(hw: Hardware, nbytes, eff=CALIBRATED):
    """Seconds a memory-bound kernel takes to move `nbytes` through HBM."""
    return nbytes / (hw.hbm_bandwidth * eff.memory)


def _attention_linears(spec: ModelSpec, n, tp, sp=False):
    """(M, N, K, batch) of one block's attention GEMMs on a rank, in forward order: QKV as one
    column-parallel GEMM (whole kv heads) and the row-parallel output; or multi-head latent
    attention's (Megatron-Core's MLA, refpar/parallel/mla_tensor_parallel.py): the down-projections
    q_a_proj (h -> rq) and kv_a_proj_with_mqa (h -> rkv + dr) whole on every rank, on its n / t
    tokens under sequence parallelism, the up-projections q_b_proj (rq -> a (dn + dr) / t; without
    q_lora_rank one q_proj from h) and kv_b_proj (rkv -> a (dn + dv) / t) by heads, o_proj
    (a dv / t -> h) by rows."""
    h = spec.d_model
    if not spec.kv_lora_rank:
        kv = spec.kv_dim
        return [(n, h / tp + 2 * kv / np.minimum(tp, spec.n_kv_head), h, 1), (n, h, h / tp, 1)]
    a, dn, dr, dv = spec.n_head, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    rq, rkv = spec.q_lora_rank, spec.kv_lora_rank
    shard = n / np.where(sp, tp, 1)  # the down-projections' tokens
    q = [(shard, rq, h, 1), (n, a * (dn + dr) / tp, rq, 1)] if rq else [(n, a * (dn + dr) / tp, h, 1)]
    return q + [(shard, rkv + dr, h, 1), (n, a * (dn + dv) / tp, rkv, 1), (n, h, a * dv / tp, 1)]


def _linears(spec: ModelSpec, n, tp, ep, moe: bool, sp=False):
    """(M, N, K, batch) of one block's forward GEMMs on a rank, n tokens, the weights split by t
    (column-parallel QKV and MLP input, row-parallel output projections; `_attention_linears`)."""
    h = spec.d_model
    wide = 2 if spec.mlp == "swiglu" else 1  # SwiGLU's gate and up projections as one GEMM
    out = _attention_linears(spec, n, tp, sp)
    if not moe:
        return out + [(n, wide * spec.d_ff / tp, h, 1), (n, h, spec.d_ff / tp, 1)]
    f = spec.moe_d_ff
    # The router; each of this rank's E/ep experts takes its share of the k n ep routed tokens of
    # the expert-parallel group (balanced routing); the shared experts take every token.
    routed = n * spec.top_k * ep / spec.n_experts
    out += [(n, spec.n_experts, h, 1), (routed, wide * f / tp, h, spec.n_experts / ep),
            (routed, h, f / tp, spec.n_experts / ep)]
    if spec.n_shared_experts:
        out += [(n, spec.n_shared_experts * wide * f / tp, h, 1),
                (n, h, spec.n_shared_experts * f / tp, 1)]
    return out


def _attention_core(spec: ModelSpec, hw: Hardware, b, seq, tp, cp, dtype, eff, software):
    """(forward, backward) seconds of QK^T, softmax and the product with V on one rank; a head's
    query and key are dk channels wide and its value dv (the head size both, or MLA's dn + dr and dv)."""
    q, heads, dk, dv = seq / cp, spec.n_head / tp, spec.qk_head_size, spec.v_head_size
    if software.attention == "flash":
        # Causal: half of the rank's q x s block of scores (the load-balanced causal split gives
        # every context-parallel rank the same half).
        forward = 2 * b * q * seq * (dk + dv) * heads / 2 / (hw.flops(dtype) * hw.flash_fraction)
        return forward, 2.5 * forward
    scores = b * heads * q * seq  # elements of the (b, a/t, q, s) score tensor
    per_byte = memory_seconds(hw, scores, eff)  # seconds to move one byte per score
    dropout = (4 + 1) * per_byte if spec.dropout else 0  # read and write, plus the 1-byte mask
    batch = b * heads

    def bmm(M, N, K, bytes_per_score):  # a batched GEMM over the scores: compute or their traffic
        return np.maximum(gemm_seconds(hw, M, N, K, batch=batch, dtype=dtype, eff=eff),
                          bytes_per_score * per_byte)

    # Forward: QK^T writes the scores, scale-mask-softmax reads and writes them, dropout, then
    # (scores) @ V reads them. Backward: dP = dO V^T writes, dV = P^T dO reads, dropout and softmax
    # backward read two and write one, dQ = dS K and dK = dS^T Q read.
    forward = bmm(q, seq, dk, 2) + 4 * per_byte + dropout + bmm(q, dv, seq, 2)
    backward = (bmm(q, seq, dv, 2) + bmm(seq, dv, q, 2) + dropout + 6 * per_byte
                + bmm(q, dk, seq, 2) + bmm(seq, dk, q, 2))
    return forward, backward


def _elementwise_bytes(spec: ModelSpec, n, tp, sp, precision: Precision, fused: bool = True):
    """HBM bytes of one block's memory-bound kernels, forward: two norms and two bias-dropout-adds
    on the (n, h) stream (on n / t tokens with sequence parallelism), the MLP's activation on its
    (n, f/t) hidden units, rotary embeddings on Q and K.

    Unfused (`Software.fused_kernels` False), as PyTorch eager runs torchtitan's Llama
    (torchtitan/models/llama/model.py, 2024), bytes per element with e the activation's size:
    RMSNorm `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight` is six
    kernels, e + 4 (upcast), 4 + 4 (pow), 4 (mean), 4 + 4 (scale), 4 + e (downcast), 2e (weight):
    4e + 28 against a fused kernel's 2e; rotary embeddings through complex fp32 numbers, e + 4
    (upcast), 4 + 4 (complex product), 4 + e (downcast): 2e + 16 on Q and K; SwiGLU's
    `silu(w1 x) * w3 x` two kernels, 2e + 3e, against 3e; the attention's layout copies, its output
    made contiguous (2e on the (n, h/t) output) and, with grouped-query attention, `repeat_kv`'s
    copies of K and V to every query head (e read, e written per element of the (n, h/t) copy)."""
    e, h = precision.activation, spec.d_model
    mask = precision.mask if spec.dropout else 0
    stream = n * h / np.where(sp, tp, 1)
    eager_norm = not fused and spec.norm == "rmsnorm"  # LayerNorm is one kernel in eager PyTorch too
    norms = 2 * (4 * e + 28 if eager_norm else 2 * e) * stream  # read the input, write the output
    residuals = 2 * (3 * e + mask) * stream  # read the branch and the residual, write, the mask
    if spec.is_moe:
        hidden = n * (spec.top_k + spec.n_shared_experts) * spec.moe_d_ff / tp
    else:
        hidden = n * spec.d_ff / tp
    swiglu = 5 * e if not fused else 3 * e  # SwiGLU reads gate and up
    activation = (swiglu if spec.mlp == "swiglu" else 2 * e) * hidden
    per_rotary = 2 * e + 16 if not fused else 2 * 2 * e
    rotary = 0 if spec.learned_positions else per_rotary * n * (h + spec.kv_dim) / tp
    if spec.kv_lora_rank:  # MLA: the rank's heads' dr query channels, the shared dr-wide key whole;
        # the latents' two RMSNorms on their (n, rq) and (n, rkv) (on n / t tokens under sp)
        dr = spec.qk_rope_head_dim
        rotary = per_rotary * n * (spec.n_head * dr / tp + dr)
        norm = 4 * e + 28 if not fused else 2 * e
        norms = norms + norm * n / np.where(sp, tp, 1) * (spec.q_lora_rank + spec.kv_lora_rank)
    copies = 0.0
    if not fused:
        copies = 2 * e * n * spec.n_head * spec.v_head_size / tp
        if spec.n_kv_head < spec.n_head:
            copies = copies + 2 * e * n * h / tp
    return norms + residuals + activation + rotary + copies


def op_checkpoint_gemms(spec: ModelSpec, n, tp, moe: bool, sp=False):
    """(M, N, K) of the forward GEMMs torchtitan's per-op activation checkpointing runs again.

    Its policy (torchtitan, `selective_ac_option = "op"`: torchtitan/parallelisms/parallelize_llama.py,
    2024) saves the output of every matmul (aten.mm) and of the flash attention kernel, "except
    every second mm": counted per block in forward order, q, k, v, o, then the MLP's (w1, w3, w2
    for SwiGLU; fc1, fc2 for GELU), the 2nd, 4th and 6th are recomputed, so k, o and w3 (fc2).
    Everything else (norms, rotary, activation) is recomputed too. A MoE block's experts run as
    grouped GEMMs, not aten.mm, so its whole MLP is recomputed. Latent attention's mms are q_a,
    q_b (or q), kv_a, kv_b and o (`_attention_linears`), so the count goes on from them."""
    h, kv = spec.d_model, spec.kv_dim / np.minimum(tp, spec.n_kv_head)  # whole kv heads per rank
    attention = [(n, h / tp, h), (n, kv, h), (n, kv, h), (n, h, h / tp)]  # q, k, v, o
    if spec.kv_lora_rank:
        attention = [(M, N, K) for M, N, K, _ in _attention_linears(spec, n, tp, sp)]
    if moe:  # what _linears lists after the attention's GEMMs
        after = len(_attention_linears(spec, n, tp, sp))
        return attention[1::2] + [(M, N, K) for M, N, K, _ in _linears(spec, n, tp, 1, True, sp)[after:]]
    if spec.mlp == "swiglu":  # w1, w3, w2
        mlp = [(n, spec.d_ff / tp, h), (n, spec.d_ff / tp, h), (n, h, spec.d_ff / tp)]
    else:  # fc1, fc2
        mlp = [(n, spec.d_ff / tp, h), (n, h, spec.d_ff / tp)]
    return (attention + mlp)[1::2]


def block_seconds(spec: ModelSpec, hw: Hardware, *, micro_batch, seq, tp=1, cp=1, ep=1, sp=False,
                  moe=False, precision: Precision, dtype="bfloat16", eff=CALIBRATED,
                  software=MODERN):
    """One block's compute on one rank for one micro-batch, by part, in seconds: "gemm_f" and
    "gemm_b" (the backward's input- and weight-gradient GEMMs), "wgrad" (the weight-gradient ones
    alone), "core_f" and "core_b" (the attention core), "memory_f" and "memory_b" (the memory-bound
    kernels), "accumulate" (adding the micro-batch's weight gradients to the step's) and "op_gemm"
    (the forward GEMMs per-op checkpointing runs again, `op_checkpoint_gemms`)."""
    n = micro_batch * seq / cp
    gemm = {"gemm_f": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    for M, N, K, batch in _linears(spec, n, tp, ep, moe, sp):
        kw = dict(batch=batch, dtype=dtype, eff=eff)
        gemm["gemm_f"] = gemm["gemm_f"] + gemm_seconds(hw, M, N, K, **kw)
        gemm["dgrad"] = gemm["dgrad"] + gemm_seconds(hw, M, K, N, **kw)  # dX = dY W^T
        gemm["wgrad"] = gemm["wgrad"] + gemm_seconds(hw, K, N, M, **kw)  # dW = X^T dY
    core_f, core_b = _attention_core(spec, hw, micro_batch, seq, tp, cp, dtype, eff, software)
    memory_f = memory_seconds(hw, _elementwise_bytes(spec, n, tp, sp, precision, software.fused_kernels), eff)
    op_gemm = sum(gemm_seconds(hw, M, N, K, dtype=dtype, eff=eff)
                  for M, N, K in op_checkpoint_gemms(spec, n, tp, moe, sp))
    params = layer_params(spec, moe)
    local = params.per_tp_rank(tp, spec.n_kv_head) + params.replicated + params.experts / (ep * tp)
    # Read the new gradient and the buffer, write the buffer: 2 + 4 + 4 bytes into an fp32
    # buffer, 2 + 2 + 2 into a 16-bit one.
    per_param = precision.grad + 2 * (precision.grad_accum or precision.grad)
    accumulate = 0.0 if software.fused_grad_accumulation else memory_seconds(hw, local * per_param, eff)
    return {"gemm_f": gemm["gemm_f"], "gemm_b": gemm["dgrad"] + gemm["wgrad"], "wgrad": gemm["wgrad"],
            "core_f": core_f, "core_b": core_b, "memory_f": memory_f, "memory_b": 2 * memory_f,
            "accumulate": accumulate, "op_gemm": op_gemm}


def head_seconds(spec: ModelSpec, hw: Hardware, *, micro_batch, seq, tp=1, cp=1, dtype="bfloat16",
                 eff=CALIBRATED):
    """(forward, backward) seconds of the LM head on the last stage: the (n, h) @ (h, V/t) GEMM and
    the cross-entropy over fp32 logits (written, read for the maximum and the sum of exponentials;
    backward reads them and writes their gradient)."""
    n, h, V = micro_batch * seq / cp, spec.d_model, spec.vocab_size
    kw = dict(dtype=dtype, eff=eff)
    logits = 4 * n * V / tp
    forward = gemm_seconds(hw, n, V / tp, h, **kw) + memory_seconds(hw, 3 * logits, eff)
    backward = (gemm_seconds(hw, n, h, V / tp, **kw) + gemm_seconds(hw, h, V / tp, n, **kw)
                + memory_seconds(hw, 2 * logits, eff))
    return forward, backward
