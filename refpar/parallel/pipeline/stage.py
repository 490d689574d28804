"""One pipeline stage of GPT-2: a contiguous run of blocks, with the embeddings on the first stage
and ln_f plus the tied LM head on the last. Pure numerics: no communication here.

Legend: B microbatch rows, T sequence, C channels, V vocab. S stages in all (p ranks x v chunks);
stage s holds blocks shard_range(L, S, s), so stage = chunk * p + rank holds layers that follow
the previous stage's.

Each stage runs the three actions of a schedule:

    out, cache = stage.forward(params, x, targets, drop, normalizer)   # F: x (B, T, C) or tokens
    dx, wcache = stage.backward_input(dout, cache)                     # B: input gradient only
    grads      = stage.backward_weight(wcache)                         # W: weight gradients

B computes what the previous stage waits for (dx) and keeps, for W, the inputs and output
gradients of every linear layer; W turns them into weight gradients (x.T @ dout), which nobody
downstream waits for: that is the split that zero-bubble schedules exploit (Qi et al. 2023,
section 2). A schedule without W runs both halves inside its B. The formulas are the model's
(`linear_backward`, `layernorm_backward`, `embed_backward`), so the gradients are the single
device's up to the order of summation over microbatches.

Mixed precision: the halves run under `fp32_compute` as the model's layers do (16-bit in, fp32
GEMMs, 16-bit out), so a 16-bit stage computes each microbatch's numbers exactly as one device
would; `dloss` (the fp16 loss scale, set by the executor for a step) starts the last stage's backward.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.config import ConfigError, ModelConfig
from refpar.holdings import stage_layers, stage_param_names
from refpar.model.attention import attention_backward
from refpar.model.gpt import (
    DropoutContext,
    add_embedding_grads,
    block_forward,
    embed_backward,
    embed_forward,
    head_forward,
    merge_heads,
    split_heads,
)
from refpar.model.layers import (
    cross_entropy_backward,
    dropout_backward,
    gelu_backward,
    layernorm_backward,
)
from refpar.precision import fp32_compute


@fp32_compute
def _linear_dx(dout, cache):
    """The input half of `linear_backward`: dx = dout @ w.T (same formula, same order)."""
    x, w, _ = cache
    xp = array_namespace(dout, w)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, out)
    return xp.reshape(dout2 @ w.T, x.shape)  # (..., in)


@fp32_compute
def _linear_dw(x, dout):
    """The weight half of `linear_backward`: dw = x.T @ dout, db = sum of dout."""
    xp = array_namespace(dout, x)
    dout2 = xp.reshape(dout, (-1, dout.shape[-1]))  # (N, out)
    x2 = xp.reshape(x, (-1, x.shape[-1]))  # (N, in)
    return x2.T @ dout2, xp.sum(dout2, axis=0)  # (in, out), (out,)


class Stage:
    """Stage `stage` of `n_stages` of the GPT-2 described by `config`."""

    # B and W below split GPT-2's MLP; a stage of MoE blocks (refpar/engine_moe.py) overrides both
    dense_only = True

    def __init__(self, config: ModelConfig, n_stages: int, stage: int):
        self.config, self.n_stages, self.stage = config, n_stages, stage
        self.dloss = 1.0  # where the last stage's backward starts: 1, or an fp16 run's loss scale
        self.layers = stage_layers(config.n_layer, n_stages, stage)
        if config.moe_blocks and self.dense_only:
            raise ConfigError("these pipeline stages run dense GPT-2 blocks; MoE models run in "
                              "pipeline stages over --mesh pp=P[,dp=D][,ep=E] (refpar/engine_moe.py)")
        self.first, self.last = stage == 0, stage == n_stages - 1

    def param_names(self) -> list[str]:
        """The parameters this stage reads (`stage_param_names`)."""
        return stage_param_names(self.config, self.n_stages, self.stage)

    def forward(self, params, x, targets, drop: DropoutContext, normalizer):
        """F. x is tokens (B, T) on the first stage, the previous stage's output (B, T, C) after.
        Returns the output (B, T, C), or the loss (a 0-d array) on the last stage, and the cache."""
        c_embed = c_head = None
        if self.first:
            x, c_embed = embed_forward(x, params, drop)  # (B, T, C)
        c_blocks = []
        for layer in self.layers:
            x, c = block_forward(x, params, layer, self.config, drop)  # (B, T, C)
            c_blocks.append(c)
        if self.last:
            x, c_head = head_forward(x, params, targets, self.config, normalizer)  # ()
        return x, (c_embed, c_blocks, c_head)

    def backward_input(self, dout, cache):
        """B. dout (B, T, C) is the next stage's input gradient (None on the last stage, where the
        loss starts it). Returns dx (B, T, C), None on the first stage, and what W needs."""
        c_embed, c_blocks, c_head = cache
        saved = []  # (parameter name prefix, kind, arrays) for W, in backward order
        d = dout
        if self.last:
            d = self._head_input(c_head, saved)  # (B, T, C)
        for c in reversed(c_blocks):
            d = self._block_input(d, c, saved)  # (B, T, C)
        if self.first:
            saved.append(("", "embed", (d, c_embed)))
            d = None
        return d, saved

    def backward_weight(self, saved) -> dict:
        """W: every weight gradient of this stage from what B saved."""
        grads = {}
        for prefix, kind, arrays in saved:
            if kind == "linear":
                x, dout = arrays
                grads[prefix + ".weight"], grads[prefix + ".bias"] = _linear_dw(x, dout)
            elif kind == "done":  # LayerNorm gains: two reductions B computed on the way
                dw, db = arrays
                grads[prefix + ".weight"], grads[prefix + ".bias"] = dw, db
            elif kind == "tied_head":  # logits = xf @ wte.T, so dwte = (xf.T @ dlogits).T
                dwte_t, _ = _linear_dw(*arrays)  # (C, V)
                grads["wte.weight"] = dwte_t.T  # (V, C); the head comes first in backward order
            else:  # embed: the first stage's input gradient scattered into wte and wpe
                dx, c_embed = arrays
                g = embed_backward(dx, c_embed)
                # on a single stage holding both ends, head + embedding as gpt.loss_and_grads adds
                add_embedding_grads(grads, g)
        return grads

    # -- the input-gradient halves, mirroring gpt.head_backward and gpt.block_backward ------------

    def _head_input(self, c_head, saved):
        (c_lnf, c_lin), c_ce = c_head
        dlogits = cross_entropy_backward(self.dloss, c_ce)  # (B, T, V)
        saved.append(("", "tied_head", (c_lin[0], dlogits)))
        dxf = _linear_dx(dlogits, c_lin)  # (B, T, C)
        dx, dw, db = layernorm_backward(dxf, c_lnf)  # (B, T, C)
        saved.append(("ln_f", "done", (dw, db)))
        return dx

    def _block_input(self, dy, cache, saved):
        (layer, n_head, c_ln1, c_attn, c_sdpa, c_proj, c_drop1, c_ln2, c_fc, c_gelu, c_mproj,
         c_drop2) = cache
        xp = array_namespace(dy)
        h = f"h.{layer}."
        dm = dropout_backward(dy, c_drop2)  # (B, T, C)
        saved.append((h + "mlp.c_proj", "linear", (c_mproj[0], dm)))
        dm = gelu_backward(_linear_dx(dm, c_mproj), c_gelu)  # (B, T, 4C)
        saved.append((h + "mlp.c_fc", "linear", (c_fc[0], dm)))
        dm, dw, db = layernorm_backward(_linear_dx(dm, c_fc), c_ln2)  # (B, T, C)
        saved.append((h + "ln_2", "done", (dw, db)))
        dx1 = dy + dm  # (B, T, C)

        do = dropout_backward(dx1, c_drop1)  # (B, T, C)
        saved.append((h + "attn.c_proj", "linear", (c_proj[0], do)))
        do = _linear_dx(do, c_proj)  # (B, T, C)
        dq, dk, dv = attention_backward(split_heads(do, n_head), c_sdpa)  # (B, nh, T, hs) each
        dqkv = xp.concat([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)  # (B, T, 3C)
        saved.append((h + "attn.c_attn", "linear", (c_attn[0], dqkv)))
        da, dw, db = layernorm_backward(_linear_dx(dqkv, c_attn), c_ln1)  # (B, T, C)
        saved.append((h + "ln_1", "done", (dw, db)))
        return dx1 + da  # (B, T, C)
