"""DeepSeek-V3's pieces on a tensor_parallel.Layout, so far the unsplit ones: each block is
refpar/model/deepseek.py's own block on the Layout's global positions, its gradients handed to the
weight half as they are; the embedding and the final norm are Llama's (the same names and layers).

    python -m refpar train --model deepseek-tiny

What runs it: one device, data parallelism with ZeRO and FSDP, pipeline stages and expert
parallelism (`moe` is the stage's expert-parallel layer), none of which splits a block's tokens or
heads. Tensor and context parallelism split multi-head latent attention's heads and positions and
are refused for arch="deepseek-v3" (refpar/engine/validate.py) until pieces of their own exist.
"""

from __future__ import annotations

from refpar.model import deepseek
from refpar.model.layers import as_like
from refpar.parallel.llama_pieces import embed_backward, embed_forward, norm_backward, norm_forward
from refpar.parallel.tensor_parallel import Layout, given

__all__ = ["block_backward", "block_forward", "embed_backward", "embed_forward", "norm_backward",
           "norm_forward"]


def block_forward(x, params, layer: int, lay: Layout, drop=None, moe=None, kv=None):
    """x (B, T, C) -> (B, T, C): deepseek.block_forward at the Layout's positions, the MoE blocks'
    MLP `moe.forward`. `drop` and `kv` (GPT-2's dropout, GQA's replica group) have no use here."""
    return deepseek.block_forward(x, params, layer, lay.config, positions=as_like(lay.region_pos, x), moe=moe)


def block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, T, C) -> (dx (B, T, C), the weight half: the block's gradients, computed already)."""
    dx, grads = deepseek.block_backward(dy, cache)
    return dx, [(given, (tuple(grads), *grads.values()))]
