"""Choosing the next token from its logits: greedy, or seeded sampling with temperature and top-k.

Legend: V vocab.

The random number of a draw is keyed by (seed, request id, position): the same request gets the
same tokens whatever the batch it shares a step with, the order requests arrive in, or the mesh
that computed its logits (refpar.rng, "sharding-invariant randomness").

    parse_sampling("greedy")                        # argmax
    parse_sampling("temperature=0.8,top_k=20")      # softmax(logits / 0.8) over the 20 largest
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refpar import rng
from refpar.config import ConfigError

OPTIONS = ("temperature", "top_k")


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k 0 keeps the whole vocabulary."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:  # nan too
            raise ConfigError(f"temperature={self.temperature} must be 0 (greedy) or a positive finite "
                              "number")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be 0 (the whole vocabulary) or positive")
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed} must be a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature={self.temperature:g}, top_k={self.top_k or 'all'}, seed={self.seed}"


def parse_sampling(text: str, seed: int = 0) -> Sampling:
    """`"greedy"` or `"temperature=T,top_k=K"` (either key may be left out); one sentence per mistake."""
    if text.strip() == "greedy":
        return Sampling(seed=seed)
    values: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = (s.strip() for s in part.partition("="))
        if name not in OPTIONS or not sep:
            raise ConfigError(f"unknown sampling option {part!r}; use greedy or "
                              f"temperature=T,top_k=K (options: {', '.join(OPTIONS)})")
        if name in values:
            raise ConfigError(f"sampling option {name} is given twice; give each option once")
        try:
            values[name] = int(value) if name == "top_k" else float(value)
        except ValueError:
            raise ConfigError(f"sampling option {name}={value!r} needs a number") from None
    if not values:
        raise ConfigError("the sampling option is empty; use greedy or temperature=T,top_k=K")
    return Sampling(temperature=float(values.get("temperature", 1.0)),
                    top_k=int(values.get("top_k", 0)), seed=seed)


def sample_token(logits, sampling: Sampling, request_id: int, position: int) -> int:
    """logits (V,) of the token at `position` - 1 -> the token placed at `position`."""
    logits = np.asarray(logits, dtype=np.float64)  # (V,)
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits / sampling.temperature  # (V,)
    if 0 < sampling.top_k < z.shape[0]:
        kth = np.partition(z, -sampling.top_k)[-sampling.top_k]
        z = np.where(z >= kth, z, -np.inf)  # (V,) ties with the k-th largest are kept
    p = np.exp(z - np.max(z))  # (V,)
    cdf = np.cumsum(p / np.sum(p))  # (V,)
    u = rng.uniform(sampling.seed, "sample", request_id, position, shape=())
    return int(min(np.searchsorted(cdf, u, side="right"), z.shape[0] - 1))
