"""A run reports as it goes (refpar/engine/runlog.py): --log's JSON lines hold what the --json summary
holds, step by step; their throughput and MFU follow from their own fields and the printed peak;
--tensorboard's event files, read back by a reader written here, hold the same losses; --log-every N
prints exactly the steps it names; a default table is never silent for longer than its heartbeat;
paths that cannot be written are refused before the run."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.mpi import ROOT, mpi_env, mpiexec

B, T = 8, 16  # the tiny preset's batch and sequence (TrainConfig's defaults)


def refpar(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m refpar ARGS` on one process, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "refpar", *args], cwd=cwd, env=mpi_env(),
                          capture_output=True, text=True, timeout=240)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rows(out: str) -> list[int]:
    """The steps the table printed a row for."""
    return [int(m.group(1)) for m in re.finditer(r"^ +(\d+) +\d+\.\d{4} ", out, re.M)]


def printed_peak(out: str) -> tuple[float, float]:
    """(the header's peak in FLOP/s, half a unit of its last printed digit, in FLOP/s)."""
    m = re.search(r"^peak GEMM ([\d,]+\.(\d+)) GFLOP/s per process", out, re.M)
    assert m, out
    return float(m.group(1).replace(",", "")) * 1e9, 0.5 * 10.0 ** -len(m.group(2)) * 1e9


# TensorBoard's files, read without the writer: TFRecord framing (the length, its masked CRC-32C,
# the bytes, their masked CRC-32C; TensorFlow's record_writer) checked with a CRC-32C computed here,
# and each record parsed as an Event with the protos tensorboardX bundles (tensorboard's own).

def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, from the one event file in `folder`."""
    from tensorboardX.proto.event_pb2 import Event

    files = list(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 writes, no other rank
    data, at, out = files[0].read_bytes(), 0, {}
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == _masked(_crc32c(header))
        body = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == _masked(_crc32c(body))
        at += 16 + length
        event = Event.FromString(body)
        for value in event.summary.value:
            out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_crc32c_is_castagnolis():
    """The reader's CRC against RFC 3720's check value (B.4: 32 bytes of zeros) and the standard one."""
    assert _crc32c(b"123456789") == 0xE3069283
    assert _crc32c(bytes(32)) == 0x8A9136AA


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank run with clipping, --log, --tensorboard and --log-every 2, and its --json summary."""
    folder = tmp_path_factory.mktemp("runlog")
    proc = mpiexec(2, "-m", "refpar", "train", "--mesh", "dp=2", "--steps", "5", "--clip-grad-norm", "0.5",
                   "--lr-schedule", "cosine", "--warmup-steps", "2", "--log", str(folder / "run.jsonl"),
                   "--tensorboard", str(folder / "tb"), "--log-every", "2", "--json", timeout=240)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = (folder / "run.jsonl").read_text().splitlines()
    return SimpleNamespace(out=proc.stdout, summary=summary, log=[json.loads(x) for x in lines],
                           folder=folder)


def test_the_log_has_a_line_per_step_with_the_summarys_losses_lrs_and_norms(two_ranks):
    log, s = two_ranks.log, two_ranks.summary
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in log] == s["losses"]  # exactly: the same floats, through JSON
    assert [r["lr"] for r in log] == s["lrs"]
    assert [r["grad_norm"] for r in log] == s["grad_norms"]
    assert all(r["val_loss"] is None for r in log)  # no --eval-every here


def test_tokens_per_s_and_elapsed_follow_from_the_step_times(two_ranks):
    """tokens/s is the global batch's tokens over the step's time; the run's elapsed time holds every
    step's time, and the last step leaves nothing to wait for."""
    log = two_ranks.log
    for r in log:
        assert r["tokens_per_s"] == pytest.approx(B * T / r["step_time_s"], rel=1e-15)
    done = np.cumsum([r["step_time_s"] for r in log])
    assert all(r["elapsed_s"] >= d for r, d in zip(log, done, strict=True))
    assert log[-1]["eta_s"] == 0


def test_mfu_is_model_flops_over_time_world_and_the_printed_peak(two_ranks):
    """MFU recomputed from the logged fields and the peak the header printed, within the printed
    digits' rounding; the model FLOPs (the planner's closed form) are what the two ranks' GEMM tallies
    add up to (refpar/model/gemm.py, the summary's flops_per_step): dense, nothing recomputed."""
    peak, half_digit = printed_peak(two_ranks.out)
    world = two_ranks.summary["world_size"]
    assert world == 2 and f"MFU = model FLOPs / (step time x {world} x peak)" in two_ranks.out
    tallies = two_ranks.summary["flops_per_step"]
    for k, r in enumerate(two_ranks.log):
        assert r["model_flops"] == sum(rank[k] for rank in tallies)
        assert r["mfu"] == pytest.approx(r["model_flops"] / (r["step_time_s"] * world * peak),
                                         rel=half_digit / peak + 1e-15)


def test_log_every_prints_exactly_its_steps_with_elapsed_eta_and_mfu(two_ranks):
    assert rows(two_ranks.out) == [1, 2, 4, 5]
    header = next(line for line in two_ranks.out.splitlines() if line.lstrip().startswith("step "))
    assert header.split()[:7] == ["step", "loss", "floor", "tokens/s", "elapsed", "ETA", "MFU"]
    mfus = [float(m) for m in re.findall(r" (\d+\.\d\d)%", two_ranks.out)]
    logged = {r["step"]: r["mfu"] for r in two_ranks.log}
    assert mfus == [round(100 * logged[s], 2) for s in (1, 2, 4, 5)]


def test_the_event_files_hold_the_logged_values_per_step(two_ranks):
    """TensorBoard's scalars are float32 (Summary.Value.simple_value): the log's float64 values,
    rounded once."""
    scalars = read_scalars(two_ranks.folder / "tb")
    assert set(scalars) == {"loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    for tag, by_step in scalars.items():
        assert by_step == {r["step"]: float(np.float32(r[tag])) for r in two_ranks.log}, tag
    assert [scalars["loss"][k + 1] for k in range(5)] == [float(np.float32(x))
                                                          for x in two_ranks.summary["losses"]]


def test_a_moe_runs_log_holds_its_router_losses_and_log_every_3_of_7(tmp_path):
    """One process: the aux and z losses logged are the summary's, rows at 1, 3, 6 and 7."""
    proc = refpar("train", "--moe-experts", "4", "--steps", "7", "--log-every", "3", "--log", "run.jsonl",
                  "--json", cwd=tmp_path)
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    log = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == s["losses"]
    assert [r["aux_loss"] for r in log] == s["moe"]["aux_loss"]
    assert [r["z_loss"] for r in log] == s["moe"]["z_loss"]
    assert all(r["grad_norm"] is None for r in log)  # no clipping
    assert rows(proc.stdout) == [1, 3, 6, 7]


def test_a_default_table_is_never_silent_longer_than_the_heartbeat(monkeypatch):
    """2000 steps of 25 s each (GPT-2 on a CPU): every steps // 12 = 166 steps alone would leave 69
    minutes between rows; the heartbeat prints one as soon as HEARTBEAT_S have passed."""
    from refpar.config import TrainConfig, model_preset
    from refpar.engine import lines

    now = [0.0]
    monkeypatch.setattr(lines, "time", SimpleNamespace(monotonic=lambda: now[0]))
    printed = []
    row = lines.progress(lambda text="": printed.append((now[0], text)), model_preset("tiny"),
                         TrainConfig(steps=2000), None, ("floor", 0.88), moves=False)
    for step in range(2000):
        now[0] += 25.0
        row(step, 3.0, 25.0, {}, None)
    times = [t for t, text in printed[1:]]  # after the column names
    assert max(np.diff(times)) <= lines.HEARTBEAT_S + 25.0
    assert rows("\n".join(text for _, text in printed))[:3] == [1, 4, 7]  # 75 s >= 60 s apart
    assert rows("\n".join(text for _, text in printed))[-1] == 2000


@pytest.mark.parametrize("flags, sentence", [
    (["--log", "no/such/folder/run.jsonl"],
     "--log 'no/such/folder/run.jsonl': the directory 'no/such/folder' does not exist"),
    (["--tensorboard", "a_file"], "--tensorboard 'a_file' is a file; give a directory"),
    (["--log-every", "0"], "--log-every 0 must be at least 1"),
])
def test_a_path_or_interval_it_cannot_use_is_refused_in_one_sentence(tmp_path, flags, sentence):
    (tmp_path / "a_file").write_text("not a folder")
    proc = refpar("train", "--steps", "2", *flags, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and sentence in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "a_file"]  # nothing written


def test_tensorboard_without_tensorboardx_is_refused_saying_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    from refpar.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    assert main(["train", "--steps", "2", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'refpar[tensorboard]'" in err, err


def test_duration_reads_as_a_clock():
    from refpar.engine.runlog import duration

    assert [duration(s) for s in (0, 59.4, 61, 3599, 3600, 90061)] == [
        "0:00", "0:59", "1:01", "59:59", "1:00:00", "25:01:01"]


def test_the_short_runs_print_no_peak_and_no_new_column():
    """Without the new flags, the table the docs show: no peak measured, no new column (tests/test_docs.py
    and tests/test_lessons.py compare the whole output)."""
    out = subprocess.run([sys.executable, "-m", "refpar", "train", "--steps", "3"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=120).stdout
    assert "peak GEMM" not in out and "ETA" not in out and rows(out) == [1, 2, 3]


def test_at_a_terminal_the_bar_shows_on_stderr_and_the_table_is_unchanged():
    """Rank 0's stderr a terminal (a pseudo-terminal 100 columns wide here): tqdm's bar draws there,
    and stdout holds the rows a run without a terminal prints, the same steps and losses."""
    import fcntl
    import os
    import pty
    import termios
    import threading

    command = [sys.executable, "-m", "refpar", "train", "--steps", "30"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns
    seen = []

    def drain():  # the child would block on a full terminal buffer
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with subprocess.Popen(command, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=slave,
                          text=True) as proc:
        os.close(slave)
        out, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    bar = b"".join(seen).decode()
    assert proc.returncode == 0 and re.search(r"\b\d+/30 \[", bar), bar[-2000:]
    plain = subprocess.run(command, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert plain.stderr == ""  # no terminal: no bar
    losses = re.compile(r"^ +(\d+) +(\d+\.\d{4}) ", re.M)
    assert losses.findall(out) == losses.findall(plain.stdout) and len(losses.findall(out)) == 16


def test_a_killed_run_keeps_every_line_it_wrote(tmp_path):
    """Each line is flushed as its step ends: SIGKILL mid-run leaves whole lines, steps 1..k in order."""
    import signal
    import time

    log = tmp_path / "run.jsonl"
    with subprocess.Popen([sys.executable, "-m", "refpar", "train", "--steps", "100000", "--log", str(log)],
                          cwd=tmp_path, env=mpi_env(), stdout=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 3):
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    text = log.read_text()
    assert text.endswith("\n")  # no half-written line
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1))


def test_a_resumed_run_continues_its_log(tmp_path):
    """--resume appends: the log of 4 steps, then of steps 5 and 6 from the checkpoint, reads as one run
    of 6, whose losses are the uninterrupted run's (float64, one device: bit for bit)."""
    refpar("train", "--steps", "4", "--save", "ckpt", "--log", "run.jsonl", cwd=tmp_path)
    refpar("train", "--steps", "6", "--resume", "ckpt", "--log", "run.jsonl", cwd=tmp_path)
    log = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    whole = json.loads(refpar("train", "--steps", "6", "--json", cwd=tmp_path).stdout.splitlines()[-1])
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in log] == whole["losses"]


def test_a_validation_loss_the_loop_gives_is_logged_on_its_step_only(tmp_path):
    """The loop names `val_loss` on the steps --eval-every evaluates (None elsewhere): the JSON line and
    the events carry it on those steps and nowhere else."""
    from refpar.config import TrainConfig, model_preset
    from refpar.engine.runlog import Peak, RunLog

    args = SimpleNamespace(log=str(tmp_path / "run.jsonl"), tensorboard=str(tmp_path / "tb"), resume=None)
    shown = []
    with RunLog(model_preset("tiny"), TrainConfig(steps=3), 1, args, Peak(1e10, 1024, "float64", 5, 0.1),
                speak=True) as log:
        on_step = log.on_step(lambda *a, **k: shown.append(a[0]))
        for step, val in enumerate((None, 2.5, None)):
            on_step(step, 3.0 - step / 10, 0.01, {}, None, None, val_loss=val)
    lines = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert shown == [0, 1, 2] and [r["val_loss"] for r in lines] == [None, 2.5, None]
    assert read_scalars(tmp_path / "tb")["val_loss"] == {2: 2.5}
