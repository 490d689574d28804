"""YaRN's RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
Models"), as DeepSeek-V3 uses it (its config's rope_scaling) and Hugging Face computes it
(transformers/modeling_rope_utils.py `_compute_yarn_parameters`; DeepseekV3Attention's softmax scale
`yarn_apply_mscale`), in float64.

    python -m pytest tests/test_deepseek_hf.py -k yarn      # against DeepseekV3ForCausalLM, float64

Legend: d the rotary width (MLA's qk_rope_head_dim), i < d/2 a frequency, s = factor,
L0 = original_max_position_embeddings, theta the base.

A frequency theta^(-2i/d) that turns fewer than beta_slow times over L0 positions is interpolated
(divided by s: it would meet angles it never saw in pretraining), one that turns more than beta_fast
times is kept (extrapolated), and those between are mixed by a linear ramp over i:

    inv_freq_i = theta^(-2i/d) (ramp_i / s + (1 - ramp_i)),   ramp_i = clamp((i - low) / (high - low), 0, 1)

with low = floor(c(beta_fast)), high = ceil(c(beta_slow)), clamped to [0, d - 1], where c(r) =
d log(L0 / (2 pi r)) / (2 log theta) is the index at which a frequency turns r times over L0.
cos and sin are multiplied by the attention factor get_mscale(s, mscale) / get_mscale(s,
mscale_all_dim) (get_mscale(s) when either is unset), get_mscale(s, m) = 0.1 m ln s + 1 for s > 1,
else 1; and the softmax scale 1/sqrt(dn + dr) by get_mscale(s, mscale_all_dim)^2 when mscale_all_dim
is set (DeepSeek-V3's 1.0: both factors then cancel in the rotary part and the scores grow by
(0.1 ln 40 + 1)^2).
"""

from __future__ import annotations

import math

import numpy as np
from array_api_compat import array_namespace, device

from refpar.config import RopeScaling
from refpar.model.layers import as_like


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 mscale ln(scale) + 1, and 1 for scale <= 1 (YaRN's attention temperature)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(s: RopeScaling) -> float:
    """What cos and sin are multiplied by (HF's `attention_factor`, when the dict gives none)."""
    if s.mscale and s.mscale_all_dim:
        return get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim)
    return get_mscale(s.factor)


def softmax_factor(s: RopeScaling | None) -> float:
    """What the softmax scale is multiplied by: get_mscale(factor, mscale_all_dim)^2, 1 without it."""
    if s is None or not s.mscale_all_dim:
        return 1.0
    return get_mscale(s.factor, s.mscale_all_dim) ** 2


def yarn_inv_freq(d: int, theta: float, s: RopeScaling) -> np.ndarray:
    """The d/2 scaled inverse frequencies (module docstring), float64."""
    def correction_dim(rotations):
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    extrapolated = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # (d/2,)
    keep = 1 - ramp  # (d/2,): 1 for the fast frequencies, kept; 0 for the slow ones, interpolated
    return extrapolated / s.factor * (1 - keep) + extrapolated * keep  # (d/2,)


def yarn_cos_sin(positions, d: int, theta: float, s: RopeScaling, like):
    """cos and sin (T, d) as model/llama_layers.rope_cos_sin lays them out ([angles, angles], HF's
    rotate_half pairs), from YaRN's frequencies, times the attention factor; computed in float64 and
    rounded once to `like`'s dtype."""
    xp = array_namespace(like)
    pos = xp.astype(as_like(positions, like), xp.float64)  # (T,)
    inv_freq = xp.asarray(yarn_inv_freq(d, theta, s), device=device(like))  # (d/2,)
    angles = xp.reshape(pos, (-1, 1)) * xp.reshape(inv_freq, (1, -1))  # (T, d/2)
    angles = xp.concat([angles, angles], axis=-1)  # (T, d)
    m = attention_factor(s)
    return xp.astype(xp.cos(angles) * m, like.dtype), xp.astype(xp.sin(angles) * m, like.dtype)
