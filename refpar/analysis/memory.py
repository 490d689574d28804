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
  Parameters are partitioned per unit (refpar/holdings.py: wte alone, the root of wpe and ln_f, one
  unit per transformer block), each unit split over ranks with `shard_range`, so a rank's share
  s = Σ_u s_u is the sum of its uneven unit shards, not Ψ/N.

fp32 gradient accumulation (--fp32-grads) is the Ultra-Scale Playbook's 20Ψ:
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
before its reduce-scatter, gathered units, and collective outputs not yet consumed (the replay of
refpar/analysis/data_parallel.py). The optimizer's elementwise temporaries (one parameter segment,
written back at once) are not counted, like any other intermediate of a single expression. These
are the data-parallel mesh's (`--mesh dp=N`) forms; refpar/analysis/closed_forms.py composes the same
for any mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refpar.analysis import closed_forms
from refpar.analysis import data_parallel as dp_forms
from refpar.config import ConfigError, ModelConfig
from refpar.holdings import units as stage_units
from refpar.model.gpt import param_shapes
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")


def unit_sizes(config: ModelConfig) -> dict[str, int]:
    """Elements of each unit (holdings.units) on one rank holding the whole model."""
    shapes = param_shapes(config)
    return {u: sum(math.prod(shapes[n]) for n in names) for u, names in stage_units(list(shapes)).items()}


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

    # the fields of a Plan (refpar/config.py) a data-parallel mesh leaves at their defaults
    kind, chunks, schedule_csv, sp, cp_algo, recompute = "1f1b", None, None, False, None, "none"

    @property
    def stage(self) -> int:
        return {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[self.strategy]

    @property
    def precision(self) -> dp_forms.Precision:
        return dp_forms.Precision(self.itemsize, self.grad_bytes, self.state_bytes, self.master,
                                  optimizer_states(self.optimizer), self.loss_scaling)


def precision_options(dtype, fp32_grads: bool = False) -> dict:
    """The Options fields of a run whose ModelConfig.dtype is `dtype` (refpar/precision.py): one
    itemsize for float64/float32; for bfloat16/float16 2-byte parameters, 2-byte gradients (4 with
    `fp32_grads`), fp32 master weights and moments, and loss scaling for float16."""
    d = dtype_of(dtype)
    if not is_16bit(d):
        return {"itemsize": d.itemsize}
    return {"itemsize": d.itemsize, "grad_itemsize": MASTER_DTYPE.itemsize if fp32_grads else d.itemsize,
            "state_itemsize": MASTER_DTYPE.itemsize, "master": True, "loss_scaling": d.name == "float16"}




def rank_units(config: ModelConfig, n: int, rank: int, opts: Options) -> dp_forms.RankUnits:
    """Rank `rank` of a data-parallel mesh of n ranks: every unit, over all n."""
    check_strategy(opts.strategy)
    sizes = {"pp": 1, "dp": n, "ep": 1, "cp": 1, "tp": 1}
    return closed_forms.rank_units(config, sizes, closed_forms.rank_coords(sizes, rank), opts)


def model_state_bytes(config: ModelConfig, n: int, rank: int, opts: Options) -> dict[str, int]:
    """Persistent bytes per category on `rank` of `n` between steps: the paper's forms, exact.
    bf16-mixed with AdamW: 2Ψ + 2Ψ + 4Ψ + 8Ψ (DP), the master and moments over N (P_os), the
    gradients too (P_os+g), the parameters too (P_os+g+p), each /N an uneven Σ s_u. With
    --fp32-grads DP and ZeRO-1 also keep the 16-bit gradient beside the fp32 one (20Ψ for DP);
    from ZeRO-2 on only the fp32 shard stays (the module docstring's per-stage layout)."""
    return dp_forms.state_bytes(rank_units(config, n, rank, opts), opts.strategy, opts.precision)


def peak_bytes(config: ModelConfig, n: int, rank: int, opts: Options, stepped: bool = True) -> dict[str, int]:
    """Peak bytes per category (params, grads, master, optimizer, comm) during a training step,
    exactly as refpar's implementation holds them. `stepped=False`: fp16 skipped every step, so
    ZeRO-1/2 never gathered parameters after one."""
    return dp_forms.peak_bytes(rank_units(config, n, rank, opts), opts, opts.precision, stepped)


def bucket_sizes(config: ModelConfig, bucket_elems: int) -> list[int]:
    """DP's gradient buckets in elements, in the order they become ready in backward: whole
    parameters taken from the end of the flat buffer (the last block's are ready first), a bucket
    closed when the next parameter would exceed `bucket_elems` (a bucket holds at least one)."""
    return [n for n, _ in dp_forms.buckets(rank_units(config, 1, 0, Options()), bucket_elems)]

