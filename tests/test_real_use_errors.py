"""Bad input at the command line, as a user meets it: each refused by `mpiexec -n 2 python -m refpar
train --mesh dp=2 ...` on every rank before any message, with exit status 2, one line on stderr
(rank 0's) naming the flag or path, no traceback, and nothing written (no --save folder, no --log or
--trace file). tests/test_data.py and tests/test_weights.py check each sentence at the function
level; here it is the whole command on two ranks, where a check made on one rank only would leave
the other waiting in a collective (the job would time out, or MPI_Abort would end it with another
status), and a sentence every rank printed would show twice. The second part: every file refpar
writes whole goes through refpar/files.py, which leaves the old file or the whole new one whether
the write raises or a SIGTERM comes in the middle of it.
"""

import json
import os

import numpy as np
import pytest

from tests.mpi import ROOT, mpiexec


def write_token_files(folder, top=1000):
    """nanoGPT's prepared data: train.bin and val.bin, uint16 token ids below `top`, the largest once."""
    folder.mkdir()
    ids = np.random.default_rng(1).integers(0, top, size=6000).astype(np.uint16)
    ids[123] = top - 1
    ids[:5000].tofile(folder / "train.bin")
    ids[5000:].tofile(folder / "val.bin")
    return folder


def gpt2_config(folder, **fields):
    """An HF GPT-2 folder's config.json, as save_pretrained writes it for a 2-layer GPT-2 (refpar reads
    the shape from it before any weight)."""
    folder.mkdir()
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 96, "n_positions": 32,
              "n_embd": 32, "n_layer": 2, "n_head": 4, "activation_function": "gelu_new"} | fields
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def wordpiece(path):
    """A BERT-style tokenizer.json made with the tokenizers library: not the BPE refpar reads."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(path))
    return path


def fifo(path):
    os.mkfifo(path)
    return path


def text_file(path, n=4000):
    path.write_text((ROOT / "docs" / "data.md").read_text()[:n])
    return path


# id -> (the flags, built in the test's folder `d`; the words rank 0's line must hold)
CASES = {
    "binary-data": (lambda d: ["--data", str(ROOT / "docs" / "app-home.png")],
                    ["app-home.png", "not UTF-8 text"]),
    "empty-data": (lambda d: ["--data", str(d / "empty.txt")], ["empty.txt", "is empty"]),
    "data-that-is-a-pipe": (lambda d: ["--data", str(fifo(d / "pipe"))],  # read, it would wait forever
                            ["pipe", "neither a file nor a folder"]),
    "corpus-shorter-than-a-window": (lambda d: ["--data", str(text_file(d / "short.txt", 100)),
                                                "--seq-len", "128"],
                                     ["short.txt", "choose seq_len below"]),
    "vocab-larger-than-uint16": (lambda d: ["--data", str(write_token_files(d / "tokens")),
                                            "--vocab-size", "70000"],
                                 ["train.bin", "70,000", "at most 65,536"]),
    "token-ids-past-vocab": (lambda d: ["--data", str(write_token_files(d / "tokens")),
                                        "--vocab-size", "500"],
                             ["train.bin", "token id 999", "vocabulary has 500"]),
    "wordpiece-tokenizer": (lambda d: ["--data", str(text_file(d / "text.txt")), "--tokenizer",
                                       str(wordpiece(d / "bert.json"))], ["bert.json", "WordPiece"]),
    "json-that-is-no-tokenizer": (lambda d: ["--data", str(text_file(d / "text.txt")), "--tokenizer",
                                             str(gpt2_config(d / "hf") / "config.json")],
                                  ["config.json", "not a tokenizer"]),
    "hf-folder-of-bert": (lambda d: ["--init-from", str(gpt2_config(d / "bert", model_type="bert",
                                                                    architectures=["BertModel"]))],
                          ["bert", "BertModel", "refpar reads GPT2LMHeadModel"]),
    "hf-folder-of-another-shape": (lambda d: ["--init-from", str(gpt2_config(d / "hf")), "--model", "tiny"],
                                   ["--model tiny has n_layer=4", "config.json"]),
    "tokenizer-without-data": (lambda d: ["--tokenizer", "bytes"], ["--tokenizer", "add --data"]),
    "negative-eval-every": (lambda d: ["--eval-every", "-1"], ["--eval-every"]),
    "log-in-a-missing-folder": (lambda d: ["--log", str(d / "no" / "run.jsonl")],
                                ["--log", "does not exist"]),
    "tensorboard-is-a-file": (lambda d: ["--tensorboard", str(text_file(d / "tb"))],
                              ["--tensorboard", "is a file"]),
    "trace-is-a-folder": (lambda d: ["--trace", str(d / "out")], ["--trace", "is a directory"]),
    # /proc: access() says root may write there, but no file can be made (as on NFS with root
    # squashed): --trace failed after the whole run with a traceback, --log as the run began
    "trace-where-no-file-can-be-made": (lambda d: ["--trace", "/proc/trace.json"],
                                        ["--trace '/proc/trace.json'", "no file can be created in '/proc'"]),
    "log-where-no-file-can-be-made": (lambda d: ["--log", "/proc/run.jsonl"],
                                      ["--log '/proc/run.jsonl'", "no file can be created in '/proc'"]),
    "save-under-a-file": (lambda d: ["--save", str(text_file(d / "text.txt") / "ckpt")],
                          ["--save", "lies under the file"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_by_every_rank_in_one_line_and_nothing_is_written(tmp_path, case):
    flags, words = CASES[case]
    (tmp_path / "empty.txt").write_bytes(b"")
    out = tmp_path / "out"  # where a run that started would write: it must stay empty
    out.mkdir()
    writers = {"--save": out / "ckpt", "--log": out / "run.jsonl", "--trace": out / "trace.json"}
    given = flags(tmp_path)
    for flag, path in writers.items():
        if flag not in given:
            given += [flag, str(path)]
    job = mpiexec(2, "-m", "refpar", "train", "--mesh", "dp=2", "--steps", "2", *given, check=False,
                  timeout=120)
    said = job.stdout + job.stderr
    lines = job.stderr.strip().splitlines()
    assert job.returncode == 2 and "Traceback" not in said and len(lines) == 1, said
    assert lines[0].startswith("refpar train: error: "), said
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert list(out.iterdir()) == [], list(out.iterdir())


# --- nothing half written: every whole file goes through refpar/files.py ------------------------


def test_a_write_that_raises_halfway_leaves_the_old_file_and_no_temporary_file(tmp_path):
    from refpar.files import make_folder_atomically, write_atomically

    def half_then_fail(f):
        f.write(b"new and half")
        raise OSError(28, "No space left on device")

    old = tmp_path / "trace.json"
    old.write_bytes(b"the old trace")
    with pytest.raises(OSError):
        write_atomically(old, half_then_fail)
    with pytest.raises(OSError):
        write_atomically(tmp_path / "new.json", half_then_fail)
    with pytest.raises(OSError):
        make_folder_atomically(tmp_path / "hf", lambda folder: half_then_fail(open(folder / "x", "wb")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    assert old.read_bytes() == b"the old trace"
    assert write_atomically(old, lambda f: f.write(b"the new trace")).read_bytes() == b"the new trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


# A process that writes `path` atomically under refpar's watcher (refpar/interrupt.py), made slow at
# one point (`where`): it says so on stdout, then the test sends SIGTERM.
SLOW_WRITER = """
import os, sys, time
from pathlib import Path
from refpar import files, interrupt
where, path = sys.argv[1], Path(sys.argv[2])

def ready():
    print("ready", flush=True)
    time.sleep(float(os.environ.get("SLOW_S", "30")))

def write(f):
    f.write(b"new, first half;")
    f.flush()
    if where == "write":
        ready()
    f.write(b" second half")

real_replace = os.replace
def slow_replace(src, dst):
    if where == "rename":
        ready()
    real_replace(src, dst)
os.replace = slow_replace

def fill(folder):
    write(open(folder / "model.safetensors", "wb"))

with interrupt.watching("refpar test"):
    if where == "folder":
        where = "write"
        files.make_folder_atomically(path, fill)
    else:
        files.write_atomically(path, write)
"""


@pytest.mark.parametrize("where, left", [("write", b"old"), ("rename", b"new, first half; second half"),
                                         ("folder", None)])
def test_sigterm_in_a_write_leaves_the_old_file_or_the_whole_new_one_and_no_temporary_file(tmp_path, where,
                                                                                           left):
    """Mid-write (between the temporary file's creation and its rename) the watcher removes the
    temporary file and the old file stays; mid-rename it waits for the rename (a file operation),
    so the new file is whole; a folder (refpar export's) mid-fill is absent, with no temporary folder."""
    import subprocess
    import sys

    from tests.mpi import mpi_env

    target = tmp_path / ("hf" if where == "folder" else "trace.json")
    if left is not None:
        target.write_bytes(b"old")
    # the rename is a file operation: the watcher waits for it, however long it takes (0.5 s here)
    slow = {"SLOW_S": "0.5" if where == "rename" else "30"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, where, str(target)], cwd=ROOT,
                            env=mpi_env(slow), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(15)  # SIGTERM
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err and out == "", (out, err)
    assert err.strip() == "refpar test: interrupted", err
    if left is None:
        assert list(tmp_path.iterdir()) == []
    else:
        assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == left


# The --log writer (refpar/engine/runlog.py) of a run under refpar's watcher, its file made to write
# each line in two halves with a pause between (as the kernel may, at a page boundary).
SLOW_LOG = """
import sys, time
from types import SimpleNamespace
from refpar import interrupt
from refpar.config import TrainConfig, model_preset
from refpar.engine.runlog import RunLog

class TwoHalves:
    def __init__(self, f):
        self.f = f
    def write(self, line):
        self.f.write(line[:10])
        self.f.flush()
        if '"step": 2' in line:
            print("ready", flush=True)
            time.sleep(0.5)
        return self.f.write(line[10:])
    def __getattr__(self, name):
        return getattr(self.f, name)

args = SimpleNamespace(log=sys.argv[1], tensorboard=None, resume=None)
with interrupt.watching("refpar train"), RunLog(model_preset("tiny"), TrainConfig(), 1, args, None,
                                                speak=True) as log:
    log.file = TwoHalves(log.file)
    step = log.on_step(lambda *row, **kw: None)
    for i in range(3):
        step(i, 3.0, 0.1, {}, None)
"""


def test_sigterm_in_the_middle_of_a_log_line_leaves_every_line_whole(tmp_path):
    """A line is one file operation: the watcher waits for its second half, then ends the process
    (without the lock, the file ends in the middle of step 2's line)."""
    import subprocess
    import sys

    from tests.mpi import mpi_env

    log = tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOG, str(log)], cwd=ROOT, env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(15)  # SIGTERM
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, (out, err)
    text = log.read_text()
    assert text.endswith("\n"), text
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    # the watcher may take the lock only after the next line's (Python's lock is not fair): whole too
    assert steps in ([1, 2], [1, 2, 3]), text
