"""Model states (the ZeRO paper's word for parameters, gradients and optimizer state): what DP, ZeRO
and FSDP (data_parallel.py, zero.py, fsdp.py) share, and the verbs a pipeline stage and the loop call.

    mpiexec -n 4 python -m refpar train --mesh dp=4 --zero 3 --check

Legend: Ψ_u elements of unit u on this rank (refpar/parallel/units.py), Ψl = Σ Ψ_u.

engine/parallelize.py builds one ModelStates per rank with everything it needs (its `Composition`:
the groups of the partial sums, the groups where fp16 agrees, clipping, the MoE layer), so a step
only calls verbs. A stage (refpar/parallel/pipeline/stage.py) runs its pieces (embedding, blocks,
head) between them, the loop (refpar/engine/train.py) around them:

    states.begin_step()                                # gradients zeroed, the loss scale to MoE
    params, bases = states.acquire(keys, phase, hold)  # the units' parameters (ZeRO-3 gathers)
    states.release(keys, phase, hold)                  # (ZeRO-3 frees, unless still held)
    states.fold(grads)                                 # a piece's gradients into the accumulator
    states.done(keys)                                  # these units' gradients are complete
    states.finish()                                    # the partial sums (tied wte, copies, sp)
    skipped = states.step(lr)                          # fp16's agreement, clipping, the optimizer

`hold` keeps units acquired across pieces (the head's from its forward to its backward; FSDP's root
from the embedding on): a unit is released when its last hold is. `bases` are the flat buffers the
parameters view (refpar/parallel/views.py).

Mixed precision: parameters in bf16/fp16, gradients in that dtype (fp32 with fp32_grads), fp32
master weights and moments on the ranks that own them (`StateDtypes`), every buffer made in the
backend's namespace (`backend.zeros`); the optimizer runs `mixed_adamw_update` on flat segments.
"""

from __future__ import annotations

from dataclasses import dataclass

from array_api_compat import array_namespace

from refpar import backend
from refpar.memory import nbytes_of
from refpar.model.optim import adamw_update, decays, mixed_adamw_update, mixed_sgd_update, sgd_update
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit, loss_scaler, overflow_anywhere


class StateDtypes:
    """The dtypes a data-parallel strategy keeps: `param` (the model's), `grad` (the param dtype, or
    fp32 with fp32_grads), `state` (master weights and moments: fp32 when mixed, else the param
    dtype); `mixed` says whether fp32 master weights exist; `wide` whether gradients accumulate
    wider than backward writes them (fp32_grads); `lowp` whether the 16-bit gradients backward
    writes then stay beside the fp32 accumulator (holdings.keeps_lowp). `scaler` is fp16's
    LossScaler or None."""

    def __init__(self, config, train, lowp: bool = True):
        self.param = dtype_of(config.dtype)
        self.mixed = is_16bit(self.param)
        self.grad = MASTER_DTYPE if self.mixed and train.fp32_grads else self.param
        self.state = MASTER_DTYPE if self.mixed else self.param
        self.wide = self.grad != self.param
        self.lowp = self.wide and lowp
        self.scaler = loss_scaler(config, train)

    @property
    def dloss(self) -> float:
        """Where backward starts: the loss scale for fp16, else 1."""
        return 1.0 if self.scaler is None else self.scaler.scale

    @property
    def inv_scale(self) -> float:
        return 1.0 if self.scaler is None else 1.0 / self.scaler.scale


@dataclass
class Composition:
    """How the model states meet the mesh's other strategies, bound once by engine/parallelize.py.
    `embedding`: the group summing the tied wte's two ends (None: one rank holds both); `tp`: the
    tensor-parallel group, where the sequence-sharded region's gradients (`sp_names`) are summed;
    `copies`: DualPipe's mirror group, summing the two copies' gradients; `differ`: the groups whose
    ranks hold different gradients (where fp16 agrees on an overflow); `clip`: a clipping.
    GlobalNormClip or None; `moe`: the MoE blocks' layer, whose router-loss gradients follow the
    loss scale, or None."""

    embedding: object = None
    tp: object = None
    sp_names: tuple = ()
    copies: object = None
    differ: tuple = ()
    clip: object = None
    moe: object = None


class ModelStates:
    """What DP, ZeRO and FSDP share: the unit layout, the dtypes, the composition, the optimizer's
    step count, the backward pieces a unit's gradient still waits for, the fold of a piece's
    gradients, the partial sums and the optimizer update on flat segments. A strategy says where
    a unit's gradient accumulates (`accumulator`) and implements the other verbs."""

    def __init__(self, units, config, train, ledger, composition: Composition | None = None,
                 lowp: bool = True):
        self.units, self.config, self.train, self.ledger = units, config, train, ledger
        c = composition or Composition()
        self.embedding, self.tp, self.sp_names, self.copies = c.embedding, c.tp, list(c.sp_names), c.copies
        self.differ, self.clip, self.moe = list(c.differ), c.clip, c.moe
        self.dtypes = StateDtypes(config, train, lowp)
        self.t = 0
        self.waiting: dict[str, int] = {}  # unit -> backward pieces whose gradient is still to come

    def begin_step(self) -> None:
        """Before a step's pipeline: every unit waits for all its backward pieces; the router losses'
        gradients scale with the rest (fp16's loss scale)."""
        self.waiting = dict(self.units.backwards)
        if self.moe is not None:
            self.moe.grad_scale = self.dtypes.dloss

    def zeros(self, like, n: int, dtype=None):
        """(n,) zeros of `dtype` (default the gradients') in `like`'s namespace and device."""
        return backend.zeros(like, n, self.dtypes.grad if dtype is None else dtype)

    def last(self, unit: str) -> bool:
        """Counts one backward piece of `unit` done; whether it was the step's last."""
        self.waiting[unit] -= 1
        return self.waiting[unit] == 0

    # ------------------------------------------------------------------------------ parameters
    def buffers(self) -> list:
        """The arrays the parameters live in (a cache viewing them keeps no activation alive)."""
        raise NotImplementedError

    def acquire(self, keys, phase: str, hold=None, following=()) -> tuple[dict, dict]:
        """The units `keys`' parameters (name -> view) and the flat buffers they view (unit -> buffer,
        empty where nothing was gathered); `hold` names the microbatch a keeping acquire is for,
        `following` the units of the action's next piece (FSDP's prefetch)."""
        raise NotImplementedError

    def release(self, keys, phase: str, hold=None) -> None:
        """The units' parameters are not needed by this piece any more (ZeRO-3 frees what no hold keeps)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------- gradients
    def accumulator(self, unit: str) -> tuple[dict, dict | None]:
        """Where `unit`'s gradient accumulates: name -> view of the accumulator, and with wide
        gradients name -> view of the parameters' 16-bit gradient buffers (else None)."""
        raise NotImplementedError

    def fold(self, grads: dict) -> None:
        """Adds a backward piece's `grads` (held in the ledger until then) into each unit's
        accumulator. With wide gradients backward writes each gradient into its 16-bit buffer (its
        .grad, cleared by the previous accumulation, so writing is adding to zero) and the fp32
        accumulator adds it at once, as DeepSpeed's BF16_Optimizer does per parameter."""
        self.ledger.alloc("grads.piece", sum(nbytes_of(g) for g in grads.values()), "grads")
        for unit in self.units.of(grads):
            views, lowp = self.accumulator(unit)
            for name, g in grads.items():
                if self.units.offsets[name][0] != unit:
                    continue
                if lowp is not None:
                    lowp[name][...] = g
                    g = lowp[name]
                views[name] += g
        self.ledger.free("grads.piece")

    def done(self, keys) -> None:
        """One backward piece of each unit in `keys` is folded in (DP's buckets, ZeRO's reduce-scatters
        start here)."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the backward: the partial sums (`partial_sums`) on what this rank keeps."""
        raise NotImplementedError

    def held_grads(self) -> list:
        """(unit, first element, flat array) of the reduced gradient this rank keeps of each unit
        after `finish`: what the optimizer reads (DataParallel: whole units; Zero: its shards)."""
        raise NotImplementedError

    def partial_sums(self, wte, segments: list, grads) -> None:
        """After the backward, the sums over the ranks that each hold a part of one gradient: the
        tied wte's (`wte`: this rank's view of its gradient, or None) over the embedding group,
        DualPipe's two copies' over `copies` (`sum_copies`, each unit's gradient `grads(unit)`), and
        the sequence-sharded region's (`segments`: (array, lo, hi) of each piece of its gradients
        this rank keeps) coalesced into one all-reduce over tp."""
        if self.embedding is not None and wte is not None:
            wte[...] = self.embedding.all_reduce(wte, tag="wte.weight:tied-grad")
        if self.copies is not None:
            self.units.sum_copies(self.copies, grads)
        if segments:
            xp = array_namespace(segments[0][0])
            summed = self.tp.all_reduce(xp.concat([a[lo:hi] for a, lo, hi in segments]),
                                        tag="sp.replicated_grads:bwd")  # (Σ segments,)
            at = 0
            for a, lo, hi in segments:
                a[lo:hi] = summed[at:at + hi - lo]
                at += hi - lo

    # ------------------------------------------------------------------------------- optimizer
    def overflowed(self) -> bool:
        """fp16 only (False otherwise, no message): whether any rank's gradients hold an inf or a
        nan, agreed over `differ`, the groups whose ranks hold different gradients; the loss scale
        backs off or grows."""
        scaler = self.dtypes.scaler
        if scaler is None:
            return False
        found = overflow_anywhere([g for _, _, g in self.held_grads()], self.differ)
        scaler.update(found)
        return found

    def begin_update(self) -> float | None:
        """What the optimizer multiplies this step's gradients by: 1/loss scale (of the scale this
        step's backward used, taken before the overflow check moves it), times the clipping
        coefficient of `clip` (refpar/parallel/clipping.py) if any. None when fp16 found an
        overflow: every rank skips the step before clipping, t not advanced."""
        factor = self.dtypes.inv_scale
        if self.overflowed():
            return None
        self.t += 1
        return factor if self.clip is None else factor * self.clip.coefficient(self, factor)

    def update(self, unit: str, p, g, state: dict, start: int, master, lr: float, factor: float) -> None:
        """One optimizer step at learning rate `lr`, in place, on flat arrays covering [start,
        start + len(p)) of `unit`, the gradient multiplied by `factor` (`begin_update`). The
        update is elementwise, so a shard gets the single device's numbers; it runs one parameter
        segment at a time so weight decay follows each parameter's full shape (optim.decays).
        With `master` (mixed precision) master and moments update in fp32 and p becomes master in
        16 bits."""
        cfg = self.train
        for name, lo, hi in self.units.segments(unit, start, start + p.shape[0]):
            s = slice(lo - start, hi - start)
            decay = decays(self.units.shapes[name], cfg)  # a tp shard has its parameter's dimensions
            if master is not None and cfg.optimizer == "adamw":
                p[s], master[s], state["m"][s], state["v"][s] = mixed_adamw_update(
                    p[s], g[s], master[s], state["m"][s], state["v"][s], self.t, cfg, decay, lr, factor)
            elif master is not None:
                p[s], master[s] = mixed_sgd_update(p[s], g[s], master[s], cfg, decay, lr, factor)
            elif cfg.optimizer == "adamw":
                p[s], state["m"][s], state["v"][s] = adamw_update(
                    p[s], g[s], state["m"][s], state["v"][s], self.t, cfg, decay, lr, factor)
            else:
                p[s] = sgd_update(p[s], g[s], cfg, decay, lr, factor)

    def step(self, lr: float) -> bool:
        """The optimizer at learning rate `lr` on what this rank keeps, gradients unscaled and clipped
        (`begin_update`); returns whether fp16 found an overflow (every rank then skips the step)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ checkpoint
    def full_params(self) -> dict:
        """Every parameter this rank holds, whole, on the host (ZeRO-3 gathers: outside the steps)."""
        raise NotImplementedError

    def held(self) -> list:
        """(prefix, unit, first element, flat array, replicated) of everything this rank holds: what
        refpar/engine/sharded_state.py writes and reads."""
        raise NotImplementedError
