"""`refpar check DUMP_DIR [--json]`: is a user's parallel run computing GPT-2's numbers?

    refpar check ./dump

DUMP_DIR holds `layout.json` and one `rank{r}.npz` per rank (loaded with allow_pickle=False; a
`rank{r}.safetensors` is read instead when the safetensors package is installed). Keys of a rank:
`tokens`, `targets` (int), `loss` (0-d), `weights.<name>` and `grads.<name>` (GPT-2 state-dict
names, Conv1D layout weight[in, out]), `weights.@<group>`/`grads.@<group>` (a ZeRO flat piece),
and optionally `masks.<layer>.<site>` (the dropout keep masks the run applied). layout.json:

    {"model": {"vocab_size": 96, "n_positions": 32, "n_embd": 32, "n_head": 4, "n_layer": 2,
               "dropout": 0.0},
     "ranks": 2, "axis": "tp",            # the one mesh axis the ranks lie on (tp, dp or sp)
     "inputs": "replicate",               # or "batch": rank r holds the next rows of the batch
     "seed": 1234, "step": 0,             # refpar's dropout keys, with dropout > 0
     "tensors": {"h.0.mlp.c_fc.weight": {"split": "column"},      # last axis split over ranks
                 "h.0.mlp.c_proj.weight": {"split": "row"},       # first axis split
                 "h.0.attn.c_attn.weight": {"split": "column", "qkv": "interleaved"}},
     "flat": {"root": ["wte.weight", "wpe.weight"]}}  # ZeRO: the group's concatenation, in order,
                                                      # split into contiguous pieces by rank

Absent tensors are replicated. "qkv": "interleaved" means rank r's piece of c_attn is
[q_r, k_r, v_r] (each rank's heads), not a contiguous slice of q|k|v.

The weights are reassembled, the step is recomputed in float64 with refpar.model.gpt and each
gradient and the loss get: max abs and rel difference, ULP distance in the dump's dtype, and a
verdict: exact (bitwise), noise (within reduction-order noise for the dtype, NOISE), or mismatch.
A mismatch is explained by re-running the reference under each common bug and naming the one
under which the user's numbers agree: vocabulary padding left in the softmax, a fused QKV copied in
GPT-2's order into Megatron-Core's per-head layout, gradients clipped by their global norm
(DeepSpeed's default), the loss normalised per rank instead of by the global token count,
sequence-parallel LayerNorm gradients not all-reduced over the ranks, a different dropout RNG.

Reading and checking a dump before any of this: refpar/commands/check_dump.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from refpar.commands.check_dump import CheckError, Dump, load, shapes_of
from refpar.config import ModelConfig
from refpar.conformance import megatron_layout
from refpar.model.dropout import keep_mask
from refpar.model.gpt import DropoutContext, loss_and_grads, param_shapes

HELP = "Check a dump of a parallel run (per rank .npz + layout.json) against refpar's GPT-2."
# Relative differences that summation in another order can produce after one step, per dtype:
# float64 the project's tolerance (DESIGN.md); float32 about 1e3 epsilons (sums of ~1e3 terms).
NOISE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-1}


# ---------------------------------------------------------------------------------- reassembly
def _uninterleave(w, n: int, axis: int):
    """[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] along `axis` -> [q | k | v]."""
    pieces = np.split(w, 3 * n, axis=axis)
    return np.concatenate([pieces[3 * r + j] for j in range(3) for r in range(n)], axis=axis)


def reassemble(dump: Dump, kind: str) -> tuple[dict, dict]:
    """({name: whole array}, {name: [each rank's copy]} for replicated names) of weights or grads."""
    lay, n = dump.layout, len(dump.ranks)
    whole, copies = {}, {}
    for group, names in lay.get("flat", {}).items():
        key = f"{kind}.@{group}"
        held = [key in arrays for arrays in dump.ranks]
        if not any(held):  # e.g. ZeRO-2: gradients flat, weights whole
            continue
        if not all(held):
            raise CheckError(f"{key} is on some ranks but not on rank {held.index(False)}")
        flat = np.concatenate([np.ravel(arrays[key]) for arrays in dump.ranks])
        shapes = shapes_of(dump.config, names)
        sizes = [int(np.prod(s)) for s in shapes]
        if sum(sizes) != flat.size:
            raise CheckError(f"flat group {group!r} holds {flat.size} elements; its names need {sum(sizes)}")
        for name, shape, piece in zip(names, shapes, np.split(flat, np.cumsum(sizes)[:-1]), strict=True):
            whole[name] = piece.reshape(shape)
    prefix = f"{kind}."
    names = [k[len(prefix):] for k in dump.ranks[0]
             if k.startswith(prefix) and not k.startswith(prefix + "@")]
    for name in names:
        if any(prefix + name not in arrays for arrays in dump.ranks):
            raise CheckError(f"{prefix + name} is on rank 0 but not on every rank")
        parts = [arrays[prefix + name] for arrays in dump.ranks]
        spec = lay.get("tensors", {}).get(name, {})
        split = spec.get("split", "replicate")
        if split == "replicate":
            if any(q.shape != parts[0].shape for q in parts):
                raise CheckError(f"{prefix + name} is replicated but its shape differs over the ranks: "
                                 f"{', '.join(str(q.shape) for q in parts)}")
            whole[name], copies[name] = parts[0], parts
            continue
        axis = -1 if split == "column" else 0
        try:
            w = np.concatenate(parts, axis=axis)
            whole[name] = _uninterleave(w, n, axis) if spec.get("qkv") == "interleaved" else w
        except ValueError as err:
            what = "join" if spec.get("qkv") != "interleaved" else "join into q, k and v pieces"
            raise CheckError(f"{prefix + name}'s pieces do not {what} along the {split} axis") from err
    return whole, copies


def inputs(dump: Dump) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(tokens, targets) of the whole batch, and each rank's row counts as index arrays."""
    how = dump.layout.get("inputs", "replicate")
    tok = [np.asarray(a["tokens"]) for a in dump.ranks]
    tgt = [np.asarray(a["targets"]) for a in dump.ranks]
    if how == "replicate":
        return tok[0], tgt[0], [np.arange(tok[0].shape[0])]
    bounds = np.cumsum([0] + [t.shape[0] for t in tok])
    rows = [np.arange(bounds[r], bounds[r + 1]) for r in range(len(tok))]
    return np.concatenate(tok), np.concatenate(tgt), rows


# --------------------------------------------------------------------------------- comparisons
def ulp_distance(got, want) -> int:
    """Largest count of representable values of got's dtype between got and want (cast to it)."""
    dtype = np.asarray(got).dtype
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]

    def ordered(a):  # sign-magnitude bits -> integers in the order of the values (-0 == +0)
        i = np.asarray(a, dtype).view(ints).astype(np.int64)
        return np.where(i < 0, np.iinfo(ints).min - i, i)

    if not np.size(got):
        return 0
    a, b = ordered(got), ordered(want)
    # Same sign: the difference fits in int64. Across zero it can pass 2**63: add magnitudes as uint64.
    same = np.abs(a - np.where((a >= 0) == (b >= 0), b, 0)).astype(np.uint64)
    across = np.abs(a).astype(np.uint64) + np.abs(b).astype(np.uint64)
    return int(np.max(np.where((a >= 0) == (b >= 0), same, across)))


def measure(got, want, dtype: str) -> dict:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got64.shape != want64.shape:
        return {"max_abs": None, "max_rel": None, "ulp": None, "verdict": "mismatch",
                "shape": f"{got64.shape} against {want64.shape}"}
    abs_diff = float(np.max(np.abs(got64 - want64))) if got64.size else 0.0
    rel = abs_diff / max(float(np.max(np.abs(want64))) if want64.size else 0.0, 1e-300)
    ulp = ulp_distance(np.asarray(got), want64)
    verdict = "exact" if ulp == 0 else "noise" if rel <= NOISE.get(dtype, 1e-4) else "mismatch"
    return {"max_abs": abs_diff, "max_rel": rel, "ulp": ulp, "verdict": verdict}


class GivenMasks(DropoutContext):
    """Dropout with the keep masks a dump applied, instead of refpar's keyed ones."""

    def __init__(self, masks: dict, base: DropoutContext):
        super().__init__(base.seed, base.step, base.sample_ids, base.p, base.training)
        object.__setattr__(self, "masks", masks)

    def keep(self, layer, site, shape, like, index=None):
        mask = self.masks.get((layer, site))
        return super().keep(layer, site, shape, like, index) if mask is None else mask


def site_shape(site: str, config: ModelConfig, T: int) -> tuple[int, ...]:
    """One sample's dropout mask at `site` (refpar/model/dropout.py)."""
    return (config.n_head, T, T) if site == "attn" else (T, config.n_embd)


def dump_masks(dump: Dump, tokens) -> dict:
    """{(layer, site): the keep mask of the whole batch}, each (B, *site_shape)."""
    out = {}
    for key in dump.ranks[0]:
        if key.startswith("masks."):
            _, layer, site = key.split(".", 2)
            parts = [a.get(key) for a in dump.ranks]
            batch = dump.layout.get("inputs", "replicate") == "batch"
            want = (tokens.shape[0], *site_shape(site, dump.config, tokens.shape[1]))
            if batch and any(q is None or q.shape[1:] != want[1:] for q in parts):
                raise CheckError(f"{key} must be on every rank, each shaped (its rows, "
                                 f"{', '.join(map(str, want[1:]))})")
            mask = np.concatenate(parts) if batch else parts[0]
            if mask.shape != want:
                raise CheckError(f"{key} has shape {mask.shape}; the batch's keep mask there is {want}")
            out[(int(layer), site)] = mask
    return out


def reference(config, params, tokens, targets, layout, normalizer=None, masks=None):
    """refpar's loss and gradients (float64) for these weights and rows; with `masks`, the dump's
    own dropout masks instead of refpar's keyed ones."""
    ids = tuple(range(tokens.shape[0]))
    drop = DropoutContext(layout.get("seed", 0), layout.get("step", 0), ids, config.dropout)
    return loss_and_grads(params, tokens, targets, config, seed=drop.seed, step=drop.step,
                          normalizer=normalizer, drop=None if masks is None else GivenMasks(masks, drop))


# ------------------------------------------------------------------------------------- causes
CAUSES = {
    "vocab-padding": "vocabulary padding: wte has {vp} rows for a vocabulary of {v}, and the padded "
                     "rows' logits enter the softmax; mask them to -inf or slice the logits to {v}",
    "per-rank-loss": "the loss is normalised per rank (each rank's mean over its own tokens, then "
                     "averaged) instead of by the global token count; ranks hold unequal shares",
    "sp-layernorm": "sequence-parallel LayerNorm gradients are not all-reduced over the {n} ranks: "
                    "each rank holds only its sequence shard's part, whose sum is the reference",
    "dropout-rng": "a different dropout RNG: {what}; refpar keys masks by (seed, step, layer, site, "
                   "sample); with dropout 0 or refpar's masks the run would agree",
    "qkv-layout": "fused QKV in the wrong layout: the run computes with c_attn copied in GPT-2's "
                  "[q | k | v] order into a layout of [q_h k_h v_h] per head (Megatron-Core's "
                  "linear_qkv); reorder its rows (refpar/conformance/megatron_layout.py, qkv_order)",
    "clipped": "the gradients are the reference's times {s:.6g}: clipped by their global norm, "
               "{norm:.6g} -> {to:.6g} (DeepSpeed clips to 1.0 unless gradient_clipping is 0.0); "
               "turn clipping off for the dump, or compare with a reference clipped alike",
}


def _agrees(got, want, dtype) -> bool:
    return measure(got, want, dtype)["verdict"] != "mismatch"


def explain(dump: Dump, params, grads, loss, tokens, targets, rows) -> dict:
    """{tensor name or "loss": cause} for the mismatches one common bug accounts for."""
    cfg, lay, dtype = dump.config, dump.layout, dump.dtype
    out = {}

    def claim(ref_loss, ref_grads, text):  # ref_loss None: the cause leaves the loss alone
        if "loss" not in out and ref_loss is not None and _agrees(loss, ref_loss, dtype):
            out["loss"] = text
        for name, g in grads.items():
            if name not in out and name in ref_grads and _agrees(g, ref_grads[name], dtype):
                out[name] = text

    vp = params["wte.weight"].shape[0]
    if vp > cfg.vocab_size:
        padded = replace(cfg, vocab_size=vp)
        ref_loss, ref_grads = reference(padded, params, tokens, targets, lay)
        claim(ref_loss, ref_grads, CAUSES["vocab-padding"].format(vp=vp, v=cfg.vocab_size))
    stripped = _strip(params, cfg)
    if cfg.n_head > 1:  # a fused QKV copied in GPT-2's order into a per-head layout
        wrong = megatron_layout.wrong_qkv_model(stripped, cfg.n_embd, cfg.head_size)
        ref_loss, ref_grads = reference(cfg, wrong, tokens, targets, lay)
        claim(ref_loss, ref_grads, CAUSES["qkv-layout"])
    ref_loss, ref_grads = reference(cfg, stripped, tokens, targets, lay)
    common = [k for k in grads if k in ref_grads and np.shape(grads[k]) == np.shape(ref_grads[k])]
    if common:  # every gradient the reference's times one s < 1: clipping by the global norm
        dot = sum(float(np.vdot(np.asarray(grads[k], np.float64), ref_grads[k])) for k in common)
        sq = sum(float(np.vdot(ref_grads[k], ref_grads[k])) for k in common)
        s = dot / sq if sq > 0 else 1.0
        if 0 < s < 1 - NOISE.get(dtype, 1e-4):
            norm = float(np.sqrt(sum(float(np.vdot(v, v)) for v in ref_grads.values())))
            claim(None, {k: s * ref_grads[k] for k in common},
                  CAUSES["clipped"].format(s=s, norm=norm, to=s * norm))
    if len(rows) > 1 and len({r.size for r in rows}) > 1:
        per_rank = [reference(cfg, _strip(params, cfg), tokens[r], targets[r], lay) for r in rows]
        ref_loss = sum(x[0] for x in per_rank) / len(rows)
        ref_grads = {k: sum(x[1][k] for x in per_rank) / len(rows) for k in per_rank[0][1]}
        claim(ref_loss, ref_grads, CAUSES["per-rank-loss"])
    if cfg.dropout > 0:
        masks = dump_masks(dump, tokens)
        if masks:
            ids = tuple(range(tokens.shape[0]))
            differ = [float(np.mean(m != keep_mask(lay.get("seed", 0), lay.get("step", 0), layer, site, ids,
                                                   m.shape[1:], cfg.dropout)))
                      for (layer, site), m in masks.items()]
            ref_loss, ref_grads = reference(cfg, _strip(params, cfg), tokens, targets, lay, masks=masks)
            what = f"its masks differ from refpar's in {100 * max(differ):.0f}% of entries"
            claim(ref_loss, ref_grads, CAUSES["dropout-rng"].format(what=what))
        else:
            text = CAUSES["dropout-rng"].format(what=f"dropout is {cfg.dropout} and the dump has no "
                                                     "masks.<layer>.<site> to compare (likely)")
            out.setdefault("loss", text)
            out.update({k: text for k in grads if k not in out})
    return out


def _strip(params, cfg):
    """The parameters with wte cut to the vocabulary (padding rows dropped)."""
    return {**params, "wte.weight": params["wte.weight"][:cfg.vocab_size]}


def sp_layernorm_causes(dump: Dump, copies, ref_grads) -> dict:
    """Replicated LayerNorm gradients that differ over ranks but sum to the reference."""
    out = {}
    for name, parts in copies.items():
        if ".ln_" not in f".{name}" or name not in ref_grads:
            continue
        same = all(np.array_equal(parts[0], q) for q in parts[1:])
        if same or not all(np.isfinite(q).all() for q in parts):
            continue  # the same on every rank, or NaN/inf that no missing all-reduce explains
        if _agrees(sum(np.asarray(q, np.float64) for q in parts), ref_grads[name], dump.dtype):
            out[name] = CAUSES["sp-layernorm"].format(n=len(parts))
    return out


# ------------------------------------------------------------------------------------- the run
def check(directory: str) -> dict:
    dump = load(directory)
    cfg, lay, dtype = dump.config, dump.layout, dump.dtype
    params, _ = reassemble(dump, "weights")
    grads, copies = reassemble(dump, "grads")
    missing = [k for k in param_shapes(cfg) if k not in params]
    if missing:
        raise CheckError(f"the dump has no weights for {missing[0]} (and {len(missing) - 1} more)")
    for name, shape in param_shapes(cfg).items():
        got = params[name].shape
        padded = name == "wte.weight" and len(got) == 2 and got[0] >= shape[0] and got[1] == shape[1]
        if got != shape and not padded:
            raise CheckError(f"weights.{name} has shape {got}, but in this GPT-2 it is {shape}; check the "
                             "model in layout.json and the tensor's split")
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    tokens, targets, rows = inputs(dump)
    losses = [float(a["loss"]) for a in dump.ranks]
    # Python floats: one rank's inf loss beside another's -inf is a NaN mismatch, not a NumPy warning
    loss = losses[0] if lay.get("inputs", "replicate") == "replicate" else sum(losses) / len(losses)
    ref_loss, ref_grads = reference(cfg, _strip(params, cfg), tokens, targets, lay)

    results = {"loss": measure(np.asarray(loss, dtype), ref_loss, dtype)}
    for name, g in grads.items():  # every name is a parameter's (load checked them)
        want = ref_grads[name]
        if name == "wte.weight" and g.ndim == 2 and g.shape[0] > want.shape[0]:  # padded rows: the real ones
            g = g[:want.shape[0]]
        results[name] = measure(g, want, dtype)
    if any(r["verdict"] == "mismatch" for r in results.values()):
        causes = sp_layernorm_causes(dump, copies, ref_grads)
        causes.update({k: v for k, v in explain(dump, params, grads, loss, tokens, targets,
                                                 rows).items() if k not in causes})
        for name, r in results.items():
            if r["verdict"] == "mismatch":
                r["cause"] = causes.get(name, "unexplained: none of the common causes accounts for it")
    return {"dtype": dtype, "ranks": len(dump.ranks), "tensors": results,
            "ok": all(r["verdict"] != "mismatch" for r in results.values())}


def add_arguments(parser) -> None:
    parser.add_argument("dump", help="directory with layout.json and rank0.npz, rank1.npz, ...")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")


def run(args) -> int:
    report = check(args.dump)
    if args.json:
        print(json.dumps(report), flush=True)
        return 0 if report["ok"] else 1
    print(f"{'tensor':<28} {'max abs':>10} {'max rel':>10} {'ULP':>8}  verdict   ({report['dtype']}, "
          f"{report['ranks']} ranks)")
    for name, r in report["tensors"].items():
        if r["max_abs"] is None:
            print(f"{name:<28} {'shape':>10} {r['shape']}")
        else:
            print(f"{name:<28} {r['max_abs']:10.2e} {r['max_rel']:10.2e} {r['ulp']:8d}  {r['verdict']}")
        if "cause" in r:
            print(f"    cause: {r['cause']}")
    print("every tensor agrees" if report["ok"] else "MISMATCH", flush=True)
    return 0 if report["ok"] else 1
