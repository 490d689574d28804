"""Training a MoE GPT-2 with expert parallelism over `--mesh dp=D,ep=P` (layout: expert_parallel.py).

    mpiexec -n 4 python -m refpar train --mesh dp=2,ep=2 --moe-experts 4 --moe-topk 2 --check

Each step, every rank runs `gpt.loss_and_grads` on its part of the global batch with the MoE blocks
replaced by `ExpertParallelMoE`, then sums gradients over the ranks that share them: dense weights
(routers included) over all dp x ep ranks, an expert's weights over dp, and takes the AdamW step
on what it holds. The loss is normalised by the global token count, so per-rank losses add up to
the single device's, router losses included.

Microbatches (`--microbatches M`, gradient accumulation): routing statistics are per microbatch,
as in Megatron-Core: each global microbatch is routed on its own tokens (capacity from its token
count, its own drop order), and each contributes 1/M of its aux and z losses, so the step's router
losses are the mean over microbatches (refpar/model/moe.py). Global microbatch j is the contiguous
slice `shard_range(B, M, j)` of the global batch, whatever the mesh, cut over the dp x ep data
ranks in batch order (`microbatch_samples`); the single-device reference (`reference_run`) runs
the same M slices, so both route the same token sets in the same queue order. With M = 1 it is the
whole batch and data rank d holds `shard_range(B, D, d)`.

Mixed precision: tokens travel to their experts and back in 16 bits, the router's softmax runs in
fp32 inside refpar.model.moe, gradients are summed in their dtype (float32 with fp32_grads) and
AdamW updates fp32 master weights (ledger category "master"). fp16 scales the loss, the router
losses' gradients included (`grad_scale`); the ep ranks, which hold different experts' gradients,
agree on an overflow (`found_inf.ep`) and all skip the step. Routing is a discrete choice: once two
runs' parameters differ in the last bit, a token near a tie or at the capacity edge can go
elsewhere, so a 16-bit run agrees with one device in its losses within a tolerance, not in every
dropped assignment.

Checkpoints (`--save`, `--resume`, refpar/checkpoint.py): a rank holds whole tensors (the dense
weights, its experts, their AdamW moments), so every piece is a whole tensor and any mesh can
load what any other wrote (`checkpoint_arrays`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from refpar import backend, checkpoint
from refpar.config import ConfigError
from refpar.memory import MemoryLedger, nbytes_of
from refpar.model.gpt import init_params, loss_and_grads
from refpar.model.moe import MoELayer, expert_prefix, kept_counts
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.parallel.expert_parallel import ExpertParallelMoE, check_expert_parallel
from refpar.parallel.intra_layer import all_reduce_replicated_grads
from refpar.precision import MASTER_DTYPE, has_overflow, loss_scaler, overflow_anywhere
from refpar.report import loss_scaling_summary
from refpar.sharding import shard_range
from refpar.trainer import corpus_for

UNSUPPORTED_AXES = ("pp", "cp", "tp")


@dataclass
class MoEStep:
    """One step as the whole run saw it: every number is global (the same on every rank)."""

    step: int
    loss: float  # cross-entropy + router losses, the single device's loss
    aux_loss: float  # sum over MoE blocks of the load-balancing losses
    z_loss: float  # sum over MoE blocks of the router z-losses
    tokens_per_expert: dict[int, list[int]]  # layer -> assignments each expert kept
    dropped: dict[int, int]  # layer -> assignments dropped by the capacity
    kept_counts: dict[int, np.ndarray]  # layer -> (D, E) kept per data rank (x cp rank) and expert
    time_s: float
    # one dict per microbatch: layer -> (D, E) kept in that microbatch (they add up to kept_counts)
    microbatch_kept_counts: list[dict[int, np.ndarray]] = field(default_factory=list)


@dataclass
class MoERun:
    steps: list[MoEStep] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # this rank's, after the last step
    ledger: MemoryLedger | None = None  # this rank's parameters, gradients, optimizer state
    first_step: int = 0  # 0-based index of steps[0]: not 0 when resumed from a checkpoint
    loss_scaling: dict | None = None  # fp16: report.loss_scaling_summary (scales, skipped steps)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def step_time_s(self) -> float:
        times = [s.time_s for s in self.steps][1:] or [s.time_s for s in self.steps]
        return sum(times) / len(times)


def check_run(model, train, sizes: dict[str, int], microbatches: int = 1,
              allowed: tuple[str, ...] = ()) -> None:
    """Every ConfigError of an expert-parallel run, before any communication; `allowed`: axes of
    UNSUPPORTED_AXES the caller composes itself (the pipeline, refpar/engine_moe.py)."""
    for axis in UNSUPPORTED_AXES:
        if sizes.get(axis, 1) > 1 and axis not in allowed:
            raise ConfigError(f"expert parallelism combines with dp{' and pp' if allowed else ''} "
                              f"only; drop {axis}={sizes[axis]} from the mesh")
    ep, n_data = sizes.get("ep", 1), sizes.get("dp", 1) * sizes.get("ep", 1)
    check_expert_parallel(model, ep)
    if model.moe_experts == 0:
        raise ConfigError("this run needs experts; add --moe-experts E")
    if train.batch_size < n_data:
        raise ConfigError(f"batch_size={train.batch_size} is smaller than dp x ep = {n_data}; use "
                          f"--batch-size {n_data} or more so every rank has a sequence")
    B, m = train.batch_size, microbatches
    if m < 1 or B % m:
        raise ConfigError(f"--microbatches {m} does not divide --batch-size {B}; MoE microbatches are "
                          f"equal slices of the batch, so choose a divisor of {B}")
    if B // m < n_data:
        raise ConfigError(f"--batch-size {B} in {m} microbatches leaves {B // m} sequences per "
                          f"microbatch for dp x ep = {n_data} ranks; use --batch-size {n_data * m} or "
                          f"more, or fewer microbatches")


def microbatch_samples(batch_size: int, m: int, n_data: int, data_rank: int, j: int) -> range:
    """The global sample ids data rank `data_rank` of `n_data` runs in microbatch j of m: the
    contiguous global slice shard_range(B, m, j), cut over the data ranks in batch order. Together
    the data ranks' parts of microbatch j are the single device's microbatch j, in the same order."""
    a, b = shard_range(batch_size, m, j)
    lo, hi = shard_range(b - a, n_data, data_rank)
    return range(a + lo, a + hi)


def checkpoint_arrays(params: dict, state: dict, coords: dict, saving: bool) -> list:
    """(checkpoint.Piece, array) for the whole tensors this rank holds, their AdamW moments and
    fp32 master weights (16-bit models).
    Saving writes each element once: the dense weights from dp = ep = cp = 0 (per pipeline stage;
    the tied wte, on the first and the last stage, from pp rank 0 only), each expert from dp rank 0
    and cp rank 0 of the ep rank (and stage) holding it (cp ranks hold the same weights)."""
    def writes(n: str) -> bool:
        if coords.get("cp", 0):
            return False
        if ".mlp.experts." in n:
            return coords.get("dp", 0) == 0
        return coords.get("dp", 0) == coords.get("ep", 0) == 0 and not (
            n == "wte.weight" and coords.get("pp", 0))

    held = [("params", params)] + [(f"adamw.{k}", state[k]) for k in ("m", "v") if k in state]
    held += [("master", state["master"])] if "master" in state else []
    return [(checkpoint.whole(f"{prefix}/{n}", a.shape), a) for prefix, arrays in held
            for n, a in arrays.items() if not saving or writes(n)]


def resume_from(path: str, model, train, params: dict, state: dict, coords: dict, scaler=None,
                microbatches: int = 1, arrays: list | None = None) -> int:
    """Loads this rank's tensors from the checkpoint `path` (any mesh's) into `params` and `state`
    in place (and the fp16 `scaler`'s state); returns the step it was saved after. The checkpoint
    must have routed its tokens in the same number of `microbatches` (checkpoints without the
    record were written before MoE runs had microbatches: one). `arrays`: the (Piece, view) pairs
    to load into, when this rank holds tp shards (engine_moe.checkpoint_arrays); default its whole
    tensors."""
    from refpar.parallel.intra_layer_runner import resumed_position

    manifest = checkpoint.open_training(path, model, train)
    check_microbatches(manifest, microbatches)
    pairs = arrays if arrays is not None else checkpoint_arrays(params, state, coords, saving=False)
    for (_, a), loaded in zip(pairs, checkpoint.load(path, [p for p, _ in pairs], manifest), strict=True):
        a[...] = loaded
    step, state["t"] = resumed_position(manifest, scaler)
    return step


def check_microbatches(manifest: dict, microbatches: int) -> None:
    """Refuses a checkpoint whose tokens were routed in another number of microbatches per step
    (checkpoints without the record were written before MoE runs had microbatches: one)."""
    saved = int(manifest.get("moe_microbatches", 1))
    if saved != microbatches:
        raise checkpoint.CheckpointError(
            f"checkpoint {manifest['dir']} routed its tokens in {saved} microbatches per step and this "
            f"run in {microbatches}; resume with --microbatches {saved} (capacity and router losses "
            "are per microbatch)")


def local_params(full: dict, model, ep: int, ep_rank: int) -> dict:
    """The dense weights and this rank's experts, sliced from the full initialisation."""
    mine = {expert_prefix(layer, e) + "." for layer in model.moe_blocks
            for e in range(*shard_range(model.moe_experts, ep, ep_rank))}
    return {n: p for n, p in full.items()
            if ".mlp.experts." not in n or any(n.startswith(m) for m in mine)}


def reduce_grads(grads: dict, names: list[str], comm, tag: str) -> None:
    """Sums `grads[names]` over `comm` in place (one coalesced all-reduce, the one the other
    data-parallel strategies use); nothing to do on one rank."""
    if comm.size > 1 and names:
        grads.update(all_reduce_replicated_grads({n: grads[n] for n in names}, comm, tag))


def router_shares(routings: list[dict]) -> tuple[float, float]:
    """(aux, z) of this process: the sum over microbatches and MoE layers of its shares."""
    return (sum(float(r["aux_loss"]) for rs in routings for r in rs.values()),
            sum(float(r["z_loss"]) for rs in routings for r in rs.values()))


def step_record(step, loss, routings: list[dict], start, totals=None) -> MoEStep:
    """A step's record from the routing of every MoE layer in each microbatch (one dict layer ->
    routing per microbatch); `totals` the (loss, aux, z) summed over ranks, else this process ran
    the whole batch."""
    if totals is None:
        totals = (loss, *router_shares(routings))
    kept = [{i: backend.to_host(kept_counts(r["selections"], r["capacity"], r["owners"]))
             for i, r in rs.items()} for rs in routings]
    layers = list(routings[0]) if routings else []  # a pipeline stage may hold no MoE block
    return MoEStep(
        step=step, loss=float(totals[0]), aux_loss=float(totals[1]), z_loss=float(totals[2]),
        tokens_per_expert={i: [int(c) for c in sum(backend.to_host(rs[i]["tokens_per_expert"])
                                                   for rs in routings)] for i in layers},
        dropped={i: sum(int(rs[i]["dropped"]) for rs in routings) for i in layers},
        kept_counts={i: sum(k[i] for k in kept) for i in layers},
        time_s=time.perf_counter() - start, microbatch_kept_counts=kept)


def grad_dtype(train):
    """float32 when gradients accumulate in fp32 (fp32_grads), else None: the parameters' dtype."""
    return MASTER_DTYPE if train.fp32_grads else None


def reference_run(model, train, on_step=None, microbatches: int = 1) -> MoERun:
    """The single-device run (`refpar.trainer.train_single_device`'s loop; with microbatches > 1,
    gradient accumulation over the slices `microbatch_samples`, each routed on its own) with the
    routing of each step kept: the numbers an expert-parallel run must reproduce."""
    params = init_params(model, train.seed)
    state = optimizer_init(params, train)
    corpus = corpus_for(model, train)
    B, T, m = train.batch_size, train.seq_len, microbatches
    scaler = loss_scaler(model, train)  # fp16 only
    run = MoERun()
    for step in range(train.steps):
        start = time.perf_counter()
        loss, grads, routings = 0.0, None, []
        scale = 1.0 if scaler is None else scaler.scale
        for j in range(m):
            layer = MoELayer(weight=1 / m, grad_scale=scale)
            sample_ids = microbatch_samples(B, m, 1, 0, j)
            tokens, targets = corpus.batch(step, sample_ids, T)  # (B/M, T) each
            with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                part, g = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                         sample_ids=sample_ids, normalizer=B * T, moe=layer,
                                         dloss=scale, grad_dtype=grad_dtype(train))
            loss += part
            grads = g if grads is None else {n: grads[n] + g[n] for n in grads}
            routings.append(layer.last_routing)
        skip = scaler is not None and has_overflow(grads)
        params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale, skip=skip)
        if scaler is not None:
            scaler.update(skip)
        run.steps.append(step_record(step, loss, routings, start))
        if on_step is not None:
            on_step(run.steps[-1])
    run.params = params
    return run


def train_expert_parallel(model, train, mesh, on_step=None, microbatches: int = 1, *,
                          save: str | None = None, save_every: int | None = None,
                          resume: str | None = None) -> MoERun:
    """Trains `train.steps` steps on `mesh` (axes dp and ep) from `init_params(model, train.seed)`,
    or from the checkpoint `resume` (any mesh's); with `save`, checkpoints every `save_every` steps
    and after the last."""
    check_run(model, train, mesh.sizes, microbatches)
    m = microbatches
    ep_comm = mesh.ep
    data = mesh.axis("data")  # dp x ep, in batch order
    layer = ExpertParallelMoE(data, ep_comm, model, weight=1 / m)
    # Drawn whole on the host, this rank's experts kept, then moved to the run's backend.
    params = backend.current().from_host(local_params(init_params(model, train.seed), model, ep_comm.size,
                                                      ep_comm.rank))
    state = optimizer_init(params, train)
    scaler = loss_scaler(model, train)  # fp16 only
    start_step = 0 if resume is None else resume_from(resume, model, train, params, state, mesh.coords,
                                                      scaler, m)
    # The model states this rank holds; activations and buffers are not counted in MoE runs.
    ledger = MemoryLedger()
    ledger.alloc("params", sum(nbytes_of(p) for p in params.values()), "params")
    for key in ("m", "v"):
        if key in state:
            ledger.alloc(f"optimizer.{key}", sum(nbytes_of(a) for a in state[key].values()), "optimizer")
    if "master" in state:  # fp32 copies of a 16-bit model's parameters
        ledger.alloc("master", sum(nbytes_of(a) for a in state["master"].values()), "master")
    scales, skipped_steps = [], []
    dense = [n for n in params if ".mlp.experts." not in n]
    experts = [n for n in params if ".mlp.experts." in n]
    corpus = corpus_for(model, train)
    B, T = train.batch_size, train.seq_len
    run = MoERun(first_step=start_step)
    for step in range(start_step, train.steps):
        start = time.perf_counter()
        tracer = mesh.world.tracer
        with tracer.context(step=step) if tracer is not None else nullcontext():
            loss, grads, routings = 0.0, None, []
            scale = layer.grad_scale = 1.0 if scaler is None else scaler.scale
            for j in range(m):
                sample_ids = list(microbatch_samples(B, m, data.size, data.rank, j))
                tokens, targets = corpus.batch(step, sample_ids, T)  # (B/(M D), T) each
                with np.errstate(over="ignore", invalid="ignore") if scaler else nullcontext():
                    part, g = loss_and_grads(params, tokens, targets, model, seed=train.seed, step=step,
                                             sample_ids=sample_ids, normalizer=B * T, moe=layer,
                                             dloss=scale, grad_dtype=grad_dtype(train))
                loss += part
                routings.append(dict(layer.last_routing))
                if grads is None:
                    grads = g
                    ledger.alloc("grads", sum(nbytes_of(a) for a in g.values()), "grads")
                else:  # the accumulator and this microbatch's gradients are both alive here
                    ledger.alloc("grads.microbatch", sum(nbytes_of(a) for a in g.values()), "grads")
                    for n in grads:
                        grads[n] += g[n]
                    ledger.free("grads.microbatch")
            reduce_grads(grads, dense, data, "dense:grad")  # over every dp x ep rank
            reduce_grads(grads, experts, mesh.dp, "experts:grad")  # over the copies of each expert
            skip = False
            if scaler is not None:  # dense sums agree everywhere; ep ranks hold different experts
                skip = overflow_anywhere(grads, [ep_comm] if ep_comm.size > 1 else [])
                scaler.update(skip)
                scales.append(scale)
                skipped_steps += [step] * skip
            params, state = optimizer_step(params, grads, state, train, inv_scale=1.0 / scale, skip=skip)
            ledger.free("grads")
            totals = data.all_reduce(np.array([loss, *router_shares(routings)]), tag="loss")
        run.steps.append(step_record(step, loss, routings, start, totals))
        if on_step is not None:
            on_step(run.steps[-1])
        if save is not None and checkpoint.should_save(step + 1, train.steps, save_every):
            from refpar.parallel.intra_layer_runner import saved_position

            checkpoint.save_training(save, step + 1, checkpoint_arrays(params, state, mesh.coords, True),
                                     model, train, mesh.sizes, "expert parallel", mesh.world,
                                     moe_microbatches=m, **saved_position(state, scaler))
    run.params, run.ledger = params, ledger
    run.loss_scaling = loss_scaling_summary(scales, skipped_steps)
    return run
