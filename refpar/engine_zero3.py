"""ZeRO-3 inside the engine's pipeline: each stage's tensor-parallel shards, sharded once more over
dp, gathered around every action (Rajbhandari et al. 2020, P_os+g+p).

    mpiexec -n 8 python -m refpar train --mesh dp=2,tp=2,pp=2 --zero 3 --microbatches 2 --check

Legend: Ψ_u elements of unit u on this rank (already a tp shard), s_u its dp rank's shard_range share.

Units: per stage, the tied embedding `wte` alone (on the first and the last stage, so that both
ends split it over dp alike and the tied gradient is summed shard by shard) and everything else
of the stage. Per microbatch and stage:

    F   all-gather the stage's units, run the stage, keep its cache with the parameters taken out
        (units.detach: a cached weight becomes its position in the gathered buffer), free them
    B   all-gather again, put the parameters back in the cache (units.attach), run the backward,
        free them, reduce-scatter each unit's gradient into this rank's gradient shard

After the schedule, the first and last pipeline ranks all-reduce their wte gradient shards (the
executor's embedding group), and AdamW updates the parameter shards in place; nothing is
gathered after the step. Per microbatch and stage 2(d-1)/d Ψ gathered and (d-1)/d Ψ
reduce-scattered: ZeRO-3's 3Ψ.
"""

from __future__ import annotations

import numpy as np

from refpar.model.optim import adamw_update, sgd_update
from refpar.parallel.units import _ParamView
from refpar.sharding import shard_range, shard_sizes


def units_of(names: list[str]) -> dict[str, list[str]]:
    """wte alone when the stage holds it; the rest of the stage as one unit."""
    rest = [n for n in names if n != "wte.weight"]
    return ({"wte": ["wte.weight"]} if "wte.weight" in names else {}) | ({"rest": rest} if rest else {})


def _owner(a):
    return a if a.base is None else a.base


def detach(cache, bases: dict):
    """`cache` with every array viewing one of `bases` (unit -> flat buffer) replaced by
    (unit, its position in that buffer), so the cache does not keep the gathered buffer alive."""
    if isinstance(cache, np.ndarray):
        for unit, base in bases.items():
            if _owner(cache) is _owner(base):
                offset = cache.__array_interface__["data"][0] - base.__array_interface__["data"][0]
                return unit, _ParamView(offset, cache.shape, cache.strides)
        return cache
    if isinstance(cache, tuple | list):
        return type(cache)(detach(c, bases) for c in cache)
    return cache


def attach(cache, bases: dict):
    """Inverse of `detach` on freshly gathered buffers of the same layout."""
    if isinstance(cache, tuple) and len(cache) == 2 and isinstance(cache[1], _ParamView):
        base, view = bases[cache[0]], cache[1]
        return np.lib.stride_tricks.as_strided(base[view.offset // base.itemsize:], view.shape,
                                               view.strides, writeable=False)
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, bases) for c in cache)
    return cache


class ZeroThree:
    """This rank's unit shards, gradient shards and AdamW moments; gathers and reduces over dp."""

    def __init__(self, params: dict, stages: dict, train, dp, ledger):
        self.train, self.dp, self.ledger, self.t = train, dp, ledger, 0
        self.units = {(s, u): names for s, st in stages.items()
                      for u, names in units_of(st.param_names()).items()}
        self.shapes = {n: params[n].shape for n in params}
        self.shards, self.grads, self.m, self.v, self.own, self.counts = {}, {}, {}, {}, {}, {}
        for key, names in self.units.items():
            if key[1] == "wte" and any(k[1] == "wte" and k < key for k in self.units):
                continue  # first and last stage on one rank (interleaved): one wte unit
            flat = np.concatenate([np.reshape(params[n], -1) for n in names])  # (Ψ_u,)
            self.counts[key] = shard_sizes(flat.size, dp.size)
            a, b = self.own[key] = shard_range(flat.size, dp.size, dp.rank)
            tag = f"{key[0]}.{key[1]}"
            self.shards[key] = ledger.alloc(f"params.shard.{tag}", flat[a:b].copy(), "params")
            self.grads[key] = ledger.alloc(f"grads.shard.{tag}", np.zeros(b - a, flat.dtype), "grads")
            if train.optimizer == "adamw":
                self.m[key] = ledger.alloc(f"optimizer.m.{tag}", np.zeros(b - a, flat.dtype), "optimizer")
                self.v[key] = ledger.alloc(f"optimizer.v.{tag}", np.zeros(b - a, flat.dtype), "optimizer")

    def key(self, stage: int, unit: str):
        """The unit's owner key (the wte unit lives under the first stage that holds it)."""
        return next(k for k in self.shards if k[1] == unit and (unit == "wte" or k[0] == stage))

    def gather(self, stage: int, phase: str) -> tuple[dict, dict]:
        """(name -> parameter view, unit -> gathered flat buffer) of the stage's units."""
        params, bases = {}, {}
        for (s, u), names in self.units.items():
            if s != stage:
                continue
            key = self.key(s, u)
            flat = self.dp.all_gather(self.shards[key], tag=f"s{stage}.{u}:params:{phase}",
                                      counts=self.counts[key])  # (Ψ_u,)
            bases[u] = self.ledger.alloc(f"params.gathered.{u}", flat, "params")
            start = 0
            for n in names:
                size = int(np.prod(self.shapes[n]))
                params[n] = flat[start:start + size].reshape(self.shapes[n])
                start += size
        return params, bases

    def release(self, bases: dict) -> None:
        for u in bases:
            self.ledger.free(f"params.gathered.{u}")

    def reduce(self, stage: int, grads: dict) -> None:
        """One microbatch's gradients of the stage (Ψ, held while reduced) into the shards."""
        self.ledger.alloc("grads.stage", sum(g.nbytes for g in grads.values()), "grads")
        for (s, u), names in self.units.items():
            if s != stage:
                continue
            key = self.key(s, u)
            flat = self.ledger.alloc("grads.flat", np.concatenate(
                [np.reshape(grads[n], -1) for n in names]), "grads")  # (Ψ_u,)
            shard = self.ledger.alloc("comm.grad_shard", self.dp.reduce_scatter(
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

    def step(self) -> None:
        """AdamW on every shard, segment by segment (decay follows each parameter's full shape)."""
        self.t += 1
        for key, p in self.shards.items():
            a, b = self.own[key]
            start = 0
            for n in self.units[key]:
                size = int(np.prod(self.shapes[n]))
                lo, hi = max(start, a), min(start + size, b)
                start += size
                if lo >= hi:
                    continue
                s, g, decay = slice(lo - a, hi - a), self.grads[key], len(self.shapes[n]) >= 2
                if self.train.optimizer == "adamw":
                    p[s], self.m[key][s], self.v[key][s] = adamw_update(
                        p[s], g[s], self.m[key][s], self.v[key][s], self.t, self.train, decay)
                else:
                    p[s] = sgd_update(p[s], g[s], self.train, decay)

    def full_params(self) -> dict:
        """Every parameter of this rank's stages (tp shards), gathered over dp: for the check."""
        out = {}
        for stage in sorted({s for s, _ in self.units}):
            params, bases = self.gather(stage, "check")
            out |= {n: p.copy() for n, p in params.items()}
            self.release(bases)
        return out
