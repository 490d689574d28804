"""Which mesh should I use, and will it fit? Enumerate every valid plan, price it, rank it.

A plan is a mesh (dp, tp, pp, cp, ep: world = their product, laid out as refpar.config.MESH_AXES)
and the options that change memory and time: ZeRO stage, micro-batch size, pipeline schedule
(with its chunks per stage), activation recomputation. The sizes are enumerated in Python (a few
hundred meshes), the options as NumPy arrays: for each (schedule, recompute) pair one call of
scale.memory_per_rank prices every candidate's memory, and one call of step_time.step_time the
time of those that fit.

Validity (what Megatron-LM accepts): tp within a node and dividing the KV heads; pp at most the
layers, which pp need not divide (scale.stage_layers: the first and the last stage take a block
less, as Llama 3 does); for interleaving v dividing a stage's blocks and micro-batches in
multiples of pp; cp dividing
s / 2 (the load-balanced causal split cuts the sequence into 2c chunks); ep dividing the experts;
dp * ep dividing the global batch, and the micro-batch size dividing each replica's share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refpar.analysis.efficiency import CALIBRATED, MODERN, Efficiency, Software
from refpar.analysis.hardware import Hardware
from refpar.analysis.mfu_ceiling import above_published
from refpar.analysis.presets import ModelSpec
from refpar.analysis.scale import PRECISIONS, memory_per_rank, stage_layers
from refpar.analysis.step_time import step_time, throughput
from refpar.config import RECOMPUTE, ConfigError

ZERO_STAGES = (0, 1, 2, 3)
# With one stage there is no schedule to choose ("none"); interleaved-1f1b is tried with every
# chunk count v >= 2 that divides a stage's blocks, as price() accepts.
SCHEDULE_CHOICES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
# What the model leaves out of a plan's cost, by the feature that makes the search prefer it: a
# plan that has one ranks after every plan that has none (plan()).
UNPRICED = {
    "zero-bubble": "zero-bubble schedules hold every W until the optimizer step and, in practice, "
                   "validate the step after it (Qi et al. 2023, Section 4); neither is priced",
    "context": "ring attention's per-hop kernel launches and any causal imbalance beyond the "
               "zig-zag split are not priced",
}
MEMORY_KEYS = ("params", "grads", "master", "optimizer", "activations", "comm")  # the ledger's
COMM_KEYS = ("tp", "cp", "ep", "pp", "dp")
TIME_KEYS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer")


def _divisors(n: int) -> list[int]:
    """In ascending order; pairs d, n // d up to sqrt(n), so that --gpus 10**12 takes a second, not
    days."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*low, *(n // d for d in low)})


def check_gpus(gpus: int, hw: Hardware) -> None:
    """Whole nodes, or a power of two inside one node: the shapes clusters are built in."""
    node = hw.gpus_per_node
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if (gpus <= node and gpus & (gpus - 1)) or (gpus > node and gpus % node):
        if gpus < node:
            lower, upper = 2 ** (gpus.bit_length() - 1), 2 ** gpus.bit_length()
        else:
            lower, upper = gpus - gpus % node, gpus - gpus % node + node
        raise ConfigError(f"--gpus {gpus} is neither a power of two up to {node} nor a whole number of "
                          f"{node}-GPU {hw.name} nodes; use e.g. {lower} or {upper}")


def splits_heads(spec: ModelSpec, tp: int) -> bool:
    """Whether tp ranks each get whole query heads and whole kv heads: tp divides the query heads,
    and either divides the kv heads or is a multiple of them (each kv head then replicated on
    tp / nkv ranks, refpar/parallel/llama_pieces.py's layout), so that no rank's query
    heads read two kv heads."""
    return spec.n_head % tp == 0 and (spec.n_kv_head % tp == 0 or tp % spec.n_kv_head == 0)


def meshes(spec: ModelSpec, gpus: int, hw: Hardware, global_batch: int, seq: int) -> np.ndarray:
    """Every valid (dp, tp, pp, cp, ep) for this model and world, one row each."""
    rows = []
    divisors = _divisors(gpus)

    def dividing(n: int) -> list[int]:  # the divisors of a divisor of gpus
        return [d for d in divisors if n % d == 0]

    for tp in divisors:
        if tp > hw.gpus_per_node or not splits_heads(spec, tp):
            continue
        for pp in dividing(gpus // tp):
            if pp > spec.n_layer:
                continue
            for cp in dividing(gpus // (tp * pp)):
                if seq % (2 * cp) and cp > 1:
                    continue
                for ep in dividing(gpus // (tp * pp * cp)):
                    if (spec.n_experts if spec.is_moe else 1) % ep:
                        continue
                    dp = gpus // (tp * pp * cp * ep)
                    if global_batch % (dp * ep) == 0:
                        rows.append((dp, tp, pp, cp, ep))
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def collectives(calls: dict, at) -> list[dict]:
    """The collectives of step_time's `calls` that run, `at` picking one plan's value of each."""
    out = []
    for name, (axis, op, nbytes, ranks, count, seconds, algo) in calls.items():
        if at(count) > 0 and at(ranks) > 1 and at(nbytes) > 0:
            out.append({"name": name, "axis": axis, "op": op, "bytes": float(at(nbytes)),
                        "ranks": int(at(ranks)), "calls_per_step": float(at(count)),
                        "seconds_per_call": float(at(seconds)), "algo": str(at(algo))})
    return out


@dataclass
class Candidates:
    """Structure of arrays: one entry per priced plan."""

    columns: dict[str, np.ndarray]
    schedule: np.ndarray  # index into SCHEDULE_CHOICES
    chunks: np.ndarray  # interleaved chunks per stage (1 for the other schedules)
    recompute: np.ndarray  # index into RECOMPUTE
    memory: dict[str, np.ndarray]
    times: dict[str, np.ndarray]
    stage: dict[str, np.ndarray]  # one micro-batch's F, B, W and p2p seconds on the busiest stage
    comm_bytes: dict[str, np.ndarray]
    part: np.ndarray  # which priced group a candidate came from, and its index there
    local: np.ndarray
    calls: list[dict]  # per group: step_time's collectives
    priced: int  # candidates whose memory was priced (the fitting ones are the rows here)
    leanest: float  # the least memory any candidate needs, in bytes per GPU

    def collectives(self, i: int) -> list[dict]:
        """Candidate i's collectives that run, each with its algorithm and alpha-beta time."""
        size = int(np.sum(self.part == self.part[i]))
        return collectives(self.calls[self.part[i]], lambda x: np.broadcast_to(x, (size,))[self.local[i]])

    def __len__(self) -> int:
        return len(self.schedule)


def enumerate_plans(spec: ModelSpec, hw: Hardware, gpus: int, global_batch: int, seq: int,
                    precision: str = "bf16", dtype: str = "bfloat16", eff: Efficiency = CALIBRATED,
                    software: Software = MODERN, budget: float = np.inf) -> Candidates:
    """Every candidate plan with its memory; the time of those within `budget` bytes per GPU.

    Memory is priced first and the step time only for the plans that fit: the pruning that keeps
    a 1T-parameter search on 4,096 GPUs well under two seconds.
    """
    check_gpus(gpus, hw)
    if global_batch < 1 or seq < 1:
        raise ConfigError(f"global batch {global_batch} and sequence {seq} must both be positive")
    if spec.learned_positions and seq > spec.seq_len:
        raise ConfigError(f"{spec.name} learns {spec.seq_len} positions; use --seq {spec.seq_len} or less")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    hw.flops(dtype)  # an unknown dtype is refused before any pricing
    mesh = meshes(spec, gpus, hw, global_batch, seq)
    if len(mesh) == 0:
        raise ConfigError(
            f"no mesh of {gpus} GPUs divides {spec.name} with a global batch of {global_batch}; "
            f"use a global batch that is a multiple of {gpus}"
        )
    # Micro-batch sizes: powers of two dividing each replica's share of the batch.
    per_replica = global_batch // (mesh[:, 0] * mesh[:, 4])
    mbs_options = 2 ** np.arange(0, 1 + int(math.log2(max(1, per_replica.max()))))
    rows, mbs = np.nonzero(per_replica[:, None] % mbs_options[None, :] == 0)
    base = np.repeat(mesh[rows], len(ZERO_STAGES), axis=0)
    micro = np.repeat(mbs_options[mbs], len(ZERO_STAGES))
    zero = np.tile(np.array(ZERO_STAGES), len(rows))
    dp, tp, pp, cp, ep = base.T
    m = global_batch // (dp * ep * micro)
    mesh_columns = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "zero": zero,
                    "micro_batch": micro, "microbatches": m}

    parts, priced, leanest = [], 0, np.inf
    memory_kw = dict(precision=PRECISIONS[precision], software=software)
    for code, label in enumerate(SCHEDULE_CHOICES):
        # One stage has no schedule to choose; its memory and time are 1F1B's with p = 1.
        schedule = "1f1b" if label == "none" else label
        ok = pp == 1 if label == "none" else pp > 1
        if schedule == "zb-h1":
            ok &= m >= pp
        if schedule == "zb-h2":
            ok &= m >= 2 * pp - 1
        rows_ok = np.nonzero(ok)[0]
        chunks = np.ones(len(rows_ok), dtype=np.int64)
        if schedule == "interleaved-1f1b":  # every v >= 2 dividing the stage's blocks, m in multiples of p
            rows_ok = rows_ok[m[rows_ok] % pp[rows_ok] == 0]
            per_stage = stage_layers(spec.n_layer, pp[rows_ok])[1]
            each = [(rows_ok[per_stage % v == 0], v) for v in range(2, int(per_stage.max(initial=1)) + 1)]
            rows_ok = np.concatenate([r for r, _ in each] or [np.zeros(0, np.int64)])
            chunks = np.concatenate([np.full(len(r), v) for r, v in each] or [np.zeros(0, np.int64)])
        sizes = dict(micro_batch=micro[rows_ok], tp=tp[rows_ok], pp=pp[rows_ok], dp=dp[rows_ok],
                     cp=cp[rows_ok], ep=ep[rows_ok], zero=zero[rows_ok])
        for rc, recompute in enumerate(RECOMPUTE if len(rows_ok) else ()):
            options = dict(seq=seq, schedule=schedule, chunks=chunks, recompute=recompute)
            memory = memory_per_rank(spec, microbatches=m[rows_ok], **sizes, **options, **memory_kw)
            total = sum(memory.values())
            priced += len(rows_ok)
            leanest = min(leanest, float(total.min()))
            keep = np.nonzero(total <= budget)[0]
            if len(keep) == 0:
                continue
            index = rows_ok[keep]
            times, comm, calls = step_time(spec, hw, global_batch=global_batch, dtype=dtype, eff=eff,
                                           software=software, precision=PRECISIONS[precision],
                                           **{**options, "chunks": chunks[keep]},
                                           **{k: v[keep] for k, v in sizes.items()})
            memory = {k: np.broadcast_to(v, total.shape)[keep] for k, v in memory.items()}
            parts.append((index, code, rc, memory, times, comm, calls, chunks[keep]))

    def cat(key_fn):
        if not parts:
            return np.zeros(0)
        return np.concatenate([np.broadcast_to(key_fn(p), p[0].shape) for p in parts])

    columns = {name: cat(lambda p, col=col: col[p[0]]) for name, col in mesh_columns.items()}
    return Candidates(
        columns=columns,
        schedule=cat(lambda p: p[1]).astype(int),
        recompute=cat(lambda p: p[2]).astype(int),
        chunks=cat(lambda p: p[7]).astype(int),
        memory={k: cat(lambda p, k=k: p[3][k]) for k in MEMORY_KEYS},
        times={k: cat(lambda p, k=k: p[4][k]) for k in (*TIME_KEYS, "total")},
        stage={k: cat(lambda p, k=k: p[4]["stage"][k]) for k in ("F", "B", "W", "p2p")},
        comm_bytes={k: cat(lambda p, k=k: p[5][k]) for k in COMM_KEYS},
        part=np.concatenate([np.full(len(p[0]), k) for k, p in enumerate(parts)] or [np.zeros(0, int)]),
        local=cat(lambda p: np.arange(len(p[0]))).astype(int),
        calls=[p[6] for p in parts],
        priced=priced,
        leanest=leanest,
    )


def plan(spec: ModelSpec, hw: Hardware, gpus: int, global_batch: int | None = None,
         seq: int | None = None, top: int = 5, precision: str = "bf16", dtype: str = "bfloat16",
         eff: Efficiency = CALIBRATED, software: Software = MODERN, priced: dict | None = None) -> dict:
    """The `top` fastest plans that fit, best first, as plain dicts (the --json output); with a
    `priced` plan (price()), also its "rank" among them (1: none is faster by more than the 0.1%
    within which the search takes step times as equal and ranks the simpler plan first)."""
    global_batch = spec.global_batch if global_batch is None else global_batch
    seq = spec.seq_len if seq is None else seq
    c = enumerate_plans(spec, hw, gpus, global_batch, seq, precision, dtype, eff, software,
                        budget=hw.memory_bytes)
    if len(c) == 0:
        raise ConfigError(
            f"{spec.name} fits on no mesh of {gpus} {hw.name} GPUs: the leanest plan needs "
            f"{c.leanest / 1e9:.1f} GB per GPU against {hw.memory_bytes / 1e9:.0f} GB; use more "
            f"GPUs, a smaller global batch or a shorter sequence"
        )
    total_memory = sum(c.memory.values())
    # Fastest first, times compared in steps of 0.1% of the fastest: within a step the simpler
    # plan goes first (fewer parallel axes besides dp, then the lower ZeRO stage), then the one
    # that leaves more memory free.
    seconds = c.times["total"]
    bucket = np.floor(seconds / (seconds.min() * 1e-3))
    axes = sum((c.columns[k] > 1).astype(int) for k in ("tp", "pp", "cp", "ep"))
    # A plan relying on what the model does not price (UNPRICED) ranks after every plan that does not.
    zero_bubble = np.isin(c.schedule, [SCHEDULE_CHOICES.index("zb-h1"), SCHEDULE_CHOICES.index("zb-h2")])
    unpriced = zero_bubble | ((c.columns["cp"] > 1) & (software.cp == "ring"))
    order = np.lexsort((total_memory, c.columns["zero"], axes, bucket, unpriced))[:top]
    plans = [_row(spec, hw, gpus, global_batch, seq, dtype,
                  mesh={k: int(c.columns[k][i]) for k in ("dp", "tp", "pp", "cp", "ep")},
                  zero=int(c.columns["zero"][i]), micro_batch=int(c.columns["micro_batch"][i]),
                  schedule=SCHEDULE_CHOICES[c.schedule[i]], chunks=int(c.chunks[i]),
                  recompute=RECOMPUTE[c.recompute[i]], sp=bool(c.columns["tp"][i] > 1),
                  memory={k: c.memory[k][i] for k in MEMORY_KEYS},
                  times={k: c.times[k][i] for k in TIME_KEYS},
                  comm={k: v[i] for k, v in c.comm_bytes.items()}, calls=c.collectives(i),
                  stage={k: v[i] for k, v in c.stage.items()}, software=software)
             for i in order]
    result = {
        "model": spec.name, "hardware": hw.name, "gpus": gpus, "global_batch": global_batch,
        "seq": seq, "candidates": c.priced, "fitting": len(c),
        "memory_capacity_bytes": hw.memory_bytes, "plans": plans,
    }
    if priced is not None:
        # Its rank in the order above: the plans that come before it.
        faster = bucket < np.floor(priced["step_time_s"] / (seconds.min() * 1e-3))
        before = (~unpriced | faster) if priced.get("unpriced") else (~unpriced & faster)
        result["rank"] = 1 + int(np.sum(before))
    return result


def _row(spec: ModelSpec, hw: Hardware, gpus: int, global_batch: int, seq: int, dtype: str, *, mesh: dict,
         zero: int, micro_batch: int, schedule: str, chunks: int, recompute: str, sp: bool, memory: dict,
         times: dict, comm: dict, calls: list[dict], stage: dict, software: Software = MODERN) -> dict:
    """One plan as the --json output lists it (a search row and a priced plan alike)."""
    step = float(sum(times[k] for k in TIME_KEYS))
    unpriced = ([UNPRICED["zero-bubble"]] if schedule in ("zb-h1", "zb-h2") else []) + (
        [UNPRICED["context"]] if mesh["cp"] > 1 and software.cp == "ring" else [])
    mfu, tokens = throughput(spec, hw, step, global_batch=global_batch, seq=seq, gpus=gpus, dtype=dtype)
    return {
        "mesh": mesh, "zero": zero, "micro_batch": micro_batch,
        "microbatches": global_batch // (mesh["dp"] * mesh["ep"] * micro_batch),
        "schedule": schedule, "chunks": chunks, "recompute": recompute, "sp": sp,
        "memory_bytes": {k: float(memory[k]) for k in MEMORY_KEYS},
        "time_s": {k: float(times[k]) for k in TIME_KEYS},
        "comm_bytes": {k: float(v) for k, v in comm.items()},
        "collectives": calls,
        "stage_costs_s": {k: float(v) for k, v in stage.items()},
        "step_time_s": step, "mfu": float(mfu), "tokens_per_s": float(tokens), "unpriced": unpriced,
        "above_published": above_published(hw.name, float(mfu)),
    }


AXES = ("dp", "tp", "pp", "cp", "ep")
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
# What to change when a category does not fit.
RELIEF = {"activations": "recompute (--recompute selective or full), use a smaller --micro-batch, or more "
                         "tp or pp",
          "params": "shard the weights (--zero 3) or use more tp or pp",
          "grads": "shard the gradients (--zero 2) or use more tp or pp",
          "master": "shard the optimizer state (--zero 1) or use more tp or pp",
          "optimizer": "shard the optimizer state (--zero 1) or use more tp or pp",
          "comm": "a smaller --micro-batch or a lower --zero stage"}


def parse_mesh(text: str, gpus: int) -> dict:
    """`tp=8,pp=64,dp=6` as {dp, tp, pp, cp, ep}: missing axes are 1, a missing dp takes the GPUs
    the others leave; the product must be the GPU count."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        axis, sep, value = item.strip().partition("=")
        if not sep or axis not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh item {item.strip()!r} must be axis=size with axis one of "
                              f"{', '.join(AXES)} and size a positive whole number, e.g. tp=8,pp=64,dp=6")
        if axis in sizes:
            raise ConfigError(f"--mesh gives {axis} twice; give it once")
        sizes[axis] = int(value)
    rest = math.prod(v for k, v in sizes.items() if k != "dp")
    if "dp" not in sizes:
        if gpus % rest:
            raise ConfigError(f"--mesh {text} uses {rest} GPUs per replica, which does not divide "
                              f"--gpus {gpus}; give sizes whose product divides it")
        sizes["dp"] = gpus // rest
    mesh = {axis: sizes.get(axis, 1) for axis in AXES}
    if math.prod(mesh.values()) != gpus:
        raise ConfigError(f"--mesh {text} has {math.prod(mesh.values())} GPUs but --gpus is {gpus}; "
                          f"make the product of the sizes {gpus}")
    return mesh


def price(spec: ModelSpec, hw: Hardware, gpus: int, mesh: dict, *, zero: int = 0,
          schedule: str | None = None, chunks: int = 1, micro_batch: int = 1, recompute: str = "none",
          sp: bool = False, global_batch: int | None = None, seq: int | None = None,
          precision: str = "bf16", dtype: str = "bfloat16", eff: Efficiency = CALIBRATED,
          software: Software = MODERN) -> dict:
    """One given plan, priced as a search row is; refused in one sentence if it is not a plan for
    this model or does not fit in memory (naming the category that takes the most, by how much)."""
    global_batch = spec.global_batch if global_batch is None else global_batch
    seq = spec.seq_len if seq is None else seq
    check_gpus(gpus, hw)
    dp, tp, pp, cp, ep = (mesh[k] for k in AXES)
    schedule = ("none" if pp == 1 else "1f1b") if schedule is None else schedule
    label = ",".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "one GPU"
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    hw.flops(dtype)
    if recompute not in RECOMPUTE:
        raise ConfigError(f"unknown recompute {recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if (schedule == "none") != (pp == 1):
        raise ConfigError(f"schedule {schedule} needs pp {'= 1' if schedule == 'none' else '> 1'}; "
                          f"use {'--schedule none' if pp == 1 else 'a pipeline schedule such as 1f1b'}")
    if zero not in ZERO_STAGES:
        raise ConfigError(f"--zero {zero} must be one of {', '.join(map(str, ZERO_STAGES))}")
    if not splits_heads(spec, tp):
        choices = [d for d in _divisors(spec.n_head) if splits_heads(spec, d)]
        raise ConfigError(f"tp={tp} does not divide {spec.name}'s {spec.n_kv_head} key/value heads, nor "
                          f"is it a multiple of them dividing its {spec.n_head} query heads (each rank "
                          f"needs whole heads); choose tp in {{{', '.join(map(str, choices))}}}")
    if pp > spec.n_layer:
        raise ConfigError(f"pp={pp} is more stages than {spec.name}'s {spec.n_layer} blocks; use pp <= "
                          f"{spec.n_layer}")
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(f"cp={cp} does not split the {seq}-token sequence into 2 x {cp} equal chunks; "
                          f"choose cp with {seq} divisible by 2 cp")
    if ep > 1 and (spec.n_experts or 1) % ep:
        raise ConfigError(f"ep={ep} does not divide {spec.name}'s {spec.n_experts or 'no'} experts; use ep=1"
                          + ("" if not spec.is_moe else " or a divisor of the experts"))
    if sp and tp == 1:
        raise ConfigError("--sp splits the sequence over the tensor-parallel ranks: it needs tp > 1")
    replicas = dp * ep
    if global_batch % (replicas * micro_batch):
        raise ConfigError(f"the global batch {global_batch} does not split into micro-batches of "
                          f"{micro_batch} over the {replicas} data-parallel replicas; choose a "
                          f"--micro-batch and dp with dp x micro-batch dividing {global_batch}")
    m = global_batch // (replicas * micro_batch)
    per_stage = -(-spec.n_layer // pp)
    chunks = chunks if schedule == "interleaved-1f1b" else 1
    if schedule == "interleaved-1f1b" and (chunks < 2 or per_stage % chunks or m % pp):
        raise ConfigError(f"interleaved-1f1b needs --chunks >= 2 dividing the {per_stage} blocks of a "
                          f"stage and micro-batches ({m}) in multiples of pp={pp}")
    if schedule in ("zb-h1", "zb-h2") and m < (pp if schedule == "zb-h1" else 2 * pp - 1):
        raise ConfigError(f"{schedule} needs at least {pp if schedule == 'zb-h1' else 2 * pp - 1} "
                          f"micro-batches; this plan has {m}: use a smaller --micro-batch or dp")
    kind = "1f1b" if schedule == "none" else schedule
    options = dict(micro_batch=micro_batch, seq=seq, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero,
                   schedule=kind, chunks=chunks, recompute=recompute, sp=sp, precision=PRECISIONS[precision])
    memory = memory_per_rank(spec, microbatches=m, software=software, **options)
    needed = float(sum(memory.values()))
    if needed > hw.memory_bytes:
        worst = max(MEMORY_KEYS, key=lambda k: float(memory[k]))
        raise ConfigError(
            f"{label} does not fit: it needs {needed / 1e9:.1f} GB per GPU, "
            f"{(needed - hw.memory_bytes) / 1e9:.1f} GB over the {hw.name}'s "
            f"{hw.memory_bytes / 1e9:.0f} GB, and {worst} take the most "
            f"({float(memory[worst]) / 1e9:.1f} GB): {RELIEF[worst]}")
    times, comm, calls = step_time(spec, hw, global_batch=global_batch, dtype=dtype, eff=eff,
                                   software=software, **options)
    return _row(spec, hw, gpus, global_batch, seq, dtype, mesh=dict(mesh), zero=zero, micro_batch=micro_batch,
                schedule=schedule, chunks=chunks, recompute=recompute, sp=sp, memory=memory,
                times=times, comm=comm, calls=collectives(calls, lambda x: np.asarray(x).item()
                                                           if np.ndim(x) == 0 else x), stage=times["stage"],
                software=software)

