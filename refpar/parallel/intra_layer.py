"""Training GPT-2 split inside its layers: tp (optionally sequence-parallel) and cp, with dp around them.

    mpiexec -n 2 python -m refpar train --mesh tp=2 --check
    mpiexec -n 2 python -m refpar train --mesh tp=2 --sp --check
    mpiexec -n 4 python -m refpar train --mesh cp=4 --cp-algo ulysses --check
    mpiexec -n 4 python -m refpar train --mesh dp=2,tp=2 --check

Puts tensor_parallel.py, sequence_parallel.py and context_parallel.py together into a step: this
rank's layout (tokens, heads, vocabulary rows), forward and backward of the whole model with every
array a piece keeps for backward registered in the MemoryLedger, the gradient sums (over tp for the
parameters of the sequence-parallel region, over cp and dp for all), and AdamW on this rank's shards.

Mixed precision: parameters, activations and gradients in the model's 16-bit dtype (gradients in
float32 with TrainConfig.fp32_grads, cast as they leave backward, as Megatron-LM's main_grad),
every gradient sum in the gradients' dtype, and the AdamW step through the optimizer's fp32
master weights and moments (ledger category "master" for the masters). fp16 scales the loss
(`refpar.precision.LossScaler`): backward starts from the scale, and the tp ranks, whose gradient
shards differ, agree on an overflow with one all-reduce (max) of a float32 flag before they all
skip the step or all take it (`precision.overflow_anywhere`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
from array_api_compat import array_namespace, is_array_api_obj

from refpar import backend
from refpar.config import ConfigError, ModelConfig, TrainConfig
from refpar.memory import nbytes_of
from refpar.model.gpt import DropoutContext, add_embedding_grads, init_params
from refpar.model.optim import optimizer_init, optimizer_step
from refpar.parallel.context_parallel import check_cp, cp_layout
from refpar.parallel.sequence_parallel import all_reduce_sequence_parallel_grads, check_sp, sp_layout
from refpar.parallel.tensor_parallel import (
    Layout,
    check_tp,
    gather_params_tp,
    parallel_block_backward,
    parallel_block_forward,
    shard_params_tp,
    tp_layout,
    vocab_parallel_embedding_backward,
    vocab_parallel_embedding_forward,
    vocab_parallel_head_backward,
    vocab_parallel_head_forward,
)
from refpar.precision import MASTER_DTYPE, loss_scaler, overflow_anywhere
from refpar.sharding import shard_range

AXES = ("dp", "tp", "cp")  # the axes this runner composes; pp and ep are other strategies'


def check_mesh(sizes: dict, sp: bool, cp_algo: str | None) -> None:
    other = [f"{a}={s}" for a, s in sizes.items() if a not in AXES and s > 1]
    if other:
        raise ConfigError(f"the tp/cp runner does not take {other[0]}; combine tp or cp with dp only")
    if sp and sizes.get("cp", 1) > 1:
        raise ConfigError("--sp and cp both shard the sequence; drop --sp when the mesh has cp")
    if sp and sizes.get("tp", 1) < 2:
        raise ConfigError("--sp shards along the sequence over tp ranks; give the mesh tp=2 or more")
    if cp_algo is not None and sizes.get("cp", 1) < 2:
        raise ConfigError("--cp-algo chooses how cp ranks share attention; give the mesh cp=2 or more")


def validate(model: ModelConfig, train: TrainConfig, sizes: dict, sp: bool = False,
             cp_algo: str | None = None) -> None:
    """Every check of a layout, with no communication: each rank raises the same ConfigError."""
    check_mesh(sizes, sp, cp_algo)
    train.check_model(model)
    t, c, d = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("dp", 1)
    check_tp(model, t)
    if sp:
        check_sp(model, train.seq_len, t)
    if c > 1:
        check_cp(model, train.seq_len, c, cp_algo or "ring", t)
    if train.batch_size < d:
        raise ConfigError(f"batch_size={train.batch_size} is smaller than dp={d}; "
                          f"use --batch-size {d} or more")


def build_layout(config: ModelConfig, seq_len: int, mesh, sp: bool = False,
                 cp_algo: str | None = None) -> Layout:
    tp = mesh.tp if mesh.sizes["tp"] > 1 else None
    if mesh.sizes["cp"] > 1:
        return cp_layout(config, seq_len, mesh.cp, cp_algo or "ring", tp)
    if sp:
        return sp_layout(config, seq_len, mesh.tp)
    return tp_layout(config, seq_len, tp)


def nbytes(a) -> int:
    """Bytes of an array of any namespace (NumPy, torch, array-api-strict, ...)."""
    return nbytes_of(a)


def _arrays(obj):
    if is_array_api_obj(obj):
        yield obj
    elif isinstance(obj, tuple | list):
        for item in obj:
            yield from _arrays(item)


def _root(a):
    """The array that owns a view's memory (NumPy's base, torch's _base): keeping the view keeps it."""
    for attr in ("base", "_base"):
        owner = getattr(a, attr, None)
        if owner is not None and is_array_api_obj(owner):
            return owner
    return a


class ActivationLedger:
    """Registers, under `activations`, every distinct array a cache keeps (a view counts its owner,
    once); parameters a cache refers to are not activations."""

    def __init__(self, ledger):
        self.ledger = ledger
        self.params: set[int] = set()
        self.seen: set[int] = set()

    def begin(self, params: dict) -> None:
        """A new forward pass, with these parameters."""
        self.params = {id(_root(p)) for p in params.values()}
        self.seen.clear()

    def keep(self, prefix: str, cache) -> None:
        for a in _arrays(cache):
            root = _root(a)
            if id(root) not in self.params and id(root) not in self.seen:
                self.seen.add(id(root))
                self.ledger.alloc(f"{prefix}{len(self.seen)}", nbytes(root), "activations")

    def release(self, prefix: str) -> None:
        self.ledger.free_prefix(prefix)


def loss_and_grads(params, tokens, targets, lay: Layout, drop, normalizer, acts: ActivationLedger,
                   dloss: float = 1.0, grad_dtype=None):
    """tokens, targets (B, T) of this rank's samples -> (this rank's share of the loss, grads of its
    shards). Under tp the share is the whole loss; under cp and dp the shares add up to it.
    `dloss`: the fp16 loss scale backward starts from; `grad_dtype`: float32 for fp32_grads."""
    acts.begin(params)
    x, emb = vocab_parallel_embedding_forward(tokens[:, lay.region_pos], params, lay, drop)  # (B, Tl, C)
    acts.keep("act.embed.", emb)
    blocks = []
    for layer in range(lay.config.n_layer):
        x, cache = parallel_block_forward(x, params, layer, lay, drop)  # (B, Tl, C)
        acts.keep(f"act.h.{layer}.", cache)
        blocks.append(cache)
    loss, head = vocab_parallel_head_forward(x, params, targets[:, lay.region_pos], lay, normalizer)
    acts.keep("act.head.", head)

    dx, grads = vocab_parallel_head_backward(head, lay, dloss)  # (B, Tl, C)
    acts.release("act.head.")
    for layer in reversed(range(lay.config.n_layer)):
        dx, g = parallel_block_backward(dx, blocks.pop(), layer, lay)
        grads |= g
        acts.release(f"act.h.{layer}.")
    g = vocab_parallel_embedding_backward(dx, emb, lay, params)
    acts.release("act.embed.")
    if grad_dtype is not None:  # fp32_grads: each gradient leaves backward into a float32 buffer
        xp = array_namespace(dx)
        grads, g = ({n: xp.astype(a, grad_dtype) for n, a in d.items()} for d in (grads, g))
    add_embedding_grads(grads, g)  # tied: head and embedding add
    return loss, {n: grads[n] for n in params}


def all_reduce_replicated_grads(grads: dict, comm, tag: str) -> dict:
    """Parameters replicated over `comm`'s axis saw only its ranks' share of the batch (dp) or of
    the sequence (cp): their gradients are summed, coalesced into one all-reduce."""
    names = list(grads)
    xp = array_namespace(grads[names[0]])
    flat = comm.all_reduce(xp.concat([xp.reshape(grads[n], (-1,)) for n in names]), tag=tag)
    bounds = np.cumsum([0] + [math.prod(grads[n].shape) for n in names]).tolist()
    return {n: xp.reshape(flat[bounds[i]:bounds[i + 1]], grads[n].shape) for i, n in enumerate(names)}


def held_state(params: dict, state: dict):
    """(ledger name, array, category) of parameters, AdamW's moments and fp32 master weights."""
    yield from ((f"param.{n}", w, "params") for n, w in params.items())
    for k in ("m", "v"):
        yield from ((f"optimizer.{k}.{n}", w, "optimizer") for n, w in state.get(k, {}).items())
    yield from ((f"master.{n}", w, "master") for n, w in state.get("master", {}).items())


class IntraLayerTrainer:
    """One rank's state: its parameter shards, AdamW moments and ledger; `step(s)` trains one step.
    `to_backend` moves the NumPy initialisation to the run's array namespace (e.g. torch.asarray);
    None: the run's backend (refpar/backend.py)."""

    def __init__(self, model: ModelConfig, train: TrainConfig, mesh, ledger, sp=False, cp_algo=None,
                 to_backend=None):
        validate(model, train, mesh.sizes, sp, cp_algo)
        self.model, self.train, self.mesh, self.ledger, self.sp = model, train, mesh, ledger, sp
        self.lay = build_layout(model, train.seq_len, mesh, sp, cp_algo)
        t, tr = mesh.sizes["tp"], mesh.coords["tp"]
        params = shard_params_tp(init_params(model, train.seed), model, t, tr)
        self.params = backend.current().from_host(params) if to_backend is None \
            else {n: to_backend(w) for n, w in params.items()}
        self.state = optimizer_init(self.params, train)
        self.scaler = loss_scaler(model, train)  # fp16 only
        self.scales, self.skipped_steps = [], []  # the scale each step used, the steps skipped
        self.grad_dtype = MASTER_DTYPE if train.fp32_grads else None
        self._hold()
        self.acts = ActivationLedger(ledger)
        self.sample_ids = tuple(range(*shard_range(train.batch_size, mesh.sizes["dp"], mesh.coords["dp"])))

    def _held(self):
        return held_state(self.params, self.state)

    def _hold(self) -> None:
        for name, w, category in self._held():
            self.ledger.alloc(name, nbytes(w), category)

    def _release(self) -> None:
        for name, _, _ in self._held():
            self.ledger.free(name)

    def step(self, step: int, corpus) -> float:
        """One optimizer step on the global batch `step`; returns the global mean loss."""
        model, train, mesh = self.model, self.train, self.mesh
        tokens, targets = corpus.batch(step, self.sample_ids, train.seq_len)  # (B/dp, T) each
        drop = DropoutContext(train.seed, step, self.sample_ids, model.dropout, True)
        scale = 1.0 if self.scaler is None else self.scaler.scale
        with np.errstate(over="ignore", invalid="ignore") if self.scaler else nullcontext():
            loss, grads = loss_and_grads(self.params, tokens, targets, self.lay, drop,
                                         train.batch_size * train.seq_len, self.acts, scale, self.grad_dtype)
        if self.sp:
            all_reduce_sequence_parallel_grads(grads, model, mesh.tp)
        for axis in ("cp", "dp"):
            if mesh.sizes[axis] > 1:
                grads = all_reduce_replicated_grads(grads, mesh.axis(axis), f"grads.{axis}:bwd")
                loss = float(mesh.axis(axis).all_reduce(np.array([loss]), tag=f"loss.{axis}:report")[0])
        self.ledger.alloc("grads", sum(nbytes(g) for g in grads.values()), "grads")
        skip = False
        if self.scaler is not None:  # cp and dp ranks hold the same sums; tp ranks different shards
            skip = overflow_anywhere(grads, [mesh.tp] if mesh.sizes["tp"] > 1 else [])
            self.scaler.update(skip)
            self.scales.append(scale)
            self.skipped_steps += [step] * skip
        self._release()
        self.params, self.state = optimizer_step(self.params, grads, self.state, train,
                                                 inv_scale=1.0 / scale, skip=skip)
        self._hold()
        self.ledger.free("grads")
        return loss

    def full_params(self) -> dict:
        """Every parameter whole as NumPy (gathered over tp), for the comparison with one device."""
        whole = gather_params_tp(self.params, self.model, self.lay.tp)
        return {n: backend.to_host(w) for n, w in whole.items()}
