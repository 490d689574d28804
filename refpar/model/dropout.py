"""Dropout masks keyed by global indices, so that any shard draws the single device's numbers.

One RNG key per (seed, "dropout", step, layer, site, sample_id). The mask of one sample is drawn
for the full per-sample shape of its site and then sliced by `index`, so a tensor-parallel rank
(heads), a sequence shard (positions) or a pipeline stage (layers) gets exactly the values the
single device used. Masks are created from nothing, so they are NumPy on the host; the caller moves
them to its namespace (`layers.as_like`).

Sites and their per-sample shapes: `embd` (T, C), `attn` (nh, T, T) on the softmax probabilities,
`attn_resid` (T, C), `mlp_resid` (T, C). The `embd` site uses layer 0; the site id keeps its
stream apart from block 0's.
"""

from __future__ import annotations

import math

import numpy as np

from refpar import rng

SITES = {"embd": 0, "attn": 1, "attn_resid": 2, "mlp_resid": 3}


def keep_mask(seed, step, layer, site, sample_ids, shape, p, index=None) -> np.ndarray:
    """Boolean (len(sample_ids), *shape[index]): True where the value is kept (probability 1 - p).

    Each sample's mask is `u >= p` for u its key's float32 uniforms of `shape` (`Generator.random(
    shape, dtype=np.float32)`: twice as fast as float64 and fine enough, 2^-24, to set p), decided
    on the 32-bit words they are made of (`_uniform_words`): u is (w >> 8) / 2^24, so u >= p
    exactly when w >= `_threshold(p)` << 8. The same masks without writing the floats: masks are
    the largest random draws of a step, and the integer comparison halves their cost."""
    if site not in SITES:
        raise ValueError(f"unknown dropout site {site!r}; sites are {', '.join(SITES)}")
    cut = _threshold(p) << 8  # the least kept word
    out = None
    for row, s in enumerate(sample_ids):
        words = _uniform_words(rng.generator(seed, "dropout", step, layer, SITES[site], int(s)), shape)
        if out is None:
            out = np.empty((len(sample_ids), *(words if index is None else words[index]).shape), dtype=bool)
        if cut >= 1 << 32:  # p above every uniform: nothing is kept
            out[row] = False
        elif index is None:
            np.greater_equal(words, cut, out=out[row])
        else:
            out[row] = words[index] >= cut
    return out


def _uniform_words(gen: np.random.Generator, shape) -> np.ndarray:
    """uint32 `shape`: the words `gen.random(shape, dtype=np.float32)` turns into its floats, in
    order. NumPy takes each float's word from a 64-bit output of the bit generator, its low half
    first and its high half next (next_uint32 keeps the high half for the following call); the
    64-bit outputs are `random_raw`'s, so the words are random_raw's outputs read as little-endian
    pairs (tests/test_model_gradients.py checks them against `random`)."""
    n = math.prod(shape)
    raw = gen.bit_generator.random_raw(-(-n // 2))  # (ceil(n/2),) uint64
    return raw.astype("<u8", copy=False).view("<u4")[:n].reshape(shape)  # (*shape,)


def _threshold(p) -> int:
    """The least k in [0, 2^24] for which the float32 uniform k / 2^24 is `>= p` as NumPy compares a
    float32 array with p (2^24: none is), found among the neighbours of ceil(p 2^24) by that very
    comparison, so it agrees with `u >= p` whatever p's type and rounding."""
    k0 = math.ceil(float(p) * (1 << 24))
    ks = np.arange(max(k0 - 2, 0), min(k0 + 3, (1 << 24) + 1))  # (<= 5,)
    kept = ks.astype(np.float32) * np.float32(2.0**-24) >= p  # (<= 5,) bool
    return int(ks[np.argmax(kept)]) if kept.any() else (1 << 24)
