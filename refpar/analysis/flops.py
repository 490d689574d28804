"""Parameter counts from shapes, and FLOPs per training step.

Legend: L layers, h = d_model, a heads, kv = n_kv_head * head_size, f MLP width, V vocabulary,
s sequence, B sequences per step, t tensor-parallel size, E routed experts, k experts per token.

Counting convention (Narayanan et al. 2021, Section 3.3 / Appendix): a matmul of an (m, n) input
by an (n, p) weight costs 2mnp FLOPs; elementwise work (norms, softmax, activations) is not counted;
the attention scores QK^T and the weighted sum of V are counted over the full s x s square (the
causal mask does not halve them). Backward costs twice the forward.

Every function takes plain ints or NumPy arrays for the batch and sequence, so the planner
evaluates thousands of candidates in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.analysis.presets import ModelSpec


def _mlp_params(h: int, f: int, mlp: str, bias: bool) -> tuple[int, int]:
    """(column-parallel part, row-parallel bias) of one MLP: weights and the biases that split by t."""
    if mlp == "swiglu":  # gate and up (h, f) each, down (f, h): Shazeer 2020
        return 3 * h * f + (2 * f if bias else 0), (h if bias else 0)
    return 2 * h * f + (f if bias else 0), (h if bias else 0)


@dataclass(frozen=True)
class LayerParams:
    """One transformer block's parameters, split the way Megatron's tensor parallelism splits them.

    `split` divides by t (attention and MLP weights, column-parallel biases); `replicated` is held
    whole by every tensor-parallel rank (norms, row-parallel output biases, the router); `experts`
    is the routed experts' total, split by ep (whole experts) and by t (each expert's matrices).
    `kv`, the part of `split` that is K and V, splits by whole kv heads (`per_tp_rank`).
    """

    split: int
    replicated: int
    experts: int
    expert_active: int  # the k experts one token goes through
    kv: int = 0  # K's and V's weights and biases, within `split`

    @property
    def total(self) -> int:
        return self.split + self.replicated + self.experts

    def per_tp_rank(self, tp, n_kv_head):
        """What one of t tensor-parallel ranks holds of `split`: a t-th, except K and V, of which it
        holds max(1, nkv / t) whole kv heads: past t = nkv each kv head is replicated on t / nkv
        ranks (grouped-query attention; refpar/parallel/llama_pieces.py, Megatron-LM, vLLM)."""
        return (self.split - self.kv) / tp + self.kv / np.minimum(tp, n_kv_head)


def attention_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(split, replicated, kv) weights of one attention block, as `LayerParams` splits them.
    Q and O are (h, h), K and V (h, kv): kv = h without GQA (Ainslie et al. 2023). Multi-head latent
    attention (DeepSeek-V2 §2.1, V3's config): Q = up(norm(down_q x)), down_q (h, q_lora) and up
    (q_lora, a (nope + rope)); K and V from one latent, (h, kv_lora + rope) (the rope part is
    the shared decoupled key), its norm, and up (kv_lora, a (nope + v)); O (a v, h). The down
    projections and their norms are replicated over tp (Megatron-Core's MLA), the rest splits by
    heads."""
    h, kv, b = spec.d_model, spec.kv_dim, spec.bias
    if spec.kv_lora_rank:
        a, rope = spec.n_head, spec.qk_rope_head_dim
        qk = spec.qk_nope_head_dim + rope
        q_lora, kv_lora = spec.q_lora_rank, spec.kv_lora_rank
        split = (q_lora * a * qk + kv_lora * a * (spec.qk_nope_head_dim + spec.v_head_dim)
                 + a * spec.v_head_dim * h)
        replicated = h * q_lora + q_lora + h * (kv_lora + rope) + kv_lora
        return split, replicated, 0
    split = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if b else 0)
    return split, (h if b else 0), 2 * h * kv + (2 * kv if b else 0)


def layer_params(spec: ModelSpec, moe: bool) -> LayerParams:
    h, b = spec.d_model, spec.bias
    norm = 2 * h if spec.norm == "layernorm" else h
    attn_split, attn_repl, kv_split = attention_params(spec)
    if not moe:
        mlp_split, mlp_repl = _mlp_params(h, spec.d_ff, spec.mlp, b)
        return LayerParams(attn_split + mlp_split, attn_repl + 2 * norm + mlp_repl, 0, 0, kv_split)
    one_split, one_repl = _mlp_params(h, spec.moe_d_ff, spec.mlp, b)
    expert = one_split + one_repl
    shared_split = spec.n_shared_experts * one_split
    shared_repl = spec.n_shared_experts * one_repl
    router = h * spec.n_experts  # the gate: (h, E), no bias (Mixtral, DeepSeekMoE)
    return LayerParams(attn_split + shared_split,
                       attn_repl + 2 * norm + shared_repl + router,
                       spec.n_experts * expert,
                       spec.top_k * expert, kv_split)


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # token table (V, h), plus the learned position table (s, h) where there is one
    layers: int  # all blocks, every expert included
    head: int  # final norm, plus the (h, V) LM head when it is not tied to the embedding
    active: int  # parameters one token goes through (MoE: k of E experts)

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.head


def param_counts(spec: ModelSpec) -> ParamCounts:
    """Parameters from the shapes alone; for GPT shapes this is Narayanan et al. 2021 eq. 2 + 2h
    (their formula leaves out the final LayerNorm)."""
    h, V = spec.d_model, spec.vocab_size
    embedding = V * h + (spec.seq_len * h if spec.learned_positions else 0)
    dense, moe = layer_params(spec, False), layer_params(spec, True)
    n_dense = spec.n_layer - spec.n_moe_layers
    layers = n_dense * dense.total + spec.n_moe_layers * moe.total
    final_norm = 2 * h if spec.norm == "layernorm" else h
    head = final_norm + (0 if spec.tied_embeddings else V * h)
    inactive = spec.n_moe_layers * (moe.experts - moe.expert_active)
    return ParamCounts(embedding, layers, head, embedding + layers + head - inactive)


def layer_matmul_params(spec: ModelSpec) -> int:
    """Weights one token multiplies by in all blocks together (MoE: k routed + shared experts)."""
    h, kv = spec.d_model, spec.kv_dim
    # every attention weight multiplies each token once (MLA's norms are not weights of a GEMM)
    attn = (sum(attention_params(spec)[:2]) - spec.q_lora_rank - spec.kv_lora_rank if spec.kv_lora_rank
            else 2 * h * h + 2 * h * kv)
    width = 3 if spec.mlp == "swiglu" else 2
    dense = attn + width * h * spec.d_ff
    moe = attn + (spec.top_k + spec.n_shared_experts) * width * h * spec.moe_d_ff + h * spec.n_experts
    n_moe = spec.n_moe_layers
    return (spec.n_layer - n_moe) * dense + n_moe * moe


def forward_flops(spec: ModelSpec, batch, seq):
    """(layer FLOPs, attention-core FLOPs, logit FLOPs) of one forward pass over batch x seq tokens.

    Attention core = QK^T and scores @ V: 2 * s * a (dk + dv) per token per layer (the full square),
    2 * 2 * s * h where a head's query, key and value are h / a wide (MLA's: dn + dr and dv).
    """
    tokens = batch * seq
    layers = 2 * tokens * layer_matmul_params(spec)
    core = 2 * tokens * seq * spec.n_head * (spec.qk_head_size + spec.v_head_size) * spec.n_layer
    logits = 2 * tokens * spec.d_model * spec.vocab_size
    return layers, core, logits


def step_flops(spec: ModelSpec, batch, seq, recompute: str = "full", scores_again: bool = False):
    """FLOPs of one training step (forward + backward) on `batch` sequences of `seq` tokens.

    recompute="full" is Narayanan et al. 2021 eq. 3 (for GPT shapes exactly
    96 B s L h^2 (1 + s/6h + V/16Lh)): the blocks run forward twice, the logit layer once.
    recompute="none" is the model's own work, 72 B s L h^2 (1 + s/6h + V/12Lh): what MFU counts.
    recompute="selective" reruns only the attention core (Korthikanti et al. 2022, Section 5).
    `scores_again`: the attention keeps its softmax statistics instead of its probabilities and
    computes QK^T once more in its backward (FlashAttention, Dao et al. 2022; refpar's ring attention
    under cp): half a core more per layer, work MFU does not count.

    For the dense models refpar trains this is exactly the GEMM FLOPs its ranks run together
    (refpar/model/gemm.py counts them; tests/test_recompute.py): for GPT-2, 72 B s L h^2 is 3 x 24 h^2
    per token and layer for c_attn (h x 3h), c_proj (h x h), c_fc (h x 4h) and the MLP's c_proj
    (4h x h), forward, dx and dw; s/6h is QK^T and scores @ V over the full s x s square (refpar masks
    them, it does not skip the upper triangle) and their four backward products; V/12Lh the tied head
    and its two backward products. Under full recomputation the head is not run again: eq. 3's
    "4 forward passes" of the blocks, 3 of the head. MoE blocks are priced as if no token were
    dropped: a run with capacity drops computes less.
    """
    layers, core, logits = forward_flops(spec, batch, seq)
    again = core / 2 if scores_again else 0
    if recompute == "full":
        return 4 * (layers + core) + 3 * logits + again
    if recompute == "selective":
        return 3 * (layers + core) + core + 3 * logits + again
    return 3 * (layers + core + logits) + again


def model_flops(spec: ModelSpec, batch, seq):
    """The work MFU counts (Chowdhery et al. 2022, Appendix B): no recomputation."""
    return step_flops(spec, batch, seq, "none")
