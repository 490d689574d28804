"""Lesson 13 exercise: the model-state bytes one rank holds under ZeRO in bf16-mixed.

    refpar lesson check 13

bf16-mixed with AdamW keeps, per parameter: 2 bytes of bf16 weight, 2 of bf16 gradient, 4 of fp32
master weight and 8 of fp32 moments (m and v): the ZeRO paper's 2Ψ + 2Ψ + 12Ψ. ZeRO stage 1 shards
the master weights and moments over the n data-parallel ranks, stage 2 also the gradients, stage 3
also the weights; stage 0 is plain data parallelism, every rank holding everything.

refpar shards *units* (`unit_sizes`: the embeddings and final LayerNorm, then one unit per block),
each split on its own as evenly as possible, the first `size % n` ranks taking one element more
(`refpar.sharding.shard_range`, lesson 0). So a rank's shard is the sum of its part of every unit.

With `fp32_grads` (`--fp32-grads`) the gradients are accumulated in an fp32 buffer (4 bytes). Backward
still writes each gradient in bf16 first: DP and ZeRO-1 keep that whole bf16 gradient beside the whole
fp32 one (6 bytes per parameter, 20Ψ in all for DP); from ZeRO-2 on only the fp32 shard stays.
"""


def model_state_bytes(unit_sizes: dict[str, int], n: int, rank: int, stage: int,
                      fp32_grads: bool = False) -> dict[str, int]:
    """Bytes rank `rank` of `n` holds between steps, by category: {"params": ..., "grads": ...,
    "master": ..., "optimizer": ...}, for a model made of units of `unit_sizes` elements."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write model_state_bytes(unit_sizes, n, rank, stage, fp32_grads) for "
                              "bf16-mixed AdamW, stages 0-3")
    # ---- end of your part -----------------------------------------------------------------------
