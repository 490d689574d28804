"""Sharded checkpoints that load into a different mesh.

    mpiexec -n 2 python -m refpar train --mesh dp=2 --zero 3 --steps 4 --save ckpt --save-every 2
    mpiexec -n 3 python -m refpar train --mesh dp=3 --zero 1 --steps 4 --resume ckpt/step-00000002
    python -m refpar train --steps 4 --resume ckpt                  # the newest complete step

A checkpoint is a directory: one `.npz` per rank holding that rank's pieces, and `manifest.json`,
written last by rank 0, which says for every *global* tensor (`params/wte.weight`,
`adamw.m/h.0.ln_1.bias`, ...) its shape and dtype, and for every file its sha256, its size and
which piece of which tensor each of its arrays is. A `Piece` is either an n-d box (`[start, stop)`
per axis: tensor- and pipeline-parallel shards, whole tensors) or a flat `[start, stop)` range of
the row-major flattened tensor (ZeRO and FSDP partitions, which cut flat buffers regardless of
rows). Loading asks for pieces in the same terms and reassembles each from whichever stored pieces
overlap it, so a checkpoint written under one mesh loads under any other.

Safety: every file is written under a temporary name, fsynced and renamed; the manifest is written
only after every rank's file is in place (the gather of their descriptions is the barrier), so a
directory without `manifest.json` is an unfinished save and is never loaded: a save killed at any
point leaves the newest complete step for `--resume DIR` (tests/test_faults.py kills one at every
file operation). A write that fails (a full disk) stops every rank with the same sentence naming
the file, removes what that save wrote and leaves the earlier steps as they were. Before reading
anything, every rank checks every file's size, sha256 and array headers (shape, dtype, no object
arrays) against the manifest, so all ranks refuse a damaged checkpoint alike; loading never
unpickles (`allow_pickle=False`). Any mismatch is one sentence naming the file. The manifest is read
as a regular file of bounded size, carries its own checksum (`manifest_sha256`) and has every field
checked for type and range (`_check_manifest`); a shard's members may not inflate past what the
manifest accounts for (refpar/reading.py).

Concurrent jobs: the step `--resume DIR` loads is chosen once, on rank 0, and sent with its manifest
to every rank (`decide_resume`; each rank listing DIR itself could load another step while a save
lands, and the ranks then waited in different collectives); a run holds `--save DIR`'s lock
(refpar/save_lock.py) and names in it the step it is writing, whose resume is refused. Ranks send
each other the save's records and outcome as JSON bytes, never pickles (refpar/agreement.py).

Mixed precision: `.npy` cannot describe ml_dtypes' bfloat16 without pickling, so 16-bit arrays are
stored as their uint16 bit patterns and the manifest keeps their true dtype; the fp32 master weights
are tensors `master/NAME`, and the manifest keeps the optimizer's step count and the loss scaler's
state, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refpar import interrupt, save_lock
from refpar.agreement import broadcast_json, decided, gather_json
from refpar.config import ConfigError, ModelConfig, TrainConfig
from refpar.files import fsync_folder, write_atomically
from refpar.model import param_shapes
from refpar.precision import MASTER_DTYPE, is_16bit
from refpar.reading import check_path_length, check_zip_sizes, load_json, read_bounded, regular_file, shown

FORMAT = "refpar-checkpoint/1"
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
MANIFEST_LIMIT = 64 << 20  # bytes: GPT-2 small on 8 ranks writes about 1 MB
CHECKSUM = "manifest_sha256"  # the manifest's own checksum, over the rest of it (`_checksum`)
DTYPES = ("float64", "float32", "float16", "bfloat16")  # what a training checkpoint's tensors are
MAX_ELEMENTS = 1 << 48  # per tensor: far past any model, short of every integer overflow


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked; the message names the file and what to do."""


@dataclass(frozen=True)
class Piece:
    """Which part of a global tensor an array is: `box` ((start, stop) per axis) or `flat`
    ((start, stop) of the row-major flattened tensor); exactly one of them is set."""

    tensor: str
    box: tuple[tuple[int, int], ...] | None = None
    flat: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array that holds this piece."""
        ranges = self.box if self.box is not None else (self.flat,)
        return tuple(b - a for a, b in ranges)

    def to_json(self) -> dict:
        if self.box is not None:
            return {"tensor": self.tensor, "box": [list(r) for r in self.box]}
        return {"tensor": self.tensor, "flat": list(self.flat)}

    @staticmethod
    def from_json(d: dict) -> Piece:
        if "box" in d:
            return Piece(d["tensor"], box=tuple((int(a), int(b)) for a, b in d["box"]))
        a, b = d["flat"]
        return Piece(d["tensor"], flat=(int(a), int(b)))


def whole(tensor: str, shape) -> Piece:
    return Piece(tensor, box=tuple((0, int(n)) for n in shape))


def shard_pieces(tensor: str, flat, shape, lo: int, axis: int | None = None, index=None
                 ) -> list[tuple[Piece, np.ndarray]]:
    """(Piece, view of `flat`) for the elements [lo, lo + len(flat)) of the row-major flattening of
    a local array of `shape` which is either the global tensor (axis None) or a tensor-parallel
    shard: along `axis` it holds the global indices `index` (increasing, maybe in runs, as c_attn's
    q, k, v columns), the other axes whole. Covers a ZeRO flat shard of a tp shard too."""
    out, at = [], 0
    for box in _contiguous_boxes(tuple(shape), lo, lo + flat.shape[0]):
        block = flat[at:at + math.prod(b - a for a, b in box)].reshape([b - a for a, b in box])
        at += block.size
        if axis is None:
            out.append((Piece(tensor, box=box), block))
            continue
        a, b = box[axis]
        held = np.asarray(index)[a:b]  # the global indices of this box along `axis`
        for run in np.split(np.arange(b - a), np.flatnonzero(np.diff(held) != 1) + 1):
            global_box = list(box)
            global_box[axis] = (int(held[run[0]]), int(held[run[-1]]) + 1)
            local = [slice(None)] * len(box)
            local[axis] = slice(int(run[0]), int(run[-1]) + 1)
            out.append((Piece(tensor, box=tuple(global_box)), block[tuple(local)]))
    return out


def _contiguous_boxes(shape: tuple, lo: int, hi: int) -> list[tuple]:
    """[lo, hi) of the row-major flattening of an array of `shape` as boxes, in order, each a
    contiguous run of it: a partial first row, whole rows, a partial last row (recursively)."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = math.prod(shape[1:])
    rest = tuple((0, n) for n in shape[1:])

    def part_of_row(i, a, b):
        return [((i, i + 1),) + box for box in _contiguous_boxes(shape[1:], a, b)]

    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return part_of_row(first, lo - first * inner, hi - first * inner)
    out = []
    if lo % inner:
        out += part_of_row(first, lo % inner, inner)
        first += 1
    if hi // inner > first:
        out.append(((first, hi // inner),) + rest)
    if hi % inner:
        out += part_of_row(hi // inner, 0, hi % inner)
    return out


def training_tensors(model: ModelConfig, optimizer: str) -> dict[str, tuple[tuple, str]]:
    """Every global tensor a training checkpoint holds: the parameters, and AdamW's m and v; for
    16-bit parameters also the fp32 master weights, and m and v are fp32."""
    dtype = model.dtype
    mixed = is_16bit(np.dtype(dtype))
    state = MASTER_DTYPE.name if mixed else np.dtype(dtype).name
    prefixes = {"params": np.dtype(dtype).name, **dict.fromkeys(["master"] if mixed else [], state),
                **dict.fromkeys(["adamw.m", "adamw.v"] if optimizer == "adamw" else [], state)}
    return {f"{p}/{n}": (tuple(s), d) for p, d in prefixes.items() for n, s in param_shapes(model).items()}


def _stored(dtype: np.dtype) -> np.dtype:
    """The dtype an array of `dtype` has in a shard file: uint16 bit patterns for 16-bit floats."""
    return np.dtype(np.uint16) if is_16bit(dtype) else dtype


# ------------------------------------------------------------------------------------ saving
def step_dir(root, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def save(path, arrays: list[tuple[Piece, np.ndarray]], tensors: dict, info: dict, comm=None) -> Path:
    """Writes this rank's `arrays` to `path`/rank{world rank}.npz and, on `comm`'s rank 0 once every
    rank's file is in place, the manifest. `tensors`: global name -> (shape, dtype), the same on
    every rank; `info`: what else a resume needs (step, mesh, configs), JSON. Collective over
    `comm`, which must span every rank that holds state (None: one process). Returns `path`."""
    path = Path(path)
    rank = 0 if comm is None else comm.world_rank
    leader = comm is None or comm.rank == 0
    manifest = path / MANIFEST
    for p, a in arrays:
        if a.shape != p.shape:
            raise ValueError(f"array of shape {a.shape} saved as {p.tensor} {_where(p)}")
    # A failed write (a full disk) on one rank must stop every rank with the same sentence, not
    # leave the others waiting: each step says how it went, and rank 0 tells every rank in the
    # exchange that also orders the steps (the others write only once the directory is ready, and
    # go on only once the manifest is in place).
    if leader:
        save_lock.mark(path.parent, path.name)  # a resume of this step is refused from here on
    _agree(comm, _attempt(lambda: _prepare(path), path)[1] if leader else None)
    name = f"rank{rank:05d}.npz"
    named = {f"a{i}": np.ascontiguousarray(a).view(_stored(a.dtype)) for i, (_, a) in enumerate(arrays)}

    def write_shard() -> dict:
        write_atomically(path / name, lambda f: np.savez(f, **named))
        return {"file": name, "sha256": _sha256(path / name), "bytes": (path / name).stat().st_size,
                "arrays": [{"key": k, **p.to_json()} for k, (p, _) in zip(named, arrays, strict=True)]}

    record, failure = _attempt(write_shard, path / name)
    mine = failure or record  # a rank's record, or why it has none
    records = gather_json(comm, mine)  # JSON bytes: no rank unpickles another's
    if leader:
        failure = next((r for r in records if isinstance(r, str)), None)  # the first failing rank's
        if failure is None:
            doc = {"format": FORMAT, **info,
                   "tensors": {n: {"shape": list(s), "dtype": d} for n, (s, d) in tensors.items()},
                   "files": records}
            text = json.dumps({**doc, CHECKSUM: _checksum(doc)}, indent=1)
            _, failure = _attempt(lambda: write_atomically(manifest, lambda f: f.write(text.encode())),
                                  manifest)
    try:
        _agree(comm, failure)
    except CheckpointError:
        with contextlib.suppress(OSError):
            (path / name).unlink(missing_ok=True)  # give a full disk back what this save took
        raise
    if leader:
        save_lock.mark(path.parent, None)
    return path


def _checksum(doc: dict) -> str:
    """sha256 of the manifest `doc` without its checksum, in one canonical spelling: a manifest edited
    by hand, or cut short, no longer matches it."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _prepare(path: Path) -> None:
    """Rank 0, before any rank writes: the directory, without the manifest of an earlier save into
    it (so a crash from here on leaves a directory that is passed over, not a manifest over a mix of
    old and new files) and without the temporary files a crashed save left."""
    with interrupt.file_operation():  # Ctrl-C waits for it, as for write_atomically's (refpar/interrupt.py)
        path.mkdir(parents=True, exist_ok=True)
        if (path / MANIFEST).exists():
            (path / MANIFEST).unlink()
            fsync_folder(path)
        for stale in path.glob(".*.tmp-*"):
            stale.unlink(missing_ok=True)


def _attempt(action, file: Path) -> tuple:
    """(`action()`'s result, None), or (None, the sentence saying why writing `file` failed: a full
    disk, a quota, a read-only or forbidden directory)."""
    try:
        return action(), None
    except OSError as err:
        reason = os.strerror(err.errno).lower() if err.errno else str(err)
        advice = "free space or pass another --save DIR" if err.errno in (errno.ENOSPC, errno.EDQUOT) \
            else "pass a --save DIR this user can write to"
        return None, f"{reason} writing checkpoint {file}; {advice}"


def _agree(comm, failure: str | None) -> None:
    """Raises CheckpointError(rank 0's `failure`) on every rank, if rank 0 has one."""
    failure = broadcast_json(comm, failure)
    if failure is not None:
        raise CheckpointError(failure)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------- loading
def find(path) -> Path:
    """The checkpoint `path` names: itself if it holds a manifest, else its newest `step-*`
    directory that does (an unfinished save, without a manifest, is passed over)."""
    check_path_length("--resume", path, CheckpointError)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint; give --resume the directory --save "
                              f"wrote (DIR or DIR/step-N)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; give --resume a "
                              f"directory written by --save")
    if (path / MANIFEST).is_file():
        return path
    steps = sorted(p for p in path.glob(f"{STEP_PREFIX}*") if (p / MANIFEST).is_file())
    if not steps:
        raise CheckpointError(f"{path} holds no complete checkpoint (no {MANIFEST}, as a save that "
                              f"did not finish leaves it); resume from a directory written by --save")
    return steps[-1]


def _latest(root) -> Path | None:
    """The checkpoint `--resume root` would load, or None: what an interruption's line names."""
    try:
        return find(root)
    except CheckpointError:
        return None


interrupt.progress.latest = _latest


def decide_resume(path, comm=None) -> str:
    """The checkpoint step `--resume path` loads, decided once for the whole job (refpar/agreement.py):
    rank 0 finds the newest complete step, reads its manifest and refuses a step another job is
    writing (refpar/save_lock.py); every rank gets the same step directory and the same manifest
    bytes (`read_manifest` takes those, not the file, which a writer could replace meanwhile)."""

    def look() -> dict:
        step = find(path)
        text = read_bounded(step / MANIFEST, "checkpoint manifest", MANIFEST_LIMIT, CheckpointError)
        who = save_lock.holder(step.parent)
        if who is not None and who.get("step") == step.name:
            raise CheckpointError(f"checkpoint {shown(step)} is being written now by "
                                  f"{save_lock.describe(step.parent, who)}; wait for its save to finish, "
                                  "or resume from an earlier step")
        try:
            return {"dir": str(step), "manifest": text.decode()}
        except UnicodeDecodeError:
            raise CheckpointError(f"checkpoint manifest {shown(step / MANIFEST)} is not text; the "
                                  "file was changed after it was written") from None

    answer = decided(comm, look)
    _decided[answer["dir"]] = answer["manifest"]
    return answer["dir"]


_decided: dict[str, str] = {}  # step directory -> the manifest text rank 0 read for this job


def decided_manifest(folder) -> str | None:
    """The manifest text `decide_resume` chose for the step directory `folder`, if it chose one."""
    return _decided.get(str(folder))


def read_manifest(path) -> dict:
    """The manifest of the checkpoint `path` names (see `find`), with every file it lists verified:
    size, sha256, and each array's header (shape, dtype) against the manifest. Every rank checks
    every file, not just those it will read, so that all ranks refuse a damaged checkpoint alike,
    with the same sentence, before any communication (one rank failing alone would leave the others
    waiting in a collective). The manifest itself is checked first: a regular file of bounded size,
    JSON without NaN or Infinity, every field of the type and range a save writes (`_check_manifest`),
    and its own checksum."""
    folder = find(path)
    file = folder / MANIFEST
    text = decided_manifest(folder)
    if text is None:
        text = read_bounded(file, "checkpoint manifest", MANIFEST_LIMIT, CheckpointError)
    doc = load_json(text, file, "checkpoint manifest", CheckpointError)
    _check_manifest(doc, file)
    tensors = {n: (tuple(t["shape"]), np.dtype(t["dtype"]).name) for n, t in doc["tensors"].items()}
    files = [{"file": r["file"], "sha256": r["sha256"], "bytes": r["bytes"],
              "arrays": [(a["key"], Piece.from_json(a)) for a in r["arrays"]]} for r in doc["files"]]
    for r in files:
        if Path(r["file"]).name != r["file"] or r["file"] in ("", ".", ".."):
            raise CheckpointError(f"{file} names shard {r['file']!r} outside its directory; "
                                  f"the manifest was changed after it was written")
        for _, piece in r["arrays"]:
            if piece.tensor not in tensors or not _inside(piece, tensors[piece.tensor][0]):
                raise CheckpointError(f"{file} says {r['file']} holds {piece.tensor} {_where(piece)}, "
                                      f"which is not part of any tensor it lists; the manifest is "
                                      f"inconsistent")
    for r in files:
        _verify_shard(file.parent, r, tensors)
    return {**doc, "tensors": tensors, "files": files, "dir": str(file.parent)}


def _check_manifest(doc, file: Path) -> None:
    """Every field a resume reads, of the type and range `save_training` writes, and the checksum;
    else one sentence naming the field. Python's json gives any JSON value: without this a
    `"step": 1.5` resumed at the wrong step and `"shape": [1e999]` was a traceback (issue 43)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint manifest {shown(file)}: {what}; the file was changed after "
                               "it was written, or was not written by refpar")

    def count(x, low=0) -> bool:
        return type(x) is int and low <= x < MAX_ELEMENTS

    def pair(x) -> bool:
        return isinstance(x, list) and len(x) == 2 and all(count(v) for v in x)

    if not isinstance(doc, dict):
        raise bad("it is not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} manifest (format {str(doc.get('format'))[:40]!r}); "
                              f"it was not written by this version of refpar")
    # A manifest without a checksum was written before refpar wrote one: still a user's run, so it
    # loads, its fields checked below like any other's (which is what stops a forger in either case).
    if CHECKSUM in doc and doc[CHECKSUM] != _checksum(doc):
        raise bad(f"its {CHECKSUM} does not match its contents")
    for key in ("model", "train", "mesh", "tensors"):  # only tensors in every manifest (save's)
        if (key in doc or key == "tensors") and not isinstance(doc.get(key), dict):
            raise bad(f"{key!r} is missing or not an object")
    for key, low in (("step", 0), ("optimizer_t", 0), ("world_size", 1), ("moe_microbatches", 1)):
        if key in doc and not count(doc.get(key), low):
            raise bad(f"{key!r} is {str(doc.get(key))[:40]}, not a whole number of at least {low}")
    scaler = doc.get("loss_scaler")
    if scaler is not None and not (isinstance(scaler, dict) and type(scaler.get("scale")) in (int, float)
                                   and 0 < scaler["scale"] < math.inf and count(scaler.get("good_steps"))
                                   and count(scaler.get("skipped"))):
        raise bad("'loss_scaler' is not a positive finite scale with whole good_steps and skipped")
    for name, t in doc["tensors"].items():
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list) and len(t["shape"]) <= 8
                and all(count(n) for n in t["shape"]) and math.prod(t["shape"]) < MAX_ELEMENTS
                and t.get("dtype") in DTYPES):
            raise bad(f"tensor {name[:80]!r} has no shape of whole sizes and dtype among {', '.join(DTYPES)}")
    if not isinstance(doc.get("files"), list):
        raise bad("'files' is missing or not a list")
    for r in doc["files"]:
        if not (isinstance(r, dict) and isinstance(r.get("file"), str) and isinstance(r.get("sha256"), str)
                and count(r.get("bytes")) and isinstance(r.get("arrays"), list)):
            raise bad("a file record lacks its name, sha256, size or arrays")
        for a in r["arrays"]:
            if not (isinstance(a, dict) and isinstance(a.get("key"), str) and isinstance(a.get("tensor"), str)
                    and (("box" in a and isinstance(a["box"], list) and all(pair(x) for x in a["box"]))
                         or ("box" not in a and pair(a.get("flat"))))):
                raise bad(f"an array of {r['file'][:80]!r} has no key, tensor and box or flat range of "
                          "whole numbers")


def load(path, wanted: list[Piece], manifest: dict | None = None) -> list[np.ndarray]:
    """The arrays of the pieces in `wanted`, in order, each reassembled from every stored piece that
    overlaps it; `manifest`, if given, is `read_manifest(path)`'s (its files already verified).
    Reads only the arrays it needs."""
    man = read_manifest(path) if manifest is None else manifest
    folder = Path(man["dir"])
    opened: dict[str, np.lib.npyio.NpzFile] = {}
    out = []
    try:
        for want in wanted:
            shape, dtype = _tensor(man, want, folder)
            dst = np.empty(want.shape, dtype)
            covered = np.zeros(want.shape, bool)
            for r in man["files"]:
                for key, have in r["arrays"]:
                    if have.tensor != want.tensor or not _may_overlap(want, have, shape):
                        continue
                    if r["file"] not in opened:
                        opened[r["file"]] = _open_shard(folder, r)
                    src = _member(opened[r["file"]], folder / r["file"], key, have, dtype)
                    _copy(want, dst, covered, have, src, shape)
            if not covered.all():
                raise CheckpointError(f"checkpoint {folder} holds no shard for part of "
                                      f"{want.tensor} {_where(want)}; its manifest's files do not "
                                      f"cover the tensor")
            out.append(dst)
    finally:
        for f in opened.values():
            f.close()
    return out


def _tensor(man: dict, piece: Piece, folder: Path) -> tuple[tuple, np.dtype]:
    if piece.tensor not in man["tensors"]:
        raise CheckpointError(f"checkpoint {folder} has no tensor {piece.tensor}; it was written "
                              f"for another model or optimizer")
    shape, dtype = man["tensors"][piece.tensor]
    if not _inside(piece, shape):
        raise CheckpointError(f"{piece.tensor} {_where(piece)} is outside its shape {shape} in "
                              f"checkpoint {folder}; it was written for another model")
    return shape, np.dtype(dtype)


def _inside(piece: Piece, shape) -> bool:
    if piece.box is not None:
        return len(piece.box) == len(shape) and all(
            0 <= a <= b <= n for (a, b), n in zip(piece.box, shape, strict=True))
    return 0 <= piece.flat[0] <= piece.flat[1] <= int(np.prod(shape))


def _where(piece: Piece) -> str:
    return f"box {list(piece.box)}" if piece.box is not None else f"flat range {list(piece.flat)}"


def _verify_shard(folder: Path, record: dict, tensors: dict) -> None:
    file = folder / record["file"]
    if not file.exists():
        raise CheckpointError(f"checkpoint shard {file} is missing; the checkpoint is incomplete "
                              f"and cannot be loaded")
    size = regular_file(file, "checkpoint shard", CheckpointError).st_size  # a FIFO would hang the hash
    if size != record["bytes"]:
        raise CheckpointError(f"checkpoint shard {file} is {size} bytes but its manifest says "
                              f"{record['bytes']} (truncated or replaced); the checkpoint cannot be loaded")
    if _sha256(file) != record["sha256"]:
        raise CheckpointError(f"checkpoint shard {file} is corrupt: its sha256 does not match the "
                              f"manifest; the checkpoint cannot be loaded")
    # the arrays' bytes and, per member, a .npy header and the zip's own: inflating more is refused
    data = sum(math.prod(p.shape) * _stored(np.dtype(tensors[p.tensor][1])).itemsize
               for _, p in record["arrays"])
    try:
        with zipfile.ZipFile(file) as z:
            check_zip_sizes(z, file, "checkpoint shard", data + 4096 * (len(record["arrays"]) + 1),
                            CheckpointError)
            for key, piece in record["arrays"]:
                with z.open(f"{key}.npy") as f:
                    header = _read_header(f)
                dtype = _stored(np.dtype(tensors[piece.tensor][1]))
                if header[2].hasobject:
                    raise CheckpointError(f"checkpoint shard {file} array {key} is an object array, "
                                          f"which only unpickling could read; refusing it")
                if header[0] != piece.shape or header[2] != dtype:
                    raise CheckpointError(
                        f"checkpoint shard {file} array {key} is {header[2]}{list(header[0])} but the "
                        f"manifest says {piece.tensor} {_where(piece)} of {dtype}")
    except KeyError:
        raise CheckpointError(f"checkpoint shard {file} lacks an array its manifest lists") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint shard {file} is not a readable .npz file ({err})") from None


def _read_header(f) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran order, dtype) of a .npy stream, read without its data."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise ValueError(f".npy format version {version} is not one np.savez writes for numbers")


def _open_shard(folder: Path, record: dict):
    file = folder / record["file"]
    try:
        return np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint shard {file} is not a readable .npz file ({err})") from None


def _member(npz, file: Path, key: str, piece: Piece, dtype: np.dtype) -> np.ndarray:
    try:
        a = npz[key]
    except KeyError:
        raise CheckpointError(f"checkpoint shard {file} has no array {key} that its manifest "
                              f"lists") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        # A damaged member lands here (an object array was refused by its header already).
        raise CheckpointError(f"checkpoint shard {file} array {key} is damaged ({err}); the checkpoint "
                              "cannot be loaded") from None
    if a.dtype != _stored(dtype) or a.shape != piece.shape:
        raise CheckpointError(f"checkpoint shard {file} array {key} is {a.dtype}{list(a.shape)} but "
                              f"the manifest says {piece.tensor} {_where(piece)} of {dtype}")
    return a.view(dtype)


# ------------------------------------------------------------------------------- reassembly
def _flat_extent(piece: Piece, shape) -> tuple[int, int]:
    """[first, last + 1) of the piece's elements in the flattened tensor."""
    if piece.flat is not None:
        return piece.flat
    if any(a == b for a, b in piece.box):
        return 0, 0
    strides = _strides(shape)
    first = sum(a * s for (a, _), s in zip(piece.box, strides, strict=True))
    last = sum((b - 1) * s for (_, b), s in zip(piece.box, strides, strict=True))
    return first, last + 1


def _may_overlap(a: Piece, b: Piece, shape) -> bool:
    (a0, a1), (b0, b1) = _flat_extent(a, shape), _flat_extent(b, shape)
    return max(a0, b0) < min(a1, b1)


def _strides(shape) -> list[int]:
    """Row-major element strides."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def _box_indices(box, shape) -> np.ndarray:
    """The flat index in the global tensor of every element of `box`, box-shaped (row-major, so
    increasing in the box's own row-major order)."""
    idx = np.zeros(tuple(b - a for a, b in box), np.int64)
    for axis, ((a, b), s) in enumerate(zip(box, _strides(shape), strict=True)):
        idx += (np.arange(a, b, dtype=np.int64) * s).reshape((-1,) + (1,) * (len(box) - axis - 1))
    return idx


def _copy(want: Piece, dst, covered, have: Piece, src, shape) -> None:
    """Copies the overlap of stored piece `have` (array `src`) into `dst`, which holds `want`."""
    if want.box is not None and have.box is not None:
        ranges = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want.box, have.box, strict=True)]
        if any(lo >= hi for lo, hi in ranges):
            return
        to = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(ranges, want.box, strict=True))
        dst[to] = src[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(ranges, have.box, strict=True))]
        covered[to] = True
    elif want.flat is not None and have.flat is not None:
        lo, hi = max(want.flat[0], have.flat[0]), min(want.flat[1], have.flat[1])
        dst[lo - want.flat[0]:hi - want.flat[0]] = src[lo - have.flat[0]:hi - have.flat[0]]
        covered[lo - want.flat[0]:hi - want.flat[0]] = True
    elif want.box is not None:  # a box from a flat range
        idx = _box_indices(want.box, shape)
        a, b = have.flat
        inside = (idx >= a) & (idx < b)
        dst[inside] = src[idx[inside] - a]
        covered[inside] = True
    else:  # a flat range from a box
        idx = _box_indices(have.box, shape)
        a, b = want.flat
        inside = (idx >= a) & (idx < b)
        dst[idx[inside] - a] = src[inside]
        covered[idx[inside] - a] = True


def assemble(arrays: list[tuple[Piece, np.ndarray]], tensors: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Whole tensors {name: (shape, dtype)} from pieces that cover each of them, as `load` reassembles
    a checkpoint's, in memory: what every rank of a mesh holds (engine/sharded_state.pieces), gathered."""
    out = {}
    for name, (shape, dtype) in tensors.items():
        want = whole(name, shape)
        dst, covered = np.empty(tuple(shape), dtype), np.zeros(tuple(shape), bool)
        for have, src in arrays:
            if have.tensor == name and _may_overlap(want, have, shape):
                _copy(want, dst, covered, have, src, shape)
        if not covered.all():
            raise ValueError(f"the pieces do not cover {name}")  # a bug in pieces(), not a user's mistake
        out[name] = dst
    return out


# ---------------------------------------------------------------------------------- training
def save_training(root, step: int, arrays: list[tuple[Piece, np.ndarray]], model, train,
                  mesh: dict, strategy: str, comm=None, *, optimizer_t: int | None = None,
                  loss_scaler: dict | None = None, moe_microbatches: int | None = None) -> Path:
    """Saves the state after `step` optimizer steps into `root`/step-{step}: the parameters and
    optimizer state in `arrays`, and what a resume needs to go on from there: the step (the data
    and dropout of step s are keyed by (seed, s, sample id), so the step and the seed are the whole
    data position), AdamW's step count t (`optimizer_t`: the step unless fp16 skipped steps), the
    fp16 `LossScaler.state_dict()`, the configs and the mesh it was written under; MoE runs also
    keep `moe_microbatches`, the M their tokens were routed in (capacity and router losses are per
    microbatch, so a resume with another M would not continue the same run)."""
    tensors = training_tensors(model, train.optimizer)
    info = {"step": step, "optimizer_t": step if optimizer_t is None else optimizer_t,
            "loss_scaler": loss_scaler, "mesh": dict(mesh), "strategy": strategy,
            "world_size": 1 if comm is None else comm.size,
            "model": model.to_dict(), "train": train.to_dict()}
    if moe_microbatches is not None:
        info["moe_microbatches"] = moe_microbatches
    return save(step_dir(root, step), arrays, tensors, info, comm)


def open_training(path, model, train) -> dict:
    """The manifest of the checkpoint `path` names, checked against this run's configs: everything
    but the number of steps must match, or the run would not continue the one that was saved."""
    man = read_manifest(path)
    where = f"checkpoint {man['dir']}"
    missing = [key for key in ("model", "train", "step") if key not in man]
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing)} in its manifest, so it is not a training "
                              "checkpoint refpar train wrote; resume from a directory written by --save")
    for kind, mine, default in (("model", model.to_dict(), ModelConfig().to_dict()),
                                ("train", train.to_dict(), TrainConfig().to_dict())):
        mine = json.loads(json.dumps(mine))  # as the manifest stores it: tuples (moe_layers) as lists
        default = json.loads(json.dumps(default))
        theirs = man.get(kind, {})
        for key, value in mine.items():
            if key not in theirs and value == default[key]:
                continue  # a field newer than the checkpoint, at its default: the same run
            if key != "steps" and theirs.get(key) != value:
                raise CheckpointError(f"{where} was written with {kind} {key}={theirs.get(key)!r} but "
                                      f"this run has {value!r}; resume with the settings it was "
                                      f"written with")
    expected = training_tensors(model, train.optimizer)
    if man["tensors"] != expected:
        raise CheckpointError(f"{where} holds other tensors than this model and optimizer have; "
                              f"resume with the model it was written for")
    if not 0 <= int(man["step"]) < train.steps:
        raise CheckpointError(f"{where} is at step {man['step']}, so --steps {train.steps} leaves "
                              f"nothing to train; give --steps more than {man['step']}")
    return man


def whole_arrays(params: dict, state: dict) -> list[tuple[Piece, np.ndarray]]:
    """One process's state as whole-tensor pieces (`refpar.model.optim` layout)."""
    out = [(whole(f"params/{n}", p.shape), p) for n, p in params.items()]
    out += [(whole(f"master/{n}", a.shape), a) for n, a in state.get("master", {}).items()]
    for k in ("m", "v"):
        out += [(whole(f"adamw.{k}/{n}", a.shape), a) for n, a in state.get(k, {}).items()]
    return out


def load_whole(path, model, train) -> tuple[int, dict, dict]:
    """(step, params, optimizer state) for one process from a checkpoint of any mesh; an fp16 run's
    state also holds "loss_scaler" (`LossScaler.state_dict()`), for the caller to take out."""
    man = open_training(path, model, train)
    names = [n.split("/", 1) for n in man["tensors"]]
    arrays = load(path, [whole(n, s) for n, (s, _) in man["tensors"].items()], man)
    step = int(man["step"])
    state: dict = {"t": int(man.get("optimizer_t", step))}
    if man.get("loss_scaler") is not None:
        state["loss_scaler"] = man["loss_scaler"]
    params = {}
    for (prefix, name), a in zip(names, arrays, strict=True):
        if prefix == "params":
            params[name] = a
        else:  # "adamw.m" -> state["m"], "master" -> state["master"]
            state.setdefault(prefix.split(".")[-1], {})[name] = a
    return step, params, state


def should_save(step_done: int, steps: int, every: int | None) -> bool:
    """Whether to save after `step_done` steps: every `every` steps, and after the last."""
    return step_done == steps or (every is not None and step_done % every == 0)
