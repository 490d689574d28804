"""The single-device trainer learns the Markov corpus, and `refpar train` reports it cleanly."""

import json
import subprocess
import sys

import numpy as np
import pytest

from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.engine.report import SUMMARY_FIELDS
from refpar.model.data import MarkovCorpus
from refpar.trainer import train_single_device
from tests.mpi import ROOT, mpi_env
from tests.numerics import CONTRACT, rel_diff, within


def refpar(*args):
    return subprocess.run([sys.executable, "-m", "refpar", *args], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=120)


def test_training_tiny_gets_more_than_halfway_from_the_initial_loss_to_the_floor():
    result = train_single_device(model_preset("tiny"), TrainConfig(steps=150, seed=7))
    first, floor = result.losses[0], result.loss_floor
    last = float(np.mean(result.losses[-10:]))  # the last ten, so one lucky batch does not pass it
    print(f"initial {first:.3f}, last ten {last:.3f}, floor {floor:.3f}")
    assert abs(first - np.log(96)) < 0.1  # GPT-2's init predicts nearly uniformly
    assert last < floor + 0.5 * (first - floor)
    assert last > floor - 0.05  # nothing beats the entropy rate (up to batch noise)


def test_a_vocabulary_too_large_for_a_dense_chain_gets_a_sparse_chain_and_its_stationary_pi():
    # GPT-2's 50257 tokens: no dense (V, V) matrix. pi by power iteration, checked against the
    # dense linear solve on the tiny chain (both within 1e-15 in the 1-norm of the exact pi:
    # a few ulps of its largest entry, far less than a wrong pi's error) and, on the large chain,
    # as a fixed point of P by np.add.at, not the bincount the corpus uses.
    from refpar.model.data import DENSE_VOCAB

    small = MarkovCorpus(96, seed=3)
    assert np.abs(small._stationary_by_iteration() - small.stationary).sum() < 1e-13
    V = DENSE_VOCAB + 1000
    corpus = MarkovCorpus(V, seed=3)
    assert corpus.transition is None
    pi = corpus.stationary
    moved = np.zeros(V)
    np.add.at(moved, corpus.successors.ravel(), (pi[:, None] * corpus.probs).ravel())  # (V,) pi P
    assert np.abs(moved - pi).sum() < 1e-13 and abs(pi.sum() - 1) < 1e-13
    rows = np.arange(V)
    assert np.array_equal(corpus.successors[:, 0], (rows + 1) % V)
    assert np.array_equal(corpus.successors[:, 1], (rows + 2) % V)
    ordered = np.sort(corpus.successors, axis=1)
    assert np.all(ordered[:, 1:] != ordered[:, :-1])  # k distinct successors per token
    tokens, targets = corpus.batch(0, range(200), 32)
    which = np.argmax(corpus.successors[tokens] == targets[..., None], axis=-1)  # (B, T) the edge taken
    assert np.all(corpus.successors[tokens, which] == targets)  # every step follows an edge
    nll = -np.log(corpus.probs[tokens, which])
    assert abs(nll.mean() - corpus.entropy_rate()) < 0.05  # 6,400 tokens: standard error ~0.01


def test_markov_floor_is_the_empirical_mean_negative_log_likelihood_of_the_chain():
    corpus = MarkovCorpus(96, seed=3)
    tokens, targets = corpus.batch(0, range(200), 32)
    nll = -np.log(corpus.transition[tokens, targets])
    assert abs(nll.mean() - corpus.entropy_rate()) < 0.05  # 6,400 tokens: standard error ~0.01
    # pi comes from a linear solve (LAPACK, in the kernel's order): stationary to the float64
    # contract, relative to its largest entry; a wrong pi is off by far more
    assert within(rel_diff(corpus.stationary @ corpus.transition, corpus.stationary), CONTRACT)
    # keyed by sample id: a data-parallel rank's slice equals the global rows
    part, _ = corpus.batch(0, [150, 151], 32)
    assert np.array_equal(part, tokens[150:152])
    with pytest.raises(ConfigError, match="vocab_size=3 is too small"):
        MarkovCorpus(3, seed=0)


def test_train_json_summary_is_the_last_line_with_every_summary_field_and_the_reference_losses():
    proc = refpar("train", "--model", "tiny", "--steps", "4", "--seed", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert list(summary) == list(SUMMARY_FIELDS)
    expected = train_single_device(model_preset("tiny"), TrainConfig(steps=4, seed=3)).losses
    assert summary["losses"] == expected  # the CLI runs exactly the reference loop
    assert summary["world_size"] == 1 and set(summary["mesh"].values()) == {1}
    assert summary["schedule"] is None and summary["reference_losses"] is None
    assert summary["config"]["train"]["seed"] == 3 and summary["dtype"] == "float64"
    assert 0 < summary["loss_floor"] < summary["losses"][0]
    assert lines[2] == ("optimizer: AdamW lr 0.01, weight decay 0.01 on matrices and embeddings, not biases "
                        "or norm gains")  # the start-up summary states the decay rule
    assert lines[3].split() == ["step", "loss", "floor", "tokens/s"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--steps", "many"], "invalid int value: 'many'"),
        (["--steps", "0"], "--steps 0 must be positive"),
        (["--model", "huge"], "unknown model preset 'huge'"),
        (["--mesh", "dp=2"], "the mesh dp=2 has 2 ranks but the job has 1"),
        (["--mesh", "dp2"], "needs the form axis=size"),
        (["--seq-len", "40"], "seq_len=40 is longer than n_positions=32"),
    ],
)
def test_bad_train_input_exits_non_zero_with_one_sentence_and_no_traceback(args, words):
    proc = refpar("train", *args)
    assert proc.returncode != 0
    assert words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
