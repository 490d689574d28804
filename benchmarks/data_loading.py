"""What real text costs a run, as a fraction of one GPT-2 small training step on one process:
opening and tokenizing corpora (bytes and BPE), and drawing one batch of GPT-2 small's shape from a
nanoGPT token file of ~100M tokens.

    python benchmarks/data_loading.py [--step-seconds S | --measure-step] [--threads 1] [--tokens 100000000]

The step, one of three ways:
- by default, a lower bound: the GEMM FLOPs of one step of the gpt2 preset (124M parameters) on a
  batch of --batch-size x --seq-len (8 x 1024, GPT-2 small's), refpar.analysis.flops.model_flops
  (exactly the GEMMs refpar's step runs), divided by the FLOP rate this machine's BLAS reaches on
  the step's largest GEMM, (B*T, C) @ (C, 4C), in the step's dtype with the same threads. A real step
  also does elementwise work and the optimizer, so it takes longer, and the fractions printed are
  upper bounds. The bound is checked against one real step of a smaller batch (--calibrate B x T,
  default 1 x 256, run by refpar.trainer's single-device loop: two steps, the second timed).
- --measure-step: the real step at the full shape, by refpar.trainer's single-device loop (two steps,
  the second timed). It holds tens of GB (float32 passed 17 GB before it was stopped on a 24 GB
  machine): for a machine with room.
- --step-seconds S: a time measured elsewhere.

The corpora: this repository's docs/ and lessons/ folders, and the Python standard library's own
source folder (sysconfig's "stdlib"; a site-packages inside it, as pyenv and python.org installs
keep one, is left out by reading a copy of the tree made of links to the other files). Each opened
with the bytes tokenizer and with a 512-token BPE (trained on the corpus, then used to tokenize it).
The token file: --tokens random uint16 ids written to a temporary train.bin and val.bin, opened by
memmap, then batches drawn: a cold batch (the first, its pages read from the page cache) and the
median of later ones. Opening reads each file once in place for its largest id.

Prints a table, each time beside its fraction of the step (the issue's target: under 5% for the
loading that happens every step; opening and tokenizing happen once a run). Not pass/fail.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="the GPT-2 small step's time, instead of measuring it")
    parser.add_argument("--measure-step", action="store_true",
                        help="run the full GPT-2 small step (tens of GB) instead of bounding it")
    parser.add_argument("--calibrate", default="1x256", help="B x T of the real step the bound is checked on")
    parser.add_argument("--step-dtype", default="float64", help="the step's dtype (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=100_000_000, help="the token file's length")
    parser.add_argument("--repeats", type=int, default=20, help="batches drawn after the first")
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    return parser.parse_args()


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)  # before NumPy loads: OpenBLAS reads its thread count once

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from refpar.data import open_data  # noqa: E402


def gpt2_step_seconds(batch_size: int, seq_len: int) -> float:
    """One real step of the gpt2 preset, by refpar.trainer's single-device loop (the second of two)."""
    from refpar.config import TrainConfig, model_preset
    from refpar.trainer import train_single_device

    result = train_single_device(model_preset("gpt2", dtype=ARGS.step_dtype),
                                 TrainConfig(steps=2, batch_size=batch_size, seq_len=seq_len))
    return result.step_times[1]


def gpt2_step_lower_bound(batch_size: int, seq_len: int) -> tuple[float, float]:
    """(seconds, FLOP/s): the step's GEMM FLOPs at the best rate of its largest GEMM on this machine."""
    from refpar.analysis.flops import model_flops
    from refpar.analysis.presets import from_model_config
    from refpar.config import model_preset

    model = model_preset("gpt2", dtype=ARGS.step_dtype)
    x = np.ones((batch_size * seq_len, model.n_embd), dtype=ARGS.step_dtype)  # (B*T, C)
    w = np.ones((model.n_embd, 4 * model.n_embd), dtype=ARGS.step_dtype)  # (C, 4C): c_fc
    times = [timed(lambda: x @ w)[1] for _ in range(5)]
    rate = 2 * x.shape[0] * w.shape[0] * w.shape[1] / min(times)
    return float(model_flops(from_model_config(model), batch_size, seq_len)) / rate, rate


def stdlib_without_site_packages(stdlib: Path, into: Path) -> Path:
    """A tree under `into` of links to the files of `stdlib`, leaving out site-packages and
    dist-packages (installed packages are not the standard library)."""
    for folder, subfolders, files in os.walk(stdlib):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        target = into / Path(folder).relative_to(stdlib)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            (target / name).symlink_to(Path(folder) / name)
    return into


def timed(call):
    start = time.perf_counter()
    value = call()
    return value, time.perf_counter() - start


def main() -> int:
    B, T = ARGS.batch_size, ARGS.seq_len
    if ARGS.step_seconds is not None:
        step, how = ARGS.step_seconds, "given"
    elif ARGS.measure_step:
        step, how = gpt2_step_seconds(B, T), "measured"
    else:
        step, rate = gpt2_step_lower_bound(B, T)
        how = f"lower bound: its GEMM FLOPs at {rate / 1e9:.1f} GFLOP/s"
        b, t = (int(v) for v in ARGS.calibrate.split("x"))
        real, bound = gpt2_step_seconds(b, t), gpt2_step_lower_bound(b, t)[0]
        print(f"check of the bound on a real {b} x {t} step: {real:.2f} s measured, {bound:.2f} s bound "
              f"({real / bound:.1f}x)", flush=True)
    print(f"GPT-2 small step of {B} x {T}, {ARGS.step_dtype}, {ARGS.threads} BLAS threads: {step:.2f} s "
          f"({how})\n", flush=True)
    print("| work | seconds | of a step | what |\n|---|---|---|---|", flush=True)

    def row(work: str, seconds: float, what: str = "") -> None:
        print(f"| {work} | {seconds:.4f} | {seconds / step:.2%} | {what} |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        stdlib = stdlib_without_site_packages(Path(ARGS.stdlib), Path(tmp) / "stdlib")
        for name, path in (("docs/", ROOT / "docs"), ("lessons/", ROOT / "lessons"), ("stdlib", stdlib)):
            for tokenizer in ("bytes", "bpe"):
                corpus, seconds = timed(lambda p=path, t=tokenizer: open_data(p, tokenizer=t))
                text_bytes = corpus.describe().split("(")[1].split(",")[0]
                row(f"open + tokenize {name}, {tokenizer}", seconds,
                    f"{text_bytes}, {corpus.train_tokens + corpus.val_tokens:,} tokens")
            _, seconds = timed(lambda c=corpus: c.batch(0, range(ARGS.batch_size), ARGS.seq_len))
            row(f"one {ARGS.batch_size} x {ARGS.seq_len} batch, {name} (in memory)", seconds)

        folder = Path(tmp) / "tokens"
        folder.mkdir()
        gen = np.random.default_rng(0)
        for split, n in (("train.bin", ARGS.tokens), ("val.bin", ARGS.tokens // 10)):
            with open(folder / split, "wb") as f:  # in chunks: never the whole file in memory here either
                for start in range(0, n, 1 << 24):
                    gen.integers(0, 50257, size=min(1 << 24, n - start)).astype(np.uint16).tofile(f)
        corpus, seconds = timed(lambda: open_data(folder, vocab_size=50304))
        row("open token files (memmap + largest-id scan)", seconds,
            f"{corpus.train_tokens + corpus.val_tokens:,} tokens, {type(corpus.train).__name__}")
        _, cold = timed(lambda: corpus.batch(0, range(ARGS.batch_size), ARGS.seq_len))
        row(f"one {ARGS.batch_size} x {ARGS.seq_len} batch from the memmap, first", cold)
        times = [timed(lambda s=s: corpus.batch(s, range(ARGS.batch_size), ARGS.seq_len))[1]
                 for s in range(1, 1 + ARGS.repeats)]
        row(f"one {ARGS.batch_size} x {ARGS.seq_len} batch from the memmap, median of {ARGS.repeats}",
            float(np.median(times)))
        _, seconds = timed(lambda: corpus.val_batch(ARGS.seq_len, ARGS.batch_size))
        row(f"validation batch of {ARGS.batch_size} x {ARGS.seq_len}", seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
