"""Real text for training: a UTF-8 file, a folder of them, or nanoGPT's token files, drawn in
windows keyed by (seed, step, sample id) as the Markov corpus draws its sequences.

    corpus = open_data("docs/", tokenizer="bpe", vocab_size=512)
    corpus.check_fits(batch_size=8, seq_len=256)
    tokens, targets = corpus.batch(step, range(8), 256)   # (8, 256) int64 each
    print(corpus.describe())

A row is the window of T+1 training tokens at an offset drawn from refpar.rng keyed by (seed,
"data", step, sample id); tokens are its first T, targets its last T. A data-parallel rank that
draws its own sample ids gets exactly its rows of the global batch, so every mesh reproduces the
single device on text as on the Markov corpus (refpar/model/data.py).

Held-out split, for text: the last `val_fraction` of each file's characters (so validation text
comes from every file, not only the last ones in sorted order, and a BPE learns its merges from the
training part only); for token files: val.bin. The streams of the files are joined as they are
(each file's training part, then the next's), with nothing between them.

Legend: T = sequence length (seq_len), b = rows of a batch (len(sample_ids)), N = training tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refpar import rng
from refpar.config import ConfigError
from refpar.data import token_files
from refpar.data.tokenizers import Tokenizer, make_tokenizer

SNIFF_BYTES = 8192  # a file whose first 8 KB hold a NUL byte is binary, and is not read further
PIECE_CHARS = 1 << 20  # a longer text is tokenized in pieces cut after a newline (see _pieces)


@dataclass
class TextCorpus:
    """Training and validation token streams (1-D arrays or np.memmaps of ids) and how to draw
    windows from them."""

    train: np.ndarray  # (N,) ids, the smallest unsigned dtype that holds the vocabulary, or a memmap
    val: np.ndarray  # (M,) held-out ids
    vocab_size: int  # the model's vocabulary: every id is below it
    tokenizer: Tokenizer | None  # None: token files with no tokenizer given (no text out)
    seed: int
    source: str  # what was read, for describe(): "text: 41 files of docs/ (312 KB, 3 skipped)"

    @property
    def train_tokens(self) -> int:
        return int(self.train.shape[0])

    @property
    def val_tokens(self) -> int:
        return int(self.val.shape[0])

    def describe(self) -> str:
        """One line for the run header."""
        if self.tokenizer is None:
            words = f"no tokenizer (vocabulary {self.vocab_size:,})"
        else:
            words = f"{self.tokenizer.name} tokenizer ({self.tokenizer.vocab_size:,})"
            if self.vocab_size != self.tokenizer.vocab_size:
                words += f", vocabulary {self.vocab_size:,}"
        return (f"{self.source}, {words}, {self.train_tokens:,} training and {self.val_tokens:,} "
                f"validation tokens")

    def batch(self, step: int, sample_ids, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets), each (b, T) int64: row i is the window of T+1 training tokens at the
        offset keyed by (seed, "data", step, sample_ids[i]); targets are the tokens shifted by one."""
        self.check_fits(len(sample_ids), seq_len)
        starts = self.train_tokens - seq_len  # offsets 0 .. N-T-1 hold a whole window
        offsets = [int(rng.generator(self.seed, "data", step, int(s)).integers(0, starts))
                   for s in sample_ids]
        return _windows(self.train, offsets, seq_len)

    def val_batch(self, seq_len: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets), each (rows, T) int64: `rows` held-out windows evenly spaced from the
        first validation token to the last, the same on every call and every rank."""
        self.check_fits(rows, seq_len)
        offsets = np.linspace(0, self.val_tokens - seq_len - 1, rows).round().astype(np.int64)  # (rows,)
        return _windows(self.val, offsets, seq_len)

    def unigram_entropy(self) -> float:
        """-sum_v p_v log p_v in nats over the training tokens' frequencies p: the loss of the best
        model that ignores context, the first mark a model that learns passes."""
        counts = token_files.token_counts(self.train, self.vocab_size)  # (V,)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def check_fits(self, batch_size: int, seq_len: int) -> None:
        """A ConfigError when a split is shorter than one window of seq_len + 1 tokens. (Rows may
        overlap, so a batch of any size fits once one window does.)"""
        for split, n, more in (("training", self.train_tokens, "give more text"),
                               ("validation", self.val_tokens, "give more text or a larger validation "
                                                               "fraction")):
            if n < seq_len + 1:
                raise ConfigError(f"{self.source} has {n:,} {split} tokens, fewer than one window of "
                                  f"seq_len + 1 = {seq_len + 1:,} for a batch of {batch_size} x {seq_len}; "
                                  f"choose seq_len below {n:,} or {more}")


def _windows(stream: np.ndarray, offsets, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows stream[o : o+T+1] as (tokens, targets). From a memmap each slice reads its own pages:
    the file is never read whole."""
    rows = np.stack([np.asarray(stream[o:o + seq_len + 1], dtype=np.int64) for o in offsets])  # (b, T+1)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])  # (b, T) each


def open_data(path, tokenizer: str | None = None, vocab_size: int | None = None, seed: int = 1234,
              val_fraction: float = 0.1) -> TextCorpus:
    """The corpus at `path`: a UTF-8 text file, a folder of them (read recursively in sorted order;
    hidden entries left out; files that are not UTF-8 text skipped and counted), a folder holding
    nanoGPT's train.bin and val.bin, or one such .bin file (its last `val_fraction` held out).

    tokenizer: for text "bytes" (default), "bpe", "gpt2" or the path of a tokenizer.json; for token
    files optional (it only decodes generated text). vocab_size: for "bpe" the BPE's size (default
    512); otherwise the model's vocabulary, default the tokenizer's, or for token files without a
    tokenizer the largest id in them + 1."""
    path = Path(path)
    if not 0 < val_fraction < 1:
        raise ConfigError(f"the validation fraction {val_fraction} must be between 0 and 1 (exclusive); "
                          f"use e.g. 0.1")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ConfigError(f"the vocab size {vocab_size} must be a positive integer; leave it out for "
                          f"the tokenizer's own")
    if not path.exists():
        raise ConfigError(f"data path {path} does not exist; give a UTF-8 text file, a folder of them, "
                          f"or a folder with nanoGPT's train.bin and val.bin")
    if not (path.is_file() or path.is_dir()):  # a device or a pipe: read as a folder it holds nothing
        raise ConfigError(f"data path {path} is neither a file nor a folder; give a UTF-8 text file, a "
                          f"folder of them, or a folder with nanoGPT's train.bin and val.bin")
    if token_files.is_token_data(path):
        train, val, vocab, tok, source = token_files.open_token_files(path, tokenizer, vocab_size,
                                                                      val_fraction)
        return TextCorpus(train, val, vocab, tok, seed, source)
    return _open_text(path, tokenizer or "bytes", vocab_size, seed, val_fraction)


def _open_text(path: Path, spec: str, vocab_size, seed: int, val_fraction: float) -> TextCorpus:
    texts, skipped, size = _read_texts(path)
    # Per file: the first 1 - val_fraction of its characters train, the rest is held out.
    cuts = [len(t) - round(len(t) * val_fraction) for t in texts]
    train_texts = [t[:c] for t, c in zip(texts, cuts, strict=True)]
    val_texts = [t[c:] for t, c in zip(texts, cuts, strict=True)]
    tokenizer = make_tokenizer(spec, lambda: iter(train_texts), vocab_size)
    vocab = tokenizer.vocab_size if vocab_size is None or spec == "bpe" else vocab_size
    dtype = np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32
    train, val = (_tokenize(tokenizer, part, dtype) for part in (train_texts, val_texts))
    if path.is_dir():
        source = f"text: {len(texts)} files of {path}/ ({_size(size)}, {skipped} skipped)"
    else:
        source = f"text: {path} ({_size(size)})"
    return TextCorpus(train, val, vocab, tokenizer, seed, source)


def _tokenize(tokenizer: Tokenizer, texts: list[str], dtype) -> np.ndarray:
    """The ids of the texts, one after the other: (n,) of `dtype`."""
    pieces = [p for t in texts for p in _pieces(t)]
    ids = tokenizer.encode_batch(pieces)
    return np.concatenate([i.astype(dtype) for i in ids]) if ids else np.zeros(0, dtype)


def _pieces(text: str) -> list[str]:
    """The text in pieces of about PIECE_CHARS, each cut after a newline that a non-space follows.
    There, byte-level BPE's pre-tokenizer (GPT-2's regular expression) ends a token anyway, so GPT-2
    style tokenizers give the same ids as for the whole text; bytes always do."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = start + PIECE_CHARS
        while cut < len(text) and not (text[cut - 1] == "\n" and not text[cut].isspace()):
            cut += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _read_texts(path: Path) -> tuple[list[str], int, int]:
    """(texts, files skipped, bytes read) of a text file or a folder of them."""
    if path.is_file():
        data = path.read_bytes()
        if not data:
            raise ConfigError(f"data file {path} is empty; give a file with text in it")
        text = _as_text(data)
        if text is None:
            raise ConfigError(f"data file {path} is not UTF-8 text; give a UTF-8 text file, a folder of "
                              f"them, or nanoGPT's token files (train.bin and val.bin)")
        return [text], 0, len(data)
    texts, skipped, size = [], 0, 0
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).parts
        if any(part.startswith(".") for part in relative):  # .git, .venv, editor files
            continue
        text = _read_if_text(file)
        if text is None:
            skipped += 1
            continue
        texts.append(text)
        size += len(text.encode("utf-8"))
    if not any(texts):
        raise ConfigError(f"data folder {path} holds no UTF-8 text ({skipped} other files skipped); "
                          f"give a folder with text files, a text file, or nanoGPT's train.bin and val.bin")
    return texts, skipped, size


def _read_if_text(file: Path) -> str | None:
    """The file's text, or None for a binary, non-UTF-8 or unreadable file."""
    try:
        with open(file, "rb") as f:
            head = f.read(SNIFF_BYTES)
            if b"\0" in head:
                return None
            data = head + f.read()
    except OSError:
        return None
    return _as_text(data)


def _as_text(data: bytes) -> str | None:
    """The bytes as a str, exactly (no newline translation), or None where they are not UTF-8 text
    (a decoding error, or a NUL byte: binary formats have them, text does not)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB" if n >= 1e3 else f"{n} bytes"
