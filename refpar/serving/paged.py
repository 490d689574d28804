"""A paged KV cache, as vLLM keeps it (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"): fixed-size blocks from a pool, a block table per request.

Legend: B block size (token slots per block), nb blocks in a request's table, Ls the layers of this
rank's pipeline stage, nkv this rank's kv heads, hs head size, n a request's positions this rank holds.

What a rank's pool holds is what its contiguous cache would (kv_cache.py): under tp its kv heads,
under pp its stage's layers, under cp its striped positions (p % c == r). Slot j of a request on a
cp rank is its j-th own position, global position j * c + r; a block holds B consecutive slots of
every layer of the stage (one block id for all layers, as vLLM's block tables are shared by layers):

    pool K, V          (blocks, Ls, nkv, B, hs), (blocks, Ls, nkv, B, hv): hv = hs, MLA's 0
    table of request   [b0, b1, ...]       slot j -> block table[j // B], offset j % B

Blocks are taken when the scheduler plans a pass (vLLM's `append_slots`) and given back when a
request finishes or is preempted; the MemoryLedger holds one `activations` entry per taken block,
so the cache's measured bytes are (blocks taken) x (bytes of a block), and the last block of each
request wastes fewer than B slots.

Prefix sharing: a request whose tokens start like a request already cached takes that request's
blocks of the common prefix instead of computing them (its prefill starts after the prefix), each
block counting its holders. The last, partly filled, block is shared too; the first holder that
writes into a block with other holders copies it first (copy on write) and writes into the copy.

Preemption by recomputation (vLLM's default): when a running request needs a block and the pool
has none, the most recently admitted request gives all its blocks back and waits again; when it
is admitted again, its prefill recomputes prompt and generated tokens, and it goes on where it was.

Every rank must take the same decisions without talking, so the scheduler keeps the tables of every
cp rank (integers only; tp and pp ranks have the same tables as their cp rank) and admits or keeps
a request only when all of them have the blocks.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from refpar.analysis.serving import paged_blocks, striped_tokens
from refpar.config import ConfigError
from refpar.memory import MemoryLedger


@dataclass(frozen=True)
class Paging:
    """`refpar generate --paged --block-size B [--kv-blocks N] [--prefix-sharing]`."""

    block_size: int = 16
    kv_blocks: int | None = None  # blocks per rank; None: enough for every request at once
    prefix_sharing: bool = False

    def check(self, n_positions: int) -> None:
        if not 1 <= self.block_size <= n_positions:
            raise ConfigError(f"--block-size {self.block_size} must be 1 to {n_positions} token slots (the "
                              f"context); give e.g. {min(16, n_positions)}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError(f"--kv-blocks {self.kv_blocks} must be at least 1 block per rank")


class BlockTables:
    """One cp rank's pool, as integers: free blocks, each block's holders, each request's table."""

    def __init__(self, num_blocks: int, block_size: int, cp: int = 1, cp_rank: int = 0,
                 ledger: MemoryLedger | None = None, block_bytes: int = 0):
        self.num_blocks, self.block_size, self.cp, self.cp_rank = num_blocks, block_size, cp, cp_rank
        self.ledger, self.block_bytes = ledger, block_bytes
        # Free ids: the given-back ones (a heap, all below `fresh`) and fresh..num_blocks-1, so the
        # lowest free id is taken first and a large pool costs nothing until it is used.
        self.given_back: list[int] = []
        self.fresh = 0
        self.refs: dict[int, int] = {}  # block -> holders
        self.table: dict[int, list[int]] = {}  # rid -> block ids
        self.filled: dict[int, int] = {}  # rid -> slots written
        self.copies = 0  # copy-on-write copies made

    def slots(self, positions: int) -> int:
        return striped_tokens(positions, self.cp, self.cp_rank)

    def needed(self, rid: int, positions: int) -> int:
        """Free blocks it takes for `rid` to hold positions 0..positions-1 (a copy included)."""
        have, want = self.filled.get(rid, 0), self.slots(positions)
        if want <= have:
            return 0
        copy = have % self.block_size != 0 and self.refs[self.table[rid][-1]] > 1
        return copy + math.ceil(want / self.block_size) - math.ceil(have / self.block_size)

    def grow(self, rid: int, positions: int) -> list[tuple[int, int]]:
        """Takes the blocks of `needed`; returns the (from, to) block copies to make before writing."""
        have, want = self.filled.get(rid, 0), self.slots(positions)
        table = self.table.setdefault(rid, [])
        copies = []
        if want <= have:
            return copies
        if have % self.block_size != 0 and self.refs[table[-1]] > 1:  # copy on write
            shared = table[-1]
            table[-1] = self._take()
            self._drop(shared)
            copies.append((shared, table[-1]))
            self.copies += 1
        table += [self._take() for _ in range(math.ceil(want / self.block_size) - len(table))]
        self.filled[rid] = want
        return copies

    def share(self, rid: int, donor: int, positions: int) -> None:
        """`rid` holds the donor's blocks of positions 0..positions-1, which hold its tokens too."""
        n = self.slots(positions)
        blocks = self.table[donor][:math.ceil(n / self.block_size)]
        for b in blocks:
            self.refs[b] += 1
        self.table[rid], self.filled[rid] = list(blocks), n

    def release(self, rid: int) -> None:
        for b in self.table.pop(rid, []):
            self._drop(b)
        self.filled.pop(rid, None)

    def used_slots(self) -> int:
        """Slots that hold a key some request reads: a shared block's slots count once."""
        used: dict[int, int] = {}
        for rid, table in self.table.items():
            for i, b in enumerate(table):
                used[b] = max(used.get(b, 0), min(self.block_size, self.filled[rid] - i * self.block_size))
        return sum(used.values())

    @property
    def taken(self) -> int:
        return self.num_blocks - self.free

    @property
    def free(self) -> int:
        return len(self.given_back) + self.num_blocks - self.fresh

    def _take(self) -> int:
        if self.given_back:
            b = heapq.heappop(self.given_back)
        else:
            b, self.fresh = self.fresh, self.fresh + 1
        self.refs[b] = 1
        if self.ledger is not None:
            self.ledger.alloc(f"kv.block{b}", self.block_bytes, "activations")
        return b

    def _drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]
            heapq.heappush(self.given_back, b)
            if self.ledger is not None:
                self.ledger.free(f"kv.block{b}")


class PagedKVCache:
    """This rank's pool of keys and values, read and written through the block tables; `ranks` are
    the tables of every cp rank (the scheduler's), `ranks[cp_rank]` this rank's own; `rows` the
    blocks every request at its longest would hold at once."""

    def __init__(self, ranks: list[BlockTables], cp_rank: int, layers, kv_heads: int, head_size: int,
                 dtype, rows: int, value_size: int | None = None):
        self.ranks, self.cp_rank = ranks, cp_rank
        self.tables = ranks[cp_rank]
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        # The lowest free block is taken first: one taken while m are in use gets an id <= m, so no id
        # reaches the most blocks ever in use at once, and that is at most `rows`.
        # `value_size` hv: head_size, or 0 for MLA's one entry per token (kv_cache.py's legend)
        shape = (min(self.tables.num_blocks, rows), len(layers), kv_heads, self.tables.block_size)
        hv = head_size if value_size is None else value_size
        self.k = np.zeros((*shape, head_size), dtype=dtype)  # (blocks, Ls, nkv, B, hs)
        self.v = np.zeros((*shape, hv), dtype=dtype)  # (blocks, Ls, nkv, B, hv)

    # ------------------------------------------------------------ the scheduler's side (every cp rank)
    def fits(self, rid: int, positions: int) -> bool:
        return all(t.needed(rid, positions) <= t.free for t in self.ranks)

    def grow(self, rid: int, positions: int) -> None:
        """Takes the blocks for positions 0..positions-1 on every cp rank, copying this rank's shared
        last block where it is written next."""
        for t in self.ranks:
            for src, dst in t.grow(rid, positions):
                if t is self.tables:
                    self.k[dst], self.v[dst] = self.k[src], self.v[src]  # (Ls, nkv, B, hs|hv)

    def share(self, rid: int, donor: int, positions: int) -> None:
        for t in self.ranks:
            t.share(rid, donor, positions)

    def free(self, rid: int) -> None:
        for t in self.ranks:
            t.release(rid)

    def bytes_by_request(self) -> dict[int, int]:
        """{rid: bytes}: each taken block under the first request holding it, so a shared block counts
        once and the values add up to the ledger's."""
        owner: dict[int, int] = {}
        for rid, table in self.tables.table.items():
            for b in table:
                owner.setdefault(b, rid)
        by_request: dict[int, int] = {}
        for rid in owner.values():
            by_request[rid] = by_request.get(rid, 0) + self.tables.block_bytes
        return by_request

    # ------------------------------------------------------------ the attention's side (this rank)
    def append(self, rid: int, layer: int, k, v, positions) -> None:
        """k (nkv, n, hs), v (nkv, n, hv) of a request's new tokens at `positions` (n,): writes the owned
        ones into the slots its table maps them to (taken by `grow` before the pass)."""
        t, positions = self.tables, np.asarray(positions)
        mine = positions % t.cp == t.cp_rank  # (n,)
        slot = positions[mine] // t.cp  # (n_mine,) this rank's slot numbers
        blocks = np.asarray(t.table[rid])[slot // t.block_size]  # (n_mine,)
        li = self.layer_index[layer]
        self.k[blocks, li, :, slot % t.block_size] = np.swapaxes(k[:, mine], 0, 1)  # (n_mine, nkv, hs)
        self.v[blocks, li, :, slot % t.block_size] = np.swapaxes(v[:, mine], 0, 1)  # (n_mine, nkv, hv)

    def get(self, rid: int, layer: int, like=None, v_like=None):
        """(K (nkv, n, hs), V (nkv, n, hv), positions (n,)): the request's blocks gathered through its
        table, in slot order, so the attention sees the arrays the contiguous cache would hold (the
        pool's shapes; `like` and `v_like` are the contiguous cache's arguments)."""
        t = self.tables
        n, table = t.filled.get(rid, 0), t.table.get(rid, [])
        nkv, hs, hv = self.k.shape[2], self.k.shape[-1], self.v.shape[-1]
        if n == 0:  # under cp, a rank may hold none of a short request yet
            return (np.zeros((nkv, 0, hs), dtype=self.k.dtype),  # (nkv, 0, hs)
                    np.zeros((nkv, 0, hv), dtype=self.v.dtype), np.zeros(0, dtype=np.int64))
        li = self.layer_index[layer]
        slots = len(table) * t.block_size  # explicit: -1 cannot be inferred for MLA's hv = 0
        K = np.reshape(np.swapaxes(self.k[table, li], 0, 1), (nkv, slots, hs))[:, :n]  # (nkv, n, hs)
        V = np.reshape(np.swapaxes(self.v[table, li], 0, 1), (nkv, slots, hv))[:, :n]  # (nkv, n, hv)
        positions = np.arange(n, dtype=np.int64) * t.cp + t.cp_rank  # (n,)
        return np.ascontiguousarray(K), np.ascontiguousarray(V), positions


def pool_blocks(paging: Paging, requests, cp: int) -> int:
    """Blocks per rank: --kv-blocks, or enough for every request at its longest at once (cp rank 0
    holds the most positions, `all_at_once`). A pool that cannot hold its longest request alone is
    refused."""
    longest = max(requests, key=lambda r: len(r.prompt) + r.max_new_tokens)
    positions = len(longest.prompt) + longest.max_new_tokens - 1  # the last token is never fed back
    need = paged_blocks([positions], paging.block_size, cp, 0)
    if paging.kv_blocks is None:
        return all_at_once(requests, paging.block_size, cp)
    if paging.kv_blocks < need:
        raise ConfigError(f"--kv-blocks {paging.kv_blocks} cannot hold request {longest.rid} alone "
                          f"({positions} positions need {need} blocks of {paging.block_size} on a rank); "
                          f"give --kv-blocks {need} or more")
    return paging.kv_blocks


def all_at_once(requests, block_size: int, cp: int) -> int:
    """Blocks cp rank 0 gives every request at its longest (the last token is never fed back)."""
    return paged_blocks([len(r.prompt) + r.max_new_tokens - 1 for r in requests], block_size, cp, 0)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
