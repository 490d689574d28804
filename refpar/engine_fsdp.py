"""FSDP inside the engine's pipeline: ZeRO-3's shards (engine_zero3.ZeroThree) organised by units,
as PyTorch's fully_shard does it (Zhao et al. 2023), for stages of tensor-parallel blocks.

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --fsdp --microbatches 2 --check

Legend: Ψ_u elements of unit u on this rank (a tp shard), s_u its share over the d ranks of
the mesh's dp_cp group (dp, or dp x cp).

Units of a stage: the tied `wte` alone (as under ZeRO-3, so that the first and the last stage sum
its gradient shard by shard), the stage's other root parameters (wpe on the first stage, ln_f on
the last) together, and one unit per block. Where the engine's ZeRO-3 gathers a whole stage for
each action, FSDP gathers each unit just before the piece that reads it and frees it right after
(reshard_after_forward), so one block is held gathered at a time:

    F   embedding: wte and root gathered; each block: its unit gathered, run, cache detached
        (engine_zero3.detach), freed; head: root and wte gathered, run, detached, freed
    B   head: root and wte gathered again, backward, freed, their gradients kept; each block:
        gathered, backward, freed, its gradient reduce-scattered at once; embedding: its backward
        reads only the parameters' row counts, so nothing is gathered. wte's and root's gradients
        are reduce-scattered once complete: after the head on the last stage, after the embedding
        on the first (on a stage that is both, at the end, as FSDP reduces its root last)

Per microbatch and stage over the d ranks: each block (d-1)/d Ψ_b gathered twice and reduced once;
the ends' units gathered once on the first stage, twice on the last, and reduced once.

ZeRO-2 runs the same UnitStage on engine_zero3.ZeroTwo, whose gather and release move nothing
(the parameters are whole on every rank): what it keeps is the unit-by-unit reduce-scatter.
"""

from __future__ import annotations

from array_api_compat import array_namespace, device

from refpar.engine_zero3 import ZeroThree, attach, detach
from refpar.holdings import ENDS
from refpar.memory import nbytes_of
from refpar.parallel.pipeline.stage import Stage
from refpar.parallel.tensor_parallel import (
    parallel_block_backward,
    parallel_block_forward,
    vocab_parallel_embedding_backward,
    vocab_parallel_embedding_forward,
    vocab_parallel_head_backward,
    vocab_parallel_head_forward,
)


class UnitStage(Stage):
    """Stage `stage` of tensor-parallel pieces on layout `lay` that asks `zero` (a ZeroThree or a
    ZeroTwo over fsdp_units) for its units piece by piece and hands it each unit's gradient as
    soon as it is complete; the same blocks, names and ends as stage.Stage."""

    moe = None  # the MoE blocks' layer (refpar/engine_moe_zero.MoEUnitStage); None in dense models

    def __init__(self, config, n_stages: int, stage: int, lay, zero: ZeroThree):
        super().__init__(config, n_stages, stage)
        self.lay, self.zero = lay, zero

    def block_units(self, layer: int) -> tuple[str, ...]:
        """The units a block's piece gathers and reduces: the block (MoE stages add its experts)."""
        return (f"h.{layer}",)

    def forward(self, params, x, targets, drop, normalizer):
        """F: tokens (b, T) on the first stage or (b, Tl, C) -> (b, Tl, C), or the loss on the last."""
        lay, zero, s = self.lay, self.zero, self.stage
        c_embed = c_head = None
        if self.first:
            p, bases = zero.gather(s, "embed:fwd", ENDS)
            x, c_embed = vocab_parallel_embedding_forward(x[:, lay.region_pos], p, lay, drop)
            zero.release(bases)  # the embedding's cache holds no parameter
        c_blocks = []
        for layer in self.layers:
            p, bases = zero.gather(s, "fwd", self.block_units(layer))
            x, c = parallel_block_forward(x, p, layer, lay, drop, self.moe)  # (b, Tl, C)
            c_blocks.append(detach(c, bases))
            zero.release(bases)
        if self.last:
            p, bases = zero.gather(s, "head:fwd", ENDS)
            x, c_head = vocab_parallel_head_forward(x, p, targets[:, lay.region_pos], lay, normalizer)
            c_head = detach(c_head, bases)
            zero.release(bases)
        return x, (c_embed, c_blocks, c_head)

    def backward_input(self, dout, cache):
        """B, the whole backward: dx (b, Tl, C) (None on the first stage); the gradients go into
        the shards, so none are returned."""
        c_embed, c_blocks, c_head = cache
        lay, zero, s, ledger = self.lay, self.zero, self.stage, self.zero.ledger
        ends, d = {}, dout  # wte's and root's gradients, reduced once they are complete
        if self.last:
            _, bases = zero.gather(s, "head:bwd", ENDS)
            d, ends = vocab_parallel_head_backward(attach(c_head, bases), lay, self.dloss)  # (b, Tl, C)
            zero.release(bases)
            if not self.first:  # complete: reduce them now rather than hold them through the blocks
                zero.reduce(s, ends, ENDS)
                ends = {}
            else:  # the embedding adds to wte's: held until the end of B
                ledger.alloc("grads.ends", sum(nbytes_of(g) for g in ends.values()), "grads")
        for layer, c in zip(reversed(self.layers), reversed(c_blocks), strict=True):
            _, bases = zero.gather(s, "bwd", self.block_units(layer))
            d, grads = parallel_block_backward(d, attach(c, bases), layer, lay)  # (b, Tl, C)
            zero.release(bases)
            zero.reduce(s, grads, self.block_units(layer))
        if self.first:
            g = vocab_parallel_embedding_backward(d, c_embed, lay, self._row_counts(d))
            ends["wte.weight"] = ends["wte.weight"] + g["wte.weight"] if self.last else g["wte.weight"]
            ends["wpe.weight"] = g["wpe.weight"]
            d = None
            if self.last:
                ledger.free("grads.ends")  # reduce holds them again while it reduces them
            zero.reduce(s, ends, ENDS)
        return d, {}

    def _row_counts(self, like) -> dict:
        """Stand-ins for wte and wpe: the embedding's backward reads only their numbers of rows
        (V/t and n_positions), so zero-width arrays spare gathering them."""
        xp, lay = array_namespace(like), self.lay
        rows = {"wte.weight": lay.vocab[1] - lay.vocab[0], "wpe.weight": self.config.n_positions}
        return {n: xp.zeros((r, 0), dtype=like.dtype, device=device(like)) for n, r in rows.items()}

    def backward_weight(self, saved) -> dict:
        """W: B already computed the weight gradients (tensor-parallel pieces fuse the halves)."""
        return saved
