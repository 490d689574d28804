"""Closed forms of serving: KV cache bytes, bytes per token by axis, and decode latency at scale.

Legend: L layers, h d_model, nkv key/value heads, hd head size, b bytes per element, t tp, c cp,
p pp, N tokens of a pass, R tokens chosen in it (one per request), B requests decoded together.

KV cache (K and V of every layer, head and cached token):
    2 · L · nkv · hd · tokens · b / shards
tp splits the kv heads (GPT-2: nkv = its heads), pp the layers, cp the tokens (striped: cp rank r
holds positions p % c == r). Past tp = nkv (grouped-query attention) a rank keeps the one kv head its
query heads read, replicated on tp / nkv ranks: max(1, nkv / tp) heads per rank, so a Llama rank
holds nkv / nh of GPT-2's cache while tp <= nkv, and 1 / (nh / tp) of it past that.
Multi-head latent attention (DeepSeek-V3) caches per token per layer one entry, the latent and the
shared rotary key:
    L · (kv_lora_rank + qk_rope_head_dim) · tokens · b / (pp · cp)
with no tp in the denominator: every tp rank attends its own query heads to the whole latent, so
each keeps all of it (replicated t times). Multi-head attention of the same heads would cache
L · nh · (dn + dr + dv) · tokens · b (2 · nh · dh when the widths agree): `kv_ratio_to_multi_head`.
What a family caches is refpar.model.kv_cache_shape's answer (model/attention.py's CacheShape).
`kv_bytes_per_rank` is the exact per-rank count the MemoryLedger measures, uneven splits included.

Paged cache (blocks of B token slots, vLLM's PagedAttention): a request of n positions takes
ceil(n_r / B) blocks on cp rank r (n_r its striped share), so its last block wastes
ceil(n_r / B) · B - n_r < B slots: internal fragmentation is below one block per request, where a
contiguous cache reserved for the longest request wastes the difference of lengths. k requests
holding one shared prefix of s positions (a system prompt) keep its floor(s_r / B) whole blocks once,
not k times: prefix sharing saves (k - 1) · floor(s_r / B) blocks on the rank (the partly filled block
after the prefix is copied when each request writes into it).

Decode is memory-bound: each step reads every weight and the whole cache from HBM once (Pope et
al. 2022, "Efficiently Scaling Transformer Inference", sec. 2). Tensor parallelism divides that
read by t and adds 2L all-reduces of B·h·b bytes per token; pipeline parallelism divides it by p
but a token still crosses all p stages one after another, so its latency is that of one GPU
reading everything (plus p-1 hops): pp raises throughput (p groups of requests in flight), not
latency. Once the tp group spans nodes its 2L all-reduces per token run over InfiniBand.
"""

from __future__ import annotations

from refpar.analysis.flops import param_counts
from refpar.analysis.hardware import Hardware
from refpar.analysis.presets import ModelSpec
from refpar.analysis.step_time import collective_time, link
from refpar.comm import cost
from refpar.config import ModelConfig
from refpar.holdings import kv_heads
from refpar.model import kv_cache_shape
from refpar.sharding import shard_range, shard_sizes

TOKEN_ITEMSIZE = 8  # the chosen tokens travel as int64


def kv_cache_bytes(n_layer, kv_heads, head_dim, tokens, itemsize, shards=1):
    """2 · layers · kv_heads · head_dim · tokens · bytes / shards."""
    return 2 * n_layer * kv_heads * head_dim * tokens * itemsize / shards


def striped_tokens(cached: int, cp: int, cp_rank: int) -> int:
    """How many of positions 0..cached-1 cp rank `cp_rank` holds (p % cp == cp_rank)."""
    return max(0, (cached - cp_rank + cp - 1) // cp)


def kv_heads_held(config: ModelConfig, t: int, rank: int) -> tuple[int, int]:
    """The cached heads [k0, k1) tp rank `rank` of `t` keeps: GPT-2's shard_range of its heads; Llama's
    shard_range of its kv heads, or past t = n_kv_head the one its query heads read
    (holdings.kv_heads, the tensor-parallel layout its k_proj and v_proj rows have); MLA's one latent
    entry on every rank."""
    shape = kv_cache_shape(config)
    return kv_heads(config, t, rank) if shape.split_by_tp else (0, shape.heads)


def kv_bytes_per_token(config: ModelConfig, t: int = 1, rank: int = 0) -> int:
    """Bytes one token's cache takes in one layer on tp rank `rank` of `t`: its cached heads x (key +
    value numbers) x itemsize; MLA (kv_lora_rank + qk_rope_head_dim) x itemsize on every tp rank."""
    shape = kv_cache_shape(config)
    heads = len(range(*kv_heads_held(config, t, rank)))
    return heads * (shape.key + shape.value) * _itemsize(config)


def kv_ratio_to_multi_head(config: ModelConfig) -> float:
    """The whole model's cache per token over what multi-head attention of its query heads would keep,
    2 · nh · hd (MLA: nh · (dn + dr + dv), CacheShape.multi_head): GPT-2 1, Llama nkv / nh."""
    shape = kv_cache_shape(config)
    return shape.per_token / shape.multi_head


def kv_shards(config: ModelConfig, sizes: dict) -> int:
    """How many pieces the model's cache is cut into: min(tp, kv heads) · cp · pp for multi-head and
    grouped-query attention (past tp = nkv the kv heads are replicated), cp · pp for MLA, whose latent
    every tp rank keeps whole."""
    shape = kv_cache_shape(config)
    tp = min(sizes.get("tp", 1), shape.heads) if shape.split_by_tp else 1
    return tp * sizes.get("cp", 1) * sizes.get("pp", 1)


def kv_total_bytes(config: ModelConfig, tokens: int, shards: int = 1) -> float:
    """L · (numbers per token per layer) · tokens · b / shards: 2 · L · nkv · hd · tokens · b / shards
    (kv_cache_bytes) for multi-head K/V, L · (rkv + dr) · tokens · b / shards for MLA."""
    return config.n_layer * kv_cache_shape(config).per_token * tokens * _itemsize(config) / shards


def kv_bytes_per_rank(config: ModelConfig, cached, sizes: dict, coords: dict) -> int:
    """Bytes of KV cache one rank holds when the requests have `cached` positions each cached."""
    layers = len(range(*shard_range(config.n_layer, sizes["pp"], coords["pp"])))
    tokens = sum(striped_tokens(n, sizes["cp"], coords["cp"]) for n in cached)
    return layers * tokens * kv_bytes_per_token(config, sizes["tp"], coords["tp"])


def paged_blocks(cached, block_size: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Blocks one rank's pool gives requests of `cached` positions each: sum of ceil(n_r / B)."""
    return sum(-(-striped_tokens(n, cp, cp_rank) // block_size) for n in cached)


def paged_wasted_slots(cached, block_size: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Slots taken but empty: each request's last block, fewer than B slots each."""
    return paged_blocks(cached, block_size, cp, cp_rank) * block_size - sum(
        striped_tokens(n, cp, cp_rank) for n in cached)


def prefix_sharing_saved_blocks(holders: int, prefix: int, block_size: int, cp: int = 1,
                                cp_rank: int = 0) -> int:
    """Blocks one rank saves when `holders` live requests share a prefix of `prefix` positions."""
    return max(0, holders - 1) * (striped_tokens(prefix, cp, cp_rank) // block_size)


def block_bytes(config: ModelConfig, block_size: int, sizes: dict, coords: dict) -> int:
    """One block of the pool: the cache of B slots for every layer of the rank's stage and its heads."""
    layers = len(range(*shard_range(config.n_layer, sizes["pp"], coords["pp"])))
    return layers * block_size * kv_bytes_per_token(config, sizes["tp"], coords["tp"])


def pass_comm_bytes(config: ModelConfig, sizes: dict, coords: dict, groups) -> dict:
    """{(axis, op): Bytes} one rank moves in one pass; `groups` is [(N, R)] per pipeline group.

    tp: the embedding's g and two g per block, all-reduces of (N, C); the logits all-gathered
        as (V/t, R) pieces on the last stage.
    cp: per block, the all-reduce of the max lse (nh/t, N) and of [weighted out, weight] (nh/t, N, a+1),
        a the attention's output width per head (CacheShape.attended: hs; MLA's latent, kv_lora_rank).
    pp: (N, C) sent to the next stage per group; the R chosen tokens broadcast from the last stage.
    """
    t, c, p = sizes["tp"], sizes["cp"], sizes["pp"]
    tr, cr, s = coords["tp"], coords["cp"], coords["pp"]
    b, C, hs = _itemsize(config), config.n_embd, kv_cache_shape(config).attended
    layers = len(range(*shard_range(config.n_layer, p, s)))
    heads = len(range(*shard_range(config.n_head, t, tr)))
    out: dict = {}

    def add(axis, op, moved, times=1):
        cost.add(out, (axis, op), moved, times)

    for n, r in groups:
        if t > 1:
            add("tp", "all_reduce", cost.all_reduce_bytes(n * C, t, tr, b), 2 * layers + (s == 0))
            if s == p - 1:
                add("tp", "all_gather", cost.all_gather_bytes(shard_sizes(config.vocab_size, t), tr, b, r))
        if c > 1:
            add("cp", "all_reduce", cost.all_reduce_bytes(heads * n, c, cr, b), layers)
            add("cp", "all_reduce", cost.all_reduce_bytes(heads * n * (hs + 1), c, cr, b), layers)
        if p > 1 and s < p - 1:
            add("pp", "send", cost.Bytes(n * C * b, 0))
        if p > 1 and s > 0:
            add("pp", "recv", cost.Bytes(0, n * C * b))
    if p > 1:
        rows = sum(r for _, r in groups)
        add("pp", "broadcast", cost.broadcast_bytes(rows, p, s, p - 1, TOKEN_ITEMSIZE))
    return {key: cost.Bytes(*moved) for key, moved in out.items()}


def _itemsize(config: ModelConfig) -> int:
    return 8 if config.dtype == "float64" else 4


# ------------------------------------------------------------------------------------ at scale
def decode_estimate(spec: ModelSpec, hw: Hardware, *, tp: int = 1, pp: int = 1, batch: int = 1,
                    context: int = 4096, prompt: int = 1024, itemsize: int = 2) -> dict:
    """One configuration of a large model on real hardware: bytes per GPU and seconds per token.

    KV heads are split over tp while tp <= nkv; past that each is replicated (GQA), so the cache is
    split over min(tp, nkv) · pp. A spec with multi-head latent attention (kv_lora_rank > 0,
    DeepSeek-V3) caches kv_lora_rank + qk_rope_head_dim numbers per token per layer, whole on every
    tp rank, so split over pp alone. Prefill is compute-bound (2 · params FLOPs per token at the
    fp16 peak); decode is the HBM read of weights and cache. Communication uses the hardware's
    NVLink inside a node and InfiniBand across (`step_time.link`), NCCL's latencies.
    """
    h, L = spec.d_model, spec.n_layer
    params = param_counts(spec).total
    weights = params * itemsize / (tp * pp)
    if spec.kv_lora_rank:  # MLA: one latent entry per token per layer, replicated over tp
        shards = pp
        per_token = L * (spec.kv_lora_rank + spec.qk_rope_head_dim) * itemsize
    else:
        shards = min(tp, spec.n_kv_head) * pp
        per_token = kv_cache_bytes(L, spec.n_kv_head, spec.head_size, 1, itemsize)
    kv = per_token * batch * context / shards
    tp_bw, tp_lat = link(hw, {"tp": tp}, "tp")
    pp_bw, pp_lat = link(hw, {"tp": tp, "pp": pp}, "pp")

    def tp_comm(tokens):  # 2L all-reduces of (tokens, h) per pass
        return float(2 * L * collective_time("all_reduce", tokens * h * itemsize, tp, tp_bw, tp_lat,
                                             hw.call_latency))

    def pp_comm(tokens):  # p - 1 hops of (tokens, h)
        return float((pp - 1) * collective_time("send", tokens * h * itemsize, 2, pp_bw, pp_lat,
                                                hw.call_latency)) if pp > 1 else 0.0

    read = (weights + kv) / hw.hbm_bandwidth  # one stage's HBM read per decode step
    decode = pp * read + tp_comm(batch) + pp_comm(batch)
    flops = 2 * params * prompt  # the prompt's forward (Kaplan et al. 2020: 2 FLOPs per param per token)
    prefill = flops / (tp * hw.flops("float16")) + tp_comm(prompt) + pp_comm(prompt)
    return {
        "tp": tp, "pp": pp, "gpus": tp * pp, "batch": batch, "context": context,
        "tp_link": "nvlink" if tp <= hw.gpus_per_node else "infiniband",
        "weights_bytes_per_gpu": weights, "kv_bytes_per_gpu": kv,
        "kv_bytes_per_token_per_gpu": per_token / shards,
        "tp_bytes_per_token": float(2 * L * (2 * (tp - 1) / tp) * h * itemsize) if tp > 1 else 0.0,
        "pp_bytes_per_token": float(h * itemsize) if pp > 1 else 0.0,
        "prefill_s_per_token": prefill / prompt,
        "decode_s_per_token": decode,
        "decode_comm_s": tp_comm(batch) + pp_comm(batch),
        "decode_tokens_per_s": batch * pp / decode,
    }


def serving_table(spec: ModelSpec, hw: Hardware, *, gpus: int = 8, batch: int = 1, context: int = 4096,
                  prompt: int = 1024, itemsize: int = 2) -> list[dict]:
    """TP inside a node, PP over the same GPUs, and two nodes: TP across them, or TP inside and PP across."""
    rows = [("tp", gpus, 1), ("pp", 1, gpus), ("tp over 2 nodes", 2 * gpus, 1),
            ("tp x pp over 2 nodes", gpus, 2)]
    return [{"layout": name, **decode_estimate(spec, hw, tp=t, pp=p, batch=batch, context=context,
                                               prompt=prompt, itemsize=itemsize)}
            for name, t, p in rows]
