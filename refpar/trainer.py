"""The single-device training loop: the reference run that every strategy's losses are compared with.

Step s trains on the global batch of sample ids 0..B-1 of `MarkovCorpus.batch(s, ...)`, with
dropout keyed by (seed, s, layer, site, sample id): a parallel run that splits the same batch and
the same keys reproduces these losses and parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from refpar import checkpoint
from refpar.config import MESH_AXES, ModelConfig, TrainConfig
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import init_params, loss_and_grads
from refpar.model.optim import optimizer_init, optimizer_step


@dataclass
class StepResult:
    step: int  # 0-based
    loss: float  # the batch's mean loss, before this step's update
    time_s: float  # wall time of data, forward, backward and update


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # after the last step
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    loss_floor: float = 0.0  # the corpus's entropy rate in nats

    @property
    def step_time_s(self) -> float:
        """Mean step time, leaving out the first step (it pays for warm-up) when there are others."""
        times = self.step_times_s[1:] or self.step_times_s
        return sum(times) / len(times)


def corpus_for(model: ModelConfig, train: TrainConfig) -> MarkovCorpus:
    return MarkovCorpus(model.vocab_size, train.seed)


def train_single_device(model: ModelConfig, train: TrainConfig,
                        on_step: Callable[[StepResult], None] | None = None, *,
                        save: str | None = None, save_every: int | None = None,
                        resume: str | None = None) -> RunResult:
    """Trains from `init_params(model, train.seed)` for `train.steps` steps on one process, or from
    the checkpoint `resume` (any mesh's) up to `train.steps`; with `save`, writes a checkpoint under
    that directory every `save_every` steps and after the last (refpar/checkpoint.py)."""
    train.check_model(model)
    corpus = corpus_for(model, train)
    params = init_params(model, train.seed) if resume is None else {}
    state = optimizer_init(params, train)
    sample_ids = range(train.batch_size)
    result = RunResult(loss_floor=corpus.entropy_rate())
    if resume is not None:
        result.first_step, params, state = checkpoint.load_whole(resume, model, train)
    for step in range(result.first_step, train.steps):
        start = time.perf_counter()
        tokens, targets = corpus.batch(step, sample_ids, train.seq_len)  # (B, T) each
        loss, grads = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                     sample_ids=sample_ids)
        params, state = optimizer_step(params, grads, state, train)
        elapsed = time.perf_counter() - start
        result.losses.append(loss)
        result.step_times_s.append(elapsed)
        if on_step is not None:
            on_step(StepResult(step, loss, elapsed))
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            checkpoint.save_training(save, step + 1, checkpoint.whole_arrays(params, state), model,
                                     train, dict.fromkeys(MESH_AXES, 1), "single")
    result.params = params
    return result
