"""One pipeline stage of either model family, for every mesh: a contiguous run of blocks, with the
embedding on the first stage and the final norm plus the LM head on the last (GPT-2's tied to
wte). No communication of its own: what moves is the pieces' (tensor, sequence, context and expert
parallelism) and the hooks'.

Legend: B microbatch rows, T sequence, Tl this rank's tokens of the residual stream (T, or its cp
and sp share), C channels, V vocab. The schedule cuts the model into P parts (its p x v stages;
DualPipe's p, twice: schedules.Layout.part); part k holds blocks shard_range(L, P, k), so a loop's
stage = chunk * p + rank, and a V's stages r and 2p-1-r, hold layers that follow the previous
stage's.

Each stage runs the three actions of a schedule:

    out, cache = stage.forward(x, targets, drop, normalizer, mb)      # F: x (B, Tl, C) or tokens
    dx, saved  = stage.backward_input(dout, cache, mb, weight=True)    # B: the input gradient
    stage.backward_weight(saved)                                       # W: weight gradients

and every piece inside them (the embedding, each block, the head) asks the stage's `hooks` (the
data-parallel strategy, refpar/parallel/units.py) for its units' parameters just before it runs and
hands them back right after (`acquire` / `release`: ZeRO-3 and FSDP gather and free them there),
then gives its gradients to the hooks (`fold`) and says which units are complete (`done`: DP's
buckets and ZeRO's reduce-scatters start there). So ZeRO-3, FSDP and DP plug into this one class.

Two kinds of pieces, one class:
- `lay` None (no tp, cp, sp or experts: a dp, pp or single-device mesh): the model's own layers
  (`block_forward`, `embed_forward`, `head_forward` of refpar/model/gpt.py or llama.py, chosen by
  `config.arch`). GPT-2's have the backward split in two as zero-bubble
  schedules need (Qi et al. 2023, section 2). B computes what the previous stage waits for (dx) and
  keeps, for W, the inputs and output gradients of every linear layer; W turns them into weight
  gradients (x.T @ dout), which nobody downstream waits for. With `weight` (a schedule without W
  for this microbatch) each piece's weight half runs right after its input half. The formulas are
  the model's (`linear_backward`, `layernorm_backward`, `embed_backward`), in the same order, so a
  stage computes the single device's gradients bit for bit. Llama's pieces run the model's own
  fused backward (`llama.block_backward`, `head_backward`, `embed_backward`), so B is its whole
  backward, as with the tensor-parallel pieces below.
- a tensor_parallel.Layout: tensor parallelism's pieces (vocab-parallel embedding and head, the
  f/g or sp pairs, ring or Ulysses attention under cp, the expert-parallel layer `moe` in MoE
  blocks). They compute input and weight gradients together, so B is the whole backward and W
  has nothing left to do: schedules that split B from W run, but gain nothing.

Recomputation (refpar/parallel/recompute.py, `recompute`): under "full" a block keeps only its
input and its backward runs `_block` again first; under "selective" the attention core keeps only
q, k, v (the Layout's core is a recompute.SelectiveAttention; the model's own block swaps its core's
cache for them here) and the core's backward runs its forward again.

Mixed precision: the pieces run under `fp32_compute` (16-bit in, fp32 GEMMs, 16-bit out); `dloss`
(the fp16 loss scale, set by the executor for a step) starts the last stage's backward.
"""

from __future__ import annotations

from functools import partial

from array_api_compat import array_namespace

from refpar.holdings import ENDS, stage_layers
from refpar.model import gpt, llama
from refpar.model.attention import attention_backward
from refpar.model.gemm import matmul
from refpar.model.gpt import DropoutContext, attention_core, embed_backward, merge_heads, split_heads
from refpar.model.layers import cross_entropy_backward, dropout_backward, gelu_backward, layernorm_backward
from refpar.parallel.pieces import family, head_backward, head_forward
from refpar.parallel.tensor_parallel import weight_grads
from refpar.parallel.units import attach, detach
from refpar.precision import fp32_compute


@fp32_compute
def _linear_dx(dout, cache):
    """The input half of `linear_backward`: dx = dout @ w.T (same formula, same order)."""
    x, w, _ = cache
    xp = array_namespace(dout, w)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, out)
    return xp.reshape(matmul(dout2, w.T), x.shape)  # (..., in)


@fp32_compute
def _linear_dw(x, dout):
    """The weight half of `linear_backward`: dw = x.T @ dout, db = sum of dout."""
    xp = array_namespace(dout, x)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, out)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, in)
    return matmul(x2.T, dout2), xp.sum(dout2, axis=0)  # (in, out), (out,)


class Stage:
    """Part `part` of the model `config` cut in `n_parts` (the stage's schedules.Layout.part); `units`
    the unit keys this rank holds of it (refpar/holdings.py), `hooks` its data-parallel strategy,
    `lay` its tensor_parallel.Layout
    (None: the model's own layers), `moe` the expert-parallel layer of its MoE blocks. A MoE stage
    routes each microbatch with `runs[sample ids]` (expert_parallel.RoutingRuns) and files its
    blocks' routing under the microbatch's sample ids in `routings` (shared by the rank's stages).
    `kv`: the mesh's "kv" group, where Llama's tp ranks replicate kv heads (else None).
    `recompute`: the rank's recompute.Recompute, or None (nothing recomputed)."""

    def __init__(self, config, n_parts: int, part: int, units: list[str], hooks, lay=None, moe=None,
                 runs=None, routings=None, kv=None, recompute=None):
        self.config, self.part, self.hooks, self.lay, self.kv = config, part, hooks, lay, kv
        self.recompute = recompute
        mode = "none" if recompute is None else recompute.mode
        self.full, self.selective = mode == "full", mode == "selective" and lay is None
        self.moe, self.runs, self.routings = moe, runs, routings
        self.dloss = 1.0  # where the last stage's backward starts: 1, or an fp16 run's loss scale
        # the model's own layers: GPT-2's (backward split for W) or Llama's (fused)
        self.own = llama if config.arch == "llama" else gpt
        self.fused = lay is not None or self.own is llama  # B computes the weight gradients too
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
        return self.hooks.acquire(pieces[j], phase, (self.part, mb), following)

    # -- F --------------------------------------------------------------------------------------
    def forward(self, x, targets, drop: DropoutContext, normalizer, mb: int = 0):
        """F. x is tokens (B, T) on the first stage, the previous stage's output (B, Tl, C) after.
        Returns the output (B, Tl, C), or the loss (a 0-d array) on the last stage, and the cache."""
        hooks, pieces = self.hooks, self._pieces(True)
        if self.moe is not None:
            self.moe.runs = self.runs[drop.sample_ids]  # this microbatch's token runs
        c_embed = c_head = None
        j = 0
        if self.first:
            p, bases = self._acquire(j, pieces, "embed:fwd", mb)
            x, c_embed = self._embed(x, p, drop)  # (B, Tl, C)
            c_embed = detach(c_embed, bases)
            del p, bases  # no reference left, so a gathered unit is really freed
            hooks.release(self.ends, "embed:fwd", (self.part, mb))
            j += 1
        c_blocks = []
        for layer in self.layers:
            p, bases = self._acquire(j, pieces, "fwd", mb)
            x_in = x
            x, c = self._block(x_in, p, layer, drop)  # (B, Tl, C)
            if self.full:  # the input alone; the backward runs the block again
                c = (x_in, drop)
            elif self.selective:  # the model's attention core keeps its inputs q, k, v alone
                c = (*c[:4], (*c[4][:3], drop), *c[5:])
            c_blocks.append(detach(c, bases))
            del p, bases, c, x_in
            hooks.release(self.blocks[layer], "fwd", (self.part, mb))
            j += 1
        if self.last:
            p, bases = self._acquire(j, pieces, "head:fwd", mb)
            x, c_head = self._head(x, p, targets, normalizer)  # a 0-d array
            c_head = detach(c_head, bases)
            del p, bases
            hooks.release(self.ends, "head:fwd", (self.part, mb))
        if self.moe is not None:
            for layer in self.layers:
                if layer in self.config.moe_blocks:
                    self.routings.setdefault(drop.sample_ids, {})[layer] = self.moe.last_routing[layer]
        return x, (c_embed, c_blocks, c_head)

    # -- B --------------------------------------------------------------------------------------
    def backward_input(self, dout, cache, mb: int = 0, weight: bool = True):
        """B. dout (B, Tl, C) is the next stage's input gradient (None on the last stage, where the
        loss starts it). Returns dx (B, Tl, C), None on the first stage, and what W needs (nothing
        with `weight`, or with tensor-parallel pieces: their weight gradients are given already)."""
        c_embed, c_blocks, c_head = cache
        hooks, pieces, hold = self.hooks, self._pieces(False), (self.part, mb)
        now = weight or self.fused
        saved = []  # (units it completes, what the weight half needs), in backward order

        def weights(done, w):  # each piece's weight half right away, or kept for W
            if now:
                self.backward_weight([(done, w)])
            else:
                saved.append((done, w))

        d, j = dout, 0
        if self.last:
            bases = self._acquire(j, pieces, "head:bwd", mb)[1]  # the cache holds what it reads
            d, w = self._head_backward(attach(c_head, bases))  # (B, Tl, C)
            del c_head, bases
            hooks.release(self.ends, "head:bwd", hold)
            weights(() if self.first else self.ends, w)  # on a first stage the embedding completes them
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
            d, w = self._block_backward(d, c, layer)  # (B, Tl, C)
            if self.full:
                self.recompute.done()
            del c, p, bases
            hooks.release(self.blocks[layer], "bwd", hold)
            weights(self.blocks[layer], w)
            j += 1
        if self.first:
            weights(self.ends, self._embed_backward(d, c_embed))
            d = None
        return d, saved

    # -- the pieces: the model's own layers (GPT-2's or Llama's) or the Layout's (refpar/parallel/pieces.py)
    def _embed(self, tokens, p, drop):
        lay = self.lay
        if lay is None:
            return self.own.embed_forward(tokens, p, drop)
        return family(self.config).embed(tokens[:, lay.region_pos], p, lay, drop)

    def _block(self, x, p, layer: int, drop):
        """Block `layer`'s forward: (out (B, Tl, C), cache)."""
        lay = self.lay
        if lay is None:
            return self.own.block_forward(x, p, layer, self.config, drop)
        return family(self.config).block(x, p, layer, lay, drop, self.moe, self.kv)

    def _head(self, x, p, targets, normalizer):
        lay = self.lay
        if lay is None:
            return self.own.head_forward(x, p, targets, self.config, normalizer)
        return head_forward(x, p, targets[:, lay.region_pos], lay, normalizer)

    def _head_backward(self, c_head):
        """-> (dx, what the weight half needs): GPT-2's own head split for W, the others fused."""
        lay = self.lay
        if lay is None and self.own is gpt:
            return self._head_input(c_head)
        if lay is None:
            d, grads = llama.head_backward(c_head, self.dloss)
            return d, ("grads", grads)
        d, work = head_backward(c_head, lay, self.dloss)
        return d, ("work", work)

    def _block_backward(self, d, c, layer: int):
        lay = self.lay
        if lay is None and self.own is gpt:
            return self._block_input(d, c)
        if lay is None:
            d, grads = llama.block_backward(d, c)
            return d, ("grads", grads)
        d, work = family(self.config).block_backward(d, c, layer, lay)
        return d, ("work", work)

    def _embed_backward(self, d, c_embed):
        lay = self.lay
        if lay is None and self.own is gpt:  # embed_backward reads no parameter (it scatters rows)
            return ("embed", (d, c_embed))
        if lay is None:
            return ("grads", llama.embed_backward(d, c_embed))
        return ("work", family(self.config).embed_backward(d, c_embed, lay))

    def backward_weight(self, saved) -> None:
        """W: each piece's weight gradients from what B saved, given to the hooks piece by piece."""
        for done, (kind, arrays) in saved:
            self.hooks.fold(arrays if kind == "grads" else self._weight_grads(kind, arrays))
            self.hooks.done(done)

    # -- the model's layers, split in halves, mirroring gpt.head_backward and gpt.block_backward --

    def _weight_grads(self, kind: str, arrays) -> dict:
        """The weight half of a piece: its gradients from what its input half kept."""
        if kind == "work":  # the Layout's pieces' weight halves
            return weight_grads(arrays)
        if kind == "embed":  # the first stage's input gradient scattered into wte and wpe
            return embed_backward(*arrays)
        grads = {}
        for prefix, how, pair in arrays:
            if how == "linear":
                grads[prefix + ".weight"], grads[prefix + ".bias"] = _linear_dw(*pair)
            elif how == "done":  # LayerNorm gains: two reductions the input half computed on the way
                grads[prefix + ".weight"], grads[prefix + ".bias"] = pair
            else:  # the tied head: logits = xf @ wte.T, so dwte = (xf.T @ dlogits).T
                grads["wte.weight"] = _linear_dw(*pair)[0].T  # (V, C)
        return grads

    def _head_input(self, c_head):
        (c_lnf, c_lin), c_ce = c_head
        dlogits = cross_entropy_backward(self.dloss, c_ce)  # (B, T, V)
        dxf = _linear_dx(dlogits, c_lin)  # (B, T, C)
        dx, dw, db = layernorm_backward(dxf, c_lnf)  # (B, T, C)
        return dx, ("pieces", [("", "tied_head", (c_lin[0], dlogits)), ("ln_f", "done", (dw, db))])

    def _block_input(self, dy, cache):
        (layer, n_head, c_ln1, c_attn, c_sdpa, c_proj, c_drop1, c_ln2, c_fc, c_gelu, c_mproj,
         c_drop2) = cache
        xp = array_namespace(dy)
        h, kept = f"h.{layer}.", []
        dm = dropout_backward(dy, c_drop2)  # (B, T, C)
        kept.append((h + "mlp.c_proj", "linear", (c_mproj[0], dm)))
        dm = gelu_backward(_linear_dx(dm, c_mproj), c_gelu)  # (B, T, 4C)
        kept.append((h + "mlp.c_fc", "linear", (c_fc[0], dm)))
        dm, dw, db = layernorm_backward(_linear_dx(dm, c_fc), c_ln2)  # (B, T, C)
        kept.append((h + "ln_2", "done", (dw, db)))
        dx1 = dy + dm  # (B, T, C)

        do = dropout_backward(dx1, c_drop1)  # (B, T, C)
        kept.append((h + "attn.c_proj", "linear", (c_proj[0], do)))
        do = _linear_dx(do, c_proj)  # (B, T, C)
        if self.selective:  # the core's forward again, from its kept q, k, v and the keyed masks
            q, k, v, drop = c_sdpa
            c_sdpa = self.recompute.rerun(f"h.{layer}.attn.core",
                                          partial(attention_core, q, k, v, layer, n_head, drop), (q, k, v))
        dq, dk, dv = attention_backward(split_heads(do, n_head), c_sdpa)  # (B, nh, T, hs) each
        if self.selective:
            self.recompute.done()
        dqkv = xp.concat([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)  # (B, T, 3C)
        kept.append((h + "attn.c_attn", "linear", (c_attn[0], dqkv)))
        da, dw, db = layernorm_backward(_linear_dx(dqkv, c_attn), c_ln1)  # (B, T, C)
        kept.append((h + "ln_1", "done", (dw, db)))
        return dx1 + da, ("pieces", kept)  # (B, T, C)
