"""Reading a dump for `refpar check` (refpar/commands/check.py's docstring gives the format): the
layout and each rank's arrays are checked before anything is computed, so that a dump broken in any
way (a crashed run's truncated file, a foreign framework's names, dtypes or shapes) gets one
sentence saying what is wrong, never a traceback.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refpar.config import ConfigError, ModelConfig
from refpar.model.dropout import SITES
from refpar.model.gpt import param_shapes
from refpar.reading import check_path_length, read_bounded, regular_file

LAYOUT_LIMIT = 16 << 20  # bytes: a layout lists a model's parameter names, kilobytes

SPLITS = ("replicate", "column", "row")
# The ranks of a dump lie on one mesh axis; which one names how its tensors were split.
AXES = ("world", "dp", "tp", "sp", "cp", "pp", "ep")
MODEL_KEYS = ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer", "dropout", "layer_norm_eps")


class CheckError(ConfigError):
    """A dump refpar cannot read: the message is one sentence saying what is wrong."""


@dataclass
class Dump:
    layout: dict
    config: ModelConfig
    ranks: list[dict]  # per rank: key -> array
    dtype: str


def _load_rank(path: Path, limit: int) -> dict:
    """One rank's arrays; `limit` bounds the bytes its members inflate to, unless the file is nearly
    as large (a zip bomb of 400 KB inflated to 5.1 GB, issue 43). Only regular files are opened: a
    FIFO would wait forever."""
    st = path.with_suffix(".safetensors")
    if not path.exists() and st.exists():
        if regular_file(st, st.name, CheckError).st_size > limit:
            raise CheckError(f"{st.name} is larger than the {limit:,} bytes the model's weights and "
                             "gradients can take; dump that model's arrays only")
        try:
            from safetensors.numpy import load_file
        except ImportError as err:
            raise CheckError(f"{st.name} needs the safetensors package, which is not installed") from err
        try:
            return dict(load_file(str(st)))
        except Exception as err:  # a truncated or foreign file: safetensors' own errors, OSError
            raise CheckError(f"{st.name} is not a readable .safetensors file ({type(err).__name__})") from err
    if not path.exists() and not path.is_symlink():
        raise CheckError(f"the dump lacks {path.name}")
    size = regular_file(path, path.name, CheckError).st_size
    try:
        with zipfile.ZipFile(path) as z:
            inflated = sum(info.file_size for info in z.infolist())
    except Exception as err:  # a truncated or foreign file: zipfile, OSError, EOFError
        raise CheckError(f"{path.name} is not a readable .npz file ({type(err).__name__})") from err
    # np.savez stores its arrays as they are; savez_compressed rarely shrinks them 50 times
    if inflated > limit and inflated > 50 * size:
        raise CheckError(f"{path.name} would inflate from {size:,} to {inflated:,} bytes, more than the "
                         f"model's weights, gradients and inputs take ({limit:,}); refusing it")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except ValueError as err:
        if "allow_pickle" in str(err):  # numpy's refusal of an object array
            raise CheckError(f"{path.name} holds pickled objects, which refpar never loads") from err
        raise CheckError(f"{path.name} has a damaged array ({str(err)[:120]}); dump it again") from err
    except Exception as err:  # a truncated or foreign file: zipfile, OSError, EOFError
        raise CheckError(f"{path.name} is not a readable .npz file ({type(err).__name__})") from err


def _whole(value, least: int = 0) -> bool:
    """A JSON whole number >= least (true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _read_layout(root: Path) -> dict:
    file = root / "layout.json"
    if not file.exists() and not file.is_symlink():
        raise CheckError(f"{root} has no layout.json")
    try:  # a regular file of bounded size: a FIFO or /dev/zero there would never end
        layout = json.loads(read_bounded(file, "layout.json", LAYOUT_LIMIT, CheckError).decode(),
                            parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise CheckError(f"layout.json is not valid JSON (line {err.lineno}: {err.msg})") from err
    except UnicodeDecodeError as err:
        raise CheckError("layout.json is not UTF-8 text; write it with json.dump") from err
    except RecursionError:
        raise CheckError("layout.json is nested too deeply to be a layout; write it with json.dump") from None
    except ValueError as err:  # NaN, Infinity
        raise CheckError(f"layout.json is not valid JSON ({err})") from err
    if not isinstance(layout, dict) or not isinstance(layout.get("model"), dict):
        raise CheckError('layout.json needs a "model" object with the GPT-2 sizes')
    return layout


def _check_layout(layout: dict) -> ModelConfig:
    """The model it describes, once every field of layout.json has the type and values the module
    docstring gives; else one sentence for the first that does not."""
    unknown = sorted(set(layout["model"]) - set(MODEL_KEYS))
    if unknown:
        raise CheckError(f'layout.json\'s model has {unknown[0]!r}; known fields are {", ".join(MODEL_KEYS)}')
    for key, value in layout["model"].items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number if key in ("dropout", "layer_norm_eps") else _whole(value, 1)):
            kind = "a number" if key in ("dropout", "layer_norm_eps") else "a positive whole number"
            raise CheckError(f"layout.json's model {key} is {value!r}; give {kind}")
    try:
        config = ModelConfig(**layout["model"], dtype="float64")
    except ConfigError as err:
        raise CheckError(f"layout.json's model is not a valid GPT-2: {err}") from err
    if not 0 < config.layer_norm_eps < math.inf:
        raise CheckError(f"layout.json's model layer_norm_eps {config.layer_norm_eps} must be a positive "
                         "finite number, e.g. 1e-5")
    if layout.get("axis", "world") not in AXES:
        raise CheckError(f"layout.json's axis {layout['axis']!r} is not one of {', '.join(AXES)}")
    if not _whole(layout.get("ranks"), 1):
        raise CheckError('layout.json needs "ranks", a positive integer')
    if layout.get("inputs", "replicate") not in ("replicate", "batch"):
        raise CheckError(f'layout.json\'s inputs {layout["inputs"]!r} is not "replicate" or "batch"')
    for key in ("seed", "step"):
        if not _whole(layout.get(key, 0)):
            raise CheckError(f"layout.json's {key} {layout[key]!r} must be a whole number >= 0")
    shapes = param_shapes(config)
    tensors, flat = layout.get("tensors", {}), layout.get("flat", {})
    if not isinstance(tensors, dict) or not all(isinstance(spec, dict) for spec in tensors.values()):
        raise CheckError('layout.json\'s "tensors" must map parameter names to {"split": ...} objects')
    for name, spec in tensors.items():
        if name not in shapes:
            raise CheckError(f"layout.json's tensors name {name!r}, which is not a parameter of this GPT-2")
        if spec.get("split", "replicate") not in SPLITS:
            raise CheckError(f"{name}'s split {spec.get('split')!r} is not one of {', '.join(SPLITS)}")
        if spec.get("qkv", "interleaved") != "interleaved":
            raise CheckError(f'{name}\'s qkv {spec["qkv"]!r} is not "interleaved"; leave it out for a '
                             "contiguous slice of q|k|v")
    if not isinstance(flat, dict) or not all(isinstance(names, list) for names in flat.values()):
        raise CheckError('layout.json\'s "flat" must map each group to the list of its parameter names')
    for group, names in flat.items():
        if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise CheckError(f"flat group {group!r} must list distinct parameter names, at least one")
        shapes_of(config, names)
    return config


def _check_rank(r: int, arrays: dict, layout: dict, config: ModelConfig) -> None:
    """Every key of one rank is one the module docstring lists, with a dtype and shape it can have."""
    for key in ("tokens", "targets", "loss"):
        if key not in arrays:
            raise CheckError(f"rank{r} lacks {key!r}")
    tokens, targets, loss = arrays["tokens"], arrays["targets"], arrays["loss"]
    for key, a in (("tokens", tokens), ("targets", targets)):
        if a.dtype.kind not in "iu" or a.ndim != 2 or 0 in a.shape:
            raise CheckError(f"rank{r}'s {key} is {a.dtype} of shape {a.shape}; give whole numbers "
                             "shaped (batch, sequence)")
        if a.min() < 0 or a.max() >= config.vocab_size:
            raise CheckError(f"rank{r}'s {key} hold {a.min()}..{a.max()}, outside the vocabulary "
                             f"0..{config.vocab_size - 1}")
    if targets.shape != tokens.shape or tokens.shape[1] > config.n_positions:
        raise CheckError(f"rank{r}'s tokens {tokens.shape} and targets {targets.shape} must have one "
                         f"shape (batch, sequence) with a sequence of at most {config.n_positions}")
    if loss.size != 1 or loss.dtype.kind not in "fiu":
        raise CheckError(f"rank{r}'s loss is {loss.dtype} of shape {loss.shape}; give one number")
    groups, shapes = layout.get("flat", {}), param_shapes(config)
    for key, a in arrays.items():
        kind, _, name = key.partition(".")
        if key in ("tokens", "targets", "loss"):
            continue
        if kind == "masks":
            _check_mask(r, name, a, config)
            continue
        if kind not in ("weights", "grads"):
            raise CheckError(f"rank{r} holds {key!r}, which refpar check does not read; keys are tokens, "
                             "targets, loss, weights.<name>, grads.<name> and masks.<layer>.<site>")
        if name.startswith("@") and name[1:] not in groups:
            raise CheckError(f"rank{r}'s {key} names no flat group of layout.json; add it to \"flat\"")
        if not name.startswith("@") and name not in shapes:
            raise CheckError(f"rank{r}'s {key} is not a parameter of GPT-2 with this model")
        if a.dtype.kind != "f":
            raise CheckError(f"rank{r}'s {key} is {a.dtype}; weights and gradients are floating point")
        if kind == "weights" and not np.isfinite(a).all():
            raise CheckError(f"rank{r}'s {key} holds NaN or inf; dump the finite weights the step "
                             "started from")


def _check_mask(r: int, name: str, mask, config: ModelConfig) -> None:
    layer, _, site = name.partition(".")
    if not (layer.isdigit() and int(layer) < config.n_layer and site in SITES):
        raise CheckError(f"rank{r}'s masks.{name} is not masks.<layer>.<site> with a layer in "
                         f"0..{config.n_layer - 1} and a site in {', '.join(SITES)}")
    if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
        raise CheckError(f"rank{r}'s masks.{name} must hold keep flags, 1 (kept) or 0 (dropped)")


def load(directory: str) -> Dump:
    check_path_length("refpar check", directory, CheckError)
    root = Path(directory)
    if not root.is_dir():
        raise CheckError(f"{directory} is not a directory holding layout.json and rank*.npz")
    layout = _read_layout(root)
    config = _check_layout(layout)
    if layout["ranks"] > 4096:
        raise CheckError(f"layout.json's ranks {layout['ranks']} is more than refpar check reads (4096)")
    # the model's weights and gradients in float64, twice over, and room for tokens and masks
    limit = 32 * sum(math.prod(s) for s in param_shapes(config).values()) + (64 << 20)
    ranks = [_load_rank(root / f"rank{r}.npz", limit) for r in range(layout["ranks"])]
    for r, arrays in enumerate(ranks):
        _check_rank(r, arrays, layout, config)
    dtypes = {str(a.dtype) for arrays in ranks for k, a in arrays.items() if k.startswith("grads.")}
    if len(dtypes) != 1:
        raise CheckError(f"the gradients must share one floating dtype, found {sorted(dtypes) or 'none'}")
    if layout.get("inputs", "replicate") == "batch" and len({a["tokens"].shape[1] for a in ranks}) > 1:
        raise CheckError("with inputs \"batch\" every rank's tokens must have the same sequence length")
    return Dump(layout, config, ranks, dtypes.pop())


def shapes_of(config: ModelConfig, names) -> list[tuple]:
    """The GPT-2 shape of each parameter name, or one sentence for the first that is none."""
    shapes = param_shapes(config)
    unknown = [m for m in names if m not in shapes]
    if unknown:
        raise CheckError(f"{unknown[0]} is not a parameter of GPT-2 with this model")
    return [shapes[m] for m in names]
