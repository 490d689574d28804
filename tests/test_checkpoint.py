"""Sharded checkpoints (refpar/checkpoint.py): any layout in, any layout out; resumed training
continues the saved run; damaged or unfinished checkpoints are refused with one sentence."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refpar import checkpoint
from refpar.checkpoint import CheckpointError, Piece
from refpar.config import TrainConfig, model_preset
from refpar.sharding import shard_range
from refpar.trainer import train_single_device
from tests.mpi import ROOT, mpi_env, mpiexec, refpar_json
from tests.numerics import CONTRACT, within

SHAPE = (5, 6, 7)


def _global() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(SHAPE)  # (5, 6, 7)


def _write(path, pieces, tensor=None) -> None:
    t = _global() if tensor is None else tensor
    arrays = [(p, _take(t, p)) for p in pieces]
    checkpoint.save(path, arrays, {"x": (t.shape, t.dtype.name)}, {"step": 0})


def _take(t, p: Piece) -> np.ndarray:
    if p.box is not None:
        return t[tuple(slice(a, b) for a, b in p.box)].copy()
    return t.reshape(-1)[p.flat[0]:p.flat[1]].copy()


def _flat_parts(n_parts: int) -> list[Piece]:
    """ZeRO's cut: shard_range of the flattened tensor, blind to rows."""
    n = int(np.prod(SHAPE))
    return [Piece("x", flat=shard_range(n, n_parts, r)) for r in range(n_parts)]


def _box_parts(axis: int, n_parts: int) -> list[Piece]:
    """Tensor parallelism's cut: shard_range along one axis."""
    out = []
    for r in range(n_parts):
        box = [(0, n) for n in SHAPE]
        box[axis] = shard_range(SHAPE[axis], n_parts, r)
        out.append(Piece("x", box=tuple(box)))
    return out


@pytest.mark.parametrize("stored", [_flat_parts(3), _box_parts(1, 4), _box_parts(2, 3) + _flat_parts(2)],
                         ids=["flat3", "rows4", "mixed"])
@pytest.mark.parametrize("wanted", [_flat_parts(4), _box_parts(0, 2), _box_parts(2, 3),
                                    [checkpoint.whole("x", SHAPE)]], ids=["flat4", "box0", "box2", "whole"])
def test_any_layout_reassembles_to_the_global_tensors_slices_exactly(tmp_path, stored, wanted):
    _write(tmp_path, stored)
    got = checkpoint.load(tmp_path, wanted)
    for piece, a in zip(wanted, got, strict=True):
        assert np.array_equal(a, _take(_global(), piece)), f"{piece}: max diff differs"


def _cut(draw, shape) -> list[Piece]:
    """A random layout of a tensor: a flat partition (ZeRO) or boxes along one axis (tp, vocab)."""
    if draw(st.booleans()):
        n = int(np.prod(shape))
        parts = draw(st.integers(1, n))
        return [Piece("x", flat=shard_range(n, parts, r)) for r in range(parts)]
    axis = draw(st.integers(0, len(shape) - 1))
    parts = draw(st.integers(1, shape[axis]))
    out = []
    for r in range(parts):
        box = [(0, n) for n in shape]
        box[axis] = shard_range(shape[axis], parts, r)
        out.append(Piece("x", box=tuple(box)))
    return out


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_random_layouts_reassemble_exactly(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    stored, wanted = _cut(data.draw, shape), _cut(data.draw, shape)
    tensor = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) / 7  # (shape)
    with tempfile.TemporaryDirectory() as path:
        _write(path, stored, tensor)
        for piece, a in zip(wanted, checkpoint.load(path, wanted), strict=True):
            assert np.array_equal(a, _take(tensor, piece)), piece


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_shard_pieces_name_the_global_slice_of_any_flat_range_of_a_tp_shard(data):
    """A tp shard holds some global indices along one axis (c_attn: three runs); ZeRO may cut its
    flattening anywhere: every element of the range lands in a piece that names where it is."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    axis = data.draw(st.integers(0, len(shape) - 1))
    index = sorted(data.draw(st.sets(st.integers(0, shape[axis] - 1), min_size=1)))
    tensor = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)  # (shape)
    local = np.take(tensor, index, axis=axis)  # the shard
    lo = data.draw(st.integers(0, local.size - 1))
    hi = data.draw(st.integers(lo + 1, local.size))
    flat = local.reshape(-1)[lo:hi].copy()  # (hi - lo,)
    pieces = checkpoint.shard_pieces("x", flat, local.shape, lo, axis, index)
    assert sum(view.size for _, view in pieces) == hi - lo
    for piece, view in pieces:
        assert np.array_equal(view, _take(tensor, piece)) and np.shares_memory(view, flat), piece


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_single_device_resume_continues_the_uninterrupted_run_bit_for_bit(tmp_path, preset):
    model, train = model_preset(preset, n_layer=2), TrainConfig(steps=4, batch_size=4, seq_len=8)
    full = train_single_device(model, train, save=str(tmp_path), save_every=2)
    resumed = train_single_device(model, train, resume=str(tmp_path / "step-00000002"))
    # Same process, same operations on the same bytes: the checkpoint only stores and restores them.
    assert resumed.first_step == 2 and resumed.losses == full.losses[2:]
    for name, p in full.params.items():
        assert np.array_equal(resumed.params[name], p), name
    assert checkpoint.find(tmp_path).name == "step-00000004"
    (tmp_path / "step-00000004" / "manifest.json").unlink()  # as if the last save had crashed
    assert checkpoint.find(tmp_path).name == "step-00000002"  # the unfinished one is passed over


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    model, train = model_preset("tiny", n_layer=1), TrainConfig(steps=1, batch_size=2, seq_len=4)
    train_single_device(model, train, save=str(tmp_path))
    with pytest.raises(CheckpointError, match="seed=1234 but this run has 7"):
        train_single_device(model, replace(train, steps=2, seed=7), resume=str(tmp_path))
    with pytest.raises(CheckpointError, match="n_layer=1 but this run has 2"):
        train_single_device(replace(model, n_layer=2), replace(train, steps=2), resume=str(tmp_path))
    with pytest.raises(CheckpointError, match="give --steps more than 1"):
        train_single_device(model, train, resume=str(tmp_path))


# ------------------------------------------------------------------------ refusing bad input
@pytest.fixture
def saved(tmp_path):
    _write(tmp_path, _flat_parts(2))
    return tmp_path


def _refused(path, *parts: str) -> str:
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, [checkpoint.whole("x", SHAPE)])
    message = str(err.value)
    assert "\n" not in message and message.count(". ") == 0, message
    for part in parts:
        assert part in message, message
    return message


def test_a_flipped_byte_is_refused_naming_the_shard(saved):
    shard = saved / "rank00000.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _refused(saved, str(shard), "sha256")


def test_a_truncated_shard_is_refused_naming_the_shard(saved):
    shard = saved / "rank00000.npz"
    shard.write_bytes(shard.read_bytes()[:-100])
    _refused(saved, str(shard), "truncated")


def test_a_file_given_to_resume_is_told_it_is_a_file_not_that_it_does_not_exist(tmp_path):
    (tmp_path / "ckpt.npz").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"ckpt.npz is a file, not a checkpoint; give --resume the dir"):
        checkpoint.find(tmp_path / "ckpt.npz")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.find(tmp_path / "nowhere")


def test_a_directory_without_manifest_is_refused_as_unfinished(saved):
    (saved / "manifest.json").unlink()  # what a crash between the shards and the manifest leaves
    _refused(saved, str(saved), "no complete checkpoint")


def test_an_object_array_is_refused_without_unpickling(tmp_path):
    piece = Piece("x", flat=(0, 2))
    checkpoint.save(tmp_path, [(piece, np.zeros(2))], {"x": ((2,), "float64")}, {"step": 0})
    shard = tmp_path / "rank00000.npz"
    with zipfile.ZipFile(shard, "w") as z:  # a forged shard: a pickled object array, checksum fixed
        with z.open("a0.npy", "w") as f:
            np.lib.format.write_array(f, np.array([{"evil": 1}, None], dtype=object), allow_pickle=True)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["files"][0].update(sha256=checkpoint._sha256(shard), bytes=shard.stat().st_size)
    manifest[checkpoint.CHECKSUM] = checkpoint._checksum(manifest)  # a forger who knows the format
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="unpickling") as err:
        checkpoint.load(tmp_path, [piece])
    assert str(shard) in str(err.value)


def test_a_resume_from_a_damaged_checkpoint_is_one_sentence_from_the_command_line(tmp_path):
    run = [sys.executable, "-m", "refpar", "train", "--steps", "3", "--batch-size", "2", "--seq-len", "4"]
    subprocess.run(run + ["--save", str(tmp_path), "--steps", "1"], cwd=ROOT, env=mpi_env(),
                   check=True, capture_output=True)
    shard = tmp_path / "step-00000001" / "rank00000.npz"
    shard.write_bytes(shard.read_bytes()[:-1])
    proc = subprocess.run(run + ["--resume", str(tmp_path)], cwd=ROOT, env=mpi_env(), text=True,
                          capture_output=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and str(shard) in proc.stderr, proc.stderr


# ------------------------------------------------------------------- across meshes, on MPI ranks
def test_zero3_checkpoint_resumes_under_other_meshes(tmp_path):
    """Saved by ZeRO-3 on 2 ranks after 2 of 4 steps; resumed by ZeRO-1 and plain DP on 2 ranks,
    ZeRO-1 on 3 ranks and one process."""
    common = ("train", "--steps", "4", "--batch-size", "6", "--seq-len", "8")
    full = refpar_json(2, *common, "--mesh", "dp=2", "--zero", "3", "--save", str(tmp_path),
                       "--save-every", "2")["losses"]
    step2 = str(tmp_path / "step-00000002")
    for mesh in (("--zero", "1"), ("--zero", "0")):
        resumed = refpar_json(2, *common, "--mesh", "dp=2", *mesh, "--resume", step2,
                              "--save", str(tmp_path / "again"), "--overwrite")["losses"]
        # Exact: the same two ranks take the same samples, so every rank's forward and backward is
        # the same sequence of operations; a sum of two partial gradients is the same number in
        # either order (addition is commutative), whether all-reduced or reduce-scattered; AdamW is
        # elementwise, so where a shard boundary falls changes no operation. Resharding moves bytes.
        assert resumed == full[2:], (mesh, resumed, full[2:])
    assert _state(tmp_path / "again" / "step-00000004") == _state(tmp_path / "step-00000004")
    three = refpar_json(3, *common, "--mesh", "dp=3", "--zero", "1", "--resume", step2)["losses"]
    model = model_preset("tiny")
    one = train_single_device(model, TrainConfig(steps=4, batch_size=6, seq_len=8), resume=step2).losses
    # Not exact: 3 ranks (or one process) sum the per-sample gradients in another order than 2 ranks
    # do, so each later step rounds differently, a few float64 ulps: the float64 contract.
    for other in (three, one):
        worst = max(abs(a - b) / abs(b) for a, b in zip(other, full[2:], strict=True))
        assert within(worst, CONTRACT)
    shard = tmp_path / "step-00000002" / "rank00001.npz"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    # Every rank checks every file first, so the ranks refuse together instead of one waiting.
    proc = mpiexec(3, "-m", "refpar", *common, "--mesh", "dp=3", "--resume", step2, check=False)
    assert proc.returncode == 2 and str(shard) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _state(path) -> dict:
    """Every global tensor of a checkpoint, as bytes, read on one process."""
    man = checkpoint.read_manifest(path)
    arrays = checkpoint.load(path, [checkpoint.whole(n, s) for n, (s, _) in man["tensors"].items()], man)
    return {n: a.tobytes() for n, a in zip(man["tensors"], arrays, strict=True)}


def test_tp2_checkpoint_resumes_under_zero3_and_a_pipeline_then_on_one_process(tmp_path):
    """Saved by tensor parallelism (boxes; c_attn's shard is three column runs) on 2 ranks after 2
    of 4 steps; resumed by ZeRO-3 on 2 ranks (flat ranges cut across the boxes) and by a 2-stage
    pipeline (whole tensors), which saves after step 3; one process resumes from that for step 4."""
    common = ("train", "--steps", "4", "--batch-size", "4", "--seq-len", "8")
    full = refpar_json(2, *common, "--mesh", "tp=2", "--save", str(tmp_path), "--save-every", "2")["losses"]
    step2 = str(tmp_path / "step-00000002")
    zero3 = refpar_json(2, *common, "--mesh", "dp=2", "--zero", "3", "--resume", step2)["losses"]
    piped = refpar_json(2, *common, "--mesh", "pp=2", "--microbatches", "2", "--resume", step2,
                        "--save", str(tmp_path / "pp"), "--save-every", "1")["losses"]
    one = train_single_device(model_preset("tiny"), TrainConfig(steps=4, batch_size=4, seq_len=8),
                              resume=str(tmp_path / "pp" / "step-00000003")).losses
    # Not exact: tp=2 sums a row-parallel product as two partial sums added by its all-reduce, one
    # process in one matmul's order, dp=2 and the pipeline's microbatches split the batch: roundings
    # differ by a few ulps (2.2e-16 each), held to the float64 contract after a few steps of AdamW.
    for other, steps in ((zero3, full[2:]), (piped, full[2:]), (one, full[3:])):
        worst = max(abs(a - b) / abs(b) for a, b in zip(other, steps, strict=True))
        assert within(worst, CONTRACT)


def test_3d_checkpoint_resumes_under_tp_pp_and_on_one_process(tmp_path):
    """Saved by the engine with dp=2,tp=2,pp=2 and ZeRO-1 (AdamW moments as flat ranges of each
    rank's tp shards laid end to end) after 2 of 3 steps; resumed by tp=2,pp=2 and by one process."""
    common = ("train", "--steps", "3", "--batch-size", "4", "--seq-len", "8", "--microbatches", "2")
    full = refpar_json(8, *common, "--mesh", "dp=2,tp=2,pp=2", "--zero", "1", "--save", str(tmp_path),
                       "--save-every", "2")["losses"]
    step2 = str(tmp_path / "step-00000002")
    tp_pp = refpar_json(4, *common, "--mesh", "tp=2,pp=2", "--resume", step2)["losses"]
    one = train_single_device(model_preset("tiny"), TrainConfig(steps=3, batch_size=4, seq_len=8),
                              resume=step2).losses
    # Not exact: the meshes split the batch and the row-parallel sums differently (see above).
    for other in (tp_pp, one):
        worst = max(abs(a - b) / abs(b) for a, b in zip(other, full[2:], strict=True))
        assert within(worst, CONTRACT)


def test_the_closing_line_of_a_resumed_run_counts_from_its_checkpoint_and_never_prints_minus_0():
    from types import SimpleNamespace

    from refpar.engine.lines import closing_lines

    said = []
    summary = {"loss_floor": 1.0, "max_loss_rel_diff": None, "grad_norms": None, "val_losses": None}
    for losses, words in (([4.0, 4.0002], "4.0000 at step 3, 4.0001 over the last 2 steps, 0% of the way"),
                          ([4.0, 2.5], "4.0000 at step 3, 3.2500 over the last 2 steps, 25% of the way"),
                          ([4.0, 4.9], "4.0000 at step 3, 4.4500 over the last 2 steps, above the first")):
        out = SimpleNamespace(losses=losses, first_step=2, step_time_s=0.1, loss_scaling=None)
        closing_lines(said.append, None, None, None, None, None, out, [None], summary)  # one rank: no table
        assert words in said[-1] and "-0%" not in said[-1], said[-1]
