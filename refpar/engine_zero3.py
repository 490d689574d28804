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

Mixed precision: the shards and their gathers are 16-bit, the gradient shards and their
reduce-scatters in the gradients' dtype (16-bit, float32 with fp32_grads), and this rank's fp32
master weights and moments cover its shards only (P_os+g+p of all 16 bytes per parameter).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, device

from refpar import backend
from refpar.memory import nbytes_of
from refpar.model.optim import adamw_update, fp32, mixed_adamw_update, mixed_sgd_update, sgd_update
from refpar.parallel.units import _ParamView, _position, _view_at
from refpar.precision import MASTER_DTYPE, is_16bit
from refpar.sharding import shard_range, shard_sizes


def units_of(names: list[str]) -> dict[str, list[str]]:
    """wte alone when the stage holds it; the rest of the stage as one unit."""
    rest = [n for n in names if n != "wte.weight"]
    return ({"wte": ["wte.weight"]} if "wte.weight" in names else {}) | ({"rest": rest} if rest else {})


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
    return cache


def attach(cache, bases: dict):
    """Inverse of `detach` on freshly gathered buffers of the same layout."""
    if isinstance(cache, tuple) and len(cache) == 2 and isinstance(cache[1], _ParamView):
        return _view_at(bases[cache[0]], cache[1])
    if isinstance(cache, tuple | list):
        return type(cache)(attach(c, bases) for c in cache)
    return cache


class ZeroThree:
    """This rank's unit shards, gradient shards and AdamW moments; gathers and reduces over dp."""

    def __init__(self, params: dict, stages: dict, train, dp, ledger, grad_dtype=None):
        self.train, self.dp, self.ledger, self.t = train, dp, ledger, 0
        self.grad_dtype = grad_dtype  # None: the parameters' dtype
        self.master = {}  # fp32 copies of 16-bit shards
        self.units = {(s, u): names for s, st in stages.items()
                      for u, names in units_of(st.param_names()).items()}
        self.shapes = {n: params[n].shape for n in params}
        self.shards, self.grads, self.m, self.v, self.own, self.counts = {}, {}, {}, {}, {}, {}
        for key, names in self.units.items():
            if key[1] == "wte" and any(k[1] == "wte" and k < key for k in self.units):
                continue  # first and last stage on one rank (interleaved): one wte unit
            xp = array_namespace(params[names[0]])
            flat = xp.concat([xp.reshape(params[n], (-1,)) for n in names])  # (Ψ_u,)
            self.counts[key] = shard_sizes(flat.shape[0], dp.size)
            a, b = self.own[key] = shard_range(flat.shape[0], dp.size, dp.rank)
            tag = f"{key[0]}.{key[1]}"

            mixed = is_16bit(flat.dtype)

            def zeros(n, dtype, like=flat, xp=xp):
                return xp.zeros(n, dtype=dtype, device=device(like))

            self.shards[key] = ledger.alloc(f"params.shard.{tag}", xp.asarray(flat[a:b], copy=True), "params")
            self.grads[key] = ledger.alloc(f"grads.shard.{tag}", zeros(b - a, grad_dtype or flat.dtype),
                                           "grads")
            state = MASTER_DTYPE if mixed else flat.dtype  # moments (and master) in fp32 when mixed
            if mixed:
                self.master[key] = ledger.alloc(f"master.shard.{tag}", fp32(self.shards[key]), "master")
            if train.optimizer == "adamw":
                self.m[key] = ledger.alloc(f"optimizer.m.{tag}", zeros(b - a, state), "optimizer")
                self.v[key] = ledger.alloc(f"optimizer.v.{tag}", zeros(b - a, state), "optimizer")

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
                params[n] = array_namespace(flat).reshape(flat[start:start + size], self.shapes[n])
                start += size
        return params, bases

    def release(self, bases: dict) -> None:
        for u in bases:
            self.ledger.free(f"params.gathered.{u}")

    def reduce(self, stage: int, grads: dict) -> None:
        """One microbatch's gradients of the stage (Ψ, held while reduced) into the shards."""
        self.ledger.alloc("grads.stage", sum(nbytes_of(g) for g in grads.values()), "grads")
        for (s, u), names in self.units.items():
            if s != stage:
                continue
            key = self.key(s, u)
            xp = array_namespace(grads[names[0]])
            flat = xp.concat([xp.reshape(grads[n], (-1,)) for n in names])  # (Ψ_u,)
            if self.grad_dtype is not None:  # fp32_grads: reduced and accumulated in float32
                flat = xp.astype(flat, self.grad_dtype)
            self.ledger.alloc("grads.flat", flat, "grads")
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

    def step(self, inv_scale: float = 1.0) -> None:
        """AdamW on every shard, segment by segment (decay follows each parameter's full shape);
        16-bit shards through their fp32 masters, the gradients times `inv_scale` (fp16)."""
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

    def full_params(self) -> dict:
        """Every parameter of this rank's stages (tp shards), gathered over dp: for the check."""
        out = {}
        for stage in sorted({s for s, _ in self.units}):
            params, bases = self.gather(stage, "check")
            out |= {n: np.array(backend.to_host(p)) for n, p in params.items()}
            self.release(bases)
        return out
