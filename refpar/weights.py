"""Weights in and out in Hugging Face's own format: a model folder (config.json + model.safetensors,
or the shards model.safetensors.index.json lists) or a bare .safetensors file, for both families.

    refpar train --init-from hf-folder --dtype float64 --steps 5          # read_hf_config, read_params
    mpiexec -n 4 python -m refpar train --init-from hf-folder --mesh dp=2,tp=2 --check
    refpar export runs/tiny hf-folder                                    # export_checkpoint
    config, params = load_model("hf-folder")             # an HF folder or a refpar checkpoint, whole
    tokenizer = find_tokenizer("hf-folder")              # its tokenizer.json, if it has one

The names are the families' own (refpar/model/__init__.py): GPT-2's `wte.weight`, ... with or without
GPT2LMHeadModel's `transformer.` prefix, in Conv1D's weight[in, out]; LlamaForCausalLM's
`model.embed_tokens.weight`, ..., weight[out, in]. So a tensor in the file is a refpar parameter as
it is, and a rank reads only its slice of it: `read_params` takes the (axis, global indices) each
parameter's tp shard holds (holdings.tp_param_slices: several runs of indices for c_attn's q, k and
v columns) and asks safetensors for those runs alone (`safe_open(...).get_slice(key)[a:b]`, which
reads the bytes of that slice from the memory-mapped file). bfloat16 tensors, which NumPy's
safetensors binding cannot return, are sliced from a memory map of the file the same way.

Anything refpar cannot compute exactly as the file's model does (another architecture, rope
scaling, a bias Llama does not have, an activation other than GPT-2's tanh-GELU, ...) is a
ConfigError naming the field and the file, raised on every rank before any communication.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from refpar.config import ConfigError, ModelConfig, check_output_path, model_preset
from refpar.files import make_folder_atomically
from refpar.holdings import names, tied_embedding
from refpar.model import param_shapes
from refpar.precision import dtype_of

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # a sharded checkpoint: tensor name -> file
TOKENIZER = "tokenizer.json"  # a text run's tokenizer, which `export` copies beside the weights
FILE_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Buffers that older files saved beside the weights: GPT-2's causal mask, Llama's rotary inv_freq.
BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
# The ModelConfig fields that set the parameters' shapes, which a --model preset must agree on.
SHAPE_FIELDS = ("arch", "vocab_size", "n_positions", "n_embd", "n_head", "n_layer", "n_kv_head",
                "intermediate_size", "tie_embeddings", "moe_experts")


# ------------------------------------------------------------------------------- the files' tensors
class SafetensorsWeights:
    """The tensors of an HF folder's safetensors files or of one bare file, from their headers:
    key -> (file, shape, safetensors dtype). Nothing but the headers is read until `read`."""

    def __init__(self, path):
        self.path = Path(path)
        self.tensors: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for file in weight_files(self.path):
            for key, entry in _header(file).items():
                if key != "__metadata__":
                    self.tensors[key] = (file, tuple(int(n) for n in entry["shape"]), str(entry["dtype"]))

    def key(self, name: str) -> str | None:
        """The file's key of refpar parameter `name`: itself, or GPT2LMHeadModel's `transformer.` + it."""
        return next((k for k in (name, "transformer." + name) if k in self.tensors), None)

    def dtype(self, name: str) -> str:
        """The dtype parameter `name` is stored in, as refpar names it ("float32")."""
        return FILE_DTYPES[self.tensors[self.key(name)][2]]

    def check(self, config: ModelConfig, shape_from: str) -> None:
        """Every parameter of `config` is in the files, of its shape, in a float dtype refpar reads,
        and no tensor is left over (a file of another model); `shape_from` says where the config's
        shape came from, for the sentence. A tied head is the embedding: HF's files leave it out, and
        one that is there is not read."""
        shapes = param_shapes(config)
        for name, shape in shapes.items():
            key = self.key(name)
            if key is None:
                raise ConfigError(f"{self.path} has no tensor {name}, which the model of {shape_from} "
                                  f"has; give the weights of that model (or the --model of this file)")
            file, have, dtype = self.tensors[key]
            if have != shape:
                raise ConfigError(f"{file}: {key} has shape {list(have)} but the model of {shape_from} "
                                  f"needs {list(shape)}; give the weights of that model")
            if dtype not in FILE_DTYPES:
                raise ConfigError(f"{file}: {key} is stored as {dtype}; refpar reads "
                                  f"{', '.join(FILE_DTYPES)} weights")
        known = {self.key(n) for n in shapes}
        tied_head = "lm_head.weight" if tied_embedding(config) else None  # HF's key for it in any family
        extra = [k for k in self.tensors if k not in known and k != tied_head and not k.endswith(BUFFERS)]
        if extra:
            raise ConfigError(f"{self.tensors[extra[0]][0]} holds {extra[0]}, which the model of "
                              f"{shape_from} does not have; give the weights of that model")

    def read(self, name: str, axis: int | None = None, index=None, opened: dict | None = None) -> np.ndarray:
        """Parameter `name`, whole, or along `axis` only the global indices `index` (increasing, in
        runs): each run is one slice read from the file, so nothing else of the tensor is read."""
        key = self.key(name)
        file, shape, dtype = self.tensors[key]
        runs = [(slice(None),) * len(shape)]
        if axis is not None:
            runs = [(slice(None),) * axis + (run,) for run in index_runs(index)]
        if dtype == "BF16":  # NumPy's binding has no bfloat16: a memory map of the file, sliced
            tensor = _bf16_map(file, key)
            parts = [np.array(tensor[r]) for r in runs]
        else:
            opened = {} if opened is None else opened
            if file not in opened:
                opened[file] = safe_open(str(file), framework="numpy")
            tensor = opened[file].get_slice(key)
            parts = [tensor[r] for r in runs]
        if not parts:  # a shard of no indices
            empty = list(shape)
            empty[axis] = 0
            return np.empty(empty, dtype_of(FILE_DTYPES[dtype]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def index_runs(index) -> list[slice]:
    """Increasing global indices as the runs of consecutive ones: [0 1 2 8 9] -> [0:3, 8:10]."""
    index = np.asarray(index)
    if index.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(index) != 1) + 1
    return [slice(int(run[0]), int(run[-1]) + 1) for run in np.split(index, cuts)]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder (model.safetensors, or the shards its index lists) or
    the bare file `path`."""
    if path.is_file():
        return [path]
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if (path / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{path / INDEX} is not a safetensors index (a JSON weight_map of tensor "
                              "-> file); give the folder as save_pretrained wrote it") from None
        missing = [s for s in shards if not (path / s).is_file() or Path(s).name != s]
        if missing:
            raise ConfigError(f"{path / INDEX} lists {missing[0]}, which is not a file in {path}; "
                              "copy every shard it lists into the folder")
        return [path / s for s in shards]
    raise ConfigError(f"{path} has no {WEIGHTS} (nor {INDEX}); give a folder with the weights in "
                      "safetensors (save_pretrained(..., safe_serialization=True) writes them)")


def _header(file: Path) -> dict:
    """The JSON header of a safetensors file: key -> {dtype, shape, data_offsets}, and __metadata__."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= min(100 << 20, file.stat().st_size - 8):  # safetensors caps it at 100 MB
                raise ValueError("no safetensors header")
            header = json.loads(f.read(n))
        with safe_open(str(file), framework="numpy"):  # the library's own checks of the layout
            pass
        if not isinstance(header, dict):
            raise ValueError("a header that is not a JSON object")
        return header
    except (OSError, ValueError, SafetensorError) as err:
        raise ConfigError(f"{file} is not a safetensors file ({err}); give an HF model folder or a "
                          ".safetensors file") from None


def _bf16_map(file: Path, key: str) -> np.ndarray:
    """A read-only memory map of bfloat16 tensor `key` of `file`, in its shape."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[key]
    start, _ = entry["data_offsets"]
    shape = tuple(entry["shape"])
    raw = np.memmap(file, dtype=np.uint16, mode="r", offset=8 + n + start, shape=shape)
    return raw.view(dtype_of("bfloat16"))


# ------------------------------------------------------------------------------------ config.json
def _get(hf: dict, key: str, default=None):
    value = hf.get(key, default)
    return default if value is None else value


def _require(hf: dict, key: str, allowed: tuple, default, where: Path, why: str) -> None:
    value = _get(hf, key, default)
    if value not in allowed:
        raise ConfigError(f"{where} sets {key}={value!r}; refpar's {why}, so it cannot run this model")


def _gpt2_fields(hf: dict, where: Path, dropout: float | None) -> dict:
    """ModelConfig fields of a GPT2LMHeadModel config.json (GPT2Config's defaults where absent)."""
    C = int(_get(hf, "n_embd", 768))
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new", where,
             "GPT-2 uses the tanh-approximated GELU (gelu_new)")
    _require(hf, "n_inner", (4 * C,), 4 * C, where, f"GPT-2 MLP is 4 n_embd = {4 * C} wide")
    _require(hf, "scale_attn_weights", (True,), True, where, "attention scales its scores by 1/sqrt(hs)")
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False, where,
             "attention does not scale by the layer index")
    _require(hf, "add_cross_attention", (False,), False, where, "GPT-2 has no cross-attention")
    _require(hf, "tie_word_embeddings", (True,), True, where, "GPT-2 ties its head to wte")
    drops = {k: float(_get(hf, k, 0.1)) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")}
    if dropout is None:
        if len(set(drops.values())) > 1:
            raise ConfigError(f"{where} sets {drops}; refpar's GPT-2 has one dropout probability for "
                              "all of them, so give it with --dropout P")
        dropout = drops["resid_pdrop"]
    return dict(arch="gpt2", vocab_size=int(_get(hf, "vocab_size", 50257)),
                n_positions=int(_get(hf, "n_positions", 1024)), n_embd=C,
                n_head=int(_get(hf, "n_head", 12)), n_layer=int(_get(hf, "n_layer", 12)),
                layer_norm_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)),
                init_std=float(_get(hf, "initializer_range", 0.02)), dropout=dropout)


def _rope_theta(hf: dict, where: Path) -> float:
    """The RoPE base, from transformers 5's rope_parameters or the older rope_theta; any rope
    scaling (Llama 3.1's "llama3", YaRN, linear, dynamic) is refused."""
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for key, value in (("rope_parameters", rope), ("rope_scaling", scaling)):
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        if kind != "default":
            raise ConfigError(f"{where} sets {key} of rope_type {kind!r}; refpar's Llama computes the "
                              "default RoPE only, so it cannot run this model")
    return float(rope.get("rope_theta", _get(hf, "rope_theta", 10000.0)))


def _llama_fields(hf: dict, where: Path, dropout: float | None) -> dict:
    """ModelConfig fields of a LlamaForCausalLM config.json (LlamaConfig's defaults where absent);
    a `dropout` given is kept, for Llama's check to say what to do with a nonzero one."""
    C, nh = int(_get(hf, "hidden_size", 4096)), int(_get(hf, "num_attention_heads", 32))
    _require(hf, "hidden_act", ("silu",), "silu", where, "Llama's SwiGLU gates with SiLU")
    _require(hf, "attention_bias", (False,), False, where, "Llama has no attention biases")
    _require(hf, "mlp_bias", (False,), False, where, "Llama has no MLP biases")
    _require(hf, "attention_dropout", (0, 0.0), 0.0, where, "Llama trains without dropout")
    _require(hf, "head_dim", (C // nh,), C // nh, where, f"head size is hidden_size / "
             f"num_attention_heads = {C // nh}")
    return dict(arch="llama", vocab_size=int(_get(hf, "vocab_size", 32000)),
                n_positions=int(_get(hf, "max_position_embeddings", 2048)), n_embd=C, n_head=nh,
                n_kv_head=int(_get(hf, "num_key_value_heads", nh)),
                n_layer=int(_get(hf, "num_hidden_layers", 32)),
                intermediate_size=int(_get(hf, "intermediate_size", 11008)),
                rope_theta=_rope_theta(hf, where),
                norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
                tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
                init_std=float(_get(hf, "initializer_range", 0.02)), dropout=dropout or 0.0)


def _mixtral_fields(hf: dict, where: Path, dropout: float | None) -> dict:
    """ModelConfig fields of a MixtralForCausalLM config.json: Llama's blocks with Mixtral's experts in
    every one (refpar/model/llama.py's MOE), routed as transformers routes them: top-k of a softmax,
    renormalised, no capacity (dropless), and no router loss in the training loss unless
    output_router_logits (which refpar does not take: its Switch loss is its own)."""
    _require(hf, "router_jitter_noise", (0, 0.0), 0.0, where, "router adds no noise to its logits")
    _require(hf, "sliding_window", (None,), None, where, "attention is causal over the whole sequence")
    _require(hf, "output_router_logits", (False,), False, where,
             "training loss adds no HF load-balancing loss")
    return _llama_fields(hf, where, dropout) | dict(
        moe_experts=int(_get(hf, "num_local_experts", 8)), moe_top_k=int(_get(hf, "num_experts_per_tok", 2)),
        moe_dropless=True, moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0)


def _gpt2_config(config: ModelConfig) -> dict:
    """GPT2Config's own keys of `config`."""
    return {"n_positions": config.n_positions, "n_embd": config.n_embd, "n_head": config.n_head,
            "n_layer": config.n_layer, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": config.layer_norm_eps, "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout, "attn_pdrop": config.dropout, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True}


def _llama_config(config: ModelConfig) -> dict:
    """LlamaConfig's own keys of `config`."""
    return {
        "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_size,
        "max_position_embeddings": config.n_positions, "rms_norm_eps": config.norm_eps,
        # both spellings: transformers >= 5 reads rope_parameters, earlier versions rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": config.tie_embeddings}


def _mixtral_config(config: ModelConfig) -> dict:
    """MixtralConfig's own keys of `config`: Llama's and its experts'."""
    return {"num_local_experts": config.moe_experts, "num_experts_per_tok": config.moe_top_k,
            "router_jitter_noise": 0.0, "output_router_logits": False,
            "sliding_window": None} | _llama_config(config)


@dataclasses.dataclass(frozen=True)
class HFModel:
    """A Hugging Face model class refpar reads (`read_hf_config`) and writes (`write_hf_folder`)."""

    architecture: str  # config.json's "architectures"
    arch: str  # the ModelConfig.arch it is
    experts: bool  # whether it has experts (refpar writes it for that family with --moe-experts)
    fields: Callable[[dict, Path, float | None], dict]  # (config.json, its path, --dropout) -> ModelConfig's
    config: Callable[[ModelConfig], dict]  # ModelConfig -> config.json's keys of this class


HF_MODELS = {  # config.json's model_type -> the class
    "gpt2": HFModel("GPT2LMHeadModel", "gpt2", False, _gpt2_fields, _gpt2_config),
    "llama": HFModel("LlamaForCausalLM", "llama", False, _llama_fields, _llama_config),
    "mixtral": HFModel("MixtralForCausalLM", "llama", True, _mixtral_fields, _mixtral_config),
}


def hf_model(config: ModelConfig) -> tuple[str, HFModel] | None:
    """(model_type, HF_MODELS row) refpar writes `config` as, None where it writes none."""
    return next(((kind, m) for kind, m in HF_MODELS.items()
                 if m.arch == config.arch and m.experts == bool(config.moe_experts)), None)


def read_hf_config(path, preset: str | None = None, *, dtype: str | None = None, dropout: float | None = None,
                   n_layer: int | None = None, moe: dict | None = None) -> ModelConfig:
    """The ModelConfig of an HF model folder's config.json (GPT2LMHeadModel, LlamaForCausalLM or
    MixtralForCausalLM), or of `preset` for a bare .safetensors file, checked against the file's
    tensors (names, shapes, dtypes). `dtype` (the run's --dtype/--precision) defaults to the
    weights' own dtype for a folder, the preset's for a bare file; `dropout` replaces GPT-2's;
    `preset`, `n_layer` and `moe` (the MoE fields of --moe-*) given with a folder must agree with it.
    Every mistake is a ConfigError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder; give a Hugging Face model folder "
                          "(config.json and model.safetensors) or a .safetensors file with --model PRESET")
    if path.is_file():
        if preset is None:
            raise ConfigError(f"{path} is a bare weights file, which holds no model shape; add --model "
                              "PRESET of its shape (or give the folder with its config.json)")
        overrides = {k: v for k, v in (("dtype", dtype), ("dropout", dropout), ("n_layer", n_layer))
                     if v is not None}
        config = model_preset(preset, **overrides, **(moe or {}))
        SafetensorsWeights(path).check(config, f"--model {preset}")
        return config
    where = path / CONFIG
    if not where.is_file() and ((path / "manifest.json").is_file() or any(path.glob("step-*/manifest.json"))):
        raise ConfigError(f"{path} is a refpar checkpoint, not a Hugging Face folder; continue it with "
                          f"--resume {path}, or write it as one with refpar export {path} OUT")
    if not where.is_file():
        raise ConfigError(f"{path} has no {CONFIG}; give a Hugging Face model folder (config.json and "
                          "model.safetensors) or a .safetensors file with --model PRESET")
    try:
        hf = json.loads(where.read_text())
        if not isinstance(hf, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} is not a JSON config ({err}); give the config.json save_pretrained "
                          "wrote") from None
    family = _family(hf, where)
    fields = family.fields(hf, where, dropout)
    if n_layer is not None and n_layer != fields["n_layer"]:
        raise ConfigError(f"--n-layer {n_layer} contradicts {where}, whose model has {fields['n_layer']} "
                          "layers; drop --n-layer")
    if moe:
        what = "gives its experts" if family.experts else "is a dense model"
        raise ConfigError(f"--moe-experts makes a Mixture of Experts, but {where} {what}; drop the --moe-* "
                          "flags")
    config = ModelConfig(**fields)
    if preset is not None:
        wanted = model_preset(preset)
        differ = next((f for f in SHAPE_FIELDS if getattr(wanted, f) != getattr(config, f)), None)
        if differ is not None:
            raise ConfigError(f"--model {preset} has {differ}={getattr(wanted, differ)!r} but {where} "
                              f"{getattr(config, differ)!r}; drop --model (the folder gives the shape)")
    weights = SafetensorsWeights(path)
    weights.check(config, str(where))
    return dataclasses.replace(config, dtype=dtype or weights.dtype(next(iter(param_shapes(config)))))


def _family(hf: dict, where: Path) -> HFModel:
    """The HF_MODELS row of config.json's model_type and architectures, else a ConfigError."""
    kind = hf.get("model_type")
    model = HF_MODELS.get(kind)
    archs = hf.get("architectures") or [model and model.architecture]
    if model is not None and model.architecture in archs:
        return model
    raise ConfigError(f"{where} describes {', '.join(map(str, archs))} (model_type {kind!r}); refpar reads "
                      f"{', '.join(m.architecture for m in HF_MODELS.values())} folders")


# ------------------------------------------------------------------------------------------ reading
def read_params(path, config: ModelConfig, names=None, slices: dict | None = None) -> dict:
    """refpar parameters `names` (default all, in the family's order) from the HF folder or
    .safetensors file `path`, in config.dtype; `slices` (holdings.tp_param_slices: name -> (axis,
    global indices)) makes each a tp shard read slice by slice, never whole."""
    weights = SafetensorsWeights(path)
    weights.check(config, str(path))
    dtype = dtype_of(config.dtype)
    slices = slices or {}
    names = list(param_shapes(config)) if names is None else names
    opened: dict = {}
    try:
        # a copy of its own, writable (training updates parameters in place), in the run's dtype
        return {n: weights.read(n, *slices.get(n, (None, None)), opened=opened).astype(dtype)
                for n in names}
    finally:
        for handle in opened.values():
            handle.__exit__(None, None, None)


def is_refpar_checkpoint(path) -> bool:
    """Whether `path` is a refpar checkpoint directory (DIR/step-N or DIR) rather than an HF folder."""
    path = Path(path)
    return path.is_dir() and not any((path / f).exists() for f in (CONFIG, WEIGHTS, INDEX))


def load_model(path, preset: str | None = None, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, every parameter whole) of an HF model folder, a .safetensors file with `preset`,
    or a refpar training checkpoint (DIR/step-N, or DIR: its newest complete step). `dtype` converts
    the weights (default: as stored). For one process: `refpar generate --from`, `refpar export`."""
    if is_refpar_checkpoint(path):
        config, params = checkpoint_params(path)
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
            params = {n: p.astype(dtype_of(dtype)) for n, p in params.items()}
        return config, params
    config = read_hf_config(path, preset, dtype=dtype)
    return config, read_params(path, config)


def find_tokenizer(path) -> Path | None:
    """The tokenizer.json that goes with the weights at `path`: an HF folder's own, or a refpar
    checkpoint's (in its step folder or the run folder above it, where a text run saves it); None
    where there is none (a Markov-corpus run's tokens are their own ids)."""
    path = Path(path)
    if is_refpar_checkpoint(path):
        from refpar import checkpoint

        step = checkpoint.find(path)
        candidates = [step / TOKENIZER, step.parent / TOKENIZER]
    else:
        candidates = [(path if path.is_dir() else path.parent) / TOKENIZER]
    return next((p for p in candidates if p.is_file()), None)


def checkpoint_params(path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, parameters in the checkpoint's dtype) of a refpar checkpoint, whatever mesh
    wrote it (its optimizer state is not read)."""
    from refpar import checkpoint

    man = checkpoint.read_manifest(path)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in man["model"].items() if k in known}
    if fields.get("moe_layers") is not None:
        fields["moe_layers"] = tuple(fields["moe_layers"])  # JSON keeps the tuple as a list
    config = ModelConfig(**fields)
    shapes = param_shapes(config)
    arrays = checkpoint.load(path, [checkpoint.whole(f"params/{n}", s) for n, s in shapes.items()], man)
    return config, dict(zip(shapes, arrays, strict=True))


# ------------------------------------------------------------------------------------------ writing
def hf_config(config: ModelConfig) -> dict:
    """config.json of `config` for transformers: GPT2LMHeadModel, LlamaForCausalLM, or
    MixtralForCausalLM for Llama with experts (`hf_model`); `dtype` the weights' (float64 stays
    float64). The special tokens are left unset (null): the Markov corpus has none, and a text run's
    tokenizer.json, copied beside the weights, names its own."""
    kind, model = hf_model(config)
    common = {"architectures": [model.architecture], "model_type": kind,
              "vocab_size": config.vocab_size, "initializer_range": config.init_std,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": config.dtype,
              "use_cache": True}
    return common | model.config(config)


def check_export_target(out) -> Path:
    """OUT must be a new or empty folder refpar can create; anything else is one sentence."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder; give a new folder for the export "
                          "(refpar never writes over files)")
    check_output_path("OUT", str(out), directory=True)
    return out


def check_exportable(config: ModelConfig) -> None:
    """A model transformers runs as refpar does (HF_MODELS): GPT-2, Llama, or Llama with Mixtral's
    experts in every block, routed by a softmax (MixtralForCausalLM; it routes without capacity, so a
    checkpoint trained with one gives the same logits where no token was dropped)."""
    target = hf_model(config)
    title = names(config).title
    if target is None:
        problem = (f"{title}'s experts have no Hugging Face model refpar writes" if config.moe_experts else
                   f"{title} has no Hugging Face model refpar writes")
        raise ConfigError(f"refpar export cannot write this model: {problem}; export dense GPT-2 or Llama, "
                          "or Llama with --moe-experts in every block")
    if not config.moe_experts:
        return
    problem = ("MixtralForCausalLM has experts in every block" if config.moe_layers is not None else
               "MixtralForCausalLM routes by a softmax" if config.moe_gate != "softmax" else
               "MixtralForCausalLM routes without expert groups" if config.moe_group_limit else
               "MixtralForCausalLM has no shared experts" if config.moe_shared_experts else
               "MixtralForCausalLM normalises its top-k gates and does not scale them"
               if not config.moe_norm_topk_prob or config.moe_routed_scaling_factor != 1.0 else
               "a checkpoint does not hold aux-free balancing's expert biases"
               if config.moe_balance == "aux-free" else None)
    if problem:
        raise ConfigError(f"refpar export cannot write this Mixture of Experts: {problem}; export dense "
                          "GPT-2 or Llama, or Llama with --moe-experts in every block")


def write_hf_folder(config: ModelConfig, params: dict, out, tokenizer: Path | None = None) -> Path:
    """OUT/config.json and OUT/model.safetensors (HF's keys: `transformer.` + GPT-2's names, Llama's
    as they are), plus a copy of `tokenizer`, written into a temporary folder beside OUT and renamed
    to it at the end (refpar/files.py): OUT is the whole export or absent, interrupted or not."""
    from refpar.model import to_hf_state_dict

    check_exportable(config)
    out = check_export_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in to_hf_state_dict(params, config).items()}

    def fill(folder: Path) -> None:
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})  # "pt": transformers expects it
        (folder / CONFIG).write_text(json.dumps(hf_config(config), indent=2) + "\n")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, folder / TOKENIZER)
        umask = os.umask(0)
        os.umask(umask)
        for file in folder.iterdir():
            file.chmod(0o666 & ~umask)  # as any file this user writes (safetensors writes 0600)

    return make_folder_atomically(out, fill)  # the temporary folder is renamed to OUT: all or nothing


def export_checkpoint(ckpt, out) -> tuple[Path, ModelConfig, Path | None]:
    """A refpar training checkpoint (DIR/step-N, or DIR: its newest complete step) written as an HF
    folder OUT (write_hf_folder), in the checkpoint's dtype, with the run's tokenizer.json (in the
    step's folder or its run folder) if there is one. Returns (OUT, the config, the tokenizer copied)."""
    from refpar import checkpoint

    check_export_target(out)
    step = checkpoint.find(ckpt)
    config, params = checkpoint_params(step)
    tokenizer = find_tokenizer(step)
    return write_hf_folder(config, params, out, tokenizer), config, tokenizer
