"""Real text in: `open_data(path, tokenizer, vocab_size)` reads a UTF-8 file, a folder of them or
nanoGPT's token files into a `TextCorpus` whose batches are keyed by (seed, step, sample id), as the
synthetic Markov corpus's are (refpar/model/data.py). Tokenizers are in refpar/data/tokenizers.py."""

from refpar.data.text import TextCorpus, open_data
from refpar.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    make_tokenizer,
    train_bpe,
)

__all__ = ["BPETokenizer", "ByteTokenizer", "TextCorpus", "Tokenizer", "gpt2_tokenizer", "load_tokenizer",
           "make_tokenizer", "open_data", "train_bpe"]
