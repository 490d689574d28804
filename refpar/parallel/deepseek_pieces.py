"""DeepSeek-V3's pieces on a tensor_parallel.Layout: refpar/model/deepseek.py's block with its
multi-head latent attention split as refpar/parallel/mla_tensor_parallel.py splits it and its MLP
Llama's (refpar/parallel/llama_pieces.py's mlp_forward: the dense SwiGLU column- then row-parallel,
the MoE blocks' layer the stage's expert-parallel one, whose routed experts expert_tensor_parallel.py
splits over tp); the embedding and the final norm are Llama's (the same names and layers).

    mpiexec -n 2 python -m refpar train --model deepseek-tiny --mesh tp=2 --check

Legend: B batch, Tl the residual stream's tokens (T, or its sp shard), C channels.
On the trivial layout (no tp) the pieces compute deepseek.block_forward's numbers bit for bit.
Under sp the two RMSNorms and the residual stream run on this rank's sequence shard, as Llama's.
"""

from __future__ import annotations

from refpar.model.llama_layers import rmsnorm_backward, rmsnorm_forward
from refpar.parallel.llama_pieces import (
    embed_backward,
    embed_forward,
    mlp_backward,
    mlp_forward,
    norm_backward,
    norm_forward,
)
from refpar.parallel.mla_tensor_parallel import mla_backward, mla_forward
from refpar.parallel.tensor_parallel import Layout, given

__all__ = ["block_backward", "block_forward", "embed_backward", "embed_forward", "norm_backward",
           "norm_forward"]


def block_forward(x, params, layer: int, lay: Layout, drop=None, moe=None, kv=None):
    """x (B, Tl, C) -> (B, Tl, C): x + mla(input_layernorm(x)), then + mlp(post_attention_layernorm(.)),
    the MLP `moe.forward` in the MoE blocks. `drop` and `kv` (GPT-2's dropout, GQA's replica group)
    have no use here."""
    cfg, P = lay.config, f"model.layers.{layer}."
    a, c_ln1 = rmsnorm_forward(x, params[P + "input_layernorm.weight"], cfg.norm_eps)  # (B, Tl, C)
    o, c_attn = mla_forward(a, params, layer, lay)  # (B, Tl, C)
    x1 = x + o  # (B, Tl, C)
    m, c_ln2 = rmsnorm_forward(x1, params[P + "post_attention_layernorm.weight"], cfg.norm_eps)  # (B, Tl, C)
    d, c_mlp = mlp_forward(m, params, layer, lay, moe)  # (B, Tl, C)
    return x1 + d, (c_ln1, c_attn, c_ln2, c_mlp)


def block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, Tl, C) -> (dx (B, Tl, C), the block's weight half: [(function, arguments)])."""
    c_ln1, c_attn, c_ln2, c_mlp = cache
    P = f"model.layers.{layer}."
    dm, work = mlp_backward(dy, c_mlp, layer, lay)  # (B, Tl, C)
    dm, dw = rmsnorm_backward(dm, c_ln2)  # (B, Tl, C)
    work.append((given, ((P + "post_attention_layernorm.weight",), dw)))
    dx1 = dy + dm  # (B, Tl, C)
    da, w_attn = mla_backward(dx1, c_attn, lay)  # (B, Tl, C)
    da, dw = rmsnorm_backward(da, c_ln1)  # (B, Tl, C)
    return dx1 + da, work + w_attn + [(given, ((P + "input_layernorm.weight",), dw))]
