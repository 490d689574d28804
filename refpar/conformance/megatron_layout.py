"""GPT-2's state dict in Megatron-Core's GPTModel layout, and back: names, orientation, and the
fused-QKV row order. NumPy only (refpar check imports it to name a QKV-layout bug).

Legend: C channels, nh heads, hs head size, V vocab, tp tensor-parallel ranks.

The fused QKV, the classic pitfall. GPT-2's c_attn is a Conv1D, weight[in, out] = (C, 3C), whose
output columns are [q | k | v], each C wide and split into heads of hs. Megatron's linear_qkv is a
ColumnParallelLinear, weight[out, in] = (3C, C), whose output rows are grouped per *query group*
(num_query_groups = nh for multi-head attention): for group g, its query heads' rows, then its key
head's, then its value head's:

    Megatron row   [ q_0 k_0 v_0 | q_1 k_1 v_1 | ... | q_{nh-1} k_{nh-1} v_{nh-1} ]   (hs rows each)
    GPT-2 column   [ q_0 q_1 ... q_{nh-1} | k_0 ... k_{nh-1} | v_0 ... v_{nh-1} ]

Tensor parallelism then cuts the (3C, C) weight into tp contiguous row blocks, so each rank gets
whole groups [q_g k_g v_g] of its heads (attention splits its rows per group:
`SelfAttention.get_query_key_value_tensors`). Copying GPT-2's c_attn.weight.T straight in runs
without an error (the shapes agree) and computes another model: rank 0's first head then reads
q_0's rows as q, q_1's as k and q_2's as v. `qkv_order` is the permutation; `wrong_qkv_model`
says which GPT-2 weights that mistake really computes with.

Everything else: Conv1D weights are transposed (nn.Linear orientation); wte is the vocabulary-
parallel embedding, shared with the output layer (`share_embeddings_and_output_weights`), split by
rows; c_fc is column-parallel (rows of linear_fc1 split), attn.c_proj and mlp.c_proj row-parallel
(columns of linear_proj and linear_fc2 split), their biases and the LayerNorms replicated.
"""

from __future__ import annotations

import numpy as np

# GPT-2 name (after "h.{i}.") -> Megatron's (after "decoder.layers.{i}."), and how tp splits it
BLOCK = {"ln_1.weight": "input_layernorm.weight", "ln_1.bias": "input_layernorm.bias",
         "attn.c_attn.weight": "self_attention.linear_qkv.weight",
         "attn.c_attn.bias": "self_attention.linear_qkv.bias",
         "attn.c_proj.weight": "self_attention.linear_proj.weight",
         "attn.c_proj.bias": "self_attention.linear_proj.bias",
         "ln_2.weight": "pre_mlp_layernorm.weight", "ln_2.bias": "pre_mlp_layernorm.bias",
         "mlp.c_fc.weight": "mlp.linear_fc1.weight", "mlp.c_fc.bias": "mlp.linear_fc1.bias",
         "mlp.c_proj.weight": "mlp.linear_fc2.weight", "mlp.c_proj.bias": "mlp.linear_fc2.bias"}
ROOT = {"wte.weight": "embedding.word_embeddings.weight",
        "wpe.weight": "embedding.position_embeddings.weight",
        "ln_f.weight": "decoder.final_layernorm.weight", "ln_f.bias": "decoder.final_layernorm.bias"}
# Megatron's tp split of its own tensor: the axis cut into tp contiguous blocks (None: replicated)
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "word_embeddings")  # output rows split: axis 0
ROW_PARALLEL_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")  # input columns split: axis 1


def names(n_layer: int) -> dict[str, str]:
    """{GPT-2 name: Megatron GPTModel parameter name}."""
    out = dict(ROOT)
    for i in range(n_layer):
        out |= {f"h.{i}.{k}": f"decoder.layers.{i}.{v}" for k, v in BLOCK.items()}
    return out


def qkv_order(C: int, hs: int) -> np.ndarray:
    """(3C,): Megatron's fused-QKV row m holds GPT-2's c_attn column qkv_order[m]."""
    heads = np.arange(C).reshape(C // hs, hs)  # head h's columns within q (and within k, v)
    return np.concatenate([np.concatenate([h, C + h, 2 * C + h]) for h in heads])


def split_axis(megatron_name: str) -> int | None:
    if any(f".{k}." in f".{megatron_name}" for k in COLUMN_PARALLEL):
        return 0
    if megatron_name.endswith(ROW_PARALLEL_WEIGHTS):
        return 1
    return None


def to_megatron(name: str, a: np.ndarray, C: int, hs: int) -> np.ndarray:
    """A GPT-2 tensor, whole, in Megatron's layout (whole: `shard` then cuts it)."""
    if ".attn.c_attn." in name:
        return (a.T if a.ndim == 2 else a)[qkv_order(C, hs)]  # (3C, C) or (3C,)
    return a.T if a.ndim == 2 and name.startswith("h.") else a


def from_megatron(name: str, a: np.ndarray, C: int, hs: int) -> np.ndarray:
    """Inverse of to_megatron."""
    if ".attn.c_attn." in name:
        b = np.empty_like(a)
        b[qkv_order(C, hs)] = a
        return b.T if b.ndim == 2 else b
    return a.T if a.ndim == 2 and name.startswith("h.") else a


def shard(megatron_name: str, a: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """Rank `rank`'s piece of a whole Megatron tensor (tp divides every split axis here)."""
    axis = split_axis(megatron_name)
    return a if axis is None else np.split(a, tp, axis=axis)[rank]


def wrong_qkv_model(params: dict, C: int, hs: int) -> dict:
    """The GPT-2 weights a Megatron model computes with when c_attn was copied in GPT-2's [q|k|v]
    order (c_attn.weight.T as linear_qkv.weight): Megatron reads that order as its own."""
    out = dict(params)
    for name in params:
        if ".attn.c_attn." in name:
            out[name] = from_megatron(name, params[name].T if params[name].ndim == 2 else params[name], C, hs)
    return out
