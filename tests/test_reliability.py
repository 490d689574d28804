"""Nothing lost, nothing hung (issue 43): a resume while another job saves, two jobs saving into one
directory, runs and files overwritten without a word.

    python -m pytest -q tests/test_reliability.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from refpar import checkpoint, save_lock
from refpar.cli import main
from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.trainer import train_single_device
from tests.mpi import ROOT, mpi_env, mpiexec
from tests.numerics import CONTRACT

MODEL, TRAIN = model_preset("tiny", n_layer=1), TrainConfig(steps=4, batch_size=4, seq_len=8)
SHAPE = ["--n-layer", "1", "--batch-size", "4", "--seq-len", "8"]
STEP2, STEP4 = "step-00000002", "step-00000004"


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A finished 4-step run on one process, saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("run4")
    train_single_device(MODEL, TRAIN, save=str(root), save_every=2)
    return root


# Rank 0 lists the directory as it was just before step 4's manifest landed, rank 1 just after: the
# moment a resume meets a live writer (issue 43, item 1: 5 of 8 tries deadlocked). Each rank choosing
# with its own listing loads another step and the two wait in different collectives.
STALE_LISTING = """
import sys
from refpar import checkpoint
from refpar.cli import launcher_rank, main

real_find = checkpoint.find

def find(path):
    found = real_find(path)
    if launcher_rank() == 0 and found.name == "step-00000004":
        return found.parent / "step-00000002"  # listed before step 4 was complete
    return found

checkpoint.find = find
sys.exit(main(sys.argv[1:]))
"""


def test_a_resume_while_a_save_lands_loads_rank_0s_step_on_every_rank(tmp_path, run4):
    script = tmp_path / "job.py"
    script.write_text(STALE_LISTING)
    proc = mpiexec(2, str(script), "train", "--mesh", "dp=2", *SHAPE, "--steps", "5", "--resume", str(run4),
                   "--json", env={"REFPAR_COLLECTIVE_TIMEOUT": "20"}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.strip().splitlines()[-1])["losses"]
    # rank 0's choice, step 2, on both ranks: the losses of steps 3, 4 and 5 of one process resumed there
    ref = train_single_device(MODEL, replace(TRAIN, steps=5), resume=str(run4 / STEP2)).losses
    assert len(losses) == 3 and np.allclose(losses, ref, rtol=CONTRACT, atol=0), (losses, ref)


def test_generate_from_a_run_while_a_save_lands_loads_rank_0s_step_on_every_rank(tmp_path, run4):
    script = tmp_path / "job.py"
    script.write_text(STALE_LISTING)
    proc = mpiexec(2, str(script), "generate", "--from", str(run4), "--mesh", "tp=2", "--prompt-lens", "5,3",
                   "--arrivals", "0", "--new-tokens", "3", "--check", "--json",
                   env={"REFPAR_COLLECTIVE_TIMEOUT": "20"}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # both ranks hold rank 0's step 2 (each its tp half), so their tokens are one device's from step 2
    assert summary["weights"]["from"] == str(run4 / STEP2) and summary["tokens_match_reference"]


# A writer that completes a step every few milliseconds (copies of step 2 under newer names,
# each renamed into place whole, as a save's manifest lands), and one job resuming from the
# directory three times meanwhile on 2 ranks.
WRITER = """
import shutil, sys, time
from pathlib import Path
root, source = Path(sys.argv[1]), Path(sys.argv[2])
for n in range(3, 100000):
    tmp = root / f".tmp-{n}"
    shutil.copytree(source, tmp)
    tmp.rename(root / f"step-{n:08d}")
    time.sleep(0.003)
"""
RESUME_THREE_TIMES = """
import sys
from refpar.cli import main
codes = [main(sys.argv[1:]) for _ in range(3)]
print("codes", codes, flush=True)
sys.exit(max(codes))
"""


def test_three_resumes_beside_a_live_writer_all_finish(tmp_path, run4):
    root = tmp_path / "live"
    shutil.copytree(run4 / STEP2, root / STEP2)
    (tmp_path / "writer.py").write_text(WRITER)
    (tmp_path / "job.py").write_text(RESUME_THREE_TIMES)
    writer = subprocess.Popen([sys.executable, str(tmp_path / "writer.py"), str(root), str(run4 / STEP2)])
    try:
        proc = mpiexec(2, str(tmp_path / "job.py"), "train", "--mesh", "dp=2", *SHAPE, "--steps", "3",
                       "--resume", str(root), env={"REFPAR_COLLECTIVE_TIMEOUT": "20"}, timeout=180,
                       check=False)
    finally:
        writer.kill()
        writer.wait()
    assert proc.returncode == 0 and "codes [0, 0, 0]" in proc.stdout, proc.stderr[-3000:]


def test_a_resume_of_the_step_another_job_is_writing_is_refused(tmp_path, run4):
    root = tmp_path / "ckpt"
    shutil.copytree(run4, root)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a job (the sleeper's pid, on this host) holds the lock and is writing step 4
        save_lock.lock_path(root).write_text(json.dumps({"host": os.uname().nodename, "pid": sleeper.pid,
                                                         "step": STEP4}))
        with pytest.raises(checkpoint.CheckpointError, match=f"{STEP4} is being written now by process "
                                                              f"{sleeper.pid}"):
            checkpoint.decide_resume(root)
        with pytest.raises(ConfigError, match=f"is being written by process {sleeper.pid}"):
            save_lock.take(root)
        # between its saves, a resume of its newest complete step goes ahead
        save_lock.lock_path(root).write_text(json.dumps({"host": os.uname().nodename, "pid": sleeper.pid,
                                                         "step": None}))
        assert checkpoint.decide_resume(root) == str(root / STEP4)
    finally:
        sleeper.kill()
        sleeper.wait()
    # its process gone (killed with SIGKILL, say), the lock is stale and the next run takes it over
    lock = save_lock.take(root)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    save_lock.release(lock)


def test_two_jobs_saving_into_one_directory_one_refused_and_the_other_run_whole(tmp_path):
    run = [sys.executable, "-m", "refpar", "train", *SHAPE, "--steps", "2", "--save-every", "1",
           "--save", str(tmp_path / "ckpt")]
    jobs = {seed: subprocess.Popen(run + ["--seed", str(seed)], cwd=ROOT, env=mpi_env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in (1, 2)}
    outs = {seed: (job.wait(timeout=120), job.communicate()[1]) for seed, job in jobs.items()}
    finished = [seed for seed, (code, _) in outs.items() if code == 0]
    refused = [err for code, err in outs.values() if code == 2]
    assert len(finished) == 1 and len(refused) == 1, outs
    assert refused[0].count("\n") == 1 and ("is being written by process" in refused[0]
                                            or "already holds a run" in refused[0]), refused[0]
    for step in (1, 2):  # every step of the run that went ahead is complete and its own
        man = checkpoint.read_manifest(tmp_path / "ckpt" / f"step-{step:08d}")
        assert man["train"]["seed"] == finished[0] and man["step"] == step
    assert not save_lock.lock_path(tmp_path / "ckpt").exists()


def test_save_over_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, run4, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(run4, root)
    before = sorted(p.name for p in root.iterdir())
    train = ["train", *SHAPE, "--steps", "2", "--save", str(root)]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert f"--save {root} already holds a run ({STEP2}, {STEP4}); continue it with --resume" in err, err
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written, no lock left
    # --overwrite replaces the run: its old step 4 no longer lies beside the new run's step 2
    assert main(train + ["--overwrite"]) == 0
    assert sorted(p.name for p in root.iterdir()) == [STEP2]
    assert main(["train", *SHAPE, "--steps", "3", "--save", str(root), "--resume", str(root)]) == 0
    assert checkpoint.find(root).name == "step-00000003"


@pytest.mark.parametrize("flag", ["--trace", "--log"])
def test_an_existing_trace_or_log_is_refused_unless_overwrite(tmp_path, flag, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    (tmp_path / "notes.jsonl").write_text("mine too")  # with_suffix's file, which --trace left alone before
    train = ["train", *SHAPE, "--steps", "1", flag, str(notes)]
    assert main(train) == 2
    assert f"{flag} '{notes}' exists; pass --overwrite" in capsys.readouterr().err
    assert notes.read_text() == "mine"
    assert main(train + ["--overwrite"]) == 0
    assert (tmp_path / "notes.jsonl").read_text() == "mine too"
    if flag == "--trace":  # its second file is PATH.jsonl, as the help says
        assert json.loads(notes.read_text())["traceEvents"] == [] and (tmp_path / "notes.txt.jsonl").exists()


def test_a_figure_that_exists_is_refused_unless_overwrite(tmp_path, capsys):
    figure = tmp_path / "f.html"
    figure.write_text("mine")
    schedule = ["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--figure", str(figure)]
    assert main(schedule) == 2
    assert f"--figure '{figure}' exists; pass --overwrite" in capsys.readouterr().err
    assert figure.read_text() == "mine"
    assert main(schedule + ["--overwrite"]) == 0 and figure.read_text() != "mine"



# ------------------------------------------------------------ refpar check on hostile files (item 7)
@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    from tests.test_fuzz_check import correct_dump

    return correct_dump(tmp_path_factory.mktemp("dump"), "tp")


def _zip_bomb(path) -> None:
    """An .npz of 80 KB whose tokens inflate to 80 MB of zeros (a 1-block model's dump is under 1 MB)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z, \
            z.open("tokens.npy", "w", force_zip64=True) as f:
        header = {"descr": "<i8", "fortran_order": False, "shape": (80 << 17,)}
        np.lib.format.write_array_header_2_0(f, header)
        zeros = bytes(1 << 20)
        for _ in range(80):
            f.write(zeros)


def _truncated_member(path) -> None:
    """An .npz whose tokens' header promises 1000 numbers and holds one."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z, z.open("tokens.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (1000,)})
        f.write(bytes(8))


HOSTILE = {  # what is put in the dump's place -> words of the sentence
    "layout-fifo": ("layout.json", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    "shard-fifo": ("rank0.npz", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    "layout-dev-zero": ("layout.json", lambda p: p.symlink_to("/dev/zero"), "is a device, not a regular"),
    "layout-deep": ("layout.json", lambda p: p.write_text("[" * 200_000), "nested too deeply"),
    "layout-nan": ("layout.json", lambda p: p.write_text('{"model": NaN}'), "NaN is not a number JSON"),
    "shard-bomb": ("rank0.npz", _zip_bomb, "to 83,886,208 bytes, more than the model's"),
    "shard-truncated-member": ("rank0.npz", _truncated_member, "rank0.npz has a damaged array"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_check_refuses_a_hostile_file_in_one_sentence_without_waiting_or_inflating(dump, tmp_path, case,
                                                                                    capsys):
    name, plant, words = HOSTILE[case]
    broken = tmp_path / "dump"
    shutil.copytree(dump, broken)
    (broken / name).unlink()
    plant(broken / name)
    assert main(["check", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refpar check: error: ") and err.count("\n") == 1 and words in err, err
    assert "pickled" not in err


# ------------------------------------------------- a hand-edited manifest (item 5), one sentence each
def _edit(doc: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    if value is _REMOVED:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


_REMOVED = object()
NOT_JSON = "is not a number JSON allows"  # NaN and Infinity: refused by the reader, checksum or not
EDITS = {  # what issue 43 tried (each a traceback, or silently taken) -> words of the sentence
    "shape-infinity": (("tensors", "params/wte.weight", "shape", 0), float("inf"), NOT_JSON),
    "bytes-infinity": (("files", 0, "bytes"), float("inf"), NOT_JSON),
    "box-infinity": (("files", 0, "arrays", 0, "box", 0, 1), float("inf"), NOT_JSON),
    "step-infinity": (("step",), float("inf"), NOT_JSON),
    "step-nan": (("step",), float("nan"), NOT_JSON),
    "shape-10**400": (("tensors", "params/wte.weight", "shape", 0), 10 ** 400, "has no shape of whole"),
    "bytes-string": (("files", 0, "bytes"), "12", "lacks its name, sha256, size or arrays"),
    "box-float": (("files", 0, "arrays", 0, "box", 0, 1), 2.0, "no key, tensor and box"),
    "step-two": (("step",), "two", "'step' is two, not a whole number"),
    "step-1.5": (("step",), 1.5, "'step' is 1.5, not a whole number"),
    "model-5": (("model",), 5, "'model' is missing or not an object"),
    "no-model": (("model",), _REMOVED, "lacks model in its manifest"),
    "optimizer-t-x": (("optimizer_t",), "x", "'optimizer_t' is x, not a whole number"),
    "loss-scaler-junk": (("loss_scaler",), {"scale": "big"}, "'loss_scaler' is not a positive finite"),
    "loss-scale-nan": (("loss_scaler",), {"scale": float("nan"), "good_steps": 0, "skipped": 0}, NOT_JSON),
    "loss-scale-0": (("loss_scaler",), {"scale": 0, "good_steps": 0, "skipped": 0},
                     "'loss_scaler' is not a positive finite"),
}


@pytest.mark.parametrize("resigned", [True, False], ids=["checksum-redone", "checksum-left"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_manifest_is_refused_in_one_sentence(tmp_path, run4, edit, resigned):
    step = tmp_path / STEP2
    shutil.copytree(run4 / STEP2, step)
    doc = json.loads((step / checkpoint.MANIFEST).read_text())
    path, value, words = EDITS[edit]
    _edit(doc, path, value)
    if resigned:  # as a forger who knew the format: the field checks must catch it
        doc[checkpoint.CHECKSUM] = checkpoint._checksum(doc)
    elif words != NOT_JSON:  # a plain hand edit: the checksum catches it first
        words = "does not match its contents"
    (step / checkpoint.MANIFEST).write_text(json.dumps(doc))  # NaN and Infinity as a hand edit writes them
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load_whole(step, MODEL, replace(TRAIN, steps=6))
    assert words in str(err.value) and "\n" not in str(err.value), err.value


def test_a_manifest_from_before_checksums_still_loads_and_its_fields_are_still_checked(tmp_path, run4):
    step = tmp_path / STEP2
    shutil.copytree(run4 / STEP2, step)
    signed = checkpoint.load_whole(step, MODEL, replace(TRAIN, steps=6))
    doc = json.loads((step / checkpoint.MANIFEST).read_text())
    del doc[checkpoint.CHECKSUM]  # as an older refpar wrote it
    (step / checkpoint.MANIFEST).write_text(json.dumps(doc))
    step_n, params, _ = checkpoint.load_whole(step, MODEL, replace(TRAIN, steps=6))
    assert step_n == signed[0] and params.keys() == signed[1].keys()  # the run is not lost: bit for bit
    assert all(np.array_equal(params[n], signed[1][n]) for n in params)
    doc["step"] = 1.5
    (step / checkpoint.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(checkpoint.CheckpointError, match="'step' is 1.5, not a whole number"):
        checkpoint.load_whole(step, MODEL, replace(TRAIN, steps=6))


def test_a_manifest_nested_200k_deep_or_larger_than_a_manifest_is_refused(tmp_path, run4):
    step = tmp_path / STEP2
    shutil.copytree(run4 / STEP2, step)
    (step / checkpoint.MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(checkpoint.CheckpointError, match="nested too deeply"):
        checkpoint.read_manifest(step)
    with open(step / checkpoint.MANIFEST, "wb") as f:  # sparse: no disk is spent on it
        f.truncate(checkpoint.MANIFEST_LIMIT + 1)
    with pytest.raises(checkpoint.CheckpointError, match="more than the 67,108,864 such a file can be"):
        checkpoint.read_manifest(step)
    (step / checkpoint.MANIFEST).unlink()
    os.mkfifo(step / checkpoint.MANIFEST)  # passed over, as an unfinished save's: find waits on nothing
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.read_manifest(tmp_path)


# --------------------------------------------------------------------- schedule CSVs (item 6)
CSVS = {
    "cell-over-131072": ("0F0," + "x" * 140_000 + "\n", "cannot be read as CSV (row 0: field larger than"),
    "number-over-4300-digits": ("0F" + "9" * 5000 + "\n", "a cell of 5,002 characters is not an action"),
    "number-of-150-digits": ("0F" + "9" * 150 + "\n", "is not a computation"),
    "20-MB-of-idle-cells": ("," * (20 << 20), "more than the 8,388,608 a schedule's can be"),
    "a-million-idle-rows": ("\n" * 5000 + "0F0\n", "more than 4,096 rows or 1,048,576 cells"),
}


@pytest.mark.parametrize("case", sorted(CSVS))
def test_a_hostile_schedule_csv_is_one_sentence_from_schedule_and_train(tmp_path, case, capsys):
    from tests.fuzz import run_as_rank

    text, words = CSVS[case]
    path = tmp_path / "s.csv"
    path.write_text(text)
    assert main(["schedule", "--from-csv", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err[:500]
    # train refuses it on every rank before any message (it was an MPI abort)
    for rank in (0, 1):
        out = run_as_rank(["train", "--mesh", "pp=2", "--schedule-csv", str(path)], rank, 2)
        assert out.kind == "refused", out.describe()[:1000]
        assert rank or (out.stderr.count("\n") == 1 and words in out.stderr), out.stderr[:500]


# ------------------------------------------------------------ hostile arguments (item 8)
LONG = "a" * 5000
ARGUMENTS = {
    "save-long": (["train", "--save", LONG], "--save aaaa"),
    "trace-long": (["train", "--trace", LONG], "--trace aaaa"),
    "resume-long": (["train", "--resume", LONG], "--resume aaaa"),
    "figure-long": (["schedule", "1f1b", "-p", "2", "-m", "2", "--figure", LONG], "--figure aaaa"),
    "check-long": (["check", LONG], "refpar check aaaa"),
    "capacity-factor": (["train", "--moe-experts", "4", "--capacity-factor", "1e308"],
                        "--capacity-factor 1e+308 is past any use"),
    "bucket-kb": (["train", "--mesh", "dp=2", "--bucket-kb", "1e308"], "--bucket-kb 1e+308 must be"),
    "verify-timeout-nan": (["verify", "--timeout", "nan"], "--timeout nan must be a positive finite"),
    "verify-steps": (["verify", "--steps=-1"], "--steps -1 must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENTS))
def test_a_hostile_argument_is_one_sentence_before_any_work(case, capsys):
    argv, words = ARGUMENTS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 400 and words in err, err
    assert "too long" in err or not case.endswith("-long"), err


def test_a_collective_timeout_of_nan_is_refused_not_taken_as_none(monkeypatch):
    from refpar.comm import diagnosis

    monkeypatch.setenv("REFPAR_COLLECTIVE_TIMEOUT", "nan")  # compared false with 0, so was accepted
    with pytest.raises(ConfigError, match="must be a positive finite number of seconds"):
        diagnosis.timeout_from_env()
