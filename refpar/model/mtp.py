"""DeepSeek-V3's multi-token prediction (MTP; Liu et al. 2024, section 2.2) as a forward/backward pair
for each depth, the convention of Megatron-Core 0.16.1's MultiTokenPredictionLayer and GPTModel
(transformers' DeepseekV3ForCausalLM has no MTP module, so Megatron-Core's is the reference).

    python -m pytest tests/test_deepseek_hf.py -k multi_token    # against HF's modules in its convention

Legend: B batch, T sequence, C channels, V vocab, D depths (num_nextn_predict_layers), k a depth
1..D, T_k = T - k the positions depth k predicts at.

Depth k, module index L = n_layer + k - 1 (DeepSeek-V3's checkpoint keeps its one MTP module as
model.layers.61 after 61 blocks), at position i < T_k:

    z_i   = eh_proj [enorm(embed(t_{i+k})); hnorm(h_i^{k-1})]       (B, T_k, C): eh_proj (C, 2C)
    h^k   = shared_head.norm(block_L(z))                          (B, T_k, C): a DeepSeek block
    loss_k = cross-entropy of h^k @ head.T against t_{i+k+1}, averaged over the B T_k positions

h^0 is the main model's last hidden state after model.norm (Megatron-Core's decoder applies its
final norm before the MTP block), the embedding and the head are the main model's own (shared, not
copied), the concatenation puts the embedding first (Megatron-Core's and DeepSeek's checkpoints;
the paper's eq. 21 writes the other order, which only permutes eh_proj's columns), and block_L is
an MoE block when the model has experts (V3's MTP module is). The training loss adds
mtp_loss_weight / D * sum_k loss_k (eq. 24-25), and the MTP blocks' router losses with weight 1.
Megatron-Core rolls the token ids left and masks each depth's last positions; here depth k runs on
the T_k positions whose target is known, the same numbers, as attention is causal.

In refpar the targets are the tokens shifted by one (targets[i] = t_{i+1}), so depth k reads
embed(targets[:, k-1 : T-1]) and predicts targets[:, k:].
"""

from __future__ import annotations

from array_api_compat import array_namespace, device

from refpar.model.layers import add_grads, cross_entropy_backward, cross_entropy_forward
from refpar.model.llama_layers import (
    linear_t_backward,
    linear_t_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    token_embedding_backward,
    token_embedding_forward,
)

EMBED = "model.embed_tokens.weight"


def mtp_layer(config, k: int) -> int:
    """The module index of depth k: its parameters are model.layers.{n_layer + k - 1}.*."""
    return config.n_layer + k - 1


def mtp_param_shapes(config, k: int) -> dict[str, tuple[int, ...]]:
    """Depth k's own parameters other than its block's, by full name (DeepSeek-V3's checkpoint names)."""
    C, p = config.n_embd, f"model.layers.{mtp_layer(config, k)}."
    return {p + "enorm.weight": (C,), p + "hnorm.weight": (C,), p + "eh_proj.weight": (C, 2 * C),
            p + "shared_head.norm.weight": (C,)}


def mtp_forward(h, targets, params, k: int, config, head: str, block_forward, normalizer):
    """h (B, T_{k-1}, C) the previous depth's hidden state (k = 1: the main model's after model.norm),
    targets (B, T) -> (loss_k (a 0-d array, sum / normalizer), h^k (B, T_k, C), cache).
    `block_forward(x, params, layer)` runs block L; `head` is the head matrix's name."""
    xp = array_namespace(h)
    P, p, eps = params, f"model.layers.{mtp_layer(config, k)}.", config.norm_eps
    T_k = h.shape[1] - 1
    e, c_emb = token_embedding_forward(targets[:, k - 1:k - 1 + T_k], P[EMBED])  # (B, T_k, C): t_{i+k}
    e, c_en = rmsnorm_forward(e, P[p + "enorm.weight"], eps)  # (B, T_k, C)
    g, c_hn = rmsnorm_forward(h[:, :T_k, ...], P[p + "hnorm.weight"], eps)  # (B, T_k, C)
    z, c_proj = linear_t_forward(xp.concat([e, g], axis=-1), P[p + "eh_proj.weight"])  # (B, T_k, C)
    y, c_block = block_forward(z, P, mtp_layer(config, k))  # (B, T_k, C)
    hk, c_norm = rmsnorm_forward(y, P[p + "shared_head.norm.weight"], eps)  # (B, T_k, C)
    logits, c_head = linear_t_forward(hk, P[head])  # (B, T_k, V)
    loss, c_ce = cross_entropy_forward(logits, targets[:, k:k + T_k], normalizer)  # (): t_{i+k+1}
    return loss, hk, (p, head, c_emb, c_en, c_hn, c_proj, c_block, c_norm, c_head, c_ce)


def mtp_backward(dloss, dhk, cache, block_backward):
    """dloss: the weight of loss_k in the training loss (times the fp16 scale); dhk (B, T_k, C) the
    next depth's gradient of h^k, or None -> (dh (B, T_{k-1}, C), {name: grad}), the shared embedding's
    and head's shares among the grads. `block_backward(dy, cache) -> (dx, grads)` is block L's."""
    p, head, c_emb, c_en, c_hn, c_proj, c_block, c_norm, c_head, c_ce = cache
    g = {}
    dlogits = cross_entropy_backward(dloss, c_ce)  # (B, T_k, V)
    dh_k, g[head] = linear_t_backward(dlogits, c_head)  # (B, T_k, C)
    if dhk is not None:
        dh_k = dh_k + dhk
    dy, g[p + "shared_head.norm.weight"] = rmsnorm_backward(dh_k, c_norm)  # (B, T_k, C)
    dz, g_block = block_backward(dy, c_block)  # (B, T_k, C)
    g.update(g_block)
    dcat, g[p + "eh_proj.weight"] = linear_t_backward(dz, c_proj)  # (B, T_k, 2C)
    C = dz.shape[-1]
    de, g[p + "enorm.weight"] = rmsnorm_backward(dcat[..., :C], c_en)  # (B, T_k, C)
    dg, g[p + "hnorm.weight"] = rmsnorm_backward(dcat[..., C:], c_hn)  # (B, T_k, C)
    demb = token_embedding_backward(de, c_emb)  # (V, C)
    add_grads(g, {EMBED: demb})  # a tied head is the embedding too
    xp = array_namespace(dg)
    last = xp.zeros((dg.shape[0], 1, C), dtype=dg.dtype, device=device(dg))  # (B, 1, C): feeds no depth k
    return xp.concat([dg, last], axis=1), g  # (B, T_{k-1}, C)
