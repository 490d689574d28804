"""Weights in and out in Hugging Face's own format (refpar/weights.py): `refpar train --init-from` an
HF folder on any mesh starts from transformers' own model, a rank reads only its slices of the file,
and `refpar export` writes a checkpoint that `from_pretrained` loads with the same logits.

The HF models are GPT2LMHeadModel and LlamaForCausalLM built from tiny configs (no download), in
float64, saved with save_pretrained(safe_serialization=True): the folder a user with a hub copy has.
The oracle is transformers itself: its logits (eager attention; Llama's float32 casts made no-ops as
in tests/hf_float64.py) and torch's cross-entropy on refpar's batch.
"""

import json
import shutil

import numpy as np
import pytest

import refpar.model as M
from refpar import checkpoint
from refpar.cli import main
from refpar.config import ConfigError, ModelConfig
from refpar.holdings import tp_param_slices
from refpar.model.data import MarkovCorpus
from tests.mpi import ROOT, mpiexec, refpar_json
from tests.numerics import CONTRACT, rel_diff, within

torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install "
                                   "'refpar[dev]'")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from refpar import weights  # noqa: E402
from tests.hf_float64 import compute_in_input_dtype  # noqa: E402

HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                            bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, max_position_embeddings=32,
                                              rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=0,
                                              eos_token_id=0),
    "mixtral": lambda: transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, max_position_embeddings=32,
                                                  num_local_experts=4, num_experts_per_tok=2,
                                                  bos_token_id=0, eos_token_id=0,
                                                  experts_implementation="eager"),
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
B, T, SEED = 8, 16, 1234  # refpar train's default batch, sequence and seed


def hf_folder(path, family: str):
    """An HF model of `family` in float64, its norms and biases moved away from 1 and 0 (so that a
    swapped or skipped one shows) and Mixtral's routers scaled so that no top-2 choice is near a tie,
    saved as save_pretrained saves it; returns the model."""
    torch.manual_seed(0)
    cls = getattr(transformers, CLASSES[family])
    model = cls(HF_CONFIGS[family]()).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_first_loss(model, vocab_size: int) -> float:
    """transformers' logits on step 0's batch of refpar's corpus, and torch's mean cross-entropy."""
    tokens, targets = MarkovCorpus(vocab_size, SEED).batch(0, range(B), T)  # (B, T) each
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size),
                                             torch.from_numpy(targets).reshape(-1)).item()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """family -> (folder, transformers' first loss), each built once."""
    built = {}

    def get(family):
        if family not in built:
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            with pytest.MonkeyPatch.context() as mp:
                compute_in_input_dtype(mp, modeling_llama, "Llama")
                compute_in_input_dtype(mp, modeling_mixtral, "Mixtral")
                built[family] = folder, hf_first_loss(hf_folder(folder, family), 96)
        return built[family]
    return get


MESHES = [(None, 1), ("dp=2,tp=2", 4), ("pp=2", 2)]


@pytest.mark.parametrize("family, mesh, ranks", [(f, m, n) for f in ("gpt2", "llama") for m, n in MESHES]
                         + [("mixtral", "dp=2,ep=2", 4)])
def test_init_from_an_hf_folder_starts_from_transformers_loss_and_matches_the_single_device(
        hf_folders, family, mesh, ranks):
    folder, hf_loss = hf_folders(family)
    args = ["train", "--init-from", str(folder), "--dtype", "float64", "--dropout", "0", "--steps", "2",
            "--check"] + (["--mesh", mesh, "--microbatches", "2"] if mesh else [])
    out = refpar_json(ranks, *args, timeout=300)
    assert out["model"]["n_layer"] == 2 and out["model"]["moe_experts"] == (4 if family == "mixtral" else 0)
    diffs = {"first loss vs transformers": rel_diff(out["losses"][0], hf_loss),
             "single device's first loss vs transformers": rel_diff(out["reference_losses"][0], hf_loss),
             "losses vs single device": out["max_loss_rel_diff"],
             "parameters vs single device after 2 steps": out["max_param_rel_diff"]}
    print(f"{family} {mesh}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert all(within(v, CONTRACT) for v in diffs.values()), diffs


class SliceSpy:
    """safetensors' safe_open, recording every (key, index) a tensor is read by."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, *args, **kwargs):
        handle, spy = self.real(*args, **kwargs), self

        class Opened:
            def get_slice(self, key):
                tensor = handle.get_slice(key)

                class Slice:
                    def __getitem__(self, index):
                        spy.reads.append((key, index))
                        return tensor[index]
                return Slice()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)
        return Opened()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tp_rank_reads_only_its_slices_of_each_tensor(tmp_path, monkeypatch, family):
    hf_folder(tmp_path, family)
    config = weights.read_hf_config(tmp_path)
    full = weights.read_params(tmp_path, config)
    real = weights.safe_open
    for rank in range(2):
        spy = SliceSpy(real)
        monkeypatch.setattr(weights, "safe_open", spy)
        slices = tp_param_slices(config, 2, rank)
        mine = weights.read_params(tmp_path, config, slices=slices)
        for name, shard in mine.items():
            key = weights.SafetensorsWeights(tmp_path).key(name)
            reads = [index for k, index in spy.reads if k == key]
            if name not in slices:  # replicated: read whole, once
                assert reads == [(slice(None),) * full[name].ndim], name
                continue
            axis, held = slices[name]
            read_rows = [i for index in reads for i in range(*index[axis].indices(full[name].shape[axis]))]
            assert read_rows == list(held), name  # exactly its global indices, each once
            assert all(s == slice(None) for index in reads for s in index[:axis]), name
            assert shard.size < full[name].size
            assert np.array_equal(shard, np.take(full[name], held, axis=axis)), name
        if family == "gpt2":  # c_attn's q, k and v columns: three runs, three slices
            assert len([1 for k, _ in spy.reads if k == "transformer.h.0.attn.c_attn.weight"]) == 3


def test_bfloat16_weights_are_read_by_slices_and_converted_to_the_runs_dtype(tmp_path):
    """Hub Llamas are stored in bfloat16, which NumPy's safetensors binding cannot return: they are
    sliced from a memory map instead, and widened exactly (every bfloat16 is a float64)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(HF_CONFIGS["llama"]()).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert weights.read_hf_config(tmp_path).dtype == "bfloat16"  # the folder's own, unless the run says
    config = weights.read_hf_config(tmp_path, dtype="float64")
    state = {n: t.to(torch.float64).numpy() for n, t in model.state_dict().items()}
    for rank in range(2):
        slices = tp_param_slices(config, 2, rank)
        for name, shard in weights.read_params(tmp_path, config, slices=slices).items():
            axis, held = slices.get(name, (0, np.arange(state[name].shape[0])))
            assert shard.dtype == np.float64 and np.array_equal(shard, np.take(state[name], held, axis=axis))


MIXTRAL_FLAGS = ("--moe-experts", "4", "--moe-topk", "2", "--dropless")


@pytest.mark.parametrize("preset, flags, ranks", [
    ("tiny", ("--mesh", "tp=2", "--data", "CORPUS", "--tokenizer", "bytes"), 2),  # text: a tokenizer.json
    ("llama-tiny", (), 1), ("llama-tiny", ("--mesh", "ep=2", *MIXTRAL_FLAGS), 2)],
    ids=["gpt2-tp2-text", "llama", "mixtral-ep2"])
def test_an_exported_checkpoint_loads_in_transformers_with_refpars_logits(tmp_path, monkeypatch, preset,
                                                                         flags, ranks):
    run, corpus = tmp_path / "run", tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "docs" / "weights.md").read_text())
    flags = [str(corpus) if f == "CORPUS" else f for f in flags]
    mpiexec(ranks, "-m", "refpar", "train", "--model", preset, "--dtype", "float64", "--steps", "3",
            "--save", str(run), *flags, timeout=300)
    if "--data" not in flags:  # a Markov run has no tokenizer; one where a text run saves it
        (run / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (tmp_path / "hf").mkdir()  # an empty OUT is taken, as a new one
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0

    manifest = checkpoint.read_manifest(run)  # the checkpoint's own parameters, read as --resume reads them
    names = [n.removeprefix("params/") for n in manifest["tensors"] if n.startswith("params/")]
    arrays = checkpoint.load(run, [checkpoint.whole(f"params/{n}", manifest["tensors"][f"params/{n}"][0])
                                   for n in names], manifest)
    params = dict(zip(names, arrays, strict=True))
    config = ModelConfig(**manifest["model"])

    compute_in_input_dtype(monkeypatch, modeling_llama, "Llama")
    compute_in_input_dtype(monkeypatch, modeling_mixtral, "Mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                              experts_implementation="eager")
    family = "mixtral" if config.moe_experts else config.arch
    assert type(model).__name__ == CLASSES[family]
    assert all(p.dtype == torch.float64 for p in model.parameters())  # stored float64, loaded float64
    tokens, _ = MarkovCorpus(config.vocab_size, 7).batch(0, range(3), config.n_positions)  # (3, P)
    with torch.no_grad():
        hf_logits = model.eval()(torch.from_numpy(tokens)).logits.numpy()  # (3, P, V)
    diff = rel_diff(hf_logits, M.forward(params, tokens, config))
    print(f"{family}: exported logits vs refpar's {diff:.1e}")
    assert within(diff, CONTRACT)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert weights.find_tokenizer(tmp_path / "hf") == tmp_path / "hf" / "tokenizer.json"
    # and back in: the HF folder gives the checkpoint's parameters, bit for bit (float64 throughout)
    again_config, again = weights.load_model(tmp_path / "hf")
    assert again_config.dtype == "float64" and list(again) == names
    if not config.moe_experts:  # config.json gives the checkpoint's config back (Mixtral's: as HF routes)
        assert again_config == config
    assert all(np.array_equal(again[n], params[n]) for n in names)


# --------------------------------------------------------------------------------------- bad input
def edited_folder(src, dst, **changes):
    """A copy of HF folder `src` with config.json's fields changed (None: removed)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def refused(argv, capsys) -> str:
    """The one line `refpar` prints for `argv`, which it must refuse with exit status 2."""
    capsys.readouterr()  # what came before (save_pretrained's progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_bad_weights_are_refused_in_one_sentence(tmp_path, capsys):
    llama, gpt2 = tmp_path / "llama", tmp_path / "gpt2"
    hf_folder(llama, "llama")
    hf_folder(gpt2, "gpt2")
    train = ["train", "--steps", "1", "--init-from"]
    mistral = edited_folder(llama, tmp_path / "mistral", model_type="mistral",
                            architectures=["MistralForCausalLM"])
    reads = "refpar reads GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM folders"
    assert reads in refused(train + [str(mistral)], capsys)
    job = mpiexec(2, "-m", "refpar", *train, str(mistral), "--mesh", "dp=2", check=False, timeout=120)
    lines = job.stderr.strip().splitlines()  # every rank refuses before any message; rank 0 says why
    assert job.returncode == 2 and len(lines) == 1 and reads in lines[0], job.stderr
    scaled = edited_folder(llama, tmp_path / "scaled", rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                        "rope_theta": 500000.0})
    assert "rope_type 'llama3'" in refused(train + [str(scaled)], capsys)
    biased = edited_folder(llama, tmp_path / "biased", attention_bias=True)
    assert "attention_bias=True" in refused(train + [str(biased)], capsys)
    relu = edited_folder(gpt2, tmp_path / "relu", activation_function="relu")
    assert "activation_function='relu'" in refused(train + [str(relu)], capsys)
    assert "--model tiny has n_layer=4" in refused(train + [str(gpt2), "--model", "tiny"], capsys)
    assert "--n-layer 4 contradicts" in refused(train + [str(gpt2), "--n-layer", "4"], capsys)
    assert "dense model" in refused(train + [str(gpt2), "--moe-experts", "2"], capsys)
    assert "dense model; drop ep" in refused(train + [str(gpt2), "--mesh", "ep=2"], capsys)
    text = tmp_path / "corpus.txt"
    text.write_text((ROOT / "docs" / "weights.md").read_text())
    bytes_text = ["--data", str(text), "--tokenizer", "bytes"]  # 256 tokens; the GPT-2 here embeds 96
    assert "has 256 tokens but the model of" in refused(train + [str(gpt2), *bytes_text], capsys)

    bare = gpt2 / "model.safetensors"  # 2 layers; the tiny preset has 4
    assert "add --model PRESET" in refused(train + [str(bare)], capsys)
    assert "has no tensor h.2.ln_1.weight" in refused(train + [str(bare), "--model", "tiny"], capsys)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    shutil.copy(bare, no_config)
    assert "has no config.json" in refused(train + [str(no_config)], capsys)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(gpt2 / "config.json", no_weights)
    assert "has no model.safetensors" in refused(train + [str(no_weights)], capsys)
    run = tmp_path / "run" / "step-00000002"  # what --save writes, as far as its layout goes
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    assert "is a refpar checkpoint" in refused(train + [str(run.parent)], capsys)
    pickle = tmp_path / "pytorch_model.safetensors"
    pickle.write_bytes(b"PK\x03\x04 a torch.save zip, not safetensors" * 10)
    assert "is not a safetensors file" in refused(train + [str(pickle), "--model", "tiny"], capsys)

    assert "is not an empty folder" in refused(["export", str(tmp_path), str(gpt2)], capsys)
    with pytest.raises(ConfigError, match="GPT-2's experts have no Hugging Face model"):
        weights.check_exportable(ModelConfig(moe_experts=2))
    assert "is not a folder" in refused(["export", str(bare), str(tmp_path / "new")], capsys)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("experts, says", [
    (0, "DeepSeek-V3 has no Hugging Face model refpar writes"),
    (8, "DeepSeek-V3's experts have no Hugging Face model refpar writes")])
def test_export_of_a_family_without_an_hf_model_refpar_writes_is_one_sentence(experts, says):
    """weights.HF_MODELS has no DeepseekV3ForCausalLM: export refuses it rather than write its weights
    under another class's config.json (hf_config raised a KeyError for it)."""
    from refpar.config import model_preset

    with pytest.raises(ConfigError, match=says):
        weights.check_exportable(model_preset("deepseek-tiny", moe_experts=experts))
