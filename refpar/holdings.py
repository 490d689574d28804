"""Which parameters a rank holds: its pipeline stages' names, its tp slices, the sequence-parallel
region's names and the units ZeRO and FSDP shard. Facts of the configuration only (no arrays, no
communication), so the runtime (refpar/parallel, refpar/engine) and the closed forms
(refpar/analysis) read the same definitions without importing each other.
"""

from __future__ import annotations

import numpy as np

from refpar.config import ConfigError, ModelConfig
from refpar.model.gpt import param_shapes
from refpar.sharding import shard_range


def stage_layers(n_layer: int, n_stages: int, stage: int) -> range:
    """The global indices of the blocks stage `stage` holds."""
    if n_layer < n_stages:
        raise ConfigError(f"{n_stages} pipeline stages need at least {n_stages} blocks, the model "
                          f"has n_layer={n_layer}; use fewer stages (or chunks) or more layers")
    return range(*shard_range(n_layer, n_stages, stage))


def stage_param_names(config: ModelConfig, n_stages: int, stage: int) -> list[str]:
    """The parameters stage `stage` reads, in GPT-2's order (every expert of its MoE blocks); wte on
    the first and the last."""
    keep = {f"h.{i}." for i in stage_layers(config.n_layer, n_stages, stage)}
    first, last = stage == 0, stage == n_stages - 1
    names = []
    for name in param_shapes(config):
        if name.startswith("h."):
            wanted = name[: name.index(".", 2) + 1] in keep
        elif name == "wte.weight":
            wanted = first or last
        elif name == "wpe.weight":
            wanted = first
        else:  # ln_f
            wanted = last
        if wanted:
            names.append(name)
    return names


def tp_param_slices(config: ModelConfig, t: int, rank: int) -> dict[str, tuple[int, np.ndarray]]:
    """Which slice of each full parameter tp rank `rank` of `t` holds: (axis, global indices);
    absent = replicated (refpar/parallel/tensor_parallel.py has the table)."""
    C, hs = config.n_embd, config.head_size
    h0, h1 = shard_range(config.n_head, t, rank)
    head_cols = np.arange(h0 * hs, h1 * hs)  # this rank's heads within q, within k, within v
    qkv_cols = np.concatenate([head_cols, C + head_cols, 2 * C + head_cols])
    fc = np.arange(*shard_range(4 * C, t, rank))
    slices = {"wte.weight": (0, np.arange(*shard_range(config.vocab_size, t, rank)))}
    for i in range(config.n_layer):
        slices |= {
            f"h.{i}.attn.c_attn.weight": (1, qkv_cols), f"h.{i}.attn.c_attn.bias": (0, qkv_cols),
            f"h.{i}.attn.c_proj.weight": (0, head_cols),
        }
        # an MoE block's MLP is its experts, each split like the dense MLP
        mlps = ([f"h.{i}.mlp.experts.{e}." for e in range(config.moe_experts)]
                if i in config.moe_blocks else [f"h.{i}.mlp."])
        for p in mlps:
            slices |= {p + "c_fc.weight": (1, fc), p + "c_fc.bias": (0, fc), p + "c_proj.weight": (0, fc)}
    return slices


def sequence_parallel_param_names(config: ModelConfig) -> list[str]:
    """Replicated parameters applied in the sequence-sharded region (refpar/parallel/
    sequence_parallel.py): each tp rank computes their gradient from its sequence shard only."""
    names = ["wpe.weight", "ln_f.weight", "ln_f.bias"]
    for i in range(config.n_layer):
        names += [f"h.{i}.{n}" for n in ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias",
                                          "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")]
    return names


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


ENDS = ("wte", "root")  # the units the embedding and the head read


def units_of(names: list[str]) -> dict[str, list[str]]:
    """ZeRO-3's units of a stage: wte alone when the stage holds it; the rest of the stage as one."""
    rest = [n for n in names if n != "wte.weight"]
    return ({"wte": ["wte.weight"]} if "wte.weight" in names else {}) | ({"rest": rest} if rest else {})


def fsdp_units(names: list[str]) -> dict[str, list[str]]:
    """wte alone; the stage's other root parameters (wpe, ln_f) together; one unit per block."""
    out = {"wte": ["wte.weight"]} if "wte.weight" in names else {}
    root = [n for n in names if not n.startswith("h.") and n != "wte.weight"]
    if root:
        out["root"] = root
    for n in names:
        if n.startswith("h."):
            out.setdefault(".".join(n.split(".")[:2]), []).append(n)  # "h.3"
    return out


def expert_unit(unit: str) -> bool:
    """Whether a unit of `moe_units_of` or `moe_fsdp_units` holds experts (sharded over dp)."""
    return unit == "experts" or unit.endswith(".experts")


def moe_units_of(names: list[str]) -> dict[str, list[str]]:
    """ZeRO-3's units of a MoE stage: `units_of` over the dense weights (wte alone, the rest), and
    the stage's experts as one more unit."""
    experts = [n for n in names if is_expert(n)]
    return units_of([n for n in names if not is_expert(n)]) | ({"experts": experts} if experts else {})


def moe_fsdp_units(names: list[str]) -> dict[str, list[str]]:
    """`fsdp_units` with each MoE block split in two: "h.3" its dense weights (router included),
    "h.3.experts" its experts on this rank."""
    out = {}
    for unit, members in fsdp_units(names).items():
        dense = [n for n in members if not is_expert(n)]
        experts = [n for n in members if is_expert(n)]
        out |= ({unit: dense} if dense else {}) | ({f"{unit}.experts": experts} if experts else {})
    return out
