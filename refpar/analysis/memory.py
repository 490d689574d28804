"""Per-rank memory under data parallelism, ZeRO 1/2/3 and FSDP, in closed form.

Two levels:
- The ZeRO paper's forms (Rajbhandari et al. 2020, sec. 5 and Figure 1): with Ψ parameters, N
  data-parallel ranks and K bytes of optimizer state per parameter, one rank holds
  DP 2Ψ+2Ψ+KΨ, P_os 2Ψ+2Ψ+KΨ/N, P_os+g 2Ψ+(2+K)Ψ/N, P_os+g+p (2+2+K)Ψ/N bytes (fp16 parameters
  and gradients, mixed-precision Adam K=12). `paper_model_state_bytes` is that, for any dtype.
- refpar's exact numbers (`model_state_bytes`, `peak_bytes`), for the run's precision
  (`precision_options`): in float64 parameters 8Ψ, gradients 8Ψ and AdamW's m and v 16Ψ (no
  master copy: the parameters are already full precision); in bf16-mixed or fp16-mixed the paper's
  own case, parameters 2Ψ, gradients 2Ψ, fp32 master weights 4Ψ and fp32 m and v 8Ψ: 16Ψ.
  Parameters are partitioned per unit (one flat buffer per transformer block, one for embeddings
  + final LayerNorm, the "root"), each unit split over ranks with `shard_range`, so a rank's share
  s = Σ_u s_u is the sum of its uneven unit shards, not Ψ/N.

fp32 gradient accumulation (--fp32-grads, `Options.wide_grads`) is the Ultra-Scale Playbook's 20Ψ:
2Ψ bf16 parameters + 2Ψ bf16 gradients + 4Ψ fp32 gradients + 4Ψ master + 8Ψ moments. The 16-bit
gradient is what backward writes (the framework's param.grad); the fp32 one accumulates it.
Per stage, following DeepSpeed (counted in "grads", both kinds):
- DP and ZeRO-1: DeepSpeed's BF16_Optimizer layout. Every parameter keeps its 16-bit .grad
  (cleared, not freed, after each accumulation) and the optimizer keeps a full fp32 gradient
  buffer beside it (ZeRO-1's partition of it is a view): grads (2 + 4)Ψ, so DP holds
  2 + 6 + 4 + 8 = 20Ψ and ZeRO-1 2Ψ + 6Ψ + 12s.
- ZeRO-2, ZeRO-3 and FSDP: a unit's 16-bit gradient exists only from its backward to its
  reduce-scatter (DeepSpeed's stage 2/3 free param.grad once it is copied into the reduction
  bucket); what stays is the reduced fp32 shard: grads 4s, so ZeRO-2 holds 2Ψ + 16s and ZeRO-3
  18s, with the unit's 16-bit gradient (2Ψ_u) in the gradient peak instead.

The peaks add what the implementation holds transiently on top of the persistent states, exactly:
a piece's freshly returned gradients before they are folded into a buffer, a unit's full gradient
before its reduce-scatter, gathered units, and collective outputs not yet consumed. The optimizer's
elementwise temporaries (one parameter segment, written back at once) are not counted, like any
other intermediate of a single expression. `activation_peak_bytes` gives the fifth category.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.analysis.activations import layer_bytes
from refpar.analysis.intra_layer import RankShape
from refpar.config import ConfigError, ModelConfig
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit
from refpar.sharding import shard_range, shard_sizes

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")
ROOT = "root"  # the unit of wte, wpe and ln_f: used by the embedding and again by the tied head


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GPT-2's parameters in state-dict order (the model's `param_shapes`, restated here so the
    closed forms depend on the configuration only)."""
    V, P, C = config.vocab_size, config.n_positions, config.n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
            h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
        })
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def units(config: ModelConfig) -> dict[str, list[str]]:
    """Unit name -> its parameters, in flat-buffer order: the root, then one unit per block."""
    names = list(param_shapes(config))
    out = {ROOT: ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]}
    for i in range(config.n_layer):
        out[f"h.{i}"] = [n for n in names if n.startswith(f"h.{i}.")]
    return out


def unit_sizes(config: ModelConfig) -> dict[str, int]:
    shapes = param_shapes(config)
    return {u: sum(numel(shapes[n]) for n in names) for u, names in units(config).items()}


def piece_grad_sizes(config: ModelConfig) -> dict[str, int]:
    """Elements of the gradient dict each backward piece returns: the embedding gives wte and wpe,
    the head gives wte (its tied share) and ln_f, a block its twelve parameters."""
    V, P, C = config.vocab_size, config.n_positions, config.n_embd
    sizes = {"embed": V * C + P * C, "head": V * C + 2 * C}
    if config.n_layer:
        sizes["block"] = unit_sizes(config)["h.0"]
    return sizes


def shard_elems(config: ModelConfig, n: int, rank: int) -> dict[str, int]:
    """Elements of each unit that rank `rank` of `n` owns (uneven: `shard_range` per unit)."""
    return {u: shard_sizes(size, n)[rank] for u, size in unit_sizes(config).items()}


def optimizer_states(optimizer: str) -> int:
    """Arrays of optimizer state per parameter: AdamW keeps m and v, plain SGD none."""
    return {"adamw": 2, "sgd": 0}[optimizer]


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def paper_model_state_bytes(psi: float, n: int, stage: int, k: float = 12,
                            param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes of model states per rank, ZeRO paper sec. 5.1-5.3 (stage 0 = plain DP):
    (2 + 2 + K)Ψ, 2Ψ + 2Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (2 + 2 + K)Ψ/N, with the paper's fp16
    parameter and gradient bytes as defaults."""
    p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
    return {0: p + g + o, 1: p + g + o / n, 2: p + (g + o) / n, 3: (p + g + o) / n}[stage]


@dataclass(frozen=True)
class Options:
    """The strategy knobs that change what a rank holds (and what it sends)."""

    strategy: str = "dp"
    itemsize: int = 8  # bytes of one parameter element (and of the others unless given below)
    grad_itemsize: int = 0  # bytes of one gradient element; 0: the parameters' (4: --fp32-grads)
    state_itemsize: int = 0  # bytes of one master/moment element; 0: the parameters' (4: mixed)
    master: bool = False  # mixed precision: fp32 master weights beside the 16-bit parameters
    loss_scaling: bool = False  # fp16-mixed: ranks with different gradients agree on overflow
    optimizer: str = "adamw"
    bucket_elems: int = 1 << 62  # DP all-reduce bucket cap in elements (a parameter is never split)
    microbatches: int = 1
    prefetch: bool = False  # FSDP: gather the next unit before computing the current one
    reshard_after_forward: bool = True  # FSDP: free a block's gathered parameters after its forward
    overlap: bool = False  # DP: buckets all-reduced by ring rounds interleaved with the backward

    @property
    def grad_bytes(self) -> int:
        return self.grad_itemsize or self.itemsize

    @property
    def state_bytes(self) -> int:
        return self.state_itemsize or self.itemsize

    @property
    def wide_grads(self) -> bool:
        """Gradients accumulated wider than the parameters (--fp32-grads): backward still writes
        a 16-bit gradient, which then sits beside the fp32 accumulator."""
        return self.grad_bytes != self.itemsize


def precision_options(dtype, fp32_grads: bool = False) -> dict:
    """The Options fields of a run whose ModelConfig.dtype is `dtype` (refpar/precision.py): one
    itemsize for float64/float32; for bfloat16/float16 2-byte parameters, 2-byte gradients (4 with
    `fp32_grads`), fp32 master weights and moments, and loss scaling for float16."""
    d = dtype_of(dtype)
    if not is_16bit(d):
        return {"itemsize": d.itemsize}
    return {"itemsize": d.itemsize, "grad_itemsize": MASTER_DTYPE.itemsize if fp32_grads else d.itemsize,
            "state_itemsize": MASTER_DTYPE.itemsize, "master": True, "loss_scaling": d.name == "float16"}


def model_state_bytes(config: ModelConfig, n: int, rank: int, opts: Options) -> dict[str, int]:
    """Persistent bytes per category on `rank` of `n` between steps: the paper's forms, exact.
    bf16-mixed with AdamW: 2Ψ + 2Ψ + 4Ψ + 8Ψ (DP), the master and moments over N (P_os), the
    gradients too (P_os+g), the parameters too (P_os+g+p), each /N an uneven Σ s_u. With
    `wide_grads` DP and ZeRO-1 also keep the 16-bit gradient beside the fp32 one (20Ψ for DP);
    from ZeRO-2 on only the fp32 shard stays (the module docstring's per-stage layout)."""
    check_strategy(opts.strategy)
    psi = sum(unit_sizes(config).values())
    s = sum(shard_elems(config, n, rank).values())  # this rank's share of every unit
    k = optimizer_states(opts.optimizer)
    stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[opts.strategy]
    state = opts.state_bytes * (psi if stage == 0 else s)  # one fp32 (or full-precision) copy
    return {
        "params": opts.itemsize * (psi if stage < 3 else s),
        # DP, ZeRO-1 with wide gradients: the 16-bit .grad and the fp32 accumulator, both whole
        "grads": (opts.grad_bytes + opts.itemsize * opts.wide_grads) * psi if stage < 2
        else opts.grad_bytes * s,
        "master": state if opts.master else 0,
        "optimizer": k * state,
    }


def peak_bytes(config: ModelConfig, n: int, rank: int, opts: Options, stepped: bool = True) -> dict[str, int]:
    """Peak bytes per category (params, grads, master, optimizer, comm) during a training step,
    exactly as refpar's implementation holds them (the sequences of events are in refpar/parallel/
    data_parallel.py, zero.py and fsdp.py). A backward piece returns its gradients in the
    parameters' dtype (b); buffers, reductions and reduced shards have the gradients' (g).
    `stepped=False`: fp16 skipped every step, so ZeRO-1/2 never gathered parameters after one."""
    state = model_state_bytes(config, n, rank, opts)
    b, g, L = opts.itemsize, opts.grad_bytes, config.n_layer
    sizes, shards, pieces = unit_sizes(config), shard_elems(config, n, rank), piece_grad_sizes(config)
    psi_root = sizes[ROOT]
    psi_block = sizes["h.0"] if L else 0
    largest_unit = max(sizes.values())
    if opts.strategy in ("dp", "zero1"):
        # The full gradient buffer plus the largest dict a backward piece returns before folding.
        grads = state["grads"] + b * max(pieces.values())
    else:
        # Shards, plus the root's full gradient (filled by the head's backward, reduce-scattered
        # after the embedding's), plus one piece's dict and the unit buffer it is folded into.
        # With wide gradients a unit's buffer is its 16-bit gradient and its fp32 accumulator,
        # both held from the unit's first backward piece to its reduce-scatter.
        unit = g + b * opts.wide_grads  # bytes per element of a unit's gradient buffers
        unit_transient = max(b * pieces["head"], b * pieces["embed"], (unit + b) * psi_block)
        grads = state["grads"] + unit * psi_root + unit_transient
    if opts.strategy == "dp" and opts.overlap:
        params = state["params"]
        comm = g * overlap_comm_peak(config, n, rank, opts.bucket_elems)
    elif opts.strategy == "dp":
        params = state["params"]
        comm = g * max(bucket_sizes(config, opts.bucket_elems))  # one all-reduce output at a time
    elif opts.strategy in ("zero1", "zero2"):
        params = state["params"]
        # A unit's reduce-scattered gradient shard, or the unit all-gathered after the step
        # before it is copied in (the larger unless fp32 gradients meet 16-bit parameters).
        comm = max(g * max(shards.values()), b * largest_unit if stepped else 0)
    elif opts.strategy == "zero3":
        params = state["params"] + b * largest_unit  # one unit gathered at a time
        comm = g * max(shards.values())  # a reduce-scattered gradient shard before it is added
    else:
        if not opts.reshard_after_forward:
            blocks = L  # every block stays gathered from its forward to its backward
        else:
            blocks = min(L, 2 if opts.prefetch else 1)
        params = state["params"] + b * (psi_root + blocks * psi_block)
        comm = g * max(shards.values())
        if opts.prefetch and n > 1 and L:
            comm = max(comm, prefetch_comm_peak(config, n, rank, opts))
    return {"params": params, "grads": grads, "master": state["master"], "optimizer": state["optimizer"],
            "comm": comm}


def bucket_sizes(config: ModelConfig, bucket_elems: int) -> list[int]:
    """DP's gradient buckets in elements, in the order they become ready in backward: whole
    parameters taken from the end of the flat buffer (the last block's are ready first), a bucket
    closed when the next parameter would exceed `bucket_elems` (a bucket holds at least one)."""
    shapes = param_shapes(config)
    flat_order = [n for names in units(config).values() for n in names]
    buckets, current = [], 0
    for name in reversed(flat_order):
        size = numel(shapes[name])
        if current and current + size > bucket_elems:
            buckets.append(current)
            current = 0
        current += size
    buckets.append(current)
    return buckets


def bucket_ready_units(config: ModelConfig, bucket_elems: int) -> list[str]:
    """For each bucket (in `bucket_sizes` order) the unit whose backward completes it: the unit of
    its lowest parameter, since units finish backward from the last block down to the root."""
    sizes = unit_sizes(config)
    starts, total = {}, 0
    for u, size in sizes.items():
        starts[u], total = total, total + size
    out, stop = [], total
    for size in bucket_sizes(config, bucket_elems):
        stop -= size
        out.append(max((u for u in sizes if starts[u] <= stop), key=lambda u: starts[u]))
    return out


def overlap_comm_peak(config: ModelConfig, n: int, rank: int, bucket_elems: int) -> int:
    """Peak elements of send copies and receive buffers held by overlapped ring all-reduces.

    The schedule (refpar/parallel/data_parallel.py): when a unit's backward ends, every bucket in
    flight completes its round (freeing that round's send and receive chunks) and posts the next,
    one bucket after the other; then the buckets this unit completes post round 0; after the
    backward the rest are advanced to the end. Ring round k of 2(N-1) on rank r moves chunks
    (r-k-1, r-k-2) in the reduce-scatter half and (r-k+p-1, r-k+p-2) in the all-gather half."""
    if n == 1:
        return 0
    rounds = 2 * (n - 1)

    def held(size: int, k: int) -> int:
        chunks = shard_sizes(size, n)
        return chunks[(rank - k - 1) % n] + chunks[(rank - k - 2) % n]

    sizes, ready = bucket_sizes(config, bucket_elems), bucket_ready_units(config, bucket_elems)
    flight: list[list[int]] = []  # [size, round] of every bucket in flight, oldest first
    now = peak = 0

    def advance_all() -> None:
        nonlocal now, peak
        for bucket in flight:
            now -= held(*bucket)
            bucket[1] += 1
            if bucket[1] < rounds:
                now += held(*bucket)
                peak = max(peak, now)
        flight[:] = [bucket for bucket in flight if bucket[1] < rounds]

    done_order = [f"h.{i}" for i in reversed(range(config.n_layer))] + [ROOT]
    for unit in done_order:
        advance_all()
        for size, u in zip(sizes, ready, strict=True):
            if u == unit:
                flight.append([size, 0])
                now += held(size, 0)
                peak = max(peak, now)
    while flight:
        advance_all()
    return peak


def activation_bytes(config: ModelConfig, b: int, T: int) -> dict[str, int]:
    """Bytes each piece's cache keeps for the backward of a micro-batch of b sequences of T tokens
    (an array several caches share counts once, parameters not at all). A block keeps what
    `refpar.analysis.activations.layer_bytes` counts for one rank without tensor, sequence or
    context parallelism (Korthikanti et al. 2022's terms as refpar keeps them). The model's own
    embedding keeps the int64 tokens and positions and, with dropout, its mask; its head keeps
    ln_f's x̂, 1/σ and output, the softmax probabilities (b, T, V) and the int64 targets."""
    e = np.dtype(config.dtype).itemsize
    rank = RankShape(B=b, T=T, Ta=T, Tl=T, t=1, c=1, nh=config.n_head, V=config.vocab_size, e=e,
                     cp_tokens=(T,), cp_rank=0)
    dropout = config.dropout > 0.0
    tokens, C, V = b * T, config.n_embd, config.vocab_size
    return {
        "embed": 8 * tokens + 8 * T + (e * tokens * C if dropout else 0),
        "block": layer_bytes(config, rank, "local", dropout),
        "head": e * (2 * tokens * C + tokens + tokens * V) + 8 * tokens,
    }


def activation_peak_bytes(config: ModelConfig, n: int, rank: int, microbatches: int, batch_size: int,
                          seq_len: int) -> int:
    """Peak activation bytes on `rank`: everything the largest micro-batch keeps at its head."""
    lo, hi = shard_range(batch_size, n, rank)
    b = max(shard_sizes(hi - lo, microbatches))
    pieces = activation_bytes(config, b, seq_len)
    return pieces["embed"] + config.n_layer * pieces["block"] + pieces["head"]


def prefetch_comm_peak(config: ModelConfig, n: int, rank: int, opts: Options) -> int:
    """Bytes of ring messages FSDP's prefetch holds at its peak (refpar/parallel/fsdp.py).

    A block's all-gather is a ring of n-1 rounds; round k on rank r sends piece (r-k) and receives
    piece (r-k-1), and one round is in flight at a time. In the backward (with resharding) the
    next block's first round is still in flight when this block's gradient shard comes back from
    its reduce-scatter, so the two add up."""
    psi_block = unit_sizes(config)["h.0"]
    pieces = shard_sizes(psi_block, n)
    b = opts.itemsize
    rounds = [b * (pieces[(rank - k) % n] + pieces[(rank - k - 1) % n]) for k in range(n - 1)]
    peak = max(rounds)
    if opts.reshard_after_forward and config.n_layer >= 2:
        peak = max(peak, rounds[0] + opts.grad_bytes * pieces[rank])
    return peak
