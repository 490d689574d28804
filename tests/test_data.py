"""Real text in (refpar/data/): batches keyed by (seed, step, sample id), targets that are the
text's next tokens, tokenizers that round-trip and read Hugging Face's files, nanoGPT's token files
by memmap, the unigram entropy, and one sentence for each bad input."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from refpar.config import ConfigError
from refpar.data import ByteTokenizer, gpt2_tokenizer, load_tokenizer, make_tokenizer, open_data, train_bpe
from refpar.data import text as text_module
from tests.mpi import ROOT, mpi_env

UNICODE = "naïve café, 東京, Ελληνικά, emoji 🙂🚀, combining e\u0301, tab\tand\r\nCRLF, \u2028 \U0010fffd"


def random_text(n: int, seed: int = 0) -> str:
    """n characters of letters, spaces, newlines and some non-ASCII: windows of a few dozen
    characters are unique in it, so a window can be found again in the file."""
    alphabet = list("abcdefghijklmnopqrstuvwxyz     \n") + ["é", "ß", "東", "🙂"]
    return "".join(np.random.default_rng(seed).choice(alphabet, size=n))


def window_positions(stream: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Every offset o with stream[o : o+len(window)] == window (an independent search)."""
    views = np.lib.stride_tricks.sliding_window_view(np.asarray(stream), len(window))  # (n-w+1, w)
    return np.flatnonzero((views == window).all(axis=1))


def library_bpe(texts, vocab_size=300):
    """A byte-level BPE built with Hugging Face tokenizers directly (not through refpar)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       special_tokens=["<|endoftext|>"]))
    return tok


def one_sentence(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    print(message)
    assert "\n" not in message and not re.search(r"\.\s+[A-Z]", message), message  # one sentence
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


# --- batches -------------------------------------------------------------------------------------


def test_rows_are_keyed_by_seed_step_and_sample_id_so_any_split_of_the_ids_draws_the_same_rows(tmp_path):
    (tmp_path / "a.txt").write_text(random_text(20_000), encoding="utf-8")
    corpus = open_data(tmp_path / "a.txt", seed=5)
    whole = corpus.batch(3, range(8), 32)
    halves = [corpus.batch(3, range(0, 4), 32), corpus.batch(3, range(4, 8), 32)]
    for part in (0, 1):  # tokens, targets
        np.testing.assert_array_equal(whole[part], np.concatenate([h[part] for h in halves]))
    picked = corpus.batch(3, [6, 1], 32)
    np.testing.assert_array_equal(picked[0], whole[0][[6, 1]])
    assert whole[0].dtype == np.int64 and whole[0].shape == (8, 32)
    # another step, another seed: other windows
    assert not np.array_equal(corpus.batch(4, range(8), 32)[0], whole[0])
    assert not np.array_equal(open_data(tmp_path / "a.txt", seed=6).batch(3, range(8), 32)[0], whole[0])


def test_targets_are_the_next_bytes_of_the_text_file(tmp_path):
    text = random_text(5_000)
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    cut = len(text[:len(text) - round(len(text) * 0.1)].encode("utf-8"))  # the training part, in bytes
    corpus = open_data(tmp_path / "t.txt", tokenizer="bytes")
    assert corpus.train_tokens == cut and corpus.val_tokens == len(raw) - cut
    tokens, targets = corpus.batch(0, range(16), 40)
    for row in range(16):
        window = np.append(tokens[row], targets[row][-1])  # (T+1,)
        offsets = window_positions(raw, window)
        assert len(offsets) == 1 and offsets[0] + 41 <= cut  # inside the training part
        np.testing.assert_array_equal(targets[row][:-1], tokens[row][1:])
    vtokens, vtargets = corpus.val_batch(40, 3)
    for row in range(3):
        offset = window_positions(raw, np.append(vtokens[row], vtargets[row][-1]))
        assert len(offset) == 1 and offset[0] >= cut
    np.testing.assert_array_equal(corpus.val_batch(40, 3)[0], vtokens)  # the same every call


def test_a_folder_is_read_recursively_in_sorted_order_skipping_hidden_binary_and_non_utf8_files(tmp_path):
    texts = {"b.txt": random_text(300, 1), "a.md": UNICODE * 3, "sub/c.py": random_text(500, 2)}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(text.encode("utf-8"))
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / ".hidden.txt").write_text("not read")
    corpus = open_data(tmp_path, val_fraction=0.25)
    order = ["a.md", "b.txt", "sub/c.py"]
    cuts = {n: len(texts[n]) - round(len(texts[n]) * 0.25) for n in order}
    train = b"".join(texts[n][:cuts[n]].encode("utf-8") for n in order)
    val = b"".join(texts[n][cuts[n]:].encode("utf-8") for n in order)
    np.testing.assert_array_equal(corpus.train, np.frombuffer(train, dtype=np.uint8))
    np.testing.assert_array_equal(corpus.val, np.frombuffer(val, dtype=np.uint8))
    assert "3 files" in corpus.describe() and "2 skipped" in corpus.describe()
    assert corpus.vocab_size == 256 and corpus.tokenizer.name == "bytes"


def test_a_long_text_tokenized_in_pieces_gives_the_ids_of_the_whole(tmp_path, monkeypatch):
    text = "\n".join(f"line {i}:  some words,\n\n  indented {i * i}" for i in range(400))
    (tmp_path / "t.txt").write_text(text)
    whole = open_data(tmp_path / "t.txt", tokenizer="bpe", vocab_size=300)
    monkeypatch.setattr(text_module, "PIECE_CHARS", 100)
    assert len(text_module._pieces(text)) > 100
    pieces = open_data(tmp_path / "t.txt", tokenizer="bpe", vocab_size=300)
    np.testing.assert_array_equal(pieces.train, whole.train)
    np.testing.assert_array_equal(pieces.val, whole.val)
    training_part = text[:len(text) - round(len(text) * 0.1)]
    np.testing.assert_array_equal(whole.train, whole.tokenizer.encode(training_part))


def test_unigram_entropy_against_a_hand_count(tmp_path):
    # val_fraction 0.5 holds out the second half; the first, "aaaabbcc", has p = 1/2, 1/4, 1/4:
    # H = 1/2 ln 2 + 2 (1/4 ln 4) = 1.5 ln 2
    (tmp_path / "t.txt").write_text("aaaabbcc" + "zzzzzzzz")
    corpus = open_data(tmp_path / "t.txt", val_fraction=0.5)
    assert corpus.unigram_entropy() == pytest.approx(1.5 * np.log(2), rel=1e-15)


# --- tokenizers ----------------------------------------------------------------------------------


def test_the_byte_tokenizer_round_trips_any_unicode_and_its_ids_are_the_utf8_bytes(tmp_path):
    code_points = np.random.default_rng(0).integers(1, 0x110000, size=2000)
    random_unicode = "".join(chr(c) for c in code_points if not 0xD800 <= c < 0xE000)  # no surrogates
    tok = ByteTokenizer()
    for text in (UNICODE, random_unicode, ""):
        ids = tok.encode(text)
        assert ids.dtype == np.int64 and list(ids) == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # a cut character: replaced, not an error
    assert isinstance(load_tokenizer(tok.save(tmp_path)), ByteTokenizer)


def test_a_bpe_trained_twice_gives_identical_files_in_any_process_and_round_trips_text(tmp_path):
    texts = [(ROOT / "docs" / name).read_text() for name in ("lessons.md", "troubleshooting.md")]
    first, second = train_bpe(texts, 400), train_bpe(iter(texts), 400)
    a, b = first.save(tmp_path / "a").read_bytes(), second.save(tmp_path / "b").read_bytes()
    assert a == b and first.vocab_size == 400
    # Another process with one thread (another rank): the same file.
    script = ("import sys; from pathlib import Path; from refpar.data import train_bpe; "
              "texts = [Path(sys.argv[1], n).read_text() for n in ('lessons.md', 'troubleshooting.md')]; "
              "train_bpe(texts, 400).save(sys.argv[2])")
    env = {**mpi_env(), "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(ROOT / "docs"), str(tmp_path / "c")], env=env,
                   check=True, timeout=120)
    assert (tmp_path / "c" / "tokenizer.json").read_bytes() == a
    for text in (texts[0][:2000], UNICODE):
        ids = first.encode(text)
        assert first.decode(ids) == text and ids.max() < 400
    assert len(first.encode(texts[0])) < 0.7 * len(texts[0].encode("utf-8"))  # the merges compress
    loaded = load_tokenizer(tmp_path / "a")
    assert loaded.name == "hf" and list(loaded.encode(UNICODE)) == list(first.encode(UNICODE))


def test_load_tokenizer_reads_files_that_tokenizers_and_transformers_wrote(tmp_path):
    library = library_bpe([random_text(3000, 3), UNICODE])
    library.save(str(tmp_path / "mine.json"))
    text = random_text(500, 4) + "<|endoftext|>" + UNICODE
    ours = load_tokenizer(tmp_path / "mine.json")
    expected = library.encode(text, add_special_tokens=False).ids
    assert list(ours.encode(text)) == expected and expected.count(library.token_to_id("<|endoftext|>")) == 1
    assert ours.decode(expected) == library.decode(expected, skip_special_tokens=False) == text
    assert ours.vocab_size == library.get_vocab_size()
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf-model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=library).save_pretrained(str(folder))
    from_folder = load_tokenizer(folder)
    assert list(from_folder.encode(text)) == expected and from_folder.decode(expected) == text


def test_gpt2_comes_from_the_hugging_face_cache_when_tiktoken_is_absent_and_never_downloads(
        tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken fails
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as error:
        gpt2_tokenizer()
    one_sentence(error, "tokenizer.json", "Hugging Face GPT-2", "downloads nothing")
    snapshot = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    library = library_bpe([random_text(2000, 5)])
    library.save(str(snapshot / "tokenizer.json"))
    tok = make_tokenizer("gpt2", None, None)
    assert tok.name == "gpt2" and list(tok.encode("some text")) == library.encode("some text").ids


# --- nanoGPT token files -------------------------------------------------------------------------


def write_token_files(folder, train_n=50_000, val_n=5_000, top=1000):
    folder.mkdir(exist_ok=True)
    gen = np.random.default_rng(1)
    train, val = (gen.integers(0, top, size=n).astype(np.uint16) for n in (train_n, val_n))
    train[123], val[45] = top - 1, top - 1  # the largest id, in both
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")


def test_token_files_are_memory_mapped_and_give_the_windows_np_fromfile_would(tmp_path):
    write_token_files(tmp_path / "data")
    (tmp_path / "data" / "input.txt").write_text("the text nanoGPT prepared them from")  # ignored
    corpus = open_data(tmp_path / "data")
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
    assert corpus.vocab_size == 1000 and corpus.tokenizer is None  # the largest id + 1
    train = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint16)
    assert (corpus.train_tokens, corpus.val_tokens) == (len(train), len(val))
    tokens, targets = corpus.batch(7, range(6), 64)
    for row in range(6):
        assert len(window_positions(train, np.append(tokens[row], targets[row][-1]))) == 1
    vtokens, vtargets = corpus.val_batch(64, 4)
    for row in range(4):
        assert len(window_positions(val, np.append(vtokens[row], vtargets[row][-1]))) == 1
    counts = np.bincount(train, minlength=1000) / len(train)
    assert corpus.unigram_entropy() == pytest.approx(-(counts[counts > 0] * np.log(counts[counts > 0])).sum(),
                                                     rel=1e-12)


def test_a_single_bin_file_or_a_train_bin_alone_holds_out_its_tail(tmp_path):
    write_token_files(tmp_path / "data")
    os.remove(tmp_path / "data" / "val.bin")
    whole = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)
    for path in (tmp_path / "data", tmp_path / "data" / "train.bin"):
        corpus = open_data(path, vocab_size=1024, val_fraction=0.2)
        assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
        np.testing.assert_array_equal(corpus.train, whole[:40_000])
        np.testing.assert_array_equal(corpus.val, whole[40_000:])
        assert corpus.vocab_size == 1024 and "last 20% held out" in corpus.describe()


def test_token_files_with_a_tokenizer_take_its_vocabulary_and_decode_with_it(tmp_path):
    library = library_bpe([random_text(3000, 6)], vocab_size=280)
    library.save(str(tmp_path / "tokenizer.json"))
    text = random_text(4000, 7)
    ids = np.asarray(library.encode(text).ids, dtype=np.uint16)
    ids.tofile(tmp_path / "text.bin")
    corpus = open_data(tmp_path / "text.bin", tokenizer=str(tmp_path / "tokenizer.json"))
    assert corpus.vocab_size == library.get_vocab_size() and corpus.tokenizer.name == "hf"
    tokens, _ = corpus.batch(0, range(2), 50)
    for row in tokens:  # each window decodes to a piece of the text
        assert len(window_positions(ids, row)) >= 1 and corpus.tokenizer.decode(row) in text


# --- bad input: one sentence each, naming the path and what to change -----------------------------


def test_each_bad_input_gets_one_sentence_naming_the_file_and_what_to_change(tmp_path):
    def refused(*words, call):
        with pytest.raises(ConfigError) as error:
            call()
        return one_sentence(error, *words)

    refused("missing.txt", "does not exist", "text file", call=lambda: open_data(tmp_path / "missing.txt"))
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    refused("image.png", "not UTF-8 text", call=lambda: open_data(tmp_path / "image.png"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    refused("latin1.txt", "not UTF-8 text", call=lambda: open_data(tmp_path / "latin1.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    refused("empty.txt", "is empty", call=lambda: open_data(tmp_path / "empty.txt"))
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(b"\0\1\2")
    refused("pictures", "no UTF-8 text", "1 other files skipped",
            call=lambda: open_data(tmp_path / "pictures"))
    (tmp_path / "short.txt").write_text("x" * 100)
    short = open_data(tmp_path / "short.txt")
    refused("short.txt", "90 training tokens", "choose seq_len below 90",
            call=lambda: short.check_fits(8, 128))
    refused("short.txt", "10 validation tokens", "larger validation fraction",
            call=lambda: short.check_fits(8, 32))
    refused("between 0 and 1", call=lambda: open_data(tmp_path / "short.txt", val_fraction=1.0))
    # token files
    write_token_files(tmp_path / "data")
    refused("70,000", "train.bin", "at most 65,536",
            call=lambda: open_data(tmp_path / "data", vocab_size=70_000))
    refused("train.bin", "token id 999", "vocabulary has 500", call=lambda: open_data(tmp_path / "data",
                                                                                        vocab_size=500))
    refused("no text to train a BPE", call=lambda: open_data(tmp_path / "data", tokenizer="bpe"))
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    refused("odd.bin", "not a whole number of uint16 tokens", call=lambda: open_data(tmp_path / "odd.bin"))
    (tmp_path / "only-val").mkdir()
    (tmp_path / "only-val" / "val.bin").write_bytes(b"\1\0")
    refused("only-val", "no train.bin", call=lambda: open_data(tmp_path / "only-val"))
    (tmp_path / "empty.bin").write_bytes(b"")
    refused("empty.bin", "is empty", call=lambda: open_data(tmp_path / "empty.bin"))
    # tokenizers
    from tokenizers import Tokenizer, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.save(str(tmp_path / "bert.json"))
    refused("bert.json", "WordPiece", "BPE", call=lambda: load_tokenizer(tmp_path / "bert.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    refused("config.json", "not a tokenizer", call=lambda: load_tokenizer(tmp_path / "config.json"))
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0b\xff\xfe sentencepiece")
    refused("tokenizer.model", "not a tokenizer", call=lambda: load_tokenizer(tmp_path / "tokenizer.model"))
    (tmp_path / "other.json").write_text(json.dumps({"refpar_tokenizer": "unigram"}))
    refused("other.json", "'unigram'", call=lambda: load_tokenizer(tmp_path / "other.json"))
    refused("pictures", "holds no tokenizer.json", call=lambda: load_tokenizer(tmp_path / "pictures"))
    short_text = tmp_path / "short.txt"
    refused("'bpf'", "choose bytes, bpe, gpt2", call=lambda: open_data(short_text, tokenizer="bpf"))
    refused("at least 257", call=lambda: open_data(short_text, tokenizer="bpe", vocab_size=256))
    refused("vocab size 0", "positive integer", call=lambda: open_data(short_text, vocab_size=0))
    refused("exactly 256", call=lambda: open_data(short_text, tokenizer="bytes", vocab_size=512))
