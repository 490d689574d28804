"""The KV cache of one rank, and the attention core that reads it while decoding.

Legend: N new tokens of a pass (all requests' segments side by side), nh this rank's query heads
(nh/t under tensor parallelism), nkv this rank's key/value heads (GPT-2: nkv = nh; Llama's
grouped-query attention: g = nh / nkv query heads read each kv head), hs head size, Tr the positions
of a request this rank holds. Multi-head latent attention caches one entry per token, [latent,
rotary key] (nkv = 1, hs = kv_lora_rank + qk_rope_head_dim), and its value width is 0: its values are
the entry's first kv_lora_rank numbers (refpar/serving/latent_attention.py).

What a rank holds of a request's keys and values, for each block of its pipeline stage:
    tp  splits the kv heads, as its k and v weights compute them (holdings.kv_heads): GPT-2's
        rank r keeps heads shard_range(nh, t, r); Llama's rank r keeps kv heads
        shard_range(n_kv_head, t, r) while t <= n_kv_head, and when t > n_kv_head the one kv head
        its query heads read, which t / n_kv_head ranks then each keep whole (vLLM replicates kv
        heads the same way): per rank max(1, n_kv_head / t) kv heads, never a fraction of one;
    cp  splits the positions, striped: cp rank r keeps positions p with p % c == r (Brandon et al.
        2023, "Striped Attention"), so every rank's share grows by one token every c decode steps.
Every append is an entry of the MemoryLedger (category `activations`: the keys and values are kept
activations), and a finished request frees its entries, so the ledger's `current` is the cache's
size on this rank at any moment.

Decode attention under cp: every cp rank computes the new tokens' queries (the linear layers are
replicated over cp), attends them to the keys it holds, and the partial results are merged with
the log-sum-exp rule of the online softmax (Milakov & Gimelshein 2018), as ring attention merges
blocks: with m = max_r lse_r, out = sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m). That is two
all-reduces per layer: the max of lse, then the sum of [exp(lse_r - m) out_r, exp(lse_r - m)].
What cp saves is the cache's memory and the attention's reads of it, which grow with the context;
the prompt's linear layers are computed on every cp rank (a training-style split of the prompt's
queries, ring attention in context_parallel.py, would divide those too).
"""

from __future__ import annotations

import math

import numpy as np

from refpar.memory import MemoryLedger
from refpar.model.attention import attention_forward


class KVCache:
    def __init__(self, ledger: MemoryLedger, cp_size: int = 1, cp_rank: int = 0):
        self.ledger, self.cp_size, self.cp_rank = ledger, cp_size, cp_rank
        self.k: dict[tuple[int, int], np.ndarray] = {}  # (rid, layer) -> (nkv, Tr, hs)
        self.v: dict[tuple[int, int], np.ndarray] = {}  # (rid, layer) -> (nkv, Tr, hs)
        self.pos: dict[tuple[int, int], np.ndarray] = {}  # (rid, layer) -> (Tr,) global positions

    def owns(self, positions) -> np.ndarray:
        """Which of these global positions this cp rank keeps (striped)."""
        return np.asarray(positions) % self.cp_size == self.cp_rank  # (n,)

    def append(self, rid: int, layer: int, k, v, positions) -> None:
        """k (nkv, n, hs), v (nkv, n, hv) of a request's new tokens at `positions` (n,): keeps the owned
        ones (hv = hs, or 0 for MLA's one entry)."""
        mine = self.owns(positions)  # (n,)
        if not mine.any():
            return
        k, v, positions = k[:, mine], v[:, mine], np.asarray(positions)[mine]  # (nkv, n_mine, hs)
        key = (rid, layer)
        if key in self.k:
            k = np.concatenate([self.k[key], k], axis=1)  # (nkv, Tr, hs)
            v = np.concatenate([self.v[key], v], axis=1)  # (nkv, Tr, hv)
            positions = np.concatenate([self.pos[key], positions])  # (Tr,)
        self.ledger.alloc(f"kv.r{rid}.h{layer}.p{int(positions[-1])}", int(mine.sum()) * k.shape[0]
                          * (k.shape[2] + v.shape[2]) * k.dtype.itemsize, "activations")
        self.k[key], self.v[key], self.pos[key] = k, v, positions

    def get(self, rid: int, layer: int, like, v_like=None):
        """(K (nkv, Tr, hs), V (nkv, Tr, hv), positions (Tr,)); empty when this rank holds none of the
        request yet, shaped as `like` and `v_like` (default `like`) are but for their token axis."""
        if (rid, layer) not in self.k:
            v_like = like if v_like is None else v_like
            return (np.zeros((like.shape[0], 0, like.shape[-1]), dtype=like.dtype),  # (nkv, 0, hs)
                    np.zeros((v_like.shape[0], 0, v_like.shape[-1]), dtype=like.dtype),  # (nkv, 0, hv)
                    np.zeros(0, dtype=np.int64))
        return self.k[(rid, layer)], self.v[(rid, layer)], self.pos[(rid, layer)]

    def bytes_by_request(self) -> dict[int, int]:
        """{rid: bytes this rank holds}, read from the ledger's entries."""
        by_request: dict[int, int] = {}
        for name, nbytes in self.ledger.live("activations").items():  # kv.r{rid}.h{layer}.p{position}
            rid = int(name.split(".")[1][1:])
            by_request[rid] = by_request.get(rid, 0) + nbytes
        return by_request

    def free(self, rid: int) -> None:
        """A finished request gives its slots back."""
        self.ledger.free_prefix(f"kv.r{rid}.")
        for key in [key for key in self.k if key[0] == rid]:
            del self.k[key], self.v[key], self.pos[key]


def partial_attention(q, k, v, q_pos, k_pos, scale=None):
    """q (..., n, hs) against the keys in hand k (..., Tr, hs), v (..., Tr, hv), the leading axes
    broadcasting (a kv head against its g query heads) -> (out (..., n, hv), lse (..., n, 1)), out
    normalised over these keys only; rows that see none of them get out 0 and lse -inf. The scores'
    scale is 1/sqrt(hs) unless given (MLA's absorbed query keeps its heads' 1/sqrt(dn + dr))."""
    *lead, n, hs = q.shape
    if k.shape[-2] == 0:
        return (np.zeros((*lead, n, v.shape[-1]), dtype=q.dtype),
                np.full((*lead, n, 1), -math.inf, dtype=q.dtype))
    scale = 1.0 / math.sqrt(hs) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., n, Tr)
    s = np.where(np.reshape(k_pos, (1, -1)) <= np.reshape(q_pos, (-1, 1)), s, -math.inf)
    m = np.max(s, axis=-1, keepdims=True)  # (..., n, 1)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)  # (..., n, Tr)
    z = np.sum(e, axis=-1, keepdims=True)  # (..., n, 1)
    seen = z > 0
    lse = np.where(seen, m + np.log(np.where(seen, z, 1.0)), -math.inf)  # (..., n, 1)
    return (e @ v) / np.where(seen, z, 1.0), lse


def merge_over_cp(cp, out, lse, layer: int):
    """The cp ranks' partial outputs out (nh, N, a) with their lse (nh, N, 1) merged by the log-sum-exp
    rule (module docstring): two all-reduces -> (nh, N, a), the same on every cp rank."""
    m = cp.all_reduce(lse, op="max", tag=f"h.{layer}.attn.lse_max")  # (nh, N, 1)
    w = np.exp(lse - m)  # (nh, N, 1): 0 on ranks that hold no visible key
    both = cp.all_reduce(np.concatenate([out * w, w], axis=-1), tag=f"h.{layer}.attn.lse_sum")  # (nh, N, a+1)
    return both[..., :-1] / both[..., -1:]  # (nh, N, a)


class CachedAttention:
    """The attention core of a decode or prefill pass (the serving Layout's `attention`, which both
    families' tensor-parallel blocks call): appends the new keys and values of each
    request's segment to the cache, then attends the segment's queries to everything the request
    has cached. `segments` are (rid, start, stop) along N. The g query heads of a kv head are one
    more axis against which the cached kv head broadcasts (model/llama_layers.gqa_attention_forward's
    grouping, HF's repeat_kv order), so the cache keeps nkv heads and copies none."""

    def __init__(self, cache: KVCache, segments, cp=None):
        self.cache, self.segments, self.cp = cache, segments, cp

    def forward(self, q, k, v, layer, lay, drop):  # q (1, nh, N, hs); k, v (1, nkv, N, hs)
        pos = lay.region_pos  # (N,)
        nh, nkv, hs = q.shape[1], k.shape[1], q.shape[-1]
        outs, lses = [], []
        for rid, a, b in self.segments:
            self.cache.append(rid, layer, k[0, :, a:b], v[0, :, a:b], pos[a:b])
            K, V, k_pos = self.cache.get(rid, layer, k[0])  # (nkv, Tr, hs)
            qg = np.reshape(q[0, :, a:b], (nkv, nh // nkv, b - a, hs))  # (nkv, g, n, hs)
            K, V = K[:, None], V[:, None]  # (nkv, 1, Tr, hs)
            if self.cp is None:
                o, _ = attention_forward(qg, K, V, pos[a:b], k_pos)  # (nkv, g, n, hs)
                outs.append(np.reshape(o, (nh, b - a, hs)))
            else:
                o, lse = partial_attention(qg, K, V, pos[a:b], k_pos)  # (nkv, g, n, hs), (nkv, g, n, 1)
                outs.append(np.reshape(o, (nh, b - a, hs)))
                lses.append(np.reshape(lse, (nh, b - a, 1)))
        out = np.concatenate(outs, axis=1)  # (nh, N, hs)
        if self.cp is not None:
            out = merge_over_cp(self.cp, out, np.concatenate(lses, axis=1), layer)  # (nh, N, hs)
        return out[None], None  # (1, nh, N, hs)
