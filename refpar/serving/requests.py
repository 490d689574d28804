"""Requests to serve, and the single-device truth they are checked against.

Legend: V vocab, T tokens of a sequence (prompt and generated).

The reference generates each request alone and recomputes the whole sequence for every new token
(`refpar.model.forward`, any family, no cache): whatever a KV cache, a batch or a mesh does must
give its logits and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar import model
from refpar.config import ConfigError, ModelConfig
from refpar.model.data import MarkovCorpus
from refpar.serving.sampling import Sampling, sample_token


@dataclass(frozen=True)
class Request:
    rid: int  # request id: keys its sampling randomness
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0  # the engine step at which it arrives


def check_requests(config: ModelConfig, requests: list[Request]) -> None:
    """Every request must fit in the context and name real tokens; one sentence for the first that
    does not."""
    if not requests:
        raise ConfigError("there is no request to serve; give at least one prompt length")
    for r in requests:
        if len(r.prompt) == 0:
            raise ConfigError(f"request {r.rid} has an empty prompt; give it at least one token")
        if len(r.prompt) > config.n_positions:
            raise ConfigError(f"request {r.rid}'s prompt of {len(r.prompt)} tokens is longer than "
                              f"the context of {config.n_positions} positions; shorten it")
        if r.max_new_tokens < 1:
            raise ConfigError(f"request {r.rid} asks for {r.max_new_tokens} new tokens; ask for 1 or more")
        if len(r.prompt) + r.max_new_tokens - 1 > config.n_positions:
            raise ConfigError(
                f"request {r.rid} needs {len(r.prompt)} prompt + {r.max_new_tokens} new tokens but the "
                f"context holds {config.n_positions} positions; ask for at most "
                f"{config.n_positions - len(r.prompt) + 1} new tokens")
        if min(r.prompt) < 0 or max(r.prompt) >= config.vocab_size:
            raise ConfigError(f"request {r.rid} has a token outside 0..{config.vocab_size - 1}")
        if r.arrival < 0:
            raise ConfigError(f"request {r.rid} arrives at step {r.arrival}; use a step >= 0")


def make_requests(config: ModelConfig, prompt_lens, new_tokens, arrivals, seed: int,
                  system_prompt: int = 0) -> list[Request]:
    """Prompts drawn from the Markov corpus refpar trains on (request i is sample i of step 0), each
    after the same `system_prompt` tokens (sample n of step 0), as chat requests share one."""
    n = len(prompt_lens)
    for flag, values in (("--new-tokens", new_tokens), ("--arrivals", arrivals)):
        if len(values) not in (1, n):
            raise ConfigError(f"{flag} has {len(values)} values for {n} prompt length{'s' * (n != 1)}; "
                              f"give one value, or one per prompt")
    new_tokens = list(new_tokens) * n if len(new_tokens) == 1 else list(new_tokens)
    arrivals = list(arrivals) * n if len(arrivals) == 1 else list(arrivals)
    if min(prompt_lens) < 1:
        raise ConfigError("every prompt length must be at least 1")
    if not 0 <= system_prompt < config.n_positions:
        raise ConfigError(f"--system-prompt {system_prompt} must be 0 to {config.n_positions - 1} tokens, "
                          f"below the context of {config.n_positions} positions")
    corpus = MarkovCorpus(config.vocab_size, seed)
    shared = tuple(int(t) for t in corpus.batch(0, [n], system_prompt)[0][0]) if system_prompt else ()
    out = []
    for i, (length, new, arrival) in enumerate(zip(prompt_lens, new_tokens, arrivals, strict=True)):
        tokens, _ = corpus.batch(0, [i], int(length))  # (1, T)
        out.append(Request(i, shared + tuple(int(t) for t in tokens[0]), int(new), int(arrival)))
    check_requests(config, out)
    return out


def reference_generate(params, config: ModelConfig, request: Request, sampling: Sampling):
    """(generated tokens, the logits (V,) each was chosen from): one device, full recompute."""
    tokens, logits = list(request.prompt), []
    for _ in range(request.max_new_tokens):
        row = model.forward(params, np.asarray([tokens]), config)[0, -1]  # (V,)
        logits.append(np.asarray(row))
        tokens.append(sample_token(row, sampling, request.rid, len(tokens)))
    return tokens[len(request.prompt):], logits
