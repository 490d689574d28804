"""ZeRO-2 and ZeRO-3 inside the engine's pipeline: each stage's tensor-parallel shards, sharded once
more over the data-parallel ranks (Rajbhandari et al. 2020, P_os+g and P_os+g+p).

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 3 --microbatches 2 --check
    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 2 --microbatches 2 --check

Legend: Ψ_u elements of unit u on this rank (already a tp shard), s_u this rank's shard_range share
of it over the d ranks of the mesh's dp_cp group (dp, or dp x cp when the mesh has cp).

ZeRO-3's units (`units_of`): per stage, the tied embedding `wte` alone (on the first and the last
stage, so that both ends split it alike and the tied gradient is summed shard by shard) and
everything else of the stage. Per microbatch and stage (ZeroThreeStage in refpar/engine.py):

    F   all-gather the stage's units, run the stage, keep its cache with the parameters taken out
        (units.detach: a cached weight becomes its position in the gathered buffer), free them
    B   all-gather again, put the parameters back in the cache (units.attach), run the backward,
        free them, reduce-scatter each unit's gradient into this rank's gradient shard

ZeRO-2 (`ZeroTwo`) keeps the parameters whole and uses FSDP's finer units and stage
(engine_fsdp.fsdp_units, UnitStage; its `gather` hands out the whole parameters, nothing moves):
each block's gradient is reduce-scattered as soon as its backward is done, so a gradient exists
whole only from its piece's backward to its reduce-scatter, as DeepSpeed's stage 2 reduces buckets
as they fill, in every microbatch (refpar's dp runner does the same, refpar/parallel/zero.py).
Reducing once after the last microbatch would keep every gradient whole through the step:
ZeRO-1's memory. The price is m reduce-scatters per step instead of one, which is why DeepSpeed's
own pipeline engine refuses stage 2; here it is counted, not hidden.

After the schedule, the first and last pipeline ranks all-reduce their wte gradient shards (the
executor's embedding group); under sp the shards' segments of the sequence-sharded region's
parameters are all-reduced over tp; then AdamW updates this rank's [a, b) of every unit. ZeRO-3
keeps it there; ZeRO-2 all-gathers each unit into the whole parameters. Per step, over the d ranks:
ZeRO-3 2(d-1)/d Ψ gathered and (d-1)/d Ψ reduce-scattered per microbatch (its 3Ψ); ZeRO-2 (d-1)/d
Ψ reduce-scattered per microbatch and (d-1)/d Ψ gathered once.

Mixed precision: the shards and every parameter gather are 16-bit, the gradient shards and their
reduce-scatters in the gradients' dtype (16-bit, float32 with fp32_grads), and this rank's fp32
master weights and moments cover its [a, b) of each unit only (P_os+g+p of all 16 bytes per
parameter); `update` runs refpar.model.optim's mixed AdamW on them, `inv_scale` undoing fp16's
loss scale.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, device

from refpar import backend
from refpar.holdings import units_of
from refpar.memory import nbytes_of
from refpar.model.optim import adamw_update, fp32, mixed_adamw_update, mixed_sgd_update, sgd_update
from refpar.parallel.units import _ParamView, _position, _view_at
from refpar.precision import MASTER_DTYPE, is_16bit
from refpar.sharding import shard_range, shard_sizes


def detach(cache, bases: dict):
    """`cache` with every array viewing one of `bases` (unit -> flat buffer) replaced by
    (unit, its position in that buffer), so the cache does not keep the gathered buffer alive."""
    if backend.is_array(cache):
        for unit, base in bases.items():
            if backend.owner(cache) is backend.owner(base):
                return unit, _position(cache, base)
        return cache
    if isinstance(cache, tuple | list):
        return type(cache)(detach(c, bases) for c in cache)
    if isinstance(cache, dict):  # a MoE block's cache (its experts' linear caches hold weights)
        return {k: detach(c, bases) for k, c in cache.items()}
    return cache


def attach(cache, bases: dict):
    """Inverse of `detach` on freshly gathered buffers of the same layout."""
    if isinstance(cache, tuple) and len(cache) == 2 and isinstance(cache[1], _ParamView):
        return _view_at(bases[cache[0]], cache[1])
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, bases) for c in cache)
    if isinstance(cache, dict):
        return {k: attach(c, bases) for k, c in cache.items()}
    return cache


class ShardedGrads:
    """What ZeRO-2 and ZeRO-3 share: each unit's gradient kept as this rank's shard only, reduce-
    scattered over `dp` (the mesh's dp_cp group: dp, or dp x cp) after every microbatch's backward of
    its stage, and the AdamW moments of that shard. `group_of(unit)` gives each unit its own group
    instead (MoE runs, refpar/engine_moe_zero.py: dense units over the data ranks, experts' over dp)."""

    def __init__(self, params: dict, stages: dict, train, dp, ledger, unit_fn=units_of, grad_dtype=None,
                 group_of=None):
        self.train, self.dp, self.ledger, self.t = train, dp, ledger, 0
        self.grad_dtype = grad_dtype  # None: the parameters' dtype; float32 with fp32_grads
        # unit_fn(names) -> {unit: names}: units_of, or engine_fsdp.fsdp_units (a unit per block)
        self.units = {(s, u): names for s, st in stages.items()
                      for u, names in unit_fn(st.param_names()).items()}
        # group_of(unit) -> the ranks that unit is sharded over and its gradient summed across:
        # `dp` for every unit, or per unit (MoE: dense units over the data ranks, experts' over dp)
        self.groups = {key: dp if group_of is None else group_of(key[1]) for key in self.units}
        self.shapes = {n: params[n].shape for n in params}
        self.grads, self.m, self.v, self.own, self.counts = {}, {}, {}, {}, {}
        self.master = {}  # a 16-bit model's fp32 masters of this rank's [a, b) of each unit
        like = params[next(iter(params))]
        xp = array_namespace(like)
        mixed = is_16bit(like.dtype)
        moments = MASTER_DTYPE if mixed else like.dtype

        def zeros(n, dtype=like.dtype):
            return xp.zeros(n, dtype=dtype, device=device(like))

        for key, names in self.units.items():
            if key[1] == "wte" and any(k[1] == "wte" and k < key for k in self.units):
                continue  # first and last stage on one rank (interleaved): one wte unit
            n = sum(int(np.prod(self.shapes[name])) for name in names)  # Ψ_u
            group = self.groups[key]
            self.counts[key] = shard_sizes(n, group.size)
            a, b = self.own[key] = shard_range(n, group.size, group.rank)
            tag = f"{key[0]}.{key[1]}"
            self.grads[key] = ledger.alloc(f"grads.shard.{tag}", zeros(b - a, grad_dtype or like.dtype),
                                           "grads")
            if mixed:
                self.master[key] = ledger.alloc(f"master.shard.{tag}", fp32(xp.concat(
                    [xp.reshape(params[n], (-1,))[first:first + hi - lo]
                     for n, lo, hi, first in self.segments(key)])), "master")  # (s_u,)
            if train.optimizer == "adamw":
                self.m[key] = ledger.alloc(f"optimizer.m.{tag}", zeros(b - a, moments), "optimizer")
                self.v[key] = ledger.alloc(f"optimizer.v.{tag}", zeros(b - a, moments), "optimizer")

    def key(self, stage: int, unit: str):
        """The unit's owner key (the wte unit lives under the first stage that holds it)."""
        return next(k for k in self.own if k[1] == unit and (unit == "wte" or k[0] == stage))

    def segments(self, key):
        """(name, lo, hi, first) of every parameter overlapping this rank's [a, b) of the unit: [lo,
        hi) in shard coordinates, `first` its first element's index in the flattened parameter.
        Updates go segment by segment, so that weight decay follows each parameter's shape."""
        a, b = self.own[key]
        start = 0
        for n in self.units[key]:
            size = int(np.prod(self.shapes[n]))
            lo, hi = max(start, a), min(start + size, b)
            if lo < hi:
                yield n, lo - a, hi - a, lo - start
            start += size

    def reduce(self, stage: int, grads: dict, units=None) -> None:
        """One microbatch's gradients of the stage's `units` (default all; held while reduced) into
        the shards."""
        self.ledger.alloc("grads.stage", sum(nbytes_of(g) for g in grads.values()), "grads")
        for (s, u), names in self.units.items():
            if s != stage or (units is not None and u not in units):
                continue
            key = self.key(s, u)
            xp = array_namespace(grads[names[0]])
            flat = xp.concat([xp.reshape(grads[n], (-1,)) for n in names])  # (Ψ_u,)
            if self.grad_dtype is not None:  # fp32_grads: reduced and accumulated in float32
                flat = xp.astype(flat, self.grad_dtype)
            self.ledger.alloc("grads.flat", flat, "grads")
            shard = self.ledger.alloc("comm.grad_shard", self.groups[key].reduce_scatter(
                flat, tag=f"s{stage}.{u}:grads"), "comm")  # (s_u,)
            self.grads[key] += shard
            self.ledger.free("comm.grad_shard")
            self.ledger.free("grads.flat")
        self.ledger.free("grads.stage")

    def begin_step(self) -> None:
        for g in self.grads.values():
            g[...] = 0.0

    def sum_tied(self, group) -> None:
        """The wte gradient shards of the first and last stage summed (Megatron's embedding group)."""
        if group is not None:
            key = self.key(0, "wte")
            self.grads[key][...] = group.all_reduce(self.grads[key], tag="wte.weight:tied-grad")

    def sum_sequence_parallel(self, tp, names) -> None:
        """Under sp the gradients of the parameters applied in the sequence-sharded region
        (sequence_parallel_param_names) cover this tp rank's tokens only: sum them over tp once per
        step, on the shards. tp divides the heads, so every tp rank's unit has the same layout and
        its [a, b) holds the same elements of those parameters: the segments line up."""
        pieces = [(key, lo, hi) for key in self.own for n, lo, hi, _ in self.segments(key)
                  if n in names]
        if not pieces:  # the same on every tp rank
            return
        xp = array_namespace(self.grads[pieces[0][0]])
        flat = tp.all_reduce(xp.concat([self.grads[k][lo:hi] for k, lo, hi in pieces]),
                             tag="sp.replicated_grads:bwd")  # (Σ segments,)
        start = 0
        for key, lo, hi in pieces:
            self.grads[key][lo:hi] = flat[start:start + hi - lo]
            start += hi - lo

    def update(self, key, p, inv_scale: float = 1.0) -> None:
        """AdamW (or SGD) on p, this rank's [a, b) of the unit, in place; a 16-bit p through its
        fp32 master, the gradients times `inv_scale` (fp16's loss scale undone)."""
        g = self.grads[key]
        for n, lo, hi, _ in self.segments(key):
            s, decay = slice(lo, hi), len(self.shapes[n]) >= 2
            if key in self.master:
                w = self.master[key]
                if self.train.optimizer == "adamw":
                    p[s], w[s], self.m[key][s], self.v[key][s] = mixed_adamw_update(
                        p[s], g[s], w[s], self.m[key][s], self.v[key][s], self.t, self.train, decay,
                        inv_scale)
                else:
                    p[s], w[s] = mixed_sgd_update(p[s], g[s], w[s], self.train, decay, inv_scale)
            elif self.train.optimizer == "adamw":
                p[s], self.m[key][s], self.v[key][s] = adamw_update(
                    p[s], g[s], self.m[key][s], self.v[key][s], self.t, self.train, decay)
            else:
                p[s] = sgd_update(p[s], g[s], self.train, decay)


class ZeroThree(ShardedGrads):
    """ZeRO-3: also the parameters as this rank's unit shards, gathered over dp around each action."""

    def __init__(self, params: dict, stages: dict, train, dp, ledger, unit_fn=units_of, grad_dtype=None,
                 group_of=None):
        super().__init__(params, stages, train, dp, ledger, unit_fn, grad_dtype, group_of)
        self.shards = {}
        for key, (a, b) in self.own.items():
            xp = array_namespace(params[self.units[key][0]])
            flat = xp.concat([xp.reshape(params[n], (-1,)) for n in self.units[key]])  # (Ψ_u,)
            self.shards[key] = ledger.alloc(f"params.shard.{key[0]}.{key[1]}",
                                            xp.asarray(flat[a:b], copy=True), "params")

    def gather(self, stage: int, phase: str, units=None) -> tuple[dict, dict]:
        """(name -> parameter view, unit -> gathered flat buffer) of the stage's `units` (default all)."""
        params, bases = {}, {}
        for (s, u), names in self.units.items():
            if s != stage or (units is not None and u not in units):
                continue
            key = self.key(s, u)
            flat = self.groups[key].all_gather(self.shards[key], tag=f"s{stage}.{u}:params:{phase}",
                                      counts=self.counts[key])  # (Ψ_u,)
            bases[u] = self.ledger.alloc(f"params.gathered.{u}", flat, "params")
            start = 0
            for n in names:
                size = int(np.prod(self.shapes[n]))
                params[n] = array_namespace(flat).reshape(flat[start:start + size], self.shapes[n])
                start += size
        return params, bases

    def release(self, bases: dict) -> None:
        for u in bases:
            self.ledger.free(f"params.gathered.{u}")

    def step(self, inv_scale: float = 1.0) -> None:
        """The optimizer on every shard; nothing is gathered after the step."""
        self.t += 1
        for key, p in self.shards.items():
            self.update(key, p, inv_scale)

    def full_params(self) -> dict:
        """Every parameter of this rank's stages (tp shards), gathered over dp a unit at a time (so
        the ledger's peaks stay the training's): for the check."""
        out = {}
        for stage, unit in self.units:
            params, bases = self.gather(stage, "check", (unit,))
            out |= {n: np.array(backend.to_host(p)) for n, p in params.items()}
            self.release(bases)
        return out


class ZeroTwo(ShardedGrads):
    """ZeRO-2: the parameters stay whole on every rank; after the step each unit's updated shard is
    all-gathered over dp into them. `gather` and `release` have ZeroThree's signature, so a stage
    written for per-unit gathers (engine_fsdp.UnitStage) runs on it: nothing moves."""

    def __init__(self, params: dict, stages: dict, train, dp, ledger, unit_fn=units_of, grad_dtype=None,
                 group_of=None):
        super().__init__(params, stages, train, dp, ledger, unit_fn, grad_dtype, group_of)
        self.params = params  # the whole parameters, updated in place by `step`

    def gather(self, stage: int, phase: str, units=None) -> tuple[dict, dict]:
        """(name -> the whole parameter, no gathered buffers) of the stage's `units` (default all)."""
        return {n: self.params[n] for (s, u), names in self.units.items() if s == stage
                and (units is None or u in units) for n in names}, {}

    def release(self, bases: dict) -> None:
        """Nothing was gathered."""

    def step(self, params: dict, inv_scale: float = 1.0) -> None:
        self.t += 1
        for key in self.own:
            names = self.units[key]
            xp = array_namespace(params[names[0]])
            p = xp.concat([xp.reshape(params[n], (-1,))[first:first + hi - lo]
                           for n, lo, hi, first in self.segments(key)])  # (s_u,), a copy
            self.update(key, p, inv_scale)
            full = self.ledger.alloc("comm.params", self.groups[key].all_gather(
                p, tag=f"s{key[0]}.{key[1]}:params:step", counts=self.counts[key]), "comm")  # (Ψ_u,)
            start = 0
            for n in names:
                size = int(np.prod(self.shapes[n]))
                params[n][...] = xp.reshape(full[start:start + size], self.shapes[n])
                start += size
            self.ledger.free("comm.params")
