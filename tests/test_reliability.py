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
