"""One pipeline stage of either model family, for every mesh: a contiguous run of blocks, with the
embedding on the first stage and the final norm plus the LM head on the last (GPT-2's tied to
wte). No communication of its own: what moves is the pieces' (tensor, sequence, context and expert
parallelism) and the model states'.

    mpiexec -n 2 python -m refpar train --mesh pp=2 --schedule zb-h1 --microbatches 4 --check

Legend: B microbatch rows, T sequence, Tl this rank's tokens of the residual stream (T, or its cp
and sp share), C channels, V vocab. The schedule cuts the model into P parts (its p x v stages;
DualPipe's p, twice: schedules.StageMap.part); part k holds blocks shard_range(L, P, k), so a loop's
stage = chunk * p + rank, and a V's stages r and 2p-1-r, hold layers that follow the previous
stage's.

Each stage runs the three actions of a schedule:

    out, cache = stage.forward(x, targets, drop, normalizer, mb)      # F: x (B, Tl, C) or tokens
    dx, saved  = stage.backward_input(dout, cache, mb, weight=True)    # B: the input gradient
    stage.backward_weight(saved)                                       # W: weight gradients

and every piece inside them (the embedding, each block, the head) asks the stage's `states` (the
data-parallel strategy, refpar/parallel/model_states.py) for its units' parameters just before it runs and
hands them back right after (`acquire` / `release`: ZeRO-3 and FSDP gather and free them there),
then gives its gradients to the states (`fold`) and says which units are complete (`done`: DP's
buckets and ZeRO's reduce-scatters start there). So ZeRO-3, FSDP and DP plug into this one class.

The pieces are those of the layout `lay` (refpar/parallel/pieces.py, one table per family): the
trivial layout where nothing is split (a dp, pp or single-device mesh), which runs the model's
layers in the model's order, bit for bit the single device's; tensor parallelism's otherwise
(vocab-parallel embedding and head, the f/g or sp pairs, ring or Ulysses attention under cp, the
expert-parallel layer `moe` in MoE blocks). Each piece's backward is split in two as zero-bubble
schedules need (Qi et al. 2023, section 2): its input half computes what the previous stage waits
for (dx, with every collective dx needs) and returns its weight half's work (each linear's input
and output gradient), which W turns into weight gradients (x.T @ dout); nobody downstream waits for
them. With `weight` (a schedule without W for this microbatch) each piece's weight half runs right
after its input half. A model with MoE blocks runs them right away always: the MoE layer's backward
(refpar/model/moe.py) computes its gradients fused.

Recomputation (refpar/parallel/recompute.py, `recompute`): under "full" a block keeps only its
input and its backward runs the block again first; under "selective" the layout's attention core
is a recompute.SelectiveAttention, which keeps q, k, v alone and runs its forward again inside its
backward.

Mixed precision: the pieces run under `fp32_compute` (16-bit in, fp32 GEMMs, 16-bit out); `dloss`
(the fp16 loss scale, set by the executor for a step) starts the last stage's backward.
"""

from __future__ import annotations

from functools import partial

from refpar.holdings import ENDS, stage_layers
from refpar.model.gpt import DropoutContext
from refpar.parallel.pieces import family, head_backward, head_forward
from refpar.parallel.tensor_parallel import weight_grads
from refpar.parallel.views import attach, detach


class Stage:
    """Part `part` of the model `config` cut in `n_parts` (the stage's schedules.StageMap.part); `units`
    the unit keys this rank holds of it (refpar/holdings.py), `states` its data-parallel strategy,
    `lay` its tensor_parallel.Layout, `moe` the expert-parallel layer of its MoE blocks. A MoE stage
    routes each microbatch with `runs[sample ids]` (routing_runs.RoutingRuns) and files its
    blocks' routing under the microbatch's sample ids in `routings` (shared by the rank's stages).
    `kv`: the mesh's "kv" group, where Llama's tp ranks replicate kv heads (else None).
    `recompute`: the rank's recompute.Recompute, or None (nothing recomputed)."""

    def __init__(self, config, n_parts: int, part: int, units: list[str], states, lay, moe=None,
                 runs=None, routings=None, kv=None, recompute=None):
        self.config, self.part, self.states, self.lay, self.kv = config, part, states, lay, kv
        self.pieces, self.recompute = family(config), recompute
        self.full = recompute is not None and recompute.mode == "full"
        self.fused = bool(config.moe_experts)  # the MoE layer's backward gives its gradients at once
        self.moe, self.runs, self.routings = moe, runs, routings
        self.dloss = 1.0  # where the last stage's backward starts: 1, or an fp16 run's loss scale
        self.layers = stage_layers(config.n_layer, n_parts, part)
        self.first, self.last = part == 0, part == n_parts - 1
        self.ends = tuple(u for u in ENDS if u in units)
        self.blocks = {i: tuple(u for u in (f"h.{i}", f"h.{i}.experts") if u in units) for i in self.layers}

    def _pieces(self, forward: bool) -> list[tuple]:
        """The units of each piece of an action, in the order it runs them."""
        pieces = [self.blocks[i] for i in self.layers]
        if forward:
            return ([self.ends] if self.first else []) + pieces + ([self.ends] if self.last else [])
        return ([self.ends] if self.last else []) + pieces[::-1]

    def _acquire(self, j: int, pieces: list, phase: str, mb: int):
        following = pieces[j + 1] if j + 1 < len(pieces) else ()
        return self.states.acquire(pieces[j], phase, (self.part, mb), following)

    def _block(self, x, p, layer: int, drop):
        """Block `layer`'s forward: (out (B, Tl, C), cache)."""
        return self.pieces.block(x, p, layer, self.lay, drop, self.moe, self.kv)

    # -- F --------------------------------------------------------------------------------------
    def forward(self, x, targets, drop: DropoutContext, normalizer, mb: int = 0):
        """F. x is tokens (B, T) on the first stage, the previous stage's output (B, Tl, C) after.
        Returns the output (B, Tl, C), or the loss (a 0-d array) on the last stage, and the cache."""
        states, pieces, lay = self.states, self._pieces(True), self.lay
        if self.moe is not None:
            self.moe.runs = self.runs[drop.sample_ids]  # this microbatch's token runs
        c_embed = c_head = None
        j = 0
        if self.first:
            p, bases = self._acquire(j, pieces, "embed:fwd", mb)
            x, c_embed = self.pieces.embed(x[:, lay.region_pos], p, lay, drop)  # (B, Tl, C)
            c_embed = detach(c_embed, bases)
            del p, bases  # no reference left, so a gathered unit is really freed
            states.release(self.ends, "embed:fwd", (self.part, mb))
            j += 1
        c_blocks = []
        for layer in self.layers:
            p, bases = self._acquire(j, pieces, "fwd", mb)
            x_in = x
            x, c = self._block(x_in, p, layer, drop)  # (B, Tl, C)
            if self.full:  # the input alone; the backward runs the block again
                c = (x_in, drop)
            c_blocks.append(detach(c, bases))
            del p, bases, c, x_in
            states.release(self.blocks[layer], "fwd", (self.part, mb))
            j += 1
        if self.last:
            p, bases = self._acquire(j, pieces, "head:fwd", mb)
            x, c_head = head_forward(x, p, targets[:, lay.region_pos], lay, normalizer)  # a 0-d array
            c_head = detach(c_head, bases)
            del p, bases
            states.release(self.ends, "head:fwd", (self.part, mb))
        if self.moe is not None:
            for layer in self.layers:
                if layer in self.config.moe_blocks:
                    self.routings.setdefault(drop.sample_ids, {})[layer] = self.moe.last_routing[layer]
        return x, (c_embed, c_blocks, c_head)

    # -- B --------------------------------------------------------------------------------------
    def backward_input(self, dout, cache, mb: int = 0, weight: bool = True):
        """B. dout (B, Tl, C) is the next stage's input gradient (None on the last stage, where the
        loss starts it). Returns dx (B, Tl, C), None on the first stage, and what W needs: each
        piece's weight half's work (nothing with `weight`, or in a MoE model: given already)."""
        c_embed, c_blocks, c_head = cache
        states, pieces, hold, lay = self.states, self._pieces(False), (self.part, mb), self.lay
        now = weight or self.fused
        saved = []  # (units it completes, its weight half's work), in backward order

        def weights(done, work):  # each piece's weight half right away, or kept for W
            if now:
                self.backward_weight([(done, work)])
            else:
                saved.append((done, work))

        d, j = dout, 0
        if self.last:
            bases = self._acquire(j, pieces, "head:bwd", mb)[1]  # the cache holds what it reads
            d, work = head_backward(attach(c_head, bases), lay, self.dloss)  # (B, Tl, C)
            del c_head, bases
            states.release(self.ends, "head:bwd", hold)
            weights(() if self.first else self.ends, work)  # on a first stage the embedding completes them
            j += 1
        for layer, c in zip(reversed(self.layers), reversed(c_blocks), strict=True):
            p, bases = self._acquire(j, pieces, "bwd", mb)
            if self.full:  # the block's forward again, on its kept input and the acquired weights
                x_in, drop = c
                if self.moe is not None:
                    self.moe.runs = self.runs[drop.sample_ids]
                c = self.recompute.rerun(f"h.{layer}", partial(self._block, x_in, p, layer, drop),
                                         (x_in, *bases.values()))
                del x_in
            else:
                c = attach(c, bases)
            d, work = self.pieces.block_backward(d, c, layer, lay)  # (B, Tl, C)
            if self.full:
                self.recompute.done()
            del c, p, bases
            states.release(self.blocks[layer], "bwd", hold)
            weights(self.blocks[layer], work)
            j += 1
        if self.first:  # the embedding reads no parameter backward (it scatters rows)
            weights(self.ends, self.pieces.embed_backward(d, c_embed, lay))
            d = None
        return d, saved

    # -- W --------------------------------------------------------------------------------------
    def backward_weight(self, saved) -> None:
        """W: each piece's weight gradients from what B saved, given to the states piece by piece."""
        for done, work in saved:
            self.states.fold(weight_grads(work))
            self.states.done(done)
