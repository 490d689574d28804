"""Memory per rank, by category, for any mesh: the closed forms the planner searches with.

Legend: L layers, h = d_model, a heads, kv = K/V width, f MLP width, V vocabulary, s sequence,
b micro-batch size, t tensor-parallel size, p pipeline stages, m micro-batches per step, c
context-parallel size, e expert-parallel size, d data-parallel size, v model chunks per stage.

The mesh is refpar's (config.MESH_AXES): world = p * d * e * c * t. The batch is split over d * e
(expert parallelism takes its ranks from the data-parallel ones, as in Megatron-Core and
DeepSpeed-MoE), the sequence over c. So the non-expert weights are replicated over d * e * c
ranks and the experts over d * c: these are the groups ZeRO shards over.

Categories are the ledger's (refpar.memory.CATEGORIES). Where a small refpar run has a ledger,
these functions take its inputs: `Precision(param=8, grad=8, master=0, optimizer=16,
activation=8)` describes a float64 AdamW run.

Every size argument may be an int or a NumPy array; arrays broadcast, so one call prices every
candidate mesh of a search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.analysis.activations import mla_attention_elements
from refpar.analysis.flops import layer_params
from refpar.analysis.presets import ModelSpec
from refpar.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state (Rajbhandari et al. 2020, Section 3.1: 2 + 2 + K)."""

    param: int = 2  # the weights forward and backward read (bf16)
    grad: int = 2  # their gradients (bf16)
    master: int = 4  # fp32 master weights; 0 when the weights are already full precision
    optimizer: int = 8  # Adam's m and v in fp32 (with `master`, the ZeRO paper's K = 12)
    grad_accum: int = 0  # an fp32 gradient accumulation buffer (Megatron's main_grad)
    activation: int = 2
    mask: int = 1  # a dropout mask element (Korthikanti et al. 2022, Section 4.1)


PRECISIONS = {
    # Mixed precision with Adam (Micikevicius et al. 2018; ZeRO's K = 12): 16 bytes per parameter.
    "bf16": Precision(),
    # The same with fp32 gradient accumulation: 20 bytes per parameter (HF Ultra-Scale Playbook,
    # "Memory usage in Transformers": 2 + 2 + 4 + 8 + 4).
    "bf16-fp32-accum": Precision(grad_accum=4),
    # refpar's own float64 runs: weights, gradients and Adam's m and v all float64, no master copy.
    "float64": Precision(param=8, grad=8, master=0, optimizer=16, activation=8),
}


def in_flight(schedule: str, pp, m, chunks=1):
    """(first stage, last stage) micro-batches whose full activations are held at the peak, from
    their F until their B.

    GPipe keeps all m (Huang et al. 2019). 1F1B keeps p on the first stage and one on the last
    (Narayanan et al. 2021, Section 2.2.1). Interleaving with v chunks keeps p (1 + (p-1)/(pv))
    on the first (Korthikanti et al. 2022, Section 4.2.3); its last stage warms up (v-1)p + 1
    chunks of one v-th of the layers (Megatron-LM's interleaved schedule). ZB-H1 keeps 1F1B's
    p and 1, ZB-H2 2p - 1 on the first stage (Qi et al. 2023, Section 3). These are the peaks of
    refpar's schedule builders (`simulate.stored`, divided by v).
    """
    pp, m = np.asarray(pp), np.asarray(m)
    if schedule == "gpipe":
        return m, m
    if schedule in ("1f1b", "zb-h1"):
        return np.minimum(pp, m), np.ones_like(pp)
    if schedule == "interleaved-1f1b":
        return pp + (pp - 1) / chunks, ((chunks - 1) * pp + 1) / chunks
    if schedule == "zb-h2":
        return np.minimum(2 * pp - 1, m), np.ones_like(pp)
    raise ConfigError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def held_until_w(schedule: str, pp, m, chunks=1):
    """(first stage, last stage) micro-batches holding anything for backward, from F until W.

    A zero-bubble schedule defers W: after its B a micro-batch still keeps the linear layers'
    inputs and output gradients, nearly its full activations, so every stage, the last included,
    holds p (ZB-H1) or 2p - 1 (ZB-H2) micro-batches (Qi et al. 2023, Section 3; the peaks of
    `simulate.peak_inflight_microbatches`). The memory model prices them as full activations:
    an upper bound. Without a split backward this is `in_flight`.
    """
    first, last = in_flight(schedule, pp, m, chunks)
    if schedule in ("zb-h1", "zb-h2"):
        return first, first
    return first, last


def layer_activation_bytes(spec: ModelSpec, micro_batch, seq, *, tp=1, cp=1, sp=False,
                           recompute="none", precision: Precision = PRECISIONS["bf16"], moe=False,
                           attention="unfused"):
    """Bytes one block keeps for backward, per micro-batch, on one rank.

    Korthikanti et al. 2022, Section 4.1, term by term, with GQA, SwiGLU, MoE and dropout-free
    models as parameters. For a GPT block in fp16 with 1-byte dropout masks this is their Table 2:
    s b h (34 + 5 a s / h) with no parallelism, s b h (10 + 24/t + 5 a s / (h t)) with tensor
    parallelism, s b h / t (34 + 5 a s / h) with sequence parallelism too; "selective" drops the
    5 a s / h term (the attention core is recomputed, as flash attention does); "full" keeps only
    the block's input, 2 s b h (/ t with sequence parallelism); "selective-op" is torchtitan's
    per-op checkpointing (what it keeps is listed where it is computed).

    attention="flash" (FlashAttention, Dao et al. 2022, Section 3.1) never stores the b a s^2
    scores nor their dropout mask (it draws the mask again from the RNG state): it keeps the
    output, which is the output projection's input counted above, and the softmax's log-sum-exp,
    one fp32 value per query and head, 4 b (a/t) s/c bytes. Selective recomputation then drops
    nothing more.
    """
    e, h, kv = precision.activation, spec.d_model, spec.kv_dim
    mk = precision.mask if spec.dropout else 0
    n = micro_batch * seq / cp  # tokens this rank holds
    sp_div = np.where(sp, tp, 1)
    if recompute == "full":
        return e * n * h / sp_div
    kv_rank = kv / np.minimum(tp, spec.n_kv_head)  # (N, kv_rank) each for K and V
    if recompute == "selective-op":
        # torchtitan's per-op checkpointing (efficiency.op_checkpoint_gemms): the block's input, the
        # outputs of the 1st, 3rd, 5th and 7th matmuls (q, v, w1, w2 for SwiGLU; q, v, fc1 for
        # GELU; q, v alone for a MoE block, whose grouped expert GEMMs it does not save; a
        # row-parallel output is the whole (n, h) before its reduction) and the flash kernel's
        # output with its fp32 log-sum-exp.
        mlp = 0 if moe else (spec.d_ff / tp + (h if spec.mlp == "swiglu" else 0))
        return e * n * (h / sp_div + 2 * h / tp + kv_rank + mlp) + 4 * (spec.n_head / tp) * n
    # Outside the tensor-parallel region: the two norm inputs, the inputs of the QKV and first
    # MLP matmuls, the two residual dropout masks. Sequence parallelism splits them by t.
    outside = (4 * e + 2 * mk) * n * h / sp_div
    # Inside: Q and K for QK^T, V, the output projection's input, the MLP's hidden activations.
    # K and V are those of the rank's max(1, nkv / t) kv heads: whole heads, replicated past t = nkv.
    if moe:
        # Each token's k dispatched copies (the routed experts' first input) and the hidden
        # activations of its k routed and the shared experts; the router reads the norm output.
        experts = spec.top_k + spec.n_shared_experts
        hidden = spec.top_k * h + experts * (3 if spec.mlp == "swiglu" else 2) * spec.moe_d_ff
    else:
        hidden = (3 if spec.mlp == "swiglu" else 2) * spec.d_ff  # gelu: its input, fc2's input
    inside = e * n * ((h + h + hidden) / tp + 2 * kv_rank)
    if spec.kv_lora_rank:  # multi-head latent attention: its latents, q, k, the kv buffer, o's input
        inside = e * (n * hidden / tp + mla_attention_elements(
            n / sp_div, n, seq / cp, spec.n_head / tp, spec.q_lora_rank, spec.kv_lora_rank,
            spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, keep_refpar=False))
    if attention == "flash":
        return outside + inside + 4 * (spec.n_head / tp) * n
    if recompute == "selective":
        return outside + inside
    # Softmax output, its dropout mask, and the dropped-out probabilities V is multiplied by:
    # 5 a s^2 b in Korthikanti's count; 2 a s^2 b without dropout. Queries are the rank's own
    # s / c, keys all s.
    score_bytes = e + (mk + e if spec.dropout else 0)
    scores = score_bytes * (spec.n_head / tp) * micro_batch * (seq / cp) * seq
    return outside + inside + scores


def model_states(params, zero, group, precision: Precision = PRECISIONS["bf16"], expert_params=0,
                 expert_group=1, fused_grad_accumulation=False):
    """Bytes of weights, gradients, master weights and moments per rank (Rajbhandari et al. 2020,
    Figure 1), in the ledger's categories.

    `params` weights are replicated over `group` ranks, `expert_params` over `expert_group`.
    ZeRO stage 1 shards the optimizer state (K = master + Adam's m and v), stage 2 the gradients
    too, stage 3 the weights too: (2 + 2 + K) psi, 2 psi + 2 psi + K psi / N_d, 2 psi +
    (2 + K) psi / N_d, (2 + 2 + K) psi / N_d.

    With an fp32 accumulation buffer (`precision.grad_accum`) and `fused_grad_accumulation`
    (Megatron-LM's gradient_accumulation_fusion: the weight-gradient GEMM writes into the fp32
    main_grad), no 16-bit gradient is kept beside it: 4 bytes of gradient per parameter, not 2 + 4
    (Megatron-LM, docs distrib_optimizer: "bf16 param, fp32 grads": 18 bytes per parameter, 6 + 12/d
    with the distributed optimizer).
    """
    zero = np.asarray(zero)

    def sharded(stage):
        return params / np.where(zero >= stage, group, 1) + expert_params / np.where(
            zero >= stage, expert_group, 1)

    return {
        "params": precision.param * sharded(3),
        "grads": grad_bytes(precision, fused_grad_accumulation) * sharded(2),
        "master": precision.master * sharded(1),  # the ledger's "master": fp32 weights
        "optimizer": precision.optimizer * sharded(1),  # the ledger's "optimizer": the moments
    }


def grad_bytes(precision: Precision, fused_grad_accumulation=False) -> int:
    """Bytes of gradient kept per parameter: the 16-bit gradient and any fp32 accumulation buffer;
    the buffer alone where the weight-gradient GEMM accumulates into it (model_states)."""
    if precision.grad_accum and fused_grad_accumulation:
        return precision.grad_accum
    return precision.grad + precision.grad_accum


def stage_layers(n_layer: int, pp):
    """(first, middle, last) stage's blocks when pp stages share n_layer: ceil(L / p) each, with
    what is missing to p ceil(L / p) taken from the last stage and then the first, whose embedding
    and head make them the heavier ones otherwise (Llama 3, Section 3.3.2: "we reduce one
    Transformer layer each from the first and the last stages"); the middle stages take any further
    shortfall and the heaviest of them holds ceil(L / p). Where p divides L all hold L / p."""
    pp = np.asarray(pp)
    k = -(-n_layer // pp)
    short = pp * k - n_layer
    first = np.where(pp == 1, n_layer, k - (short >= 2))
    return first, k, np.where(pp == 1, n_layer, k - (short >= 1))


def _stage_layers(spec: ModelSpec, pp):
    """(dense, moe) layer counts on the first and on the last stage: the dense layers come first."""
    first, _, last = stage_layers(spec.n_layer, pp)
    n_dense = spec.n_layer - spec.n_moe_layers
    first_dense = np.minimum(n_dense, first)
    last_dense = np.clip(n_dense - (spec.n_layer - last), 0, last)
    return (first_dense, first - first_dense), (last_dense, last - last_dense)


def stage_params(spec: ModelSpec, tp, pp, ep):
    """((shared, expert) on the first stage, (shared, expert) on the last): one rank's weights.

    Shared weights are split by t (Megatron's column/row split; norms, row-parallel biases and
    the router whole; K and V by whole kv heads, `LayerParams.per_tp_rank`), experts by e and t.
    The first stage holds the embedding (vocabulary split by t), the last the final norm and the
    LM head; a tied head is a second copy of the embedding when the two are on different stages
    (Megatron keeps both and all-reduces their gradients).
    """
    tp, pp, ep = np.asarray(tp), np.asarray(pp), np.asarray(ep)
    h, V = spec.d_model, spec.vocab_size
    dense, moe = layer_params(spec, False), layer_params(spec, True)

    def blocks(nd, nm):
        nkv = spec.n_kv_head
        shared = (nd * (dense.per_tp_rank(tp, nkv) + dense.replicated)
                  + nm * (moe.per_tp_rank(tp, nkv) + moe.replicated))
        return shared, nm * moe.experts / (ep * tp)

    norm = 2 * h if spec.norm == "layernorm" else h
    embed = V * h / tp + (spec.seq_len * h if spec.learned_positions else 0)
    head = norm + np.where(spec.tied_embeddings & (pp == 1), 0, V * h / tp)
    (fd, fm), (ld, lm) = _stage_layers(spec, pp)
    first_shared, first_expert = blocks(fd, fm)
    last_shared, last_expert = blocks(ld, lm)
    first_shared = first_shared + embed + np.where(pp == 1, head, 0)
    last_shared = last_shared + head + np.where(pp == 1, embed, 0)
    return (first_shared, first_expert), (last_shared, last_expert)


def middle_stage_params(spec: ModelSpec, tp, pp, ep):
    """(shared, expert) one rank's weights on the heaviest middle stage (pp >= 3; zeros otherwise):
    ceil(L / p) blocks and no embedding or head, as many of them MoE as the model has, as
    step_time prices its compute. DeepSeek-V3's dense blocks all lie on the first stage, so its
    middle stages hold the most experts (61 blocks over p = 16: the first 3 dense, the middle 4 MoE)."""
    tp, pp, ep = np.asarray(tp), np.asarray(pp), np.asarray(ep)
    dense, moe = layer_params(spec, False), layer_params(spec, True)
    k = stage_layers(spec.n_layer, pp)[1]
    nm = np.minimum(spec.n_moe_layers, k)
    nkv = spec.n_kv_head
    shared = (k - nm) * (dense.per_tp_rank(tp, nkv) + dense.replicated) + nm * (moe.per_tp_rank(tp, nkv)
                                                                              + moe.replicated)
    middle = pp >= 3
    return np.where(middle, shared, 0), np.where(middle, nm * moe.experts / (ep * tp), 0)


def memory_per_rank(spec: ModelSpec, *, micro_batch, seq, tp=1, pp=1, dp=1, cp=1, ep=1, zero=0,
                    schedule="1f1b", microbatches=1, chunks=1, recompute="none", sp=None,
                    precision: Precision = PRECISIONS["bf16"], software=None):
    """Peak bytes per rank by category on the stage that needs the most (first, a middle one or last).

    params, grads, master, optimizer: ZeRO stage 1 shards the optimizer state (master weights and
    moments), 2 the gradients too, 3 the weights too (Rajbhandari et al. 2020, Section 5 and
    Figure 1), over the ranks that hold the same weights. activations: `layer_activation_bytes` times the
    layers of a stage times the micro-batches the schedule holds (`held_until_w`), plus the
    embedding's dropout mask on the first stage and the final norm, head input and fp32 logits
    on the last
    (Korthikanti et al. 2022, Section 4.3). comm: send and receive buffers of one activation for
    the pipeline, and ZeRO-3's two gathered blocks (the one computing and the one prefetched).
    sp defaults to on whenever tp > 1 (it costs no extra bytes on the wire: Korthikanti et al.
    2022, Section 4.2.2). `software` (efficiency.Software) says how the framework holds them: its
    attention kernel (flash keeps no scores) and whether gradients accumulate in the fp32 buffer
    alone; None is refpar's own way (materialized scores, a 16-bit gradient beside the buffer).
    """
    tp, pp, dp, cp, ep, zero = (np.asarray(x) for x in (tp, pp, dp, cp, ep, zero))
    sp = tp > 1 if sp is None else np.asarray(sp)
    pr, h, V = precision, spec.d_model, spec.vocab_size
    dense, moe = layer_params(spec, False), layer_params(spec, True)
    (fd, fm), (ld, lm) = _stage_layers(spec, pp)
    (first_shared, first_expert), (last_shared, last_expert) = stage_params(spec, tp, pp, ep)

    attention = "unfused" if software is None else software.attention
    fused = software is not None and software.fused_grad_accumulation

    def states(shared, expert):
        return model_states(shared, zero, dp * ep * cp, pr, expert, dp * cp, fused)

    first_hold, last_hold = held_until_w(schedule, pp, microbatches, chunks)
    act_kw = dict(tp=tp, cp=cp, sp=sp, precision=pr, attention=attention)
    per_layer = {
        kind: layer_activation_bytes(spec, micro_batch, seq, recompute=recompute, moe=kind, **act_kw)
        for kind in (False, True)
    }
    n = micro_batch * seq / cp
    sp_div = np.where(sp, tp, 1)
    mk = pr.mask if spec.dropout else 0
    embed_act = mk * n * h / sp_div
    head_act = 2 * pr.activation * n * h / sp_div + 4 * n * V / tp
    # Recomputation rebuilds, during a block's backward, a working set: its activations (full) or
    # its attention core's (selective), beside what the schedule keeps (refpar/parallel/recompute.py).
    working = 0
    if recompute != "none":
        working = layer_activation_bytes(spec, micro_batch, seq, recompute="none", moe=spec.is_moe, **act_kw)
    if recompute in ("selective", "selective-op"):
        working = working - layer_activation_bytes(spec, micro_batch, seq, recompute=recompute,
                                                   moe=spec.is_moe, **act_kw)

    def activations(nd, nm, hold, extra):
        return (nd * per_layer[False] + nm * per_layer[True]) * hold + extra + working

    p2p = np.where(pp > 1, 2 * pr.activation * n * h / sp_div, 0)
    biggest_block = np.maximum(dense.per_tp_rank(tp, spec.n_kv_head),
                               moe.per_tp_rank(tp, spec.n_kv_head) + moe.experts / (ep * tp))
    gathered = np.where(zero >= 3, 2 * pr.param * biggest_block, 0)
    first = states(first_shared, first_expert)
    # Activations are priced on ceil(L / p) blocks: where p does not divide L the first stage holds
    # a block less, but the second, holding one micro-batch less of the full count, may hold more.
    full = stage_layers(spec.n_layer, pp)[1]
    act_dense = np.minimum(spec.n_layer - spec.n_moe_layers, full)
    first["activations"] = activations(act_dense, full - act_dense, first_hold, first_hold * embed_act
                                       + np.where(pp == 1, head_act, 0))
    last = states(last_shared, last_expert)
    last["activations"] = activations(ld, lm, last_hold, head_act
                                      + np.where(pp == 1, last_hold * embed_act, 0))
    # A middle stage (pp >= 3) holds ceil(L / p) blocks, the MoE ones where there are that many, with
    # the first stage's hold, which bounds its own (1F1B's stage s holds p - s).
    middle = states(*middle_stage_params(spec, tp, pp, ep))
    middle_moe = np.minimum(spec.n_moe_layers, full)
    middle["activations"] = activations(full - middle_moe, middle_moe, first_hold, 0)
    for stage in (first, middle, last):
        stage["comm"] = p2p + gathered
    use_first = sum(first.values()) >= sum(last.values())
    heavy = {k: np.where(use_first, first[k], last[k]) for k in first}
    use_middle = (pp >= 3) & (sum(middle.values()) > sum(heavy.values()))
    return {k: np.where(use_middle, middle[k], heavy[k]) for k in first}
