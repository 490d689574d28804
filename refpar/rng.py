"""Sharding-invariant randomness: numbers keyed by (seed, purpose, global indices).

A stream is a NumPy Philox generator whose key is derived from the seed, a named purpose and a
tuple of global ids (step, layer, sample index, a parameter's name ...). Nothing depends on the
mesh: a rank that holds a slice of a tensor draws the full per-key tensor and takes its slice, or
draws by global index, and gets the same numbers as the single device.

    uniform(seed, "dropout", step, layer, site, sample, shape=(T, C))[t0:t1]   # SP/CP shard
    normal(seed, "init", name_id("h.0.attn.c_attn.weight"), shape=(C, 3 * C))  # then sliced
"""

from __future__ import annotations

import zlib

import numpy as np

# A fixed number per purpose, so that adding a purpose never changes another's stream.
PURPOSES = {"init": 1, "data": 2, "dropout": 3, "moe": 4, "sample": 5, "test": 6, "validation": 7}


def name_id(name: str) -> int:
    """A stable integer for a string (a parameter's name), the same in every process."""
    return zlib.crc32(name.encode("utf-8"))


def generator(seed: int, purpose: str, *ids: int) -> np.random.Generator:
    """The Philox generator for one key. The key hashes the seed, the purpose, how many ids follow
    and the ids themselves, so (s, p, 1) and (s, p, 1, 0) are different streams."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown RNG purpose {purpose!r}; add it to refpar.rng.PURPOSES")
    words = [int(seed), PURPOSES[purpose], len(ids), *(int(i) for i in ids)]
    if min(words) < 0:
        raise ValueError(f"RNG seed and ids must be non-negative integers, got {words}")
    # Philox takes its 128-bit key from the sequence (generate_state(2, uint64)); given the key
    # itself it would also draw an unused SeedSequence from the OS's entropy, a third of the cost
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(words)))


def _draw(kind, seed, purpose, ids, shape, index):
    gen = generator(seed, purpose, *ids)
    full = gen.random(shape) if kind == "uniform" else gen.standard_normal(shape)
    return full if index is None else full[index]


def uniform(seed: int, purpose: str, *ids: int, shape, index=None) -> np.ndarray:
    """Float64 in [0, 1) for the whole keyed tensor of `shape`, then `[index]` if given."""
    return _draw("uniform", seed, purpose, ids, shape, index)


def normal(seed: int, purpose: str, *ids: int, shape, index=None) -> np.ndarray:
    """Standard normal float64 for the whole keyed tensor of `shape`, then `[index]` if given."""
    return _draw("normal", seed, purpose, ids, shape, index)
