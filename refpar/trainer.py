"""The single-device training loop: the reference run that every strategy's losses are compared with,
for either model family (refpar.model dispatches by ModelConfig.arch).

    mpiexec -n 8 refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --check   # rank 0 runs it first

Step s trains on the global batch of sample ids 0..B-1 of `MarkovCorpus.batch(s, ...)`, with
dropout keyed by (seed, s, layer, site, sample id): a parallel run that splits the same batch and
the same keys reproduces these losses and parameters.

Mixed precision (refpar/precision.py): a 16-bit model trains with fp32 master weights in the
optimizer state; fp16 runs scale the loss (`LossScaler`) and skip the steps whose gradients overflow.

Each step trains at `learning_rate(train, step)`; with `train.clip_grad_norm` the gradients are
multiplied by `clip_coefficient` of their global L2 norm (of the unscaled gradients, in fp32 under
mixed precision; none on a step fp16 skips), the definition every mesh reproduces
(refpar/parallel/clipping.py).

MoE models (`microbatches` M): routing statistics are per microbatch, as in Megatron-Core: global
microbatch j is the contiguous slice shard_range(B, M, j) of the batch, routed on its own tokens
(capacity from its token count, its own drop order), each contributing 1/M of its router losses, and
the gradients accumulate over the M slices; every step's routing is kept (refpar/records.py:MoEStep).
A parallel run with M microbatches routes the same token sets in the same queue order. Routing is a
discrete choice: once two runs' parameters differ in the last bit, a token near a tie or at the
capacity edge can go elsewhere, so a 16-bit run agrees with one device in its losses within a tolerance.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refpar import backend, checkpoint, interrupt
from refpar.allocator import keep_freed_memory
from refpar.config import MESH_AXES, ModelConfig, TrainConfig
from refpar.model import forward, init_params, loss_and_grads, moe_layer
from refpar.model.data import MarkovCorpus
from refpar.model.layers import cross_entropy_forward
from refpar.model.optim import clip_coefficient, learning_rate, optimizer_init, optimizer_step, sum_of_squares
from refpar.model.routing import update_expert_bias
from refpar.precision import MASTER_DTYPE, has_overflow, loss_scaler
from refpar.records import Run, step_record
from refpar.sharding import shard_range


@dataclass
class StepResult:
    step: int  # 0-based
    loss: float  # the batch's mean loss, before this step's update
    time_s: float  # wall time of data, forward, backward and update
    loss_scale: float | None = None  # fp16-mixed: the scale this step's backward used
    skipped: bool = False  # fp16-mixed: the gradients overflowed, so the update was skipped
    skipped_total: int = 0  # fp16-mixed: steps skipped so far, from step 0 (across resumes)


_OPENED: dict[tuple, object] = {}  # corpora by (path, tokenizer, vocabulary, seed) or ("markov", V, seed)


def corpus_for(model: ModelConfig, train: TrainConfig):
    """The corpus a run trains on: the text or token files `train.data` names (refpar/data), else the
    Markov corpus. Either draws the global batch by (seed, step, sample id) (`batch`) and has held-out
    windows (`val_batch`)."""
    if train.data is None:  # the chain is drawn once: a run, its --check reference and its floor share it
        key = ("markov", model.vocab_size, train.seed)
        if key not in _OPENED:
            _OPENED[key] = MarkovCorpus(model.vocab_size, train.seed)
        return _OPENED[key]
    key = (train.data, train.tokenizer, train.tokenizer_vocab, train.seed)
    if key not in _OPENED:
        from refpar.data import open_data

        _OPENED[key] = open_data(train.data, train.tokenizer, train.tokenizer_vocab, train.seed)
    return _OPENED[key]


def loss_floor(corpus) -> float | None:
    """The lowest mean loss possible where it is known: the Markov chain's entropy rate; None for text."""
    return corpus.entropy_rate() if isinstance(corpus, MarkovCorpus) else None


def baseline(corpus) -> tuple[str, float]:
    """What a run's loss is printed next to: the Markov chain's floor, or the text's unigram entropy (the
    loss of a model that ignores the context: below it, the model has learned from the context)."""
    floor = loss_floor(corpus)
    return ("floor", floor) if floor is not None else ("unigram", corpus.unigram_entropy())


EVAL_BATCHES = 4  # the held-out rows of a validation loss: this many global batches (nanoGPT: eval_iters)
LOGITS_BUDGET = 1 << 24  # logits evaluated at once, at most: GPT-2's T x V is 51M per row


def validation_loss(params: dict, model: ModelConfig, corpus, train: TrainConfig) -> float:
    """Mean cross-entropy, in evaluation mode (no dropout, no router losses), of the corpus's held-out
    windows: EVAL_BATCHES x batch_size rows of seq_len tokens, a few rows at a time."""
    rows = EVAL_BATCHES * train.batch_size
    tokens, targets = corpus.val_batch(train.seq_len, rows)  # (rows, T) each
    chunk = max(1, LOGITS_BUDGET // (train.seq_len * model.vocab_size))
    total = 0.0
    for a in range(0, rows, chunk):
        logits = forward(params, tokens[a:a + chunk], model)  # (chunk, T, V)
        loss, _ = cross_entropy_forward(logits, targets[a:a + chunk], tokens.size)
        total += float(backend.to_host(loss))
    return total


def evaluates(train: TrainConfig, step: int) -> bool:
    """Whether the validation loss is computed after 0-based step `step`: before the first (step -1:
    the loss of the weights the run starts from, as nanoGPT's iteration 0), every eval_every steps and
    after the last."""
    return bool(train.eval_every) and ((step + 1) % train.eval_every == 0 or step + 1 == train.steps)


def train_single_device(model: ModelConfig, train: TrainConfig,
                        on_step: Callable[[StepResult], None] | None = None, *, microbatches: int = 1,
                        save: str | None = None, save_every: int | None = None,
                        resume: str | None = None) -> Run:
    """Trains from `init_params(model, train.seed)` (or the weights `train.init_from` names,
    refpar/weights.py) for `train.steps` steps on one process, or from
    the checkpoint `resume` (any mesh's) up to `train.steps`; with `save`, writes a checkpoint under
    that directory every `save_every` steps and after the last (refpar/checkpoint.py). A MoE model
    routes each step in `microbatches` slices (module docstring); a dense model's numbers do not
    depend on them but for the order of sums, so it takes the batch at once."""
    train.check_model(model)
    keep_freed_memory()  # each step reuses the pages of the one before (refpar/allocator.py)
    corpus = corpus_for(model, train)
    if resume is not None:
        params = {}
    elif train.init_from is not None:
        from refpar.weights import read_params

        params = read_params(train.init_from, model)
    else:
        params = init_params(model, train.seed)
    state = optimizer_init(params, train)
    scaler = loss_scaler(model, train)  # None unless fp16-mixed
    grad_dtype = MASTER_DTYPE if train.fp32_grads else None
    sample_ids = range(train.batch_size)
    result = Run(loss_floor=loss_floor(corpus))
    if resume is not None:
        result.first_step, params, state = checkpoint.load_whole(resume, model, train)
        if scaler is not None:
            scaler.load_state_dict(state.pop("loss_scaler"))
    m = microbatches if model.moe_experts else 1
    expert_bias: dict = {}  # aux-free balancing: layer -> (E,), updated after each step
    if evaluates(train, -1) and result.first_step == 0:  # the weights it starts from
        result.val_losses.append((0, validation_loss(params, model, corpus, train)))
    for step in range(result.first_step, train.steps):
        interrupt.at(step, train.steps)  # what Ctrl-C's line says (refpar/interrupt.py)
        start = time.perf_counter()
        dloss = 1.0 if scaler is None else scaler.scale
        loss, grads, routings = 0.0, None, []
        for j in range(m):
            ids = range(*shard_range(train.batch_size, m, j)) if m > 1 else sample_ids
            tokens, targets = corpus.batch(step, ids, train.seq_len)  # (B/M, T) each
            layer = (moe_layer(model, weight=1 / m, grad_scale=dloss, bias=expert_bias)
                     if model.moe_experts else None)
            # fp16 loss scaling expects overflow to inf now and then, and checks for it: no warnings.
            with np.errstate(over="ignore", invalid="ignore") if scaler else contextlib.nullcontext():
                part, g = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                         sample_ids=ids, normalizer=train.batch_size * train.seq_len,
                                         moe=layer, dloss=dloss, grad_dtype=grad_dtype)
            loss += part
            grads = g if grads is None else {n: grads[n] + g[n] for n in grads}
            if layer is not None:
                routings.append(layer.last_routing)
        if model.moe_experts:
            result.moe_steps.append(step_record(step, loss, routings, start, bias=expert_bias))
            update_expert_bias(expert_bias, routings, model)
        skip = scaler is not None and has_overflow(grads)
        factor = 1.0 / dloss  # the loss scale undone
        if train.clip_grad_norm:
            norm = None if skip else float(sum_of_squares(grads.values())[0]) ** 0.5 * factor
            result.grad_norms.append(norm)
            factor *= 1.0 if skip else clip_coefficient(norm, train.clip_grad_norm)
        result.lrs.append(learning_rate(train, step))
        params, state = optimizer_step(params, grads, state, train, lr=result.lrs[-1], grad_factor=factor,
                                       skip=skip)
        if scaler is not None:
            scaler.update(skip)
            result.loss_scales.append(dloss)
            if skip:
                result.skipped_steps.append(step)
        elapsed = time.perf_counter() - start
        result.losses.append(loss)
        result.step_times.append(elapsed)
        if evaluates(train, step):
            result.val_losses.append((step + 1, validation_loss(params, model, corpus, train)))
        if on_step is not None:
            on_step(StepResult(step, loss, elapsed, None if scaler is None else dloss, skip,
                               0 if scaler is None else scaler.skipped))
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            checkpoint.save_training(save, step + 1, checkpoint.whole_arrays(params, state), model,
                                     train, dict.fromkeys(MESH_AXES, 1), "single",
                                     optimizer_t=state["t"],
                                     loss_scaler=None if scaler is None else scaler.state_dict(),
                                     moe_microbatches=m if model.moe_experts else None)
    result.params = params
    return result
