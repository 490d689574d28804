"""The single-device training loop: the reference run that every strategy's losses are compared with,
for either model family (refpar.model dispatches by ModelConfig.arch).

Step s trains on the global batch of sample ids 0..B-1 of `MarkovCorpus.batch(s, ...)`, with
dropout keyed by (seed, s, layer, site, sample id): a parallel run that splits the same batch and
the same keys reproduces these losses and parameters.

Mixed precision (refpar/precision.py): a 16-bit model trains with fp32 master weights in the
optimizer state; fp16 runs scale the loss (`LossScaler`) and skip the steps whose gradients overflow.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from refpar import checkpoint
from refpar.config import MESH_AXES, ModelConfig, TrainConfig
from refpar.model import init_params, loss_and_grads
from refpar.model.data import MarkovCorpus
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.precision import MASTER_DTYPE, has_overflow, loss_scaler


@dataclass
class StepResult:
    step: int  # 0-based
    loss: float  # the batch's mean loss, before this step's update
    time_s: float  # wall time of data, forward, backward and update
    loss_scale: float | None = None  # fp16-mixed: the scale this step's backward used
    skipped: bool = False  # fp16-mixed: the gradients overflowed, so the update was skipped
    skipped_total: int = 0  # fp16-mixed: steps skipped so far, from step 0 (across resumes)


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # after the last step
    first_step: int = 0  # 0-based index of losses[0]: not 0 when resumed from a checkpoint
    loss_floor: float = 0.0  # the corpus's entropy rate in nats
    loss_scales: list[float] = field(default_factory=list)  # fp16-mixed: the scale of each step
    skipped_steps: list[int] = field(default_factory=list)  # fp16-mixed: 0-based steps skipped

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
    scaler = loss_scaler(model, train)  # None unless fp16-mixed
    grad_dtype = MASTER_DTYPE if train.fp32_grads else None
    sample_ids = range(train.batch_size)
    result = RunResult(loss_floor=corpus.entropy_rate())
    if resume is not None:
        result.first_step, params, state = checkpoint.load_whole(resume, model, train)
        if scaler is not None:
            scaler.load_state_dict(state.pop("loss_scaler"))
    for step in range(result.first_step, train.steps):
        start = time.perf_counter()
        tokens, targets = corpus.batch(step, sample_ids, train.seq_len)  # (B, T) each
        dloss = 1.0 if scaler is None else scaler.scale
        # fp16 loss scaling expects overflow to inf now and then, and checks for it: no warnings.
        with np.errstate(over="ignore", invalid="ignore") if scaler else contextlib.nullcontext():
            loss, grads = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                         sample_ids=sample_ids, dloss=dloss, grad_dtype=grad_dtype)
        skip = scaler is not None and has_overflow(grads)
        params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / dloss, skip=skip)
        if scaler is not None:
            scaler.update(skip)
            result.loss_scales.append(dloss)
            if skip:
                result.skipped_steps.append(step)
        elapsed = time.perf_counter() - start
        result.losses.append(loss)
        result.step_times_s.append(elapsed)
        if on_step is not None:
            on_step(StepResult(step, loss, elapsed, None if scaler is None else dloss, skip,
                               0 if scaler is None else scaler.skipped))
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            checkpoint.save_training(save, step + 1, checkpoint.whole_arrays(params, state), model,
                                     train, dict.fromkeys(MESH_AXES, 1), "single",
                                     optimizer_t=state["t"],
                                     loss_scaler=None if scaler is None else scaler.state_dict())
    result.params = params
    return result
