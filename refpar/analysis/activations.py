"""Activation memory per rank: the bytes kept for backward (Korthikanti et al. 2022, §4).

Legend (the paper's): s sequence, b batch, h hidden (C), a heads, t tp size, L layers.
The paper counts 16-bit activations and 1-byte dropout masks, per layer:

    eq. 1, no parallelism:  sbh (34 + 5as/h)
    eq. 2, tensor parallel: sbh (10 + 24/t + 5as/(ht))
    eq. 4, TP + sequence parallel: sbh/t (34 + 5as/h)

where 34 = 4 (two LayerNorm inputs) + 2 + 2 (inputs of c_attn and c_fc) + 1 + 1 (two residual
dropout masks) + 24 (Q, K, V 6, c_proj's input 2, GeLU's input 8, the second linear's input 8) and
5as/h = softmax output 2 + its dropout mask 1 + dropout output 2 (times as^2 b / sbh).

`layer_bytes` writes the same terms for e bytes per element and counts what refpar really keeps,
which differs from the paper in three places, each a term of its own: a dropout mask is kept as a
scale array of the activation dtype (e bytes, not 1), LayerNorm keeps rstd (one value per token),
and the tanh-GELU keeps its tanh (4h per token) beside its input. `PAPER` switches those
off, and then `layer_bytes` with e = 2 is the paper's equation (tests check this). Context
parallelism and the embedding and head are not in the paper; their terms follow the same rules.

Recomputation (refpar/parallel/recompute.py; the paper's section 5): "selective" keeps the attention
core's inputs q, k, v but not `core_bytes`, which the backward makes again for one block at a time;
"full" keeps a block's input alone, e B Tl C (the paper's 2sbh at e = 2, /t under sp), and the
backward makes one block's `layer_bytes` again. TP + SP + selective at the paper's 2-byte
activations and 1-byte masks: sbh/t 34 per layer, eq. 4 without its 5as/h.
"""

from __future__ import annotations

from dataclasses import dataclass

from refpar.analysis.intra_layer import RankShape
from refpar.config import ModelConfig
from refpar.precision import dtype_of
from refpar.sharding import shard_sizes


@dataclass(frozen=True)
class Keep:
    """What is kept beyond the paper's list, and how big a dropout mask is."""

    mask_bytes: int | None  # bytes per mask element; None: the activation's e (refpar's scale array)
    ln_rstd: bool  # LayerNorm keeps 1/std per token
    gelu_tanh: bool  # the GELU keeps tanh(...) beside its input


REFPAR = Keep(mask_bytes=None, ln_rstd=True, gelu_tanh=True)
PAPER = Keep(mask_bytes=1, ln_rstd=False, gelu_tanh=False)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Per layer, 16-bit activations: eq. 1 (t = 1), eq. 2 (tensor parallel), eq. 4 (with sp)."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def core_bytes(model: ModelConfig, r: RankShape, attention: str = "local", dropout: bool = True,
               keep: Keep = REFPAR) -> int:
    """What one block's attention core keeps beyond its inputs q, k, v: what selective recomputation
    drops and the backward makes again."""
    e, B, nh, hs = r.e, r.B, r.nh, model.head_size
    mask = (e if keep.mask_bytes is None else keep.mask_bytes) if dropout else 0
    if attention == "local":  # softmax output, its mask, its dropout output
        return B * nh * r.Ta * r.Ta * (e + (mask + e if dropout else 0))
    if attention == "ring":  # out and lse for the backward's softmax; the bool mask rows
        # lse is a float32 statistic when the activations are 16-bit
        return B * nh * r.Ta * (e * hs + (4 if e == 2 else e)) + (B * nh * r.Ta * r.T if dropout else 0)
    # Ulysses: the head-sharded q, k, v and local attention's arrays over all T
    nh_c = shard_sizes(nh, r.c)[r.cp_rank]
    return 3 * B * nh_c * r.T * hs * e + B * nh_c * r.T * r.T * (e + (mask + e if dropout else 0))


def layer_bytes(model: ModelConfig, r: RankShape, attention: str = "local", dropout: bool = True,
                keep: Keep = REFPAR, recompute: str = "none") -> int:
    """One block on one rank: residual-stream terms over Tl tokens, region terms over Ta tokens
    and this rank's heads and columns; with `recompute` (module docstring) what it keeps then."""
    e, B, C = r.e, r.B, model.n_embd
    if recompute == "full":  # the block's input
        return e * B * r.Tl * C
    mask = (e if keep.mask_bytes is None else keep.mask_bytes) if dropout else 0
    Cl = C // r.t  # this rank's channels of the region (its heads' columns)
    resid = B * r.Tl * (2 * e * C  # the inputs of ln_1 and ln_2 (refpar keeps x-hat, the same size)
                        + 2 * e * C  # ln outputs, kept by c_attn and c_fc (sharded under SP)
                        + 2 * mask * C  # the attn_resid and mlp_resid dropout masks
                        + (2 * e if keep.ln_rstd else 0))  # rstd of both LayerNorms
    region = B * r.Ta * e * (Cl  # c_proj's input (the merged heads)
                             + 4 * Cl + 4 * Cl  # GeLU's input, the second linear's input
                             + (4 * Cl if keep.gelu_tanh else 0))
    if attention != "ulysses" or recompute == "selective":  # the core's inputs q, k, v (one buffer)
        region += B * r.Ta * e * 3 * Cl
    if recompute != "selective":
        region += core_bytes(model, r, attention, dropout, keep)
    return resid + region


def embed_bytes(model: ModelConfig, r: RankShape, dropout: bool = True) -> int:
    """Vocab-parallel embedding: the looked-up token ids (int64; the backward finds its rows among
    them again), and the embd dropout mask."""
    return r.B * r.Ta * 8 + (r.B * r.Tl * model.n_embd * r.e if dropout else 0)


def head_bytes(model: ModelConfig, r: RankShape) -> int:
    """ln_f (x-hat, rstd), its output kept by the LM head, over this rank's vocabulary rows (B, Ta,
    V/t) the softmax probabilities, and the int64 targets (the backward makes their one-hot rows
    again, as the model's cross-entropy does)."""
    C = model.n_embd
    return r.B * r.Tl * r.e * (C + 1 + C) + r.B * r.Ta * (r.e * r.V + 8)


def llama_layer_bytes(config: ModelConfig, b: int, T: int, heads: int | None = None,
                      kv_heads: int | None = None, ff: int | None = None, keep_refpar: bool = True,
                      Tl: int | None = None, Ta: int | None = None, attention: str = "local",
                      cp: int = 1, cp_rank: int = 0, recompute: str = "none") -> int:
    """One Llama block's kept bytes (refpar/model/llama.py's caches, each buffer once), for b
    sequences of T tokens, kv = n_kv_head * head_size; on a tp rank (llama_pieces) of its
    `heads` query heads, `kv_heads` kv heads and `ff` SwiGLU columns, where C in the inside terms is
    its heads' columns (the RMSNorms and their outputs stay whole); on a cp rank of cp ranks holding
    `Ta` of the tokens (default T), attention "ring" or "ulysses"; under sp of the `Tl` tokens of its
    sequence shard (default Ta). Nl = b Tl, Na = b Ta:

        outside  4 e Nl C: the inputs of both RMSNorms (refpar keeps x-hat, the same size) and their
                 outputs, which q, k, v and gate, up keep (the shard: the backward gathers it again)
        inside   e Na (C + kv + kv + C + 3F): the rotated q and k, v, o_proj's input (the merged
                 heads), gate's and up's outputs and down's input
        scores   e nh Ta T b: the softmax probabilities (no dropout) of the rank's queries

    which is the planner's analysis/scale.layer_activation_bytes for a SwiGLU, GQA, dropout-free
    block, its sp and cp divisions and its recompute modes included (tests show it): the attention
    core beyond q, k, v is `llama_core_bytes`, which "selective" drops (keeping q, k, v, the core's
    inputs); "full" keeps the block's input alone, e Nl C. Ulysses keeps its core's q, k, v (head-
    sharded) instead of the sequence-sharded ones. `keep_refpar` adds what refpar keeps beyond the
    planner: each RMSNorm's 1/rms per token (2 e Nl) and the block's RoPE cos and sin tables of its
    positions (2 e Ta hs)."""
    hs, e, C = config.head_size, dtype_of(config.dtype).itemsize, config.n_embd
    nh = config.n_head if heads is None else heads
    nkv = config.n_kv_head if kv_heads is None else kv_heads
    F = config.intermediate_size if ff is None else ff
    Ta = T if Ta is None else Ta
    Tl = Ta if Tl is None else Tl
    Na, Nl, Ch, kv = b * Ta, b * Tl, nh * hs, nkv * hs  # tokens; the shard's; the heads' columns
    if recompute == "full":
        return e * Nl * C
    n = 4 * e * Nl * C + e * Na * (Ch + 3 * F)  # the norms; o_proj's input, gate's and up's outputs, down's
    if attention != "ulysses" or recompute == "selective":
        n += e * Na * (Ch + 2 * kv)  # q, k, v
    if recompute != "selective":
        n += llama_core_bytes(config, b, T, nh, nkv, Ta, attention, cp, cp_rank)
        if attention == "ring" and nh == 1:  # the merged heads o_proj keeps are a view of the output
            n -= e * Na * Ch
    return n + (2 * e * Nl + 2 * e * Ta * hs if keep_refpar else 0)


def llama_core_bytes(config: ModelConfig, b: int, T: int, heads: int, kv_heads: int, Ta: int,
                     attention: str = "local", cp: int = 1, cp_rank: int = 0) -> int:
    """What a Llama block's attention core keeps beyond its inputs q, k, v (`llama_layer_bytes`'
    legend): the scores e nh Ta T b; under Ulysses the head-sharded q, k, v and scores of its heads
    nh_c, nkv_c (shard_range over cp) over all T, the planner's numbers split by heads; under ring
    attention no scores (context_parallel.py: the backward makes each block's again from the
    log-sum-exp) but its output e Na C and the log-sum-exp b nh Ta (float32 under 16 bits)."""
    hs, e = config.head_size, dtype_of(config.dtype).itemsize
    if attention == "ulysses":
        nh_c, nkv_c = shard_sizes(heads, cp)[cp_rank], shard_sizes(kv_heads, cp)[cp_rank]
        return e * b * T * hs * (nh_c + 2 * nkv_c) + e * nh_c * b * T * T
    if attention == "ring":
        return e * b * Ta * heads * hs + b * heads * Ta * (4 if e == 2 else e)
    return e * heads * Ta * T * b


def mla_attention_elements(Nl, Na, Ta, heads, rq, rkv, dn, dr, dv, keep_refpar: bool = True,
                           qkv: bool = True):
    """Elements multi-head latent attention keeps for its backward between the block's first
    norm's output and o_proj (refpar/parallel/mla_tensor_parallel.py's caches, each buffer once),
    the attention core's own and the norm's output aside: Nl of the residual stream's tokens (the
    sequence shard under sp), Na = b Ta of the region's, `heads` this rank's; rq = 0 without a
    query latent (q_proj reads the norm's output).

        latents   Nl (2 rq + 2 rkv): each latent RMSNorm's x-hat, and its output, which the up-
                  projection keeps (the shard: under sp the backward gathers it again)
        heads     Na heads (2 dq + dn + dv): the rotated q and k, the up-projected key-value buffer
                  (v is a view of it, so it is kept whole), the core's inputs; `qkv` False where
                  the core keeps its own copies instead (Ulysses' head-sharded ones)
        output    Na heads dv: o_proj's input (the merged heads)

    `keep_refpar` adds what refpar keeps beyond the planner's count: each latent RMSNorm's 1/rms
    per token (Nl each) and the block's RoPE cos and sin of its positions (2 Ta dr). Every size may
    be a NumPy array (the planner prices a grid of meshes in one call)."""
    dq = dn + dr
    n = Nl * (2 * rq + 2 * rkv) + Na * heads * ((2 * dq + dn + dv if qkv else 0) + dv)
    if keep_refpar:
        n = n + Nl * ((rq > 0) + 1) + 2 * Ta * dr
    return n


def mla_layer_bytes(config: ModelConfig, b: int, T: int, heads: int | None = None, ff: int | None = None,
                    keep_refpar: bool = True, Tl: int | None = None, Ta: int | None = None,
                    attention: str = "local", cp: int = 1, cp_rank: int = 0, recompute: str = "none") -> int:
    """One DeepSeek-V3 block's kept bytes with a dense MLP (refpar/parallel/deepseek_pieces.py's
    caches), for b sequences of T tokens, on a tp rank of its `heads` heads and `ff` SwiGLU columns,
    on a cp rank of cp ranks holding `Ta` of the tokens (default T), attention "ring" or "ulysses",
    under sp of the `Tl` tokens of its sequence shard (default Ta); a MoE block's MLP terms give
    way to analysis/moe.py's. Nl = b Tl, Na = b Ta:

        outside  4 e Nl C + 2 e Nl: both RMSNorms' inputs (x-hat) and outputs (the first's kept by
                 the down-projections, the second's by gate and up), their 1/rms (refpar's)
        latent   e `mla_attention_elements`
        mlp      e Na 3F: gate's and up's outputs, down's input (llama_layer_bytes' SwiGLU)
        core     `mla_core_bytes`: the scores, or ring attention's output and log-sum-exp, or
                 Ulysses' head-sharded q, k, v and their scores (which replace the sequence-sharded
                 q, k and key-value buffer)

    "selective" drops the core (it keeps q, k, v alone); "full" keeps the block's input alone, e Nl C."""
    e, C = dtype_of(config.dtype).itemsize, config.n_embd
    nh = config.n_head if heads is None else heads
    F = config.intermediate_size if ff is None else ff
    Ta = T if Ta is None else Ta
    Tl = Ta if Tl is None else Tl
    if recompute == "full":
        return e * b * Tl * C
    n = e * (4 * b * Tl * C + b * Ta * 3 * F) + (2 * e * b * Tl if keep_refpar else 0)
    n += e * mla_attention_elements(b * Tl, b * Ta, Ta, nh, config.q_lora_rank or 0, config.kv_lora_rank,
                                    config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
                                    keep_refpar, qkv=attention != "ulysses" or recompute == "selective")
    if recompute != "selective":
        n += mla_core_bytes(config, b, T, nh, Ta, attention, cp, cp_rank)
        if attention == "ring" and nh == 1:  # the merged heads o_proj keeps are a view of the output
            n -= e * b * Ta * config.v_head_dim
    return n


def mla_core_bytes(config: ModelConfig, b: int, T: int, heads: int, Ta: int, attention: str = "local",
                   cp: int = 1, cp_rank: int = 0) -> int:
    """What a DeepSeek-V3 block's attention core keeps beyond q, k, v (`mla_layer_bytes`' legend),
    which selective recomputation makes again: the softmax probabilities e heads Ta T b (no dropout);
    under ring attention (context_parallel.py) the output e b Ta heads dv and the log-sum-exp b heads
    Ta (float32 under 16 bits) instead; under Ulysses the head-sharded q and k (dn + dr each) and v
    (dv) of its heads nh_c (shard_range over cp) over all T, and their scores."""
    e, dv = dtype_of(config.dtype).itemsize, config.v_head_dim
    dq = config.qk_nope_head_dim + config.qk_rope_head_dim
    if attention == "ulysses":
        nh_c = shard_sizes(heads, cp)[cp_rank]
        return e * b * T * nh_c * (2 * dq + dv) + e * nh_c * b * T * T
    if attention == "ring":
        return e * b * Ta * heads * dv + b * heads * Ta * (4 if e == 2 else e)
    return e * heads * Ta * T * b
