"""Continuous batching over a mesh of tp x cp x pp ranks: prefill, then decode with a KV cache.

    mpiexec -n 2 python -m refpar generate --mesh tp=2 --check
    mpiexec -n 4 python -m refpar generate --model llama-tiny --mesh tp=4 --check
    mpiexec -n 2 python -m refpar generate --model deepseek-tiny --mesh cp=2 --check

Legend: N tokens of a pass (the segments of several requests side by side, as vLLM flattens a
batch), R rows whose logits are needed (one per request: the last token of its segment),
C channels, V vocab, t tp size.

Every engine step (one tick of the scheduler, the same on every rank):
  1. requests that have arrived take free slots (at most `max_batch` run at once);
  2. prefill pass: the new requests' whole prompts, which fills their caches and gives each its
     first token;
  3. decode pass: one token for every request that was already running;
  4. requests with all their tokens leave and free their KV cache slots.
With a paged cache (`paging`, refpar/serving/paged.py) the step is planned first, as vLLM's
scheduler does: every running request gets the block for its next position (the newest is
preempted where a pool has none), then arrived requests are admitted while the pools have blocks
for their prompts, each prefill starting after the prefix it shares with a cached request.
A pass runs the tensor-parallel block of training (refpar/parallel/pieces.py's table: GPT-2's
`gpt2_pieces.block_forward`, Llama's `llama_pieces.block_forward`, RoPE at the tokens' global
positions) on the new tokens only, with `CachedAttention` as its core (DeepSeek-V3: its own block
with `LatentAttention`, the cached latent read with the up-projections absorbed, latent_attention.py,
each tp rank its heads over the whole latent): under tp the two g
all-reduces per layer per pass (after attention, after the MLP) are the only traffic besides the
vocab-parallel embedding and the gather of the logits. Under pp the pass is split into one group of
requests per stage, so several groups are in flight (stage s works on group g while stage s+1 works
on group g-1), and the last stage broadcasts the new tokens to every stage.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from refpar.analysis.serving import block_bytes, kv_heads_held
from refpar.config import ConfigError, ModelConfig
from refpar.holdings import stage_layers, stage_param_names
from refpar.memory import MemoryLedger
from refpar.model import kv_cache_shape
from refpar.model.gpt import NO_DROPOUT
from refpar.parallel.pieces import family, tp_layout
from refpar.parallel.tensor_parallel import check_tp, shard_params_tp
from refpar.serving.kv_cache import CachedAttention, KVCache
from refpar.serving.latent_attention import LatentAttention
from refpar.serving.paged import BlockTables, PagedKVCache, Paging, all_at_once, common_prefix, pool_blocks
from refpar.serving.requests import Request, check_requests
from refpar.serving.sampling import Sampling, sample_token
from refpar.sharding import shard_range


@dataclass(frozen=True)
class ServeMesh:
    """The communicators a serving rank uses (None for an axis of size 1) and its coordinates."""

    sizes: dict  # {"tp": t, "cp": c, "pp": p}
    coords: dict  # this rank's position on each axis
    tp: object = None
    cp: object = None
    pp: object = None

    @staticmethod
    def from_mesh(mesh) -> ServeMesh:
        """The tp, cp and pp communicators of a mesh that passed `check_serving` (dp = ep = 1)."""
        sizes = {a: mesh.sizes[a] for a in ("tp", "cp", "pp")}
        comms = {a: (mesh.axis(a) if sizes[a] > 1 else None) for a in sizes}
        return ServeMesh(sizes, {a: mesh.coords[a] for a in sizes}, **comms)

    @property
    def stage(self) -> int:
        return self.coords["pp"]

    @property
    def last_stage(self) -> bool:
        return self.stage == self.sizes["pp"] - 1


SINGLE = ServeMesh({"tp": 1, "cp": 1, "pp": 1}, {"tp": 0, "cp": 0, "pp": 0})


def check_serving(config: ModelConfig, sizes: dict, max_batch: int) -> None:
    """What serving needs of the model, the mesh (any of its axes; missing ones are 1) and the batch,
    checked from the sizes alone: on every rank, before any communication."""
    for axis in ("dp", "ep"):
        if sizes.get(axis, 1) > 1:
            raise ConfigError(f"serving splits a model over tp, cp and pp; {axis}={sizes[axis]} "
                              "would be independent replicas, so leave it out of --mesh")
    latent = kv_cache_shape(config).latent  # DeepSeek-V3's multi-head latent attention
    if config.moe_experts and not (latent and config.moe_dropless):
        # a token's experts must not depend on which tokens share its pass (capacity drops would)
        raise ConfigError("refpar generate serves dense GPT-2 and Llama models and DeepSeek-V3 with "
                          "dropless experts; leave out the MoE options, or set moe_dropless")
    stage_layers(config.n_layer, sizes.get("pp", 1), 0)  # enough blocks for the stages
    check_tp(config, sizes.get("tp", 1))  # whole heads and vocabulary rows on every tp rank
    if max_batch < 1:
        raise ConfigError(f"max_batch={max_batch} must be at least 1; give --max-batch 1 or more")


def local_params(full: dict, config: ModelConfig, sm: ServeMesh) -> dict:
    """This rank's weights: its tp slice of the parameters its pipeline stage uses."""
    names = stage_param_names(config, sm.sizes["pp"], sm.stage)
    return shard_params_tp({n: full[n] for n in names}, config, sm.sizes["tp"], sm.coords["tp"])


@dataclass
class Pass:
    """One prefill or decode pass as this rank saw it."""

    step: int
    phase: str  # prefill | decode
    tokens: int  # N, all groups together
    rows: int  # R: new tokens chosen
    groups: list  # (N, R) of each pipeline group
    seconds: float


@dataclass
class ServeResult:
    tokens: dict = field(default_factory=dict)  # rid -> generated tokens
    logits: dict = field(default_factory=dict)  # rid -> [(V,) per token], on the last stage
    passes: list = field(default_factory=list)
    # After every pass (the cache at its largest) and after every step's frees: this rank's cache
    # bytes as the ledger counts them, and the positions each running request has cached.
    kv_bytes: list = field(default_factory=list)
    cached: list = field(default_factory=list)
    kv_by_request: list = field(default_factory=list)  # {rid: bytes this rank holds}, from the ledger
    moments: list = field(default_factory=list)  # "step 3 decode", "step 3 end"
    pool: list = field(default_factory=list)  # paged: this rank's blocks, slots, tables at each moment
    # paged, at each moment: {rid: positions it holds blocks for}; a step's blocks are taken when it
    # is planned (vLLM's scheduler), so after a prefill pass the decoding requests hold one more
    reserved: list = field(default_factory=list)
    preemptions: list = field(default_factory=list)  # paged: (step, rid) of each preemption
    shared: dict = field(default_factory=dict)  # paged: rid -> positions taken from a cached request
    kv_blocks: int | None = None  # paged: blocks of each rank's pool
    steps: int = 0


def progress_line(step: int, running, waiting, tables, preempted) -> str:
    """One line per engine step of a paged run: what runs, what the pool holds, who was preempted."""
    line = (f"step {step}: {len(running)} running, {len(waiting)} waiting, pool {tables.taken}/"
            f"{tables.num_blocks} blocks ({tables.used_slots()} of {tables.taken * tables.block_size} "
            f"slots used)")
    if preempted:
        line += f"; preempted request{'s' * (len(preempted) > 1)} {', '.join(map(str, preempted))} " \
                "(blocks back to the pool, recomputed when admitted again)"
    return line


def _embed(tokens, params, lay):
    """tokens (1, N) -> x (1, N, C): this rank's vocabulary rows, summed over tp (g)."""
    return family(lay.config).embed(tokens, params, lay, NO_DROPOUT)[0]


def _block(x, params, layer: int, lay):
    """x (1, N, C) -> (1, N, C): the training block's forward, lay.attention its attention core
    (forward only: no kv heads' gradient to sum over their replicas); DeepSeek-V3's block with its
    absorbed latent attention (latent_attention.py)."""
    if isinstance(lay.attention, LatentAttention):
        return lay.attention.block(x, params, layer, lay)
    return family(lay.config).block(x, params, layer, lay, NO_DROPOUT)[0]


def _head(x, params, lay, sm: ServeMesh):
    """x (R, C) -> logits (R, V) on every tp rank: the family's final norm, this rank's vocabulary
    rows of the head, all-gather."""
    fam, config = family(lay.config), lay.config
    h, _ = fam.norm(x, params, lay)  # (R, C)
    local = h @ params[fam.head(config)].T  # (R, V/t)
    if sm.tp is None:
        return local
    t = sm.sizes["tp"]
    counts = [b - a for a, b in (shard_range(config.vocab_size, t, r) for r in range(t))]
    return sm.tp.all_gather(np.ascontiguousarray(local.T), tag="lm_head.logits", counts=counts).T


def make_cache(config: ModelConfig, requests, sm: ServeMesh, ledger: MemoryLedger, paging: Paging | None):
    """The contiguous cache, or the paged one with the tables of every cp rank (see paged.py)."""
    if paging is None:
        return KVCache(ledger, sm.sizes["cp"], sm.coords["cp"])
    paging.check(config.n_positions)
    c = sm.sizes["cp"]
    blocks = pool_blocks(paging, requests, c)
    nbytes = block_bytes(config, paging.block_size, sm.sizes, sm.coords)
    ranks = [BlockTables(blocks, paging.block_size, c, r, ledger if r == sm.coords["cp"] else None, nbytes)
             for r in range(c)]
    heads, shape = kv_heads_held(config, sm.sizes["tp"], sm.coords["tp"]), kv_cache_shape(config)
    return PagedKVCache(ranks, sm.coords["cp"], stage_layers(config.n_layer, sm.sizes["pp"], sm.stage),
                        heads[1] - heads[0], shape.key, np.dtype(config.dtype),
                        all_at_once(requests, paging.block_size, c), shape.value)


def serve(full_params: dict, config: ModelConfig, requests: list[Request], sampling: Sampling,
          sm: ServeMesh = SINGLE, max_batch: int = 4, ledger: MemoryLedger | None = None,
          tracer=None, paging: Paging | None = None, progress=None) -> ServeResult:
    """Generates every request's tokens; see the module docstring for the step. `progress`, when
    given, is called with one line per engine step of a paged run."""
    check_requests(config, requests)
    check_serving(config, sm.sizes, max_batch)
    ledger = MemoryLedger(record_events=True) if ledger is None else ledger
    cache = make_cache(config, requests, sm, ledger, paging)  # before the weights: it may refuse the pool
    params = local_params(full_params, config, sm)
    for name, w in params.items():
        ledger.alloc(name, w, "params")
    base = tp_layout(config, config.n_positions, sm.tp)
    attention = LatentAttention if kv_cache_shape(config).latent else CachedAttention
    layers = stage_layers(config.n_layer, sm.sizes["pp"], sm.stage)
    out = ServeResult()
    seqs: dict[int, list[int]] = {}  # rid -> prompt + generated tokens
    fed: dict[int, int] = {}  # rid -> positions whose keys and values are cached
    reserved: dict[int, int] = {}  # paged: rid -> positions it holds blocks for (this step's included)
    waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
    running: list[Request] = []
    if paging is not None:
        out.kv_blocks = cache.tables.num_blocks

    def snapshot(moment):
        out.kv_bytes.append(ledger.current["activations"])
        out.kv_by_request.append(cache.bytes_by_request())
        out.cached.append(dict(fed))
        out.moments.append(moment)
        if paging is not None:
            out.reserved.append(dict(reserved))
            t = cache.tables
            out.pool.append({"blocks": t.taken, "used_slots": t.used_slots(),
                             "wasted_slots": t.taken * t.block_size - t.used_slots(), "copies": t.copies,
                             "tables": {rid: list(table) for rid, table in t.table.items()}})

    def make_room(decoding, step) -> list[Request]:
        """Blocks for one more position of every running request, oldest first; where the pool of
        some cp rank has none, the newest running request is preempted (recomputed later)."""
        preempted, i = [], 0
        while i < len(decoding):
            r = decoding[i]
            while not cache.fits(r.rid, len(seqs[r.rid])):
                victim = decoding.pop()
                cache.free(victim.rid)
                del fed[victim.rid], reserved[victim.rid]
                preempted.append(victim)
                out.preemptions.append((step, victim.rid))
                if victim is r:
                    break
            else:
                cache.grow(r.rid, len(seqs[r.rid]))
                reserved[r.rid] = len(seqs[r.rid])
                i += 1
        return preempted

    def admit(r, decoding) -> int | None:
        """Blocks for a request's prefill (None: the pool has too few); returns the positions it
        takes from a cached request with the same first tokens (0 without prefix sharing). A running
        request that shares its last block writes past the sharer's slots, which the sharer never
        reads; the sharer copies the block before its own first write into it."""
        if paging is None:
            return 0
        seq, shared = seqs[r.rid], 0
        if paging.prefix_sharing:  # the longest cached prefix, leaving one token to compute the logits of
            def cached_prefix(d):
                return common_prefix(seq[:-1], seqs[d.rid][:fed[d.rid]])

            best = max(decoding, default=None, key=cached_prefix)  # ties: the earliest admitted
            shared = 0 if best is None else cached_prefix(best)
            if shared:
                cache.share(r.rid, best.rid, shared)
        if not cache.fits(r.rid, len(seq)):
            cache.free(r.rid)
            return None
        cache.grow(r.rid, len(seq))
        reserved[r.rid], out.shared[r.rid] = len(seq), shared
        return shared

    def run_pass(step, phase, segs):  # segs: [(request, tokens, first position)]
        t0 = time.perf_counter()
        n_groups = min(sm.sizes["pp"], len(segs))
        chosen, sizes = [], []
        for g in range(n_groups):
            group = segs[slice(*shard_range(len(segs), n_groups, g))]
            tokens = np.concatenate([np.asarray(tok, dtype=np.int64) for _, tok, _ in group])  # (N,)
            pos = np.concatenate([np.arange(p0, p0 + len(tok)) for _, tok, p0 in group])  # (N,)
            ends = np.cumsum([len(tok) for _, tok, _ in group])  # (R,)
            spans = [(r.rid, int(e - len(tok)), int(e)) for (r, tok, _), e in zip(group, ends, strict=True)]
            lay = replace(base, region_pos=pos, resid_pos=pos,
                          attention=attention(cache, spans, sm.cp))
            sizes.append((len(tokens), len(group)))
            ctx = tracer.context(step=step, microbatch=g, phase=phase) if tracer else nullcontext()
            with ctx:
                if sm.stage == 0:
                    x = _embed(tokens[None], params, lay)  # (1, N, C)
                else:
                    x = sm.pp.recv((1, len(tokens), config.n_embd), np.dtype(config.dtype),
                                   source=sm.stage - 1, tag="pp:act")  # (1, N, C)
                for layer in layers:
                    x = _block(x, params, layer, lay)  # (1, N, C)
                if not sm.last_stage:
                    sm.pp.send(x, dest=sm.stage + 1, tag="pp:act")
                    chosen += [0] * len(group)  # placeholders: the last stage broadcasts the tokens
                    continue
                logits = _head(x[0, ends - 1], params, lay, sm)  # (R, V)
            for (r, tok, p0), row in zip(group, logits, strict=True):
                out.logits[r.rid].append(row)
                chosen.append(sample_token(row, sampling, r.rid, p0 + len(tok)))
        chosen = np.asarray(chosen, dtype=np.int64)  # (R,)
        if sm.pp is not None:
            ctx = tracer.context(step=step, phase=phase) if tracer else nullcontext()
            with ctx:
                chosen = sm.pp.broadcast(chosen, root=sm.sizes["pp"] - 1, tag="pp:tokens")
        for (r, tok, p0), token in zip(segs, chosen, strict=True):
            fed[r.rid] = p0 + len(tok)
            seqs[r.rid].append(int(token))
            out.tokens[r.rid].append(int(token))
        seconds = time.perf_counter() - t0
        out.passes.append(Pass(step, phase, sum(n for n, _ in sizes), len(segs), sizes, seconds))
        snapshot(f"step {step} {phase}")

    step = 0
    while waiting or running:
        decoding = list(running)
        preempted = make_room(decoding, step) if paging is not None else []
        waiting = sorted(waiting + preempted, key=lambda r: (r.arrival, r.rid))
        arrived = []  # first come, first served; none in a step that had to preempt (vLLM)
        for r in [r for r in waiting if r.arrival <= step and not preempted]:
            if len(decoding) + len(arrived) == max_batch:
                break
            if r.rid not in seqs:
                seqs[r.rid], out.tokens[r.rid], out.logits[r.rid] = list(r.prompt), [], []
            shared = admit(r, decoding)
            if shared is None:
                break
            arrived.append((r, shared))
        for r, _ in arrived:
            waiting.remove(r)
        if arrived:
            run_pass(step, "prefill", [(r, seqs[r.rid][shared:], shared) for r, shared in arrived])
        if decoding:
            run_pass(step, "decode", [(r, seqs[r.rid][-1:], len(seqs[r.rid]) - 1) for r in decoding])
        running = decoding + [r for r, _ in arrived]
        for r in [r for r in running if len(out.tokens[r.rid]) == r.max_new_tokens]:
            running.remove(r)
            cache.free(r.rid)
            del fed[r.rid]
            reserved.pop(r.rid, None)
        snapshot(f"step {step} end")
        if progress is not None and paging is not None:
            progress(progress_line(step, running, waiting, cache.tables,
                                   [rid for s_, rid in out.preemptions if s_ == step]))
        step += 1
    out.steps = step
    if not sm.last_stage:
        out.logits = {}
    return out

