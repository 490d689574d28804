"""`train`: THE training loop, for every mesh (the all-ones mesh included) and every plan.

    run = train(parallelize(model, train_config, mesh, plan), on_step=print_row)

One step on every rank:

    batch      this rank's rows of each microbatch (holdings.microbatch_samples), the tokens and
               targets of the global step, dropout keyed by global sample ids
    pipeline   executor.step walks this rank's list of the schedule: each stage's F and B run their
               pieces, which acquire their units' parameters from the model states and fold their
               gradients into them (DP's buckets and ZeRO's reduce-scatters start as units complete)
    sums       states.finish: DP's rings still in flight, the tied wte over the embedding group, the
               sequence-sharded region over tp (on ZeRO's shards)
    optimizer  states.step: fp16 agrees on an overflow over the groups whose gradients differ, the
               global norm is summed over the axes that shard it (refpar/parallel/clipping.py),
               then AdamW at the step's learning rate (optim.learning_rate) on what this rank keeps,
               gradients clipped (ZeRO-1/2 then all-gather the updated units)
    loss       the microbatch losses (and a MoE model's router losses) summed over pp, then over
               the ranks that saw different tokens

There is no other branch: the pipeline of one stage on one rank is the single device's step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np

from refpar import checkpoint, interrupt
from refpar.allocator import keep_freed_memory
from refpar.model import gemm
from refpar.model.optim import learning_rate
from refpar.model.routing import update_expert_bias
from refpar.parallel.pipeline.executor import Microbatch
from refpar.records import Run, router_shares, step_record
from refpar.trainer import corpus_for, evaluates

from .parallelize import Parallel
from .sharded_state import pieces, resume_from, saved_position


def train(par: Parallel, on_step=None, *, save: str | None = None, save_every: int | None = None,
          resume: str | None = None, evaluate=None) -> Run:
    """Trains `par.train.steps` steps, or from the checkpoint `resume` (any mesh's) up to them;
    with `save`, checkpoints every `save_every` steps and after the last (refpar/checkpoint.py).
    `on_step(step, loss, seconds, totals, moe_step, scaling, val_loss=..., grad_norm=...)` after each
    step (moe_step None without experts; scaling, fp16 only: the step's loss scale, whether it was
    skipped, the skips so far; val_loss None but where the validation loss was computed; grad_norm, with
    clipping: the global norm before clipping, None on a skipped step). `evaluate()`, called on every
    rank after the steps trainer.evaluates names, returns the validation loss on rank 0."""
    model, cfg, mesh, states, executor = par.model, par.train, par.mesh, par.states, par.executor
    keep_freed_memory()  # each step reuses the pages of the one before (refpar/allocator.py)
    scaler = states.dtypes.scaler  # fp16 only
    run = Run()
    if resume is not None:
        run.first_step = resume_from(par, resume)
    corpus = corpus_for(model, cfg)
    normalizer = cfg.batch_size * cfg.seq_len  # global tokens: the losses add up to the mean
    tracer = mesh.world.tracer
    scales, skipped_steps = [], []
    if evaluate is not None and evaluates(cfg, -1) and run.first_step == 0:  # the weights it starts from
        start_loss = evaluate()
        if start_loss is not None:
            run.val_losses.append((0, start_loss))
    for step in range(run.first_step, cfg.steps):
        interrupt.at(step, cfg.steps)  # what Ctrl-C's line says (refpar/interrupt.py)
        start = time.perf_counter()
        gemm.take()  # the tally from 0: GEMMs run before this step (--check's single device) are not its
        par.routings.clear()
        with tracer.context(step=step) if tracer else nullcontext():
            # the rank's samples drawn at once (the corpus walks every sequence a token at a time),
            # then cut into microbatches; copies, so a microbatch owns its rows and a cache that
            # keeps its tokens holds (b, T)
            tokens, targets = corpus.batch(step, [i for ids in par.samples for i in ids], cfg.seq_len)
            starts = np.cumsum([0, *map(len, par.samples)])
            mbs = [Microbatch(np.array(tokens[a:b]), np.array(targets[a:b]), ids)  # (b, T) each
                   for ids, a, b in zip(par.samples, starts[:-1], starts[1:], strict=True)]
            scale = states.dtypes.dloss
            states.begin_step()  # the router losses' gradients scale with the rest
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                loss = executor.step(mbs, step=step, seed=cfg.seed, normalizer=normalizer, dloss=scale)
            states.finish()
            run.lrs.append(learning_rate(cfg, step))
            skipped = states.step(run.lrs[-1])
            run.flops.append(gemm.take())  # the step's forwards, backwards and recomputed forwards
            if states.clip is not None:
                run.grad_norms.append(None if skipped else states.clip.norm)
            if scaler is not None:
                scales.append(scale)
                skipped_steps += [step] * skipped
            routed = [par.routings[ids] for ids in par.samples if ids in par.routings]  # this rank's blocks
            shares = np.array([loss, *router_shares(routed)]) if par.moe is not None else np.array([loss])
            if par.moe is not None:
                shares[0] += shares[1] + shares[2]  # the router losses are part of the loss
            if mesh.sizes["pp"] > 1:  # only the last stage's cross-entropy is not 0
                shares = mesh.pp.all_reduce(shares, tag="loss.pp:report")
            if par.data.size > 1:  # each rank's loss is over its tokens
                shares = par.data.all_reduce(shares, tag="loss")
        run.windows.append((start, time.perf_counter()))
        run.step_times.append(run.windows[-1][1] - start)
        run.losses.append(float(shares[0]))
        val_loss = evaluate() if evaluate is not None and evaluates(cfg, step) else None
        if val_loss is not None:
            run.val_losses.append((step + 1, val_loss))
        record = step_record(step, loss, routed, start, shares, par.moe.bias) if par.moe is not None else None
        if record is not None:
            run.moe_steps.append(record)
            update_expert_bias(par.moe.bias, routed, model)  # from the global counts: no message
        if on_step is not None:
            on_step(step, run.losses[-1], run.step_times[-1], tracer.totals() if tracer else {}, record,
                    None if scaler is None else (scale, skipped, len(skipped_steps)), val_loss=val_loss,
                    grad_norm=run.grad_norms[-1] if states.clip is not None else None)
        if save is not None and checkpoint.should_save(step + 1, cfg.steps, save_every):
            checkpoint.save_training(save, step + 1, pieces(par, saving=True), model, cfg, mesh.sizes,
                                     f"engine {par.plan.strategy}", mesh.world,
                                     moe_microbatches=par.plan.microbatches if model.moe_experts else None,
                                     **saved_position(states.t, scaler))
    run.totals = tracer.totals() if tracer else {}  # before the timeline's gather adds its own
    run.loss_scales, run.skipped_steps = scales, skipped_steps
    run.measured = executor.measured_timeline()
    run.simulated = executor.simulated_timeline(run.measured)
    return run
