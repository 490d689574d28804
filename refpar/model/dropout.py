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

import numpy as np

from refpar import rng

SITES = {"embd": 0, "attn": 1, "attn_resid": 2, "mlp_resid": 3}


def keep_mask(seed, step, layer, site, sample_ids, shape, p, index=None) -> np.ndarray:
    """Boolean (len(sample_ids), *shape[index]): True where the value is kept (probability 1 - p)."""
    if site not in SITES:
        raise ValueError(f"unknown dropout site {site!r}; sites are {', '.join(SITES)}")
    out = None
    for row, s in enumerate(sample_ids):
        # float32 uniforms: twice as fast as float64 and fine enough (2^-24) to set p; masks are the
        # largest random draws of a step.
        u = rng.generator(seed, "dropout", step, layer, SITES[site], int(s)).random(shape, dtype=np.float32)
        kept = (u if index is None else u[index]) >= p
        if out is None:
            out = np.empty((len(sample_ids), *kept.shape), dtype=bool)
        out[row] = kept
    return out
