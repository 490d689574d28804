"""Tokenizers for real text: UTF-8 bytes, a byte-level BPE trained on the corpus, GPT-2's, or one
read from a tokenizer.json.

    from refpar.data.tokenizers import make_tokenizer, load_tokenizer
    tok = make_tokenizer("bpe", lambda: ["some text", "more text"], vocab_size=300)
    ids = tok.encode("some text")            # (n,) int64, each in [0, tok.vocab_size)
    tok.decode(ids)                          # 'some text'
    load_tokenizer(tok.save("run/"))         # run/tokenizer.json, read back as the same tokenizer

- `bytes`: the 256 byte values of the text's UTF-8 encoding. No dependency, no training; every
  text round-trips; decoding a cut multi-byte character gives U+FFFD (errors="replace").
- `bpe`: a byte-level BPE (Sennrich et al. 2016; GPT-2's byte-to-unicode pre-tokenizer, Radford et
  al. 2019) trained on the corpus by Hugging Face's `tokenizers` library. Its trainer is
  deterministic (merges picked by count, ties by pair id): the same texts give the same file, so
  every rank that trains one gets the same tokenizer.
- `gpt2`: tiktoken's "gpt2" encoding where tiktoken and its encoding file are on this machine, or a
  GPT-2 tokenizer.json in the Hugging Face cache. Nothing is downloaded.
- a path: a tokenizer.json (or a folder holding one): refpar's own, `{"refpar_tokenizer": "bytes"}`,
  or a Hugging Face BPE tokenizer file (one `bpe` saved, GPT-2's, Llama's ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from refpar.config import ConfigError
from refpar.files import write_atomically

FILE_NAME = "tokenizer.json"
REFPAR_KEY = "refpar_tokenizer"  # refpar's own tokenizer.json: {"refpar_tokenizer": "bytes" | "gpt2"}
NAMES = ("bytes", "bpe", "gpt2")  # the tokenizers named by a word; anything else is a path
# A corpus of a few MB (refpar's docs and lessons, a slice of the standard library) has a few hundred
# frequent pieces (common words, indentation, keywords): 512 tokens learn those, about halve the
# tokens per text against bytes, and keep the embedding and logits small for the tiny and small
# presets. Pass a vocab size for more.
DEFAULT_BPE_VOCAB = 512
ENCODE_BATCH_CHARS = 1 << 20  # texts handed to the library at once: its Encodings cost ~100 bytes a token


class Tokenizer:
    """Text <-> int64 ids in [0, vocab_size). `name` is "bytes", "bpe", "gpt2", or "hf" for a
    Hugging Face tokenizer read from a file."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode(t) for each text; a library tokenizer does them together."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def save(self, folder) -> Path:
        """Writes folder/tokenizer.json (atomically: a reader sees the old file or the whole new one);
        `load_tokenizer` reads it back."""
        path = Path(folder) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self._json()
        write_atomically(path, lambda f: f.write(text.encode("utf-8")))
        return path

    def _json(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name} tokenizer, {self.vocab_size} tokens>"


class ByteTokenizer(Tokenizer):
    name, vocab_size = "bytes", 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)  # (n_bytes,)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def _json(self) -> str:
        return json.dumps({REFPAR_KEY: "bytes"})


class BPETokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (Hugging Face): one `train_bpe` made ("bpe") or one read from a
    file ("hf"). Special tokens are neither added on encode nor dropped on decode: the ids are the
    text's own, and a generated <|endoftext|> shows."""

    def __init__(self, library_tokenizer, name: str = "bpe"):
        self.library_tokenizer = library_tokenizer
        self.name = name
        self.vocab_size = library_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.library_tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The library encodes a group of texts on all cores; groups of ~1M characters keep its
        per-token Encoding objects (offsets, masks: ~100 bytes a token) small."""
        out: list[np.ndarray] = []
        start = 0
        while start < len(texts):
            end, chars = start, 0
            while end < len(texts) and (end == start or chars + len(texts[end]) <= ENCODE_BATCH_CHARS):
                chars += len(texts[end])
                end += 1
            encodings = self.library_tokenizer.encode_batch_fast(texts[start:end], add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int64) for e in encodings)
            start = end
        return out

    def decode(self, ids) -> str:
        return self.library_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _json(self) -> str:
        return self.library_tokenizer.to_str()


class TiktokenTokenizer(Tokenizer):
    """tiktoken's "gpt2" encoding (50257 tokens). `<|endoftext|>` in a text is encoded as plain text
    (encode_ordinary), as the library tokenizers here do with text."""

    name = "gpt2"

    def __init__(self, encoding):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids], errors="replace")

    def _json(self) -> str:
        return json.dumps({REFPAR_KEY: "gpt2"})


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, then merges in order of count)
    learned from `texts`; fewer if the texts run out of pairs to merge. No special tokens."""
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ConfigError(f"a BPE vocabulary of {vocab_size} tokens has no merges (its first 256 "
                          f"tokens are the bytes); choose a vocab size of at least 257, e.g. 512, or "
                          f"the bytes tokenizer")
    from tokenizers import Tokenizer as LibraryTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    library_tokenizer = LibraryTokenizer(models.BPE())
    library_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    library_tokenizer.decoder = decoders.ByteLevel()
    # All 256 bytes in the alphabet, whatever the corpus holds: any text encodes, none is unknown.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    library_tokenizer.train_from_iterator(texts, trainer)
    return BPETokenizer(library_tokenizer, name="bpe")


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's tokenizer from what is on this machine, never downloaded: tiktoken's "gpt2" encoding
    if tiktoken is installed and its encoding files are in its cache, else a GPT-2 tokenizer.json in
    the Hugging Face hub cache; a ConfigError saying how to give one otherwise."""
    encoding = _tiktoken_gpt2()
    if encoding is not None:
        return TiktokenTokenizer(encoding)
    cached = _hf_cached_gpt2()
    if cached is not None:
        tokenizer = load_tokenizer(cached)
        tokenizer.name = "gpt2"
        return tokenizer
    raise ConfigError("GPT-2's tokenizer is not on this machine (it needs tiktoken with its gpt2 "
                      "encoding files already cached, and refpar downloads nothing); give the path of "
                      "a tokenizer.json instead, e.g. the one in a Hugging Face GPT-2 model folder")


class _WouldDownload(Exception):
    pass


def _tiktoken_gpt2():
    """tiktoken's "gpt2" Encoding, or None. tiktoken reads its files through `tiktoken.load.read_file`
    when they are not in its cache: replaced for the call by one that refuses URLs, so a missing
    file is a None here, never a download (whatever the version's URLs or cache folder)."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        return None
    read_file = tiktoken.load.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _WouldDownload(blobpath)
        return read_file(blobpath)

    tiktoken.load.read_file = local_only
    try:
        return tiktoken.get_encoding("gpt2")
    except (_WouldDownload, ValueError, OSError):
        return None
    finally:
        tiktoken.load.read_file = read_file


def _hf_cached_gpt2() -> Path | None:
    """A GPT-2 tokenizer.json the Hugging Face hub cache already holds (HF_HUB_CACHE, HF_HOME/hub or
    ~/.cache/huggingface/hub), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    for repo in ("models--openai-community--gpt2", "models--gpt2"):
        found = sorted(Path(hub, repo, "snapshots").glob(f"*/{FILE_NAME}"))
        if found:
            return found[-1]
    return None


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer in a tokenizer.json file, or in a folder holding one: refpar's own
    ({"refpar_tokenizer": "bytes" | "gpt2"}) or a Hugging Face BPE tokenizer file."""
    path = Path(path)
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        where = (f"{path} holds no {FILE_NAME}" if path.is_dir() else
                 f"tokenizer file {path} is not a file" if path.exists() else  # a device, a pipe
                 f"tokenizer file {path} does not exist")
        raise ConfigError(f"{where}; give a {FILE_NAME} (one a run saved, or a Hugging Face model "
                          f"folder's) or a folder holding one, or choose bytes, bpe or gpt2")
    try:
        spec = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{file} is not a tokenizer: a {FILE_NAME} is JSON (a Hugging Face tokenizers "
                          f"file, or refpar's own); give one, or choose bytes, bpe or gpt2") from None
    if isinstance(spec, dict) and REFPAR_KEY in spec:
        kind = spec[REFPAR_KEY]
        if kind == "bytes":
            return ByteTokenizer()
        if kind == "gpt2":
            return gpt2_tokenizer()
        raise ConfigError(f"{file} names refpar tokenizer {kind!r}, which this refpar does not know; "
                          f"refpar writes bytes and gpt2 (a BPE is written as a Hugging Face file)")
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or "type" not in model:
        raise ConfigError(f"{file} is JSON but not a tokenizer (it has no tokenizer model); give a "
                          f"{FILE_NAME} written by Hugging Face tokenizers or by refpar")
    if model["type"] != "BPE":
        # WordPiece and Unigram files (BERT's, T5's) normalise text (lower case, accents): decoded
        # text is not the text, so a language model's output could not be read back as written.
        raise ConfigError(f"{file} holds a {model['type']} tokenizer; refpar reads BPE tokenizer files "
                          f"(GPT-2's, Llama's, or one trained with --tokenizer bpe) and its own bytes "
                          f"tokenizer: give one of those")
    from tokenizers import Tokenizer as LibraryTokenizer

    try:
        library_tokenizer = LibraryTokenizer.from_str(json.dumps(spec))
    except Exception as error:  # the library's own parse error: any malformed field
        raise ConfigError(f"{file} is not a tokenizer file Hugging Face tokenizers can read "
                          f"({str(error).splitlines()[0]}); give an unmodified {FILE_NAME}") from None
    return BPETokenizer(library_tokenizer, name="hf")


def make_tokenizer(spec: str, texts_fn: Callable[[], Iterable[str]], vocab_size: int | None) -> Tokenizer:
    """The tokenizer `spec` names: "bytes", "bpe" (trained on `texts_fn()`, `vocab_size` tokens),
    "gpt2", or the path of a tokenizer.json or of a folder holding one. `vocab_size` is the BPE's
    size; for the others it must be left out (bytes: 256) or be at least the tokenizer's (a model
    vocabulary padded past it, as nanoGPT pads GPT-2's 50257 to 50304)."""
    if spec == "bpe":
        return train_bpe(texts_fn(), DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size)
    if spec == "bytes":
        if vocab_size not in (None, 256):
            raise ConfigError(f"the bytes tokenizer has exactly 256 tokens, not {vocab_size}; leave out "
                              f"the vocab size, or choose the bpe tokenizer to train {vocab_size} tokens")
        return ByteTokenizer()
    if spec == "gpt2":
        tokenizer = gpt2_tokenizer()
    elif os.sep in spec or spec.endswith(".json") or Path(spec).exists():
        tokenizer = load_tokenizer(spec)
    else:
        raise ConfigError(f"unknown tokenizer {spec!r}; choose {', '.join(NAMES)} or the path of a "
                          f"{FILE_NAME}")
    if vocab_size is not None and vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"a vocab size of {vocab_size} is smaller than the {tokenizer.name} "
                          f"tokenizer's {tokenizer.vocab_size} tokens; leave it out or give at least "
                          f"{tokenizer.vocab_size}")
    return tokenizer

