"""GPT-2's pieces on a tensor_parallel.Layout: the embedding, the block (attention and MLP, each a
tensor-parallel region entered by f and left by g) and the final LayerNorm, each a forward and a
backward whose input half returns its weight half's work (refpar/parallel/tensor_parallel.py).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check

Legend: B batch, T sequence, C channels, nh heads (nh/t this rank's), hs head size, t tp size; Ta
the tokens inside a region, Tl the residual stream's (both T under plain TP and where nothing is
split). The layers are refpar/model/layers.py's, in refpar/model/gpt.py's order, so a layout that
splits nothing computes gpt.block_forward's and gpt.block_backward's numbers bit for bit.
"""

from __future__ import annotations

from array_api_compat import array_namespace

from refpar.model.layers import (
    as_like,
    compute,
    gelu_backward,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    one_hot,
    rounded,
)
from refpar.parallel.tensor_parallel import (
    Layout,
    column_parallel_linear_backward,
    column_parallel_linear_forward,
    given,
    resid_dropout_backward,
    resid_dropout_forward,
    row_parallel_linear_backward,
    row_parallel_linear_forward,
)
from refpar.parallel.vocab_parallel import vocab_rows_backward, vocab_rows_forward


def _names(prefix: str) -> tuple[str, str]:
    return prefix + ".weight", prefix + ".bias"


def attention_forward(x, params, layer: int, lay: Layout, drop):
    """x (B, Tl, C), ln_1's output -> (B, Tl, C), before the residual dropout."""
    P, hs = f"h.{layer}.attn.", lay.config.head_size
    nh = lay.heads[1] - lay.heads[0]
    (qkv,), c_attn = column_parallel_linear_forward(
        x, [(params[P + "c_attn.weight"], params[P + "c_attn.bias"])], lay, P + "c_attn")  # (B, Ta, 3C/t)
    xp, (B, Ta, _) = array_namespace(qkv), qkv.shape
    qkv = xp.permute_dims(xp.reshape(qkv, (B, Ta, 3, nh, hs)), (2, 0, 3, 1, 4))  # (3, B, nh/t, Ta, hs)
    q, k, v = qkv[0, ...], qkv[1, ...], qkv[2, ...]  # (B, nh/t, Ta, hs) each
    y, core = lay.attention.forward(q, k, v, layer, lay, drop)  # (B, nh/t, Ta, hs)
    y = xp.reshape(xp.permute_dims(y, (0, 2, 1, 3)), (B, Ta, nh * hs))  # (B, Ta, C/t)
    out, c_proj = row_parallel_linear_forward(
        y, params[P + "c_proj.weight"], params[P + "c_proj.bias"], lay, P + "c_proj")  # (B, Tl, C)
    return out, (c_attn, core, c_proj)


def attention_backward(dout, cache, layer: int, lay: Layout):
    """-> (dx (B, Tl, C), the weight half's work of c_proj and c_attn)."""
    c_attn, core, c_proj = cache
    P, hs = f"h.{layer}.attn.", lay.config.head_size
    nh = lay.heads[1] - lay.heads[0]
    dy, w_proj = row_parallel_linear_backward(dout, c_proj, lay, _names(P + "c_proj"))  # (B, Ta, C/t)
    xp, (B, Ta, _) = array_namespace(dy), dy.shape
    dy = xp.permute_dims(xp.reshape(dy, (B, Ta, nh, hs)), (0, 2, 1, 3))  # (B, nh/t, Ta, hs)
    dqkv = xp.stack(lay.attention.backward(dy, core, lay))  # (3, B, nh/t, Ta, hs)
    dqkv = xp.reshape(xp.permute_dims(dqkv, (1, 3, 0, 2, 4)), (B, Ta, 3 * nh * hs))  # (B, Ta, 3C/t)
    dx, w_attn = column_parallel_linear_backward([dqkv], c_attn, lay, [_names(P + "c_attn")])  # (B, Tl, C)
    return dx, [w_proj, w_attn]


def mlp_forward(x, params, layer: int, lay: Layout):
    """x (B, Tl, C), ln_2's output -> (B, Tl, C), before the residual dropout."""
    P = f"h.{layer}.mlp."
    (h,), c_fc = column_parallel_linear_forward(
        x, [(params[P + "c_fc.weight"], params[P + "c_fc.bias"])], lay, P + "c_fc")  # (B, Ta, 4C/t)
    g, gelu = gelu_forward(h)  # (B, Ta, 4C/t)
    out, c_proj = row_parallel_linear_forward(
        g, params[P + "c_proj.weight"], params[P + "c_proj.bias"], lay, P + "c_proj")  # (B, Tl, C)
    return out, (c_fc, gelu, c_proj)


def mlp_backward(dout, cache, layer: int, lay: Layout):
    c_fc, gelu, c_proj = cache
    P = f"h.{layer}.mlp."
    dg, w_proj = row_parallel_linear_backward(dout, c_proj, lay, _names(P + "c_proj"))  # (B, Ta, 4C/t)
    dx, w_fc = column_parallel_linear_backward([gelu_backward(dg, gelu)], c_fc, lay, [_names(P + "c_fc")])
    return dx, [w_proj, w_fc]  # (B, Tl, C)


def block_forward(x, params, layer: int, lay: Layout, drop, moe=None, kv=None):
    """x (B, Tl, C) -> (B, Tl, C): GPT-2's pre-LayerNorm block with both sublayers tensor-parallel.
    In the blocks of `config.moe_blocks` the MLP is `moe.forward` (the expert-parallel layer
    refpar/engine/parallelize.py builds). `kv`: Llama's, unused."""
    P, eps = f"h.{layer}.", lay.config.layer_norm_eps
    a, ln_1 = layernorm_forward(x, params[P + "ln_1.weight"], params[P + "ln_1.bias"], eps)
    a, attn = attention_forward(a, params, layer, lay, drop)  # f ... g
    a, drop_a = resid_dropout_forward(a, drop, layer, "attn_resid", lay)
    x = x + a
    m, ln_2 = layernorm_forward(x, params[P + "ln_2.weight"], params[P + "ln_2.bias"], eps)
    if layer in lay.config.moe_blocks:
        m, mlp = moe.forward(m, params, layer, lay.config)  # (B, Tl, C)
        mlp = (moe, mlp)
    else:
        m, mlp = mlp_forward(m, params, layer, lay)  # f ... g
    m, drop_m = resid_dropout_forward(m, drop, layer, "mlp_resid", lay)
    return x + m, (ln_1, attn, drop_a, ln_2, mlp, drop_m)


def block_backward(dy, cache, layer: int, lay: Layout):
    """dy (B, Tl, C) -> (dx (B, Tl, C), the block's weight half: [(function, arguments)])."""
    ln_1, attn, drop_a, ln_2, mlp, drop_m = cache
    P = f"h.{layer}."
    if layer in lay.config.moe_blocks:
        moe, c_moe = mlp
        dm, grads = moe.backward(resid_dropout_backward(dy, drop_m), c_moe)  # (B, Tl, C)
        work = [(given, (tuple(grads), *grads.values()))]
    else:
        dm, work = mlp_backward(resid_dropout_backward(dy, drop_m), mlp, layer, lay)
    dx, dw, db = layernorm_backward(dm, ln_2)  # (B, Tl, C)
    work.append((given, (_names(P + "ln_2"), dw, db)))
    dx = dx + dy
    da, attn_work = attention_backward(resid_dropout_backward(dx, drop_a), attn, layer, lay)
    dx0, dw, db = layernorm_backward(da, ln_1)  # (B, Tl, C)
    return dx + dx0, [*work, *attn_work, (given, (_names(P + "ln_1"), dw, db))]


def embed_forward(tokens, params, lay: Layout, drop):
    """tokens (B, Ta) global ids at lay.region_pos -> x (B, Tl, C): this rank's rows of wte, summed
    over tp (g), plus wpe at the residual stream's positions, then the embd dropout."""
    wte, wpe = params["wte.weight"], params["wpe.weight"]
    xp = array_namespace(wte)
    x, tokens = vocab_rows_forward(tokens, wte, lay, "wte")  # (B, Tl, C)
    x = x + xp.take(wpe, as_like(lay.resid_pos, wpe), axis=0)  # (B, Tl, C)
    x, drop_e = resid_dropout_forward(x, drop, 0, "embd", lay)
    return x, (tokens, drop_e)


def embed_backward(dx, cache, lay: Layout) -> list:
    """dx (B, Tl, C) -> the weight half's work: the gradients of this rank's rows of wte (V/t, C)
    and of wpe (n_positions, C). The input half (the embd dropout's backward, g's) runs now."""
    tokens, drop_e = cache
    dx = resid_dropout_backward(dx, drop_e)  # (B, Tl, C)
    return [vocab_rows_backward(dx, tokens, lay, "wte"), (wpe_weight, (dx, lay))]


def wpe_weight(dx, lay: Layout) -> dict:
    """wpe's gradient (n_positions, C): dx (B, Tl, C) summed over rows, placed at its positions."""
    xp, dc = array_namespace(dx), compute(dx)  # (B, Tl, C)
    dwpe = one_hot(as_like(lay.resid_pos, dx), lay.config.n_positions, dc.dtype).T @ xp.sum(dc, axis=0)
    return {"wpe.weight": rounded(dwpe, dx.dtype)}  # (P, C)


def norm_forward(x, params, lay: Layout):
    """ln_f: x (B, Tl, C) -> (B, Tl, C)."""
    return layernorm_forward(x, params["ln_f.weight"], params["ln_f.bias"], lay.config.layer_norm_eps)


def norm_backward(dh, cache):
    dx, dw, db = layernorm_backward(dh, cache)  # (B, Tl, C)
    return dx, (given, (_names("ln_f"), dw, db))
