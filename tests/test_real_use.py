"""What a new user meets first (issue 38): each preset's optimizer recipe lowers its loss, one process
runs one BLAS thread unless told otherwise, the validation loss of a mesh is the single device's, the
Markov corpus's held-out sequences are the chain's, and outputs that could not be written are refused
before the run. Text data, weights in and out and interruption have their own files (test_data.py,
test_weights.py, test_interrupt.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from refpar.cli import main, parse
from refpar.commands.train import configs
from refpar.config import MODEL_PRESETS, RECIPES, ConfigError, TrainConfig, check_output_path, model_preset
from refpar.model.data import MarkovCorpus
from refpar.trainer import train_single_device
from tests.mpi import ROOT, refpar_json


def run_refpar(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refpar", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.parametrize("corpus", [(), ("--data", "docs")], ids=["markov", "text"])
def test_every_preset_has_a_recipe_whose_defaults_lower_its_loss(corpus):
    """`refpar train --model M` with no optimizer flag, on the Markov corpus and on this repository's
    docs/ in bytes: the loss on held-out windows after the last step is below that of the weights the
    run started from (a batch's own loss is too noisy a measure at these sizes). 12 steps of 8 x 16
    tokens; GPT-2 small's recipe on 2 of its 12 blocks (all 12 take minutes here), on the Markov corpus
    (50,257 tokens: its head alone is 39M parameters) 3 steps of 2 x 16."""
    assert set(RECIPES) == set(MODEL_PRESETS)
    for name in MODEL_PRESETS:
        shape = ("--steps", "12")
        if name == "gpt2":
            shape = ("--n-layer", "2") + (("--steps", "3", "--batch-size", "2") if not corpus else shape)
        proc = run_refpar("train", "--model", name, *shape, "--eval-every", "4", *corpus, "--json")
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout.splitlines()[-1])
        recipe, val = RECIPES[name], summary["val_losses"]
        assert summary["config"]["train"]["lr"] == recipe.lr
        assert summary["config"]["train"]["lr_schedule"] == recipe.schedule
        assert val[0]["step"] == 0 and val[-1]["loss"] < val[0]["loss"], f"{name}: {val}"


def test_a_recipe_warms_up_over_at_most_a_tenth_of_the_run_and_decays_to_its_fraction_of_the_peak():
    def train_config(*flags):
        return configs(parse(["train", "--model", "small", *flags]))[1]

    small = RECIPES["small"]
    cfg = train_config("--steps", "20")
    assert (cfg.lr, cfg.warmup_steps, cfg.lr_schedule) == (small.lr, 2, "cosine")  # min(100, 20 // 10)
    assert cfg.min_lr == small.min_lr_ratio * small.lr
    assert train_config("--steps", "5000").warmup_steps == small.warmup_steps
    cfg = train_config("--steps", "20", "--lr", "0.002")  # the recipe's floor follows the given peak
    assert cfg.min_lr == small.min_lr_ratio * 0.002
    cfg = train_config("--steps", "20", "--lr-schedule", "constant", "--warmup-steps", "0")
    assert (cfg.lr_schedule, cfg.min_lr, cfg.warmup_steps) == ("constant", 0.0, 0)


@pytest.mark.parametrize("chosen, threads", [(None, 1), ("2", 2)])
def test_one_process_runs_one_blas_thread_unless_the_user_chose(chosen, threads):
    """refpar's entry point sets the thread count before NumPy loads OpenBLAS; threadpoolctl reads
    what OpenBLAS actually runs."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS")}
    if chosen is not None:
        env["OPENBLAS_NUM_THREADS"] = chosen
    code = ("import refpar.cli, threadpoolctl; print(max(i['num_threads'] for i in "
            "threadpoolctl.threadpool_info() if i['user_api'] == 'blas'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if chosen is not None and os.cpu_count() < threads:
        pytest.skip("OpenBLAS caps its threads at the cores")
    assert int(out.stdout) == threads


def test_the_validation_loss_of_a_mesh_is_the_single_devices_on_the_held_out_sequences():
    """dp=2 with ZeRO-3 (each rank holds half of every unit) and pp=2 (each rank half the blocks): the
    parameters gathered as a save writes them, evaluated on rank 0, give the single device's held-out
    loss after the same steps."""
    for mesh in (("--mesh", "dp=2", "--zero", "3"), ("--mesh", "pp=2", "--microbatches", "2")):
        s = refpar_json(2, "train", *mesh, "--steps", "4", "--eval-every", "2", "--check")
        assert [v["step"] for v in s["val_losses"]] == [0, 2, 4]  # 0: the weights it starts from
        for got, want in zip(s["val_losses"], s["reference_val_losses"], strict=True):
            assert abs(got["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
        assert s["val_losses"][-1]["loss"] < s["val_losses"][0]["loss"]
        # the gathers ran on an untraced communicator: the traced bytes are still the closed forms'
        rows = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in s["comm_bytes"]}
        want = {(r["rank"], r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"])
                for r in s["expected_comm_bytes"] if r["bytes_sent"] or r["bytes_recv"]}
        assert rows == want


def test_the_markov_corpus_held_out_sequences_follow_the_chain_and_are_not_training_rows():
    corpus = MarkovCorpus(96, seed=7)
    tokens, targets = corpus.val_batch(16, 32)  # (32, 16) each
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])
    # every step is an edge of the chain: its successor table, an independent description of it
    for a, b in zip(tokens.ravel(), targets.ravel(), strict=True):
        assert b in corpus.successors[a]
    again, _ = corpus.val_batch(16, 32)
    assert np.array_equal(tokens, again)
    train, _ = corpus.batch(0, range(32), 16)
    assert not any(np.array_equal(row, t) for row in tokens for t in train)


def test_a_validation_loss_is_computed_every_n_steps_and_after_the_last():
    model, cfg = model_preset("tiny"), TrainConfig(steps=5, eval_every=2)
    assert [s for s, _ in train_single_device(model, cfg).val_losses] == [0, 2, 4, 5]


def test_trace_on_one_device_writes_a_trace_with_no_messages(tmp_path):
    path = tmp_path / "t.json"
    proc = run_refpar("train", "--steps", "2", "--trace", str(path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(path.read_text())["traceEvents"] == []
    assert path.with_name(path.name + ".jsonl").exists()  # PATH.jsonl, as --help says


def test_an_existing_output_the_user_cannot_write_is_refused_before_the_run():
    """As another user (uid 65534) a root-owned read-only file cannot be written: the check refuses it
    in one sentence (root itself may write any file, so the check runs in a child that gave root up)."""
    folder = tempfile.mkdtemp()  # pytest's tmp_path lies in a folder only root may enter
    os.chmod(folder, 0o755)
    target = os.path.join(folder, "trace.json")
    with open(target, "w") as f:
        f.write("{}")
    os.chmod(target, 0o444)
    try:
        if os.geteuid() != 0:
            with pytest.raises(ConfigError, match="exists and is not writable"):
                check_output_path("--trace", target)
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop root, check, report the sentence through the pipe, leave
            message = "accepted"
            try:
                os.setuid(65534)
                check_output_path("--trace", target)
            except BaseException as err:  # noqa: BLE001  (whatever it is, the parent reports it)
                message = f"{type(err).__name__}: {err}"
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        message = os.read(read, 4096).decode()
        assert message.startswith("ConfigError") and "exists and is not writable" in message, message
    finally:
        shutil.rmtree(folder)


def test_a_resumed_run_keeps_the_schedule_its_checkpoint_trained_with(tmp_path):
    """The small recipe warms up over a tenth of --steps: a run extended from 20 to 40 steps by
    --resume keeps the checkpoint's 2 warmup steps (its manifest's), instead of refusing to go on."""
    run = str(tmp_path / "run")
    small = ["--model", "small", "--seq-len", "8", "--batch-size", "2"]
    assert main(["train", *small, "--steps", "20", "--save", run]) == 0
    cfg = configs(parse(["train", *small, "--steps", "40", "--resume", run]))[1]
    assert (cfg.warmup_steps, cfg.lr, cfg.min_lr) == (2, RECIPES["small"].lr, 0.1 * RECIPES["small"].lr)
    assert main(["train", *small, "--steps", "22", "--resume", run]) == 0
    given = configs(parse(["train", *small, "--steps", "40", "--resume", run, "--warmup-steps", "3"]))[1]
    assert given.warmup_steps == 3  # a flag given wins, and the checkpoint then refuses what differs
