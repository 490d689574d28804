"""nanoGPT's prepared token files, read as they are: train.bin and val.bin hold uint16 token ids
one after the other, as nanoGPT's data/*/prepare.py writes them (`np.array(ids, np.uint16).tofile`).

    train, val, vocab, tokenizer, source = open_token_files(Path("data/shakespeare"), "gpt2", None, 0.1)

Both are opened with np.memmap: a batch reads the pages of its own windows, and the ranks on one
machine share the page cache; no rank ever copies a file whole. Opening reads each file once, in
place, for its largest id (every id must be below the model's vocabulary).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from refpar.config import ConfigError
from refpar.data.tokenizers import Tokenizer, make_tokenizer

TOKEN_DTYPE = np.uint16  # nanoGPT's: GPT-2's 50257 ids fit, and each token takes 2 bytes
TOKEN_LIMIT = int(np.iinfo(TOKEN_DTYPE).max) + 1  # 65536 ids: the largest vocabulary the files hold
COUNT_CHUNK = 1 << 22  # tokens counted at once: bincount makes an int64 copy of what it counts


def is_token_data(path: Path) -> bool:
    """A .bin file, or a folder holding train.bin or val.bin (nanoGPT's data folders also hold
    input.txt and prepare.py: the token files win)."""
    if path.is_file():
        return path.suffix == ".bin"
    return (path / "train.bin").is_file() or (path / "val.bin").is_file()


def open_token_files(path: Path, tokenizer: str | None, vocab_size: int | None, val_fraction: float):
    """(train, val, vocab_size, tokenizer or None, source) for a folder with train.bin (and val.bin)
    or a single .bin file; without a val.bin the file's last `val_fraction` is held out."""
    if path.is_dir():
        train_path, val_path = path / "train.bin", path / "val.bin"
        if not train_path.is_file():
            raise ConfigError(f"data folder {path} holds val.bin but no train.bin; put nanoGPT's train.bin "
                              f"beside it (its prepare.py writes both)")
        val_path = val_path if val_path.is_file() else None
    else:
        train_path, val_path = path, None
    if vocab_size is not None and vocab_size > TOKEN_LIMIT:
        raise ConfigError(f"a vocabulary of {vocab_size:,} tokens does not fit the uint16 ids of "
                          f"{train_path} (at most {TOKEN_LIMIT:,}); give a vocab size of at most "
                          f"{TOKEN_LIMIT:,}")
    tok = _tokenizer(tokenizer, vocab_size, train_path)
    train = _memmap(train_path)
    if val_path is not None:
        val = _memmap(val_path)
        held_out = f"{train_path} and {val_path.name}"
    else:
        cut = train.shape[0] - round(train.shape[0] * val_fraction)
        train, val = train[:cut], train[cut:]  # slices of a memmap are memmaps of the same file
        held_out = f"{train_path} (its last {val_fraction:.0%} held out: no val.bin)"
    largest = {file: int(part.max())  # one pass over each file, in place
               for file, part in ((train_path, train), (val_path, val)) if part.shape[0]}
    vocab = vocab_size or (tok.vocab_size if tok is not None else max(largest.values()) + 1)
    for file, top in largest.items():
        if top >= vocab:
            raise ConfigError(f"{file or train_path} holds token id {top:,}, but the vocabulary has "
                              f"{vocab:,} tokens (ids 0 to {vocab - 1:,}); give a vocab size above {top:,} "
                              f"or the tokenizer that wrote the file")
    return train, val, vocab, tok, f"token files: {held_out} (uint16, memory-mapped)"


def _tokenizer(spec: str | None, vocab_size: int | None, train_path: Path) -> Tokenizer | None:
    if spec is None:
        return None
    if spec == "bpe":
        raise ConfigError(f"{train_path} is already tokenized, so there is no text to train a BPE on; "
                          f"give the tokenizer that wrote it (gpt2 or a tokenizer.json), or none")
    tok = make_tokenizer(spec, lambda: (), vocab_size)
    if tok.vocab_size > TOKEN_LIMIT:
        raise ConfigError(f"the {tok.name} tokenizer has {tok.vocab_size:,} tokens, more than the uint16 ids "
                          f"of {train_path} hold ({TOKEN_LIMIT:,}); give the tokenizer that wrote the file")
    return tok


def _memmap(path: Path) -> np.memmap:
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"token file {path} is empty; give nanoGPT's prepared files, or a text file")
    if size % np.dtype(TOKEN_DTYPE).itemsize:
        raise ConfigError(f"token file {path} is {size:,} bytes, not a whole number of uint16 tokens; "
                          f"give a file of uint16 ids as nanoGPT's prepare.py writes them")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def token_counts(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """(V,) int64 occurrences of each id in the stream, counted a chunk at a time: a memmap is read
    in place, never converted whole."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, stream.shape[0], COUNT_CHUNK):
        counts += np.bincount(stream[start:start + COUNT_CHUNK], minlength=vocab_size)
    return counts
