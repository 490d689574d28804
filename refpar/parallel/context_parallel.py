"""Context parallelism on the `cp` axis: each rank holds part of the sequence in every layer.

    mpiexec -n 2 python -m refpar train --mesh cp=2 --cp-algo ring --check
    mpiexec -n 2 python -m refpar train --mesh cp=2 --cp-algo ulysses --check

Legend: B batch, T sequence, C channels, nh heads (this rank's tp heads), hs head size, c cp size,
Tl this rank's tokens, Tk the tokens of the key/value block in hand.

Everything but attention works token by token, so a rank runs the block on its own tokens with
their global positions; only attention needs the other ranks' keys and values. Two ways:

- Ring attention (Liu et al. 2023): the K/V blocks travel around the ring (isend to rank+1, irecv
  from rank-1) while each rank attends its queries to the block in hand and folds the result into
  an online softmax (Milakov & Gimelshein 2018): out and the log-sum-exp lse are merged block by
  block, exactly. The backward sends the K/V blocks around again with their gradients travelling
  alongside, which arrive back at their owner after c steps. With contiguous chunks the causal mask
  leaves early ranks little real work (their queries see few keys), so the sequence is cut into 2c
  chunks and rank r holds chunks r and 2c-1-r (zig-zag): every rank gets the same number of visible
  (query, key) pairs (`causal_work`). refpar computes each block whole, masked scores as -inf,
  which is exact; a kernel that skips masked blocks is what turns that balance into time.
  Chunks come from shard_range, so T need not divide 2c.
- DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns sequence-sharded q, k, v into
  head-sharded ones over the whole sequence, attention runs locally, and a second all-to-all turns
  the output back. Heads are split with shard_range, so nh need not divide c (c <= nh).

Llama's grouped-query attention (k and v have nkv heads, each read by g = nh / nkv query heads):
ring attention sends the kv heads alone around the ring (2 nkv, not 2 nh, heads a block) and each
rank's g query heads of a kv head attend to it as one more batch axis (gqa_attention_forward's
grouping), their dK and dV summed over the g before the block travels on. Ulysses splits the kv
heads over cp as it splits the query heads, kv heads shard_range(nkv, c, r) going to the rank
that gets their query heads, so each rank's all-to-all carries every kv head once: this needs
the tp rank's kv heads to be a multiple of cp (`check_cp`). Replicating kv heads over cp
(repeat_kv up to c heads, as some Ulysses ports do when nkv < c) would send each kv head to c/nkv
ranks, more bytes for no gain where the split works; refpar refuses those meshes and ring
attention runs them.

DeepSeek-V3's latent attention (refpar/parallel/mla_tensor_parallel.py) hands over k of dn + dr and
v of dv channels per head, the shared RoPE key already rotated by the rank's global positions and
copied into every head: the ring's block is k and v side by side on the last axis, and Ulysses
moves each array at its own width.

Parameters are replicated over cp and their gradients summed over cp, as over dp.

Mixed precision: the K/V blocks and Ulysses' all-to-alls travel in the 16-bit activation dtype.
Ring attention keeps its online softmax in float32, as FlashAttention-style ring kernels do
(zhuzilin/ring-flash-attention): the running max, the log-sum-exp (kept for backward, a statistic
of one float32 per query) and the output accumulator, rounded to 16 bits once after the last
block; in backward dq and the travelling dK/dV accumulate in float32 and travel as float32 (a sum
over c blocks that rounded at every hop would add c roundings), rounded once at the end.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from array_api_compat import array_namespace, device

from refpar import backend
from refpar.config import ConfigError, ModelConfig
from refpar.holdings import kv_heads_per_rank
from refpar.model.gemm import matmul
from refpar.model.layers import as_like, compute, rounded
from refpar.parallel.pieces import family, tp_layout
from refpar.parallel.tensor_parallel import Layout
from refpar.sharding import shard_range, shard_sizes

CP_ALGOS = ("ring", "ulysses")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Chunks rank and 2cp-1-rank of 2cp: an early and a late chunk, so causal work is balanced."""
    first, last = shard_range(seq_len, 2 * cp, rank), shard_range(seq_len, 2 * cp, 2 * cp - 1 - rank)
    return np.concatenate([np.arange(*first), np.arange(*last)])


def contiguous_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Chunk rank of cp (Ulysses, which attends over the whole sequence after its all-to-all)."""
    return np.arange(*shard_range(seq_len, cp, rank))


def cp_positions(seq_len: int, cp: int, rank: int, algo: str | None) -> np.ndarray:
    """(Ta,) the positions cp rank `rank` holds of every row: zig-zag chunks under ring attention
    (the default), one contiguous chunk under Ulysses; the whole sequence when cp = 1."""
    return (zigzag_positions if (algo or "ring") == "ring" else contiguous_positions)(seq_len, cp, rank)


def causal_work(positions) -> int:
    """Visible (query, key) pairs of these query positions under the causal mask (key k <= query q,
    so q+1 each). Zig-zag gives every rank the same; contiguous chunks give the last rank the most."""
    return int(np.sum(np.asarray(positions) + 1))


def check_cp(config: ModelConfig, seq_len: int, cp: int, algo: str, tp: int) -> None:
    if algo not in CP_ALGOS:
        raise ConfigError(f"unknown --cp-algo {algo!r}; choose one of {', '.join(CP_ALGOS)}")
    if algo == "ring" and seq_len < 2 * cp:
        raise ConfigError(f"ring attention cuts the sequence into 2*cp={2 * cp} zig-zag chunks; "
                          f"use --seq-len {2 * cp} or more")
    if algo == "ulysses" and (seq_len < cp or config.n_head // tp < cp):
        raise ConfigError(f"Ulysses gives each of cp={cp} ranks whole heads and sequence positions; "
                          f"use cp <= n_head/tp={config.n_head // tp} and cp <= seq_len={seq_len}")
    kv = kv_heads_per_rank(config, tp)
    if algo == "ulysses" and family(config).grouped_kv and (tp > config.n_kv_head or kv % cp):
        raise ConfigError(f"Ulysses splits each tp rank's kv heads over cp like its query heads, but a "
                          f"rank of tp={tp} holds {kv} of n_kv_head={config.n_kv_head}, which cp={cp} "
                          f"does not divide; use --cp-algo ring, or a cp that divides {kv}")


def cp_layout(config: ModelConfig, seq_len: int, cp_comm, algo: str, tp_comm=None) -> Layout:
    """tp's layout (its heads and vocabulary rows) on this cp rank's positions, attention by `algo`."""
    lay = tp_layout(config, seq_len, tp_comm)
    check_cp(config, seq_len, cp_comm.size, algo, 1 if tp_comm is None else tp_comm.size)
    pos = cp_positions(seq_len, cp_comm.size, cp_comm.rank, algo)
    core = RingAttention(cp_comm) if algo == "ring" else UlyssesAttention(cp_comm)
    return replace(lay, region_pos=pos, resid_pos=pos, attention=core)


def _scores(q, k, q_pos, k_pos):
    """(B, nh, Tq, hs) x (B, nh, Tk, hs) -> (B, nh, Tq, Tk) scaled, -inf where causality forbids."""
    xp = array_namespace(q)
    s = matmul(q, xp.matrix_transpose(k)) * (1.0 / math.sqrt(q.shape[-1]))
    visible = np.reshape(k_pos, (1, -1)) <= np.reshape(q_pos, (-1, 1))  # (Tq, Tk), host
    return xp.where(as_like(visible, s), s, -math.inf)


def _dropped(p, keep, k_pos, scale):
    """p (B, nh, Tq, Tk) times the dropout scale of the keys in hand (keep holds all T columns)."""
    if keep is None:
        return p
    xp = array_namespace(p)
    cols = xp.take(keep, as_like(k_pos, p), axis=-1)  # (B, nh, Tq, Tk)
    return xp.where(cols, p, xp.zeros_like(p)) * scale


class RingAttention:
    def __init__(self, cp):
        self.cp = cp

    def _source(self, step):
        """The rank whose K/V block this rank holds at ring step `step`."""
        return (self.cp.rank - step) % self.cp.size

    def _pass(self, x, step, lay: Layout, tag):
        """Sends the block held at `step` to rank+1; receives from rank-1 the one held at step+1.
        (The receive buffer is NumPy on the host, of x's dtype, whatever x's namespace.)"""
        r, c = self.cp.rank, self.cp.size
        shape = list(x.shape)
        shape[-2] = len(zigzag_positions(lay.seq_len, c, self._source(step + 1)))
        send = self.cp.isend(x, dest=(r + 1) % c, tag=tag)
        recv = self.cp.irecv(tuple(shape), backend.host_dtype(x), source=(r - 1) % c, tag=tag)
        return send, recv

    def forward(self, q, k, v, layer, lay: Layout, drop):  # (B, nh, Tl, hs); k, v (B, nkv, Tl, hs)
        xp = array_namespace(q)
        nh, nkv = q.shape[1], k.shape[1]
        if nkv < nh:  # GQA (Llama: no dropout, keep is None): each kv head's g query heads a batch axis
            q = xp.reshape(q, (q.shape[0], nkv, nh // nkv, *q.shape[2:]))  # (B, nkv, g, Tl, hs)
            k, v = xp.expand_dims(k, axis=2), xp.expand_dims(v, axis=2)  # (B, nkv, 1, Tl, hs)
        cfg, T, c, pos = lay.config, lay.seq_len, self.cp.size, lay.region_pos
        keep = drop.keep(layer, "attn", (cfg.n_head, T, T), q,
                         np.ix_(np.arange(*lay.heads), pos, np.arange(T)))  # (B, nh, Tl, T) bool
        scale = 1.0 / (1.0 - drop.p)
        qc = compute(q)  # (B, nh, Tl, hs), float32 when q is 16-bit
        # Fresh and contiguous (zeros_like would copy q's strides, and the merged heads c_proj keeps
        # would then be a view of it in some namespaces): the same arrays are kept in every backend.
        out = xp.zeros((*q.shape[:-1], v.shape[-1]), dtype=qc.dtype, device=device(q))  # (B, nh, Tl, hs)
        lse = xp.full((*q.shape[:-1], 1), -math.inf, dtype=qc.dtype, device=device(q))  # (B, nh, Tl, 1)
        wk = k.shape[-1]  # k's width; v's may differ (DeepSeek-V3's MLA: dn + dr, and dv)
        # the block that travels, in q's dtype: k and v side by side in one message
        kv = xp.concat([k, v], axis=-1)  # (B, nh, Tl, 2hs)
        for step in range(c):
            if step < c - 1:
                send, recv = self._pass(kv, step, lay, f"h.{layer}.attn.ring_kv:fwd")
            kc = compute(kv)  # (B, nh, Tk, 2hs)
            s = _scores(qc, kc[..., :wk], pos, zigzag_positions(T, c, self._source(step)))  # (B, nh, Tl, Tk)
            m = xp.max(s, axis=-1, keepdims=True)  # (B, nh, Tl, 1)
            m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # rows with no visible key in this block
            e = xp.exp(s - m)  # (B, nh, Tl, Tk)
            z = xp.sum(e, axis=-1, keepdims=True)  # (B, nh, Tl, 1)
            seen = z > 0
            p = _dropped(e / xp.where(seen, z, xp.ones_like(z)), keep,
                         zigzag_positions(T, c, self._source(step)), scale)
            lse_b = xp.where(seen, m + xp.log(xp.where(seen, z, xp.ones_like(z))), -math.inf)
            new = xp.logaddexp(lse, lse_b)  # finite from step 0 on: each query sees itself
            out = out * xp.exp(lse - new) + matmul(p, kc[..., wk:]) * xp.exp(lse_b - new)
            lse = new
            if step < c - 1:
                send.wait()
                kv = as_like(recv.wait(), q)
        out = rounded(out, q.dtype)  # (B, nh, Tl, hs), or (B, nkv, g, Tl, hs)
        return xp.reshape(out, (out.shape[0], nh, *out.shape[-2:])), (q, k, v, out, lse, keep, scale, layer)

    def backward(self, dout, cache, lay: Layout):
        q, k, v, out, lse, keep, scale, layer = cache
        xp, dt = array_namespace(dout), dout.dtype
        T, c, pos = lay.seq_len, self.cp.size, lay.region_pos
        dout = xp.reshape(dout, out.shape)  # grouped as q under GQA
        qc, dc = compute(q), compute(dout)  # (B, nh, Tl, hs) each
        D = xp.sum(dc * compute(out), axis=-1, keepdims=True)  # (B, nh, Tl, 1): sum_j P_ij dP_ij of softmax
        dq, wk = xp.zeros_like(qc), k.shape[-1]  # k's width, as forward
        kv = xp.concat([k, v], axis=-1)  # (B, nh, Tk, 2hs)
        dkv = xp.zeros_like(compute(kv))  # the gradient of the block in hand, travelling with it
        for step in range(c):
            if step < c - 1:
                send_kv, recv_kv = self._pass(kv, step, lay, f"h.{layer}.attn.ring_kv:bwd")
            k_pos = zigzag_positions(T, c, self._source(step))
            kc = compute(kv)  # (B, nh, Tk, 2hs)
            p = xp.exp(_scores(qc, kc[..., :wk], pos, k_pos) - lse)  # (B, nh, Tl, Tk), the global softmax
            pd = _dropped(p, keep, k_pos, scale)
            dp = matmul(dc, xp.matrix_transpose(kc[..., wk:]))  # (B, nh, Tl, Tk)
            dp = _dropped(dp, keep, k_pos, scale)
            ds = p * (dp - D) * (1.0 / math.sqrt(q.shape[-1]))
            dq = dq + matmul(ds, kc[..., :wk])
            block = xp.concat([matmul(xp.matrix_transpose(ds), qc), matmul(xp.matrix_transpose(pd), dc)],
                              axis=-1)  # (B, nh, Tk, 2hs)
            if block.shape != dkv.shape:  # GQA: a kv head's gradient sums over its g query heads
                block = xp.sum(block, axis=-3, keepdims=True)  # (B, nkv, 1, Tk, 2hs)
            dkv = dkv + block
            send_d, recv_d = self._pass(dkv, step, lay, f"h.{layer}.attn.ring_dkv:bwd")
            if step < c - 1:
                send_kv.wait()
                kv = as_like(recv_kv.wait(), q)
            send_d.wait()
            dkv = as_like(recv_d.wait(), q)  # after the last step: this rank's own block, complete
        dq, dk, dv = rounded(dq, dt), rounded(dkv[..., :wk], dt), rounded(dkv[..., wk:], dt)
        if dq.ndim == 5:  # GQA: back to (B, nh, Tl, hs) and (B, nkv, Tl, hs)
            B, nkv, g, Tl, hs = dq.shape
            dq, dk, dv = xp.reshape(dq, (B, nkv * g, Tl, hs)), dk[:, :, 0, ...], dv[:, :, 0, ...]
        return dq, dk, dv


class UlyssesAttention:
    """Ulysses' core: q (B, nh, Tl, hs) and k, v (B, nkv, Tl, hs), nkv = nh but for Llama's GQA; each
    array moves at its own width (DeepSeek-V3's q and k dn + dr, v dv)."""

    def __init__(self, cp):
        self.cp = cp

    def _to_heads(self, xs, seq_len, tag):
        """[(B, n_i, Tl, hs)] sequence-sharded -> [(B, n_i_c, T, hs)] head-sharded: one all-to-all,
        each array's heads split with shard_range. Chunks travel flat, each destination's pieces
        one after another, because their shapes differ when the splits are uneven."""
        xp, c, r = array_namespace(xs[0]), self.cp.size, self.cp.rank
        B, seqs = xs[0].shape[0], shard_sizes(seq_len, c)
        heads, widths = [shard_sizes(x.shape[1], c) for x in xs], [x.shape[-1] for x in xs]  # hs each
        chunks = [xp.concat([xp.reshape(x[:, slice(*shard_range(x.shape[1], c, d)), ...], (-1,)) for x in xs])
                  for d in range(c)]
        mine = [h[r] * w for h, w in zip(heads, widths, strict=True)]  # each array's, per (row, token)
        counts = [B * sum(mine) * seqs[s] for s in range(c)]
        got = self.cp.all_to_all(chunks, tag=tag, recv_counts=counts)
        return [xp.concat([xp.reshape(_piece(g, mine, i, B * seqs[s]), (B, h[r], seqs[s], widths[i]))
                           for s, g in enumerate(got)], axis=2)  # sources in sequence order
                for i, h in enumerate(heads)]

    def _to_sequence(self, xs, n_heads, tag):
        """[(B, n_i_c, T, hs)] head-sharded -> [(B, n_i, Tl, hs)] sequence-sharded, n_i = n_heads[i]:
        the reverse."""
        xp, c, r = array_namespace(xs[0]), self.cp.size, self.cp.rank
        B, T, widths = xs[0].shape[0], xs[0].shape[2], [x.shape[-1] for x in xs]
        heads, seqs = [shard_sizes(n, c) for n in n_heads], shard_sizes(T, c)
        chunks = [xp.concat([xp.reshape(x[:, :, slice(*shard_range(T, c, d)), ...], (-1,)) for x in xs])
                  for d in range(c)]
        # each source's arrays, per (row, token): their heads there times their widths
        theirs = [[h[s] * w for h, w in zip(heads, widths, strict=True)] for s in range(c)]
        counts = [B * sum(theirs[s]) * seqs[r] for s in range(c)]
        got = self.cp.all_to_all(chunks, tag=tag, recv_counts=counts)
        return [xp.concat([xp.reshape(_piece(g, theirs[s], i, B * seqs[r]), (B, h[s], seqs[r], widths[i]))
                           for s, g in enumerate(got)], axis=1)  # sources in head order
                for i, h in enumerate(heads)]

    def forward(self, q, k, v, layer, lay: Layout, drop):  # (B, nh, Tl, hs); k, v (B, nkv, Tl, hs)
        cfg, T, nh = lay.config, lay.seq_len, q.shape[1]
        a, b = shard_range(nh, self.cp.size, self.cp.rank)  # this rank's heads while head-sharded
        qc, kc, vc = self._to_heads([q, k, v], T, f"h.{layer}.attn.ulysses_qkv:fwd")  # (B, n_c, T, hs)
        pos = as_like(np.arange(T), q)
        keep = drop.keep(layer, "attn", (cfg.n_head, T, T), q,
                         (slice(lay.heads[0] + a, lay.heads[0] + b),))  # (B, nh_c, T, T) or None
        # the family's core: Llama's GQA reads the kv heads this rank got (check_cp)
        y, core = family(cfg).attend(qc, kc, vc, pos, pos, keep, drop.p)  # (B, nh_c, T, hs)
        y = self._to_sequence([y], [nh], f"h.{layer}.attn.ulysses_out:fwd")[0]  # (B, nh, Tl, hs)
        return y, (core, layer, nh, k.shape[1])

    def backward(self, dy, cache, lay: Layout):
        core, layer, nh, nkv = cache
        dyh = self._to_heads([dy], lay.seq_len, f"h.{layer}.attn.ulysses_out:bwd")[0]  # (B, nh_c, T, hs)
        grads = family(lay.config).attend_backward(dyh, core)
        return tuple(self._to_sequence(list(grads), [nh, nkv, nkv], f"h.{layer}.attn.ulysses_qkv:bwd"))


def _piece(flat, sizes, i, per):
    """Array i's part of a received flat chunk, whose arrays' pieces lie one after another, array
    j's of sizes[j] x `per` elements (its heads times their width, times rows and tokens)."""
    start = sum(sizes[:i]) * per
    return flat[start:start + sizes[i] * per]
