"""Text out (issue 38): `refpar generate --from CKPT_OR_HF_DIR --prompt TEXT --max-new-tokens N` decodes
text with the weights' own tokenizer, on one device and on serving meshes, checked against
transformers' greedy decoding of the same folder and against one device recomputing every sequence;
without --from the first line says the weights are random.

The Hugging Face folder is a GPT2LMHeadModel built from a config (no download) in float64 with a
256-token vocabulary, and refpar's byte tokenizer saved beside it: the tokens of a prompt are its UTF-8
bytes, so the test decodes the generated text by itself (bytes(...).decode), independently of refpar.
"""

import json

import pytest

from refpar.cli import main
from refpar.data.tokenizers import ByteTokenizer
from tests.mpi import mpiexec

torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install "
                                   "'refpar[dev]'")

PROMPT, NEW = "Pipeline parallelism", 8  # 20 bytes + 8 new tokens in 32 positions


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """(folder, transformers model): GPT-2 with biases and norms moved away from 0 and 1, so a skipped
    one would change the tokens."""
    folder = tmp_path_factory.mktemp("hf-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    ByteTokenizer().save(folder)
    return folder, model


def greedy_transformers(model, prompt: str, new: int) -> list[int]:
    """transformers' own forward, the most likely next token each time (greedy decoding)."""
    ids = list(prompt.encode("utf-8"))
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids])).logits[0, -1]  # (V,)
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt.encode("utf-8")):]


def generate(n: int, *args: str) -> dict:
    proc = mpiexec(n, "-m", "refpar", "generate", *args, "--json", timeout=300)
    lines = proc.stdout.strip().splitlines()
    return {"summary": json.loads(lines[-1]), "lines": lines}


@pytest.mark.parametrize("mesh", [(), ("--mesh", "tp=2"), ("--mesh", "pp=2"), ("--mesh", "cp=2")])
def test_generate_from_an_hf_folder_writes_transformers_greedy_text_on_every_serving_mesh(hf_gpt2, mesh):
    folder, model = hf_gpt2
    n = 2 if mesh else 1
    out = generate(n, "--from", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--check",
                   *mesh)
    s = out["summary"]
    (request,) = s["requests"]
    want = greedy_transformers(model, PROMPT, NEW)
    assert request["tokens"] == want
    assert request["prompt_text"] == PROMPT
    assert request["text"] == bytes(want).decode("utf-8", errors="replace")
    assert s["tokens_match_reference"] and s["max_logit_rel_diff"] <= 1e-10
    assert s["weights"] == {"from": str(folder), "seed": None, "tokenizer": "bytes", "trained_seq_len": None}
    assert out["lines"][0] == f"weights: {folder}; tokenizer: bytes"


def test_generate_from_a_trained_checkpoint_decodes_with_the_tokenizer_the_run_saved(tmp_path):
    """A run on text saves tokenizer.json beside its steps; generate --from that run reads both."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "run"
    assert main(["train", "--data", str(text), "--steps", "3", "--save", str(run)]) == 0
    assert (run / "tokenizer.json").is_file()
    out = generate(2, "--from", str(run), "--mesh", "tp=2", "--prompt", "the quick", "--prompt", "lazy",
                   "--max-new-tokens", "5", "--check")
    s = out["summary"]
    assert [r["prompt_text"] for r in s["requests"]] == ["the quick", "lazy"]
    for r in s["requests"]:
        assert len(r["tokens"]) == 5 and r["text"] == bytes(r["tokens"]).decode("utf-8", errors="replace")
    assert s["tokens_match_reference"] and s["max_logit_rel_diff"] <= 1e-10


def test_without_from_the_first_line_says_the_weights_are_random(capsys):
    assert main(["generate", "--prompt-lens", "4", "--new-tokens", "2", "--arrivals", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("weights: random, drawn from --seed 1234") and "--from" in first


@pytest.mark.parametrize(("args", "words"), [
    (["--prompt", "hello"], "random weights have no tokenizer"),
    (["--prompt", "hello", "--tokenizer", "bytes"],
     "the bytes tokenizer has 256 tokens but the model only 96"),
    (["--from", "/nonexistent/run"], "/nonexistent/run"),
])
def test_bad_generate_input_is_one_sentence(args, words, capsys):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


def test_generating_past_the_trained_length_notes_that_learned_positions_are_untrained(tmp_path, capsys):
    """GPT-2 (the family with a learned position table, holdings.Names.positions) trained on 8 positions,
    asked for 6 + 4: the report says positions 9 and 10 were never trained."""
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--seq-len", "8", "--save", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", "--from", str(run), "--prompt-lens", "6", "--new-tokens", "4",
                 "--arrivals", "0"]) == 0
    out = capsys.readouterr().out
    assert ("a sequence here reaches 9 positions; the run trained on 8, so GPT-2's learned position "
            "embeddings past those are untrained") in out
