"""Fuzzed dumps for `refpar check DUMP_DIR` (refpar/commands/check.py): a dump broken in any way a
crashed or foreign run leaves one (a truncated or empty .npz, a missing rank or key, wrong shapes
and dtypes, NaN and inf, a missing or malformed layout.json, a directory where a file goes, a file
where the directory goes) gets a report (exit 0 or 1: the numbers agree or not) or one sentence and
exit 2, never a traceback and never a warning on stderr.

Each case starts from a correct dump that refpar's own model writes (one float64 step of a 1-block
GPT-2, checked below to agree exactly), over 2 ranks in one of two layouts: tensor-parallel pieces
(column, row, fused QKV interleaved per rank) with replicated inputs, or data-parallel batch rows
with the embeddings as ZeRO flat pieces. Then one to four breakages are drawn and applied.
Sentences are judged as in tests/test_fuzz_cli.py; its docstring says what one sentence is and
why the examples are derandomized.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refpar.commands.check import check
from refpar.config import ModelConfig
from refpar.model.gpt import init_params, loss_and_grads
from tests.fuzz import run_as_rank
from tests.test_fuzz_cli import fuzz_settings, judge

MODEL = {"vocab_size": 16, "n_positions": 8, "n_embd": 8, "n_head": 2, "n_layer": 1, "dropout": 0.0}
RANKS = 2
COLUMN = ("h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias")
ROW = ("h.0.attn.c_proj.weight", "h.0.mlp.c_proj.weight")
FLAT = ("wte.weight", "wpe.weight")
ODD = (None, -1, 0, 3, 2.5, "x", "", [], {}, True, 1e308, "nan", [1, 2], {"split": "diagonal"})


def _pieces(name: str, w: np.ndarray) -> list[np.ndarray]:
    """Rank r's piece of a tensor-parallel weight: columns (rank r's heads of q, k and v, side by
    side, for the fused c_attn) or rows."""
    if name in ROW:
        return np.split(w, RANKS, axis=0)
    if "c_attn" in name:
        q, k, v = (np.split(part, RANKS, axis=-1) for part in np.split(w, 3, axis=-1))
        return [np.concatenate([q[r], k[r], v[r]], axis=-1) for r in range(RANKS)]
    return np.split(w, RANKS, axis=-1)


def correct_dump(root: Path, kind: str) -> Path:
    """One step of refpar's GPT-2 written as `refpar check` reads it (module docstring)."""
    config = ModelConfig(**MODEL)
    params = init_params(config, 3)
    gen = np.random.default_rng(5)
    tokens = gen.integers(0, MODEL["vocab_size"], (4, MODEL["n_positions"]))  # (B, T)
    targets = gen.integers(0, MODEL["vocab_size"], (4, MODEL["n_positions"]))  # (B, T)
    loss, grads = loss_and_grads(params, tokens, targets, config)
    ranks = [{} for _ in range(RANKS)]
    if kind == "tp":
        layout = {"model": MODEL, "ranks": RANKS, "axis": "tp", "inputs": "replicate",
                  "tensors": {n: {"split": "column" if n in COLUMN else "row",
                                  **({"qkv": "interleaved"} if "c_attn" in n else {})}
                              for n in (*COLUMN, *ROW)}}
        for r, arrays in enumerate(ranks):
            arrays.update(tokens=tokens, targets=targets, loss=np.asarray(loss))
            for prefix, tensors in (("weights", params), ("grads", grads)):
                for n, w in tensors.items():
                    arrays[f"{prefix}.{n}"] = _pieces(n, w)[r] if n in COLUMN + ROW else w
    else:  # dp: rank r holds rows 2r, 2r + 1 and a contiguous piece of the flat embeddings
        layout = {"model": MODEL, "ranks": RANKS, "axis": "dp", "inputs": "batch",
                  "flat": {"embeddings": list(FLAT)}}
        rows = np.split(np.arange(tokens.shape[0]), RANKS)
        for r, arrays in enumerate(ranks):
            own_loss, _ = loss_and_grads(params, tokens[rows[r]], targets[rows[r]], config)
            arrays.update(tokens=tokens[rows[r]], targets=targets[rows[r]], loss=np.asarray(own_loss))
            for prefix, tensors in (("weights", params), ("grads", grads)):
                flat = np.concatenate([np.ravel(tensors[n]) for n in FLAT])
                arrays[f"{prefix}.@embeddings"] = np.array_split(flat, RANKS)[r]
                arrays.update({f"{prefix}.{n}": w for n, w in tensors.items() if n not in FLAT})
    out = root / kind
    out.mkdir()
    (out / "layout.json").write_text(json.dumps(layout))
    for r, arrays in enumerate(ranks):
        np.savez(out / f"rank{r}.npz", **arrays)
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dumps")
    return {kind: correct_dump(root, kind) for kind in ("tp", "dp")}


def test_the_unbroken_dumps_agree_exactly(dumps):
    """The fuzz's starting points are right, so each refusal below is the breakage's doing."""
    for kind, path in dumps.items():
        report = check(str(path))
        assert report["ok"] and report["ranks"] == RANKS, (kind, report)
        # Every gradient bitwise: the same ops on the same weights. The dp loss is the mean of the
        # two ranks' means, summed in another order than one mean over the batch: a few ULPs.
        tensors = dict(report["tensors"])
        loss = tensors.pop("loss")
        assert all(r["verdict"] == "exact" for r in tensors.values()), (kind, report)
        assert loss["ulp"] <= (0 if kind == "tp" else 4), (kind, loss)


# ------------------------------------------------------------------------------ breakages
def _load(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# Every breakage draws the same values whatever the files hold (an index is taken modulo the
# keys there are), so that hypothesis replays a case exactly.
def pick(data, options):
    return data.draw(st.sampled_from(options))


def break_file(data, dump: Path) -> None:
    """A file of the dump damaged, missing or replaced by something else."""
    target = dump / pick(data, ["layout.json", "rank0.npz", "rank1.npz"])
    how = pick(data, ["truncate", "junk", "empty", "delete", "directory", "safetensors", "pickled"])
    keep, junk = data.draw(st.floats(0, 1, exclude_max=True)), data.draw(st.binary(max_size=64))
    if how == "truncate":
        raw = target.read_bytes()
        target.write_bytes(raw[:int(keep * len(raw))])
    elif how == "junk":
        target.write_bytes(junk)
    elif how == "empty":
        target.write_bytes(b"")
    elif how == "delete":
        target.unlink()
    elif how == "directory":
        target.unlink()
        target.mkdir()
    elif how == "safetensors":
        target.rename(target.with_suffix(".safetensors"))
    elif target.suffix == ".npz":  # pickled: an object array, which refpar never unpickles
        np.savez(target, **{**_load(target), "loss": np.array([object()], dtype=object)})


def break_layout(data, dump: Path) -> None:
    """layout.json valid JSON but wrong: a key gone, or an odd value where a key, a model field, a
    tensor's spec or a flat group should be."""
    path = dump / "layout.json"
    layout = json.loads(path.read_text())
    where, odd, drop = pick(data, ["top", "model", "tensors", "flat", "whole"]), pick(data, ODD), \
        data.draw(st.booleans())
    key = pick(data, ["model", "ranks", "axis", "inputs", "tensors", "flat", "seed", "step"])
    field = pick(data, [*MODEL, "layer_norm_eps", "n_inner"])
    name = pick(data, [*COLUMN, *ROW, "h.7.mlp.c_fc.weight"])
    group = pick(data, ["embeddings", "other"])
    names = pick(data, [odd, ["wte.weight"], ["wpe.weight", "wte.weight"], ["h.9.ln_1.weight"],
                        list(FLAT) * 2])
    if where == "whole":
        layout = odd
    elif where == "top" and drop:
        layout.pop(key, None)
    elif where == "top":
        layout[key] = odd
    elif where == "model":
        layout["model"] = {k: v for k, v in layout["model"].items() if k != field or not drop}
        if not drop:
            layout["model"][field] = odd
    elif where == "tensors":
        layout.setdefault("tensors", {})[name] = odd
    else:
        layout.setdefault("flat", {})[group] = names
    path.write_text(json.dumps(layout))


def break_array(data, dump: Path) -> None:
    """One array of one rank gone, reshaped, retyped, made non-finite or out of range, or an
    unexpected one added."""
    path = dump / f"rank{data.draw(st.integers(0, RANKS - 1))}.npz"
    index, how = data.draw(st.integers(0, 99)), pick(data, ["delete", "shape", "dtype", "nonfinite",
                                                           "range", "extra"])
    shape, dtype = data.draw(st.integers(0, 5)), pick(data, ["int32", "float16", "float32", "bool",
                                                            "complex128", "uint8", "<U3"])
    bad, factor = pick(data, [np.nan, np.inf, -np.inf]), pick(data, [-1, 1000, 10**15])
    extra = pick(data, ["grads.h.9.mlp.c_fc.weight", "weights.wte", "masks.0.attn", "masks.x",
                        "grads.@nowhere", "tokens2"])
    extra_value = data.draw(st.integers(0, 2))
    arrays = _load(path)
    key = sorted(arrays)[index % len(arrays)]
    a = arrays[key]
    if how in ("dtype", "nonfinite", "range") and a.dtype.kind not in "biuf":  # already retyped
        how = "delete"
    if how == "delete":
        del arrays[key]
    elif how == "shape":
        arrays[key] = [a.reshape(-1), a.reshape(-1)[:-1], a[..., None], np.zeros((0,) + a.shape[1:], a.dtype),
                       np.asarray(a.reshape(-1)[0] if a.size else 0), np.stack([a, a])][shape]
    elif how == "dtype":
        arrays[key] = a.astype(dtype)
    elif how == "nonfinite":
        arrays[key] = a.astype(np.float64)
        arrays[key].reshape(-1)[: max(1, a.size // 2)] = bad
    elif how == "range":
        with np.errstate(over="ignore"):  # float16 * 10**15 is inf on purpose
            arrays[key] = a * factor + (a.size > 0)
    else:
        arrays[extra] = [a, np.ones(3), np.ones((4, 2, 8, 8), bool)][extra_value]
    np.savez(path, **arrays)


def _clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def test_broken_dumps_get_a_report_or_one_sentence(dumps, tmp_path_factory):
    dump = tmp_path_factory.mktemp("broken") / "dump"
    tally: Counter = Counter()

    @fuzz_settings(200)
    @given(st.data())
    def one_case(data):
        _clear(dump)
        shutil.copytree(dumps[data.draw(st.sampled_from(sorted(dumps)))], dump)
        # Arrays first, then the layout, then whole files: no breakage removes what a later one edits.
        n_arrays, n_layout, n_files = data.draw(st.tuples(st.integers(0, 2), st.integers(0, 1),
                                                          st.integers(0, 1)).filter(any))
        for _ in range(n_arrays):
            break_array(data, dump)
        for _ in range(n_layout):
            break_layout(data, dump)
        for _ in range(n_files):
            break_file(data, dump)
        where = data.draw(st.sampled_from(["dump"] * 5 + ["empty", "file", "missing"]))
        if where != "dump":
            _clear(dump)
            if where == "empty":
                dump.mkdir()
            elif where == "file":
                dump.write_text("a file where the dump directory should be\n")
        outcome = run_as_rank(["check", str(dump)] + data.draw(st.sampled_from([[], ["--json"]])))
        judge(outcome, "check", finish_codes=(0, 1))
        tally[outcome.kind] += 1

    one_case()
    print(f"refpar check: {sum(tally.values())} broken dumps, {dict(tally)}")
    assert tally["refused"] and tally["finished"], tally
