"""Which parameters a rank holds: its pipeline stages' names, its tp slices, the sequence-parallel
region's names and the units ZeRO and FSDP shard. Facts of the configuration only (no arrays, no
communication), so the runtime (refpar/parallel, refpar/engine) and the closed forms
(refpar/analysis) read the same definitions without importing each other.

Both families (refpar.model: GPT-2's names `h.{i}.`, `wte`, `wpe`, `ln_f`; Llama's Hugging Face
names `model.layers.{i}.`, `model.embed_tokens`, `model.norm`, `lm_head`) go through the same
functions: `block_of` says which block a name is in, `tied_embedding` which (V, C) matrix both ends
read. Unit keys are refpar's own and the same for both (`wte` the tied embedding, `root`, `h.i`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refpar.config import ConfigError, ModelConfig
from refpar.model import param_shapes
from refpar.sharding import shard_range


def stage_layers(n_layer: int, n_stages: int, stage: int) -> range:
    """The global indices of the blocks stage `stage` holds."""
    if n_layer < n_stages:
        raise ConfigError(f"{n_stages} pipeline stages need at least {n_stages} blocks, the model "
                          f"has n_layer={n_layer}; use fewer stages (or chunks) or more layers")
    return range(*shard_range(n_layer, n_stages, stage))


@dataclass(frozen=True)
class Names:
    """What holdings asks of one family's parameter names (refpar.model's state-dict keys)."""

    title: str  # the family as the header names it
    block_prefix: str  # a block's names start with this and "{i}."
    embedding: str  # the (V, C) token embedding
    positions: tuple[str, ...]  # read by the embedding only (GPT-2's learned positions)
    final_norm: tuple[str, ...]
    untied_head: str | None  # the head's own (V, C) matrix where it is not tied; None: always tied
    expert_marker: str  # an expert's names hold this then "{e}."
    tp_slices: Callable  # (config, t, rank) -> {name: (axis, global indices)}
    sp_names: Callable  # config -> the replicated parameters of the sequence-parallel region
    # A block's names after its prefix and "{i}.": the row-parallel linears, whose partial outputs tp
    # sums, and the weights the sharding view draws (refpar/viz/sharding.py), one of each tp layout.
    row_parallel: tuple[str, ...] = ()
    drawn: tuple[str, ...] = ()


def _gpt2_tp_slices(config: ModelConfig, t: int, rank: int) -> dict[str, tuple[int, np.ndarray]]:
    """GPT-2's table (refpar/parallel/gpt2_pieces.py), weights in its Conv1D [in, out] layout."""
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


def _gpt2_sp_names(config: ModelConfig) -> list[str]:
    names = ["wpe.weight", "ln_f.weight", "ln_f.bias"]
    for i in range(config.n_layer):
        names += [f"h.{i}.{n}" for n in ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias",
                                          "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")]
    return names


def _llama_tp_slices(config: ModelConfig, t: int, rank: int) -> dict[str, tuple[int, np.ndarray]]:
    """Llama's table (refpar/parallel/llama_pieces.py), weights in HF's [out, in] layout."""
    hs, F = config.head_size, config.intermediate_size
    h0, h1 = shard_range(config.n_head, t, rank)
    k0, k1 = kv_heads(config, t, rank)
    heads, kv = np.arange(h0 * hs, h1 * hs), np.arange(k0 * hs, k1 * hs)
    ff = np.arange(*shard_range(F, t, rank))
    vocab = (0, np.arange(*shard_range(config.vocab_size, t, rank)))
    slices = {"model.embed_tokens.weight": vocab}
    if not config.tie_embeddings:
        slices["lm_head.weight"] = vocab
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        slices |= {p + "self_attn.q_proj.weight": (0, heads), p + "self_attn.k_proj.weight": (0, kv),
                   p + "self_attn.v_proj.weight": (0, kv), p + "self_attn.o_proj.weight": (1, heads),
                   p + "mlp.gate_proj.weight": (0, ff), p + "mlp.up_proj.weight": (0, ff),
                   p + "mlp.down_proj.weight": (1, ff)}
    return slices


def _llama_sp_names(config: ModelConfig) -> list[str]:
    """Its RMSNorm gains (no biases, no position table)."""
    return ["model.norm.weight"] + [f"model.layers.{i}.{n}_layernorm.weight"
                                    for i in range(config.n_layer) for n in ("input", "post_attention")]


def _deepseek_tp_slices(config: ModelConfig, t: int, rank: int) -> dict[str, tuple[int, np.ndarray]]:
    """DeepSeek-V3's table (refpar/parallel/mla_tensor_parallel.py, deepseek_pieces.py), HF's [out,
    in] layout: the up-projections' rows and o_proj's columns of this rank's heads (the down-
    projections and norms whole), the dense MLPs as Llama's, each routed expert's SwiGLU split the
    same way over its own width (expert_tensor_parallel.py; the router and shared experts whole)."""
    dn, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    h0, h1 = shard_range(config.n_head, t, rank)
    ff = np.arange(*shard_range(config.intermediate_size, t, rank))
    vocab = (0, np.arange(*shard_range(config.vocab_size, t, rank)))
    slices = {"model.embed_tokens.weight": vocab}
    if not config.tie_embeddings:
        slices["lm_head.weight"] = vocab
    q = "q_proj" if config.q_lora_rank is None else "q_b_proj"
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        slices |= {p + f"self_attn.{q}.weight": (0, np.arange(h0 * (dn + dr), h1 * (dn + dr))),
                   p + "self_attn.kv_b_proj.weight": (0, np.arange(h0 * (dn + dv), h1 * (dn + dv))),
                   p + "self_attn.o_proj.weight": (1, np.arange(h0 * dv, h1 * dv))}
        if i in config.moe_blocks:
            H = np.arange(*shard_range(config.moe_intermediate_size, t, rank))
            mlps = [(f"{p}mlp.experts.{e}.", H) for e in range(config.moe_experts)]
        else:
            mlps = [(p + "mlp.", ff)]
        for m, cols in mlps:
            slices |= {m + "gate_proj.weight": (0, cols), m + "up_proj.weight": (0, cols),
                       m + "down_proj.weight": (1, cols)}
    return slices


def _deepseek_sp_names(config: ModelConfig) -> list[str]:
    """Llama's RMSNorm gains, and latent attention's down-projections and their norms, which run on
    the sequence shard (refpar/parallel/mla_tensor_parallel.py)."""
    down = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"]
    if config.q_lora_rank is not None:
        down = ["q_a_proj.weight", "q_a_layernorm.weight", *down]
    return _llama_sp_names(config) + [f"model.layers.{i}.self_attn.{n}" for i in range(config.n_layer)
                                      for n in down]


FAMILIES = {
    "gpt2": Names("GPT-2", "h.", "wte.weight", ("wpe.weight",), ("ln_f.weight", "ln_f.bias"), None,
                  ".mlp.experts.", _gpt2_tp_slices, _gpt2_sp_names,
                  row_parallel=("attn.c_proj", "mlp.c_proj"),
                  drawn=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")),
    "llama": Names("Llama", "model.layers.", "model.embed_tokens.weight", (), ("model.norm.weight",),
                   "lm_head.weight", ".block_sparse_moe.experts.", _llama_tp_slices, _llama_sp_names,
                   row_parallel=("self_attn.o_proj", "mlp.down_proj"),
                   # v_proj is laid out as k_proj, up_proj as gate_proj
                   drawn=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight",
                          "mlp.down_proj.weight")),
    # DeepSeek-V3's names are Llama's outside the blocks
    "deepseek-v3": Names("DeepSeek-V3", "model.layers.", "model.embed_tokens.weight", (),
                         ("model.norm.weight",), "lm_head.weight", ".mlp.experts.",
                         _deepseek_tp_slices, _deepseek_sp_names),
}


def names(config: ModelConfig) -> Names:
    return FAMILIES[config.arch]


def block_of(name: str) -> int | None:
    """The index of the block parameter `name` belongs to (any family), None outside the blocks."""
    for fam in FAMILIES.values():
        if name.startswith(fam.block_prefix):
            return int(name[len(fam.block_prefix):name.index(".", len(fam.block_prefix))])
    return None


def tied_embedding(config: ModelConfig) -> str | None:
    """The embedding the head also reads, which the first and the last stage hold alike (their
    gradients sum over the embedding group): GPT-2's wte; Llama's embed_tokens if tie_embeddings."""
    fam = names(config)
    return fam.embedding if fam.untied_head is None or config.tie_embeddings else None


def embed_param_names(config: ModelConfig) -> tuple[str, ...]:
    """The parameters whose gradients the embedding's backward returns."""
    return (names(config).embedding, *names(config).positions)


def head_param_names(config: ModelConfig) -> tuple[str, ...]:
    """The parameters whose gradients the head's backward returns: the (V, C) matrix and the final norm."""
    return (tied_embedding(config) or names(config).untied_head, *names(config).final_norm)


def stage_param_names(config: ModelConfig, n_stages: int, stage: int) -> list[str]:
    """The parameters stage `stage` reads, in the family's order (every expert of its MoE blocks):
    its blocks'; the embedding's on the first stage, the final norm's and the head's on the last
    (the tied embedding on both)."""
    keep = set(stage_layers(config.n_layer, n_stages, stage))
    first, last = stage == 0, stage == n_stages - 1
    tied = tied_embedding(config)
    names = []
    for name in param_shapes(config):
        block = block_of(name)
        if block is not None:
            wanted = block in keep
        elif name == tied:
            wanted = first or last
        elif name in embed_param_names(config):
            wanted = first
        else:  # the final norm, Llama's untied lm_head
            wanted = last
        if wanted:
            names.append(name)
    return names


def stage_names(config: ModelConfig, lay, stage: int) -> list[str]:
    """The parameters stage `stage` of a schedule with stage map `lay` (schedules.StageMap) reads: those
    of its part of the model (DualPipe's two copies hold the same parts)."""
    return stage_param_names(config, lay.stages_per_copy, lay.part(stage))


def held_param_names(config: ModelConfig, n_stages: int, stages, ep: int = 1, ep_rank: int = 0) -> list[str]:
    """The parameters a rank holds, in the family's order: those of its pipeline stages `stages` (of
    `n_stages`), of a MoE block's experts only its ep rank's `shard_range` of them."""
    names = {n for s in stages for n in stage_param_names(config, n_stages, s)}
    return [n for n in param_shapes(config) if n in names and held_expert(config, n, ep, ep_rank)]


def held_numels(config: ModelConfig, sizes: dict, coords: dict, chunks: int = 1) -> dict[str, int]:
    """Elements of each parameter the rank at mesh `coords` holds (`held_param_names` of its
    stages, chunk c holding stage c p + r), tp-sliced."""
    p = sizes["pp"]
    stages = [c * p + coords["pp"] for c in range(chunks)]
    slices = tp_param_slices(config, sizes["tp"], coords["tp"])
    shapes = param_shapes(config)
    out = {}
    for n in held_param_names(config, p * chunks, stages, sizes["ep"], coords["ep"]):
        axis, index = slices.get(n, (None, None))
        whole = math.prod(shapes[n])
        out[n] = whole if axis is None else whole // shapes[n][axis] * len(index)
    return out


def n_kv_heads(config: ModelConfig) -> int:
    """The model's kv heads: Llama's n_kv_head (grouped-query attention); GPT-2's are its query heads."""
    return config.n_kv_head or config.n_head


def kv_replicas(config: ModelConfig, t: int) -> int:
    """How many tp ranks hold each kv head: t / n_kv_head when t > n_kv_head (grouped-query
    attention with fewer kv heads than ranks replicates each), else 1 (GPT-2: 1)."""
    kv = n_kv_heads(config)
    return 1 if t <= kv else t // kv


def kv_heads_per_rank(config: ModelConfig, t: int) -> int:
    """How many kv heads each tp rank holds: n_kv_head / t, one when replicated; GPT-2's are its
    query heads, n_head / t."""
    return max(n_kv_heads(config) // t, 1)


def kv_heads(config: ModelConfig, t: int, rank: int) -> tuple[int, int]:
    """The kv heads [k0, k1) tp rank `rank` of `t` holds: its shard_range of them, or, replicated,
    the one its query heads read (query head h reads kv head h // (n_head / n_kv_head))."""
    b = kv_replicas(config, t)
    if b > 1:
        return rank // b, rank // b + 1
    return shard_range(n_kv_heads(config), t, rank)


def tp_param_slices(config: ModelConfig, t: int, rank: int) -> dict[str, tuple[int, np.ndarray]]:
    """Which slice of each full parameter tp rank `rank` of `t` holds: (axis, global indices);
    absent = replicated (the family's pieces split them so: refpar/parallel/pieces.py)."""
    return names(config).tp_slices(config, t, rank)


def sequence_parallel_param_names(config: ModelConfig) -> list[str]:
    """Replicated parameters applied in the sequence-sharded region (refpar/parallel/
    sequence_parallel.py): each tp rank computes their gradient from its sequence shard only."""
    return names(config).sp_names(config)


def microbatch_samples(model: ModelConfig, batch_size: int, m: int, sizes: dict, coords: dict,
                       j: int) -> range:
    """The global sample ids this rank runs in microbatch j of m. Dense: its dp rank's
    `shard_range` of the batch, then microbatch j's share of that. MoE (routing per microbatch, as
    Megatron-Core): the contiguous global slice shard_range(B, m, j), cut over the dp x ep data
    ranks in batch order, so that the data ranks' parts of microbatch j are the single device's
    microbatch j. cp ranks run the same rows (other positions)."""
    if not model.moe_experts:
        a, b = shard_range(batch_size, sizes["dp"], coords["dp"])
        lo, hi = shard_range(b - a, m, j)
        return range(a + lo, a + hi)
    a, b = shard_range(batch_size, m, j)
    lo, hi = shard_range(b - a, sizes["dp"] * sizes["ep"], coords["dp"] * sizes["ep"] + coords["ep"])
    return range(a + lo, a + hi)


def keeps_lowp(config: ModelConfig, sizes: dict) -> bool:
    """With --fp32-grads, whether the 16-bit gradients backward writes stay beside the fp32
    accumulator: on a data-parallel-only mesh, as DeepSpeed's BF16_Optimizer keeps each .grad (the
    Ultra-Scale Playbook's 20 bytes per parameter); on every other mesh each backward piece's
    16-bit gradients are added into the fp32 accumulator as they are handed over, as Megatron-LM's
    main_grad (18)."""
    return not config.moe_experts and all(n == 1 for a, n in sizes.items() if a != "dp")


def is_expert(name: str) -> bool:
    return any(fam.expert_marker in name for fam in FAMILIES.values())


def expert_of(name: str) -> int | None:
    """The expert a parameter belongs to (either family), None outside the experts."""
    for marker in (fam.expert_marker for fam in FAMILIES.values()):
        if marker in name:
            rest = name[name.index(marker) + len(marker):]
            return int(rest[:rest.index(".")])
    return None


def held_expert(config: ModelConfig, name: str, ep: int, ep_rank: int) -> bool:
    """Whether ep rank `ep_rank` of `ep` holds parameter `name`: every non-expert one, and of the
    experts its `shard_range` of them."""
    return not is_expert(name) or expert_of(name) in range(*shard_range(config.moe_experts, ep, ep_rank))


ENDS = ("wte", "root")  # the units the embedding and the head read


def units(names: list[str], tied: str | None = "wte.weight") -> dict[str, list[str]]:
    """The units of a pipeline stage holding `names` (in the family's order): what ZeRO and FSDP
    shard, gather and reduce one at a time, and DP's gradient buckets wait for. `wte` alone (the
    tied embedding, GPT-2's wte or a tied Llama's embed_tokens: the first and the last stage shard
    it alike, so its gradient sums shard by shard), `root` the stage's other parameters outside the
    blocks (wpe, or Llama's untied embed_tokens, on the first stage; the final norm and Llama's
    lm_head on the last), then per block `h.i` its dense parameters (the router included) and, in a
    MoE block, `h.i.experts` the experts of it this rank holds. `tied`: the model's
    `tied_embedding` (GPT-2's wte by default)."""
    out = {"wte": [tied]} if tied in names else {}
    root = [n for n in names if block_of(n) is None and n != tied]
    if root:
        out["root"] = root
    for n in names:
        block = block_of(n)
        if block is not None:
            out.setdefault(f"h.{block}" + (".experts" if is_expert(n) else ""), []).append(n)
    return {u: out[u] for u in sorted(out, key=unit_order)}


def unit_order(unit: str) -> tuple:
    """wte, root, then the blocks in order, each block's experts after its dense unit."""
    if not unit.startswith("h."):
        return (ENDS.index(unit),)
    return (2, int(unit.split(".")[1]), unit.endswith(".experts"))


def expert_unit(unit: str) -> bool:
    return unit.endswith(".experts")


def buckets(params: list[tuple[str, int, object]], bucket_elems: int) -> list[tuple[int, int, frozenset]]:
    """DP's gradient buckets over a rank's flat buffer of `params` ((unit, elements, replica group)
    of each parameter, in layout order), in the order backward completes them: [start, stop) and
    the units a bucket touches. Whole parameters taken from the end of each group's run, a bucket
    closed when the next parameter would exceed `bucket_elems` (a bucket holds at least one)."""
    out, members, group = [], set(), None
    start = stop = sum(n for _, n, _ in params)  # the bucket [start, stop) grows backwards
    for unit, n, g in reversed(params):
        if start < stop and (stop - start + n > bucket_elems or g != group):
            out.append((start, stop, frozenset(members)))
            stop, members = start, set()
        start, group = start - n, g
        members.add(unit)
    if start < stop:
        out.append((start, stop, frozenset(members)))
    return out


def rank_units(by_stage: dict[int, dict[str, list[str]]]) -> dict[str, list[str]]:
    """A rank's units end to end, as its flat buffers lay them out (`by_stage`: each stage's
    `units`): the dense units first, then the experts', each in stage order; a unit two stages hold
    (the tied wte) once. Unit -> its parameters."""
    ordered = [u for us in by_stage.values() for u in us]
    ordered = [u for u in ordered if not expert_unit(u)] + [u for u in ordered if expert_unit(u)]
    # a unit two stages hold has each stage's parameters (in stage order): a V's rank 0 holds wpe
    # (stage 0) and ln_f (stage 2p-1) as one root; the tied wte, and DualPipe's copies, the same ones
    return {u: list(dict.fromkeys(n for us in by_stage.values() for n in us.get(u, ())))
            for u in dict.fromkeys(ordered)}
