"""`Communicator`: every byte refpar moves between ranks goes through here (the only mpi4py import).

    comm = world(tracer=Tracer())                       # MPI.COMM_WORLD, axis "world"
    total = comm.all_reduce(x, tag="loss")              # MPI's own Allreduce
    total = comm.all_reduce(x, algo="ring", tag="loss") # the ring of refpar.comm.algorithms

Each call converts its input to a contiguous NumPy array on the host (arrays of other namespaces,
e.g. torch tensors, come back in their own namespace and on their own device), never modifies it,
returns new arrays, and records one `CommEvent` on the tracer if there is one. Device arrays are
staged through host buffers, since the MPI library is not GPU-aware, and their events say so
(`staged=True`). Arrays move with mpi4py's uppercase,
buffer-based calls: no pickling.

16-bit floats (float16, ml_dtypes.bfloat16) move as their 2-byte bit patterns and reduce in the
16-bit dtype, every pairwise sum rounded to 16 bits as NCCL's ring does: the written-out ring
with NumPy's ufuncs in a known order, `algo="native"` through a user-defined MPI operation in
MPI's order. The trace records the 16-bit dtype and 2 bytes per element.

Switches (constructor arguments; None reads the environment): `debug`
(`REFPAR_DEBUG_COLLECTIVES=1`) checks that the ranks of a group make the same call, `timeout`
(`REFPAR_COLLECTIVE_TIMEOUT=seconds`) turns a hang into a sentence naming whom a rank waits for:
refpar/comm/diagnosis.py. Wrap a program's main in `abort_on_error()` so that an error on one rank
ends the whole job.

MPICH's waiting ranks busy-poll; `MPIR_CVAR_ENABLE_HEAVY_YIELD=1` makes them sleep between polls.
Before MPI starts, refpar sets it where the node runs more than twice as many ranks as it has cores
(`wait_policy`), and leaves an explicit setting alone. Measured on 2 cores (MPICH 5.0.2): with 4
ranks the sleeps cost every collective its wake-ups (an all-gather between 1.5 ms of compute +0.7
ms with them, +0.1 ms without; `--mesh dp=2,tp=2` 38 -> 19 ms a step without, MoE `ep=4` 70 -> 49);
with 8 the pollers take the cores from the ranks that compute (the `small` preset on `dp=2,tp=2,pp=2`
305-355 ms a step with them, 352-405 without; one rank computing while 7 wait: 1.6 s against 3.4 s).
"""

from __future__ import annotations

import math
import os
import pickle
import zlib

import numpy as np

from refpar import backend
from refpar.comm import algorithms, cost, diagnosis
from refpar.comm.buffers import (
    SIXTEEN_BIT,
    displacements,
    dtype_name,
    from_host,
    require_axis0,
    row_size,
    staged,
    to_host,
    wire,
)
from refpar.comm.trace import Tracer, now
from refpar.config import ConfigError
from refpar.sharding import shard_sizes


def wait_policy(environ: dict, cores: int) -> dict:
    """The MPICH settings this process starts MPI with (module docstring): `environ` plus heavy
    yield when the node's ranks (hydra's MPI_LOCALNRANKS) outnumber its `cores` more than twice,
    unless `environ` sets it already."""
    ranks = int(environ.get("MPI_LOCALNRANKS") or 1)
    if "MPIR_CVAR_ENABLE_HEAVY_YIELD" in environ or ranks <= 2 * cores:
        return environ
    return {**environ, "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


# MPICH reads its settings from the environment when mpi4py's import starts MPI: set them first.
os.environ.update(wait_policy(dict(os.environ), len(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
from mpi4py import MPI  # noqa: E402

# op name -> (NumPy ufunc for the written-out algorithms, MPI reduction for native calls)
REDUCE_OPS = {
    "sum": (np.add, MPI.SUM),
    "prod": (np.multiply, MPI.PROD),
    "max": (np.maximum, MPI.MAX),
    "min": (np.minimum, MPI.MIN),
}

# Tags up to MPI's TAG_UB (2^29 - 1 in MPICH; the standard promises at least 32767), so that two
# tensors in flight on one link almost never share a hash.
_TAG_LIMIT = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1


def _mpi_tag(tag: str) -> int:
    """The MPI tag of a point-to-point message: a hash of its refpar tag, the same on every rank,
    so a receive matches the send of the same tensor. `Communicator._tag` refuses a collision."""
    return zlib.crc32(tag.encode()) % _TAG_LIMIT


class _Link:
    """Point-to-point for the written-out algorithms, on the communicator's private duplicate (so
    it never matches a user's send/recv), counting the bytes it moves."""

    def __init__(self, owner: Communicator):
        self.owner, self.rank, self.size = owner, owner.rank, owner.size
        self.sent = self.recv = 0

    def sendrecv(self, sendbuf, dest, recvbuf, source) -> None:
        requests = []
        if recvbuf is not None:
            requests.append(self.owner._private.Irecv(wire(recvbuf), source, 0))
            self.recv += recvbuf.nbytes
        if sendbuf is not None:
            requests.append(self.owner._private.Isend(wire(sendbuf), dest, 0))
            self.sent += sendbuf.nbytes
        self.owner._wait(requests)

    def moved(self) -> cost.Bytes:
        return cost.Bytes(self.sent, self.recv)


class Request:
    """A pending `isend`/`irecv`. `wait()` completes it, records its event (from the post to the
    completion) and returns the received array (irecv) or None (isend); a second wait() returns
    the same."""

    def __init__(self, comm: Communicator, request, op: str, peer: int, buf: np.ndarray, like,
                 tag: str, t_start: float):
        self._comm, self._request, self._op, self._peer = comm, request, op, peer
        self._buf, self._like, self._tag, self._t_start = buf, like, tag, t_start
        self._done = False

    def wait(self):
        if not self._done:
            self._comm._wait([self._request], late=lambda: diagnosis.late_message(
                self._comm, self._op, self._peer, self._tag))
            self._done = True
            if self._comm.tracer is not None:
                n = self._buf.nbytes
                moved = cost.Bytes(n, 0) if self._op == "isend" else cost.Bytes(0, n)
                self._comm._record(self._op, "p2p", self._comm.group[self._peer], self._buf.shape,
                                   self._buf.dtype, moved, self._tag, self._t_start, self._like)
        return from_host(self._buf, self._like) if self._op == "irecv" else None


class Communicator:
    """One MPI communicator and the axis it spans (`world`, `pp`, `dp`, `ep`, `cp`, `tp`).

    `rank` and `size` are within the group; `group` lists the world ranks of the group in rank
    order; `world_rank` is this process's rank in MPI.COMM_WORLD. Collectives must be called by
    every rank of the group in the same order, with the same algo.
    """

    def __init__(self, mpi_comm, axis: str = "world", tracer: Tracer | None = None, *,
                 debug: bool | None = None, timeout: float | None = None, transport=None):
        self.comm = mpi_comm
        # A device-aware transport (gpu_backend/transport.py) or None: MPI, staged through the host.
        self.transport = transport
        self.axis = axis
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        group, world_group = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.group = tuple(int(g) for g in group.Translate_ranks(list(range(self.size)), world_group))
        group.Free()
        world_group.Free()
        self.tracer = tracer
        if tracer is not None and tracer.rank is None:
            tracer.rank = self.world_rank
        self.debug = diagnosis.debug_from_env() if debug is None else bool(debug)
        self.timeout = diagnosis.timeout_from_env() if timeout is None else timeout
        # Written-out algorithms, debug checks and count exchanges talk on a duplicate, so their
        # messages can never be taken by a user's recv on the same communicator.
        self._private = mpi_comm.Dup()
        self.doing = ("", "")  # (op, tag) of the call in progress, for the timeout's message
        self._arrivals: diagnosis.Arrivals | None = None  # with a timeout: the group has reached it
        self._tag_names: dict[int, str] = {}  # MPI tag -> the refpar tag that first used it

    def __repr__(self) -> str:
        return f"Communicator(axis={self.axis!r}, rank={self.rank}, size={self.size}, group={self.group})"

    def split(self, color: int | None, key: int = 0, axis: str | None = None) -> Communicator | None:
        """MPI Comm_split: ranks with the same color form a new communicator ordered by key; color
        None takes no part and gets None. Tracer, debug and timeout carry over."""
        mpi_color = MPI.UNDEFINED if color is None else color
        sub = self.comm.Split(mpi_color, key)
        if sub == MPI.COMM_NULL:
            return None
        out = Communicator(sub, axis or self.axis, self.tracer, debug=self.debug, timeout=self.timeout)
        if self.transport is not None:
            out.transport = self.transport.subgroup(out.group)
        return out

    # --- collectives -------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        """Elementwise reduction (`sum`, `prod`, `max`, `min`) over the group; every rank gets it.
        algo: native or ring."""
        if self._transported("all_reduce", x, algo):
            _reduce_op(op)
            return self._by_transport("all_reduce", x, tag, lambda item: cost.all_reduce_bytes(
                math.prod(x.shape), self.size, self.rank, item), lambda: self.transport.all_reduce(x, op))
        a, like = to_host(x)
        ufunc, mpi_op = _reduce_op(op, a.dtype)
        t0 = self._begin("all_reduce", algo, a.shape, a.dtype, tag)
        if algo == "native":
            out = np.empty_like(a)
            self._native(lambda: self.comm.Iallreduce(wire(a), wire(out), mpi_op),
                         lambda: self.comm.Allreduce(wire(a), wire(out), mpi_op))
        else:
            link = _Link(self)
            out = algorithms.ring_all_reduce(link, a, ufunc)
        if self.tracer is not None:
            moved = cost.all_reduce_bytes(a.size, self.size, self.rank, a.itemsize) \
                if algo == "native" else link.moved()
            self._record("all_reduce", algo, None, a.shape, a.dtype, moved, tag, t0, like)
        return from_host(out, like)

    def reduce_scatter(self, x, op: str = "sum", algo: str = "native", tag: str = ""):
        """x (n, ...), the same shape on every rank -> rows `shard_range(n, size, rank)` of the
        elementwise reduction, shape (n_rank, ...). algo: native or ring."""
        if x.ndim and self._transported("reduce_scatter", x, algo, even=x.shape[0] % self.size == 0):
            _reduce_op(op)
            return self._by_transport("reduce_scatter", x, tag, lambda item: cost.reduce_scatter_bytes(
                x.shape[0], self.size, self.rank, item, math.prod(x.shape[1:])),
                lambda: self.transport.reduce_scatter(x, op, self.size))
        a, like = to_host(x)
        require_axis0(a, "reduce_scatter")
        ufunc, mpi_op = _reduce_op(op, a.dtype)
        t0 = self._begin("reduce_scatter", algo, a.shape, a.dtype, tag)
        rows = shard_sizes(a.shape[0], self.size)
        unit = row_size(a)
        if algo == "native":
            out = np.empty((rows[self.rank], *a.shape[1:]), dtype=a.dtype)
            counts = [c * unit for c in rows]
            self._native(lambda: self.comm.Ireduce_scatter(wire(a), wire(out), counts, mpi_op),
                         lambda: self.comm.Reduce_scatter(wire(a), wire(out), counts, mpi_op))
        else:
            link = _Link(self)
            out = algorithms.ring_reduce_scatter(link, a, ufunc)
        if self.tracer is not None:
            moved = cost.reduce_scatter_bytes(a.shape[0], self.size, self.rank, a.itemsize, unit) \
                if algo == "native" else link.moved()
            self._record("reduce_scatter", algo, None, a.shape, a.dtype, moved, tag, t0, like)
        return from_host(out, like)

    def all_gather(self, x, algo: str = "native", tag: str = "", counts: list[int] | None = None):
        """x (n_rank, ...) on each rank -> the pieces concatenated along axis 0 in rank order,
        (sum n_i, ...). Pieces may differ in length; pass `counts` (every rank's n_i) if known,
        else the ranks exchange them first (a small untraced message). algo: native or ring."""
        even = counts is not None and len(set(counts)) == 1 and x.ndim and counts[0] == x.shape[0]
        if self._transported("all_gather", x, algo, even=bool(even)):
            return self._by_transport("all_gather", x, tag, lambda item: cost.all_gather_bytes(
                [int(c) for c in counts], self.rank, item, math.prod(x.shape[1:])),
                lambda: self.transport.all_gather(x, self.size))
        a, like = to_host(x)
        require_axis0(a, "all_gather")
        t0 = self._begin("all_gather", algo, ("*", *a.shape[1:]), a.dtype, tag)
        counts = self._counts(a.shape[0]) if counts is None else [int(c) for c in counts]
        if len(counts) != self.size or counts[self.rank] != a.shape[0]:
            raise ValueError(f"all_gather counts {counts} do not give rank {self.rank} its "
                             f"{a.shape[0]} rows; pass one count per rank or none")
        unit = row_size(a)
        if algo == "native":
            out = np.empty((sum(counts), *a.shape[1:]), dtype=a.dtype)
            if len(set(counts)) == 1:  # MPICH's Allgather is 10-50x faster than its Allgatherv here
                self._native(lambda: self.comm.Iallgather(wire(a), wire(out)),
                             lambda: self.comm.Allgather(wire(a), wire(out)))
            else:
                spec = [wire(out), ([c * unit for c in counts], displacements(counts, unit))]
                self._native(lambda: self.comm.Iallgatherv(wire(a), spec),
                             lambda: self.comm.Allgatherv(wire(a), spec))
        else:
            link = _Link(self)
            out = algorithms.ring_all_gather(link, a, counts)
        if self.tracer is not None:
            moved = cost.all_gather_bytes(counts, self.rank, a.itemsize, unit) \
                if algo == "native" else link.moved()
            self._record("all_gather", algo, None, a.shape, a.dtype, moved, tag, t0, like)
        return from_host(out, like)

    def all_to_all(self, chunks, algo: str = "native", tag: str = "",
                   recv_counts: list[int] | None = None) -> list:
        """chunks[j] (n_j, ...) goes to rank j -> a list whose entry i is what rank i sent here.
        Chunk lengths may differ (uneven); all chunks share the shape after axis 0 and the dtype.
        Pass `recv_counts` if known, else the ranks exchange the lengths first (untraced).
        algo: native or pairwise."""
        if len(chunks) != self.size:
            raise ValueError(f"all_to_all needs one chunk per rank ({self.size}), got {len(chunks)}")
        hosted = [to_host(c) for c in chunks]
        parts = [h[0] for h in hosted]
        like = hosted[0][1]  # results come back in the namespace and on the device of the first chunk
        for part in parts:
            require_axis0(part, "all_to_all")
            if part.shape[1:] != parts[0].shape[1:] or part.dtype != parts[0].dtype:
                raise ValueError("all_to_all chunks must share their shape after axis 0 and their "
                                 f"dtype; got {[(p.shape, p.dtype.name) for p in parts]}")
        rest, dtype = parts[0].shape[1:], parts[0].dtype
        t0 = self._begin("all_to_all", algo, ("*", *rest), dtype, tag)
        send_counts = [p.shape[0] for p in parts]
        if recv_counts is None:
            recv_counts = self._exchange_all_to_all(send_counts)
        recv_counts = [int(c) for c in recv_counts]
        unit = int(np.prod(rest, dtype=np.int64))
        if algo == "native":
            sendbuf = np.concatenate(parts)  # (sum n_j, ...) one buffer for MPI's Alltoallv
            recvbuf = np.empty((sum(recv_counts), *rest), dtype=dtype)
            send_spec = [wire(sendbuf), ([c * unit for c in send_counts], displacements(send_counts, unit))]
            recv_spec = [wire(recvbuf), ([c * unit for c in recv_counts], displacements(recv_counts, unit))]
            self._native(lambda: self.comm.Ialltoallv(send_spec, recv_spec),
                         lambda: self.comm.Alltoallv(send_spec, recv_spec))
            received = np.split(recvbuf, np.cumsum(recv_counts)[:-1])
        else:
            received = [np.empty((c, *rest), dtype=dtype) for c in recv_counts]
            link = _Link(self)
            algorithms.pairwise_all_to_all(link, parts, received)
        if self.tracer is not None:
            moved = cost.all_to_all_bytes([c * unit for c in send_counts], [c * unit for c in recv_counts],
                                          self.rank, dtype.itemsize) if algo == "native" else link.moved()
            self._record("all_to_all", algo, None, (sum(send_counts), *rest), dtype, moved, tag, t0,
                         like)
        return [from_host(r, like) for r in received]

    def broadcast(self, x, root: int = 0, algo: str = "native", tag: str = ""):
        """Rank `root`'s x to every rank. As in MPI, every rank passes an array of the same shape
        and dtype (the others' contents are ignored). algo: native, tree or scatter_allgather."""
        if self._transported("broadcast", x, algo):
            self._check_peer(root, "root")
            return self._by_transport("broadcast", x, tag, lambda item: cost.broadcast_bytes(
                math.prod(x.shape), self.size, self.rank, root, item),
                lambda: self.transport.broadcast(x, root, self.group[root]), root=root)
        a, like = to_host(x)
        self._check_peer(root, "root")
        t0 = self._begin("broadcast", algo, a.shape, a.dtype, tag, root=root)
        out = a.copy() if self.rank == root else np.empty_like(a)  # the others' contents are ignored
        if algo == "native":
            self._native(lambda: self.comm.Ibcast(wire(out), root),
                         lambda: self.comm.Bcast(wire(out), root))
        else:
            link = _Link(self)
            written_out = {"tree": algorithms.tree_broadcast,
                           "scatter_allgather": algorithms.scatter_allgather_broadcast}
            written_out[algo](link, out, root)
        if self.tracer is not None:
            moved = cost.broadcast_bytes(out.size, self.size, self.rank, root, a.itemsize) \
                if algo == "native" else link.moved()
            self._record("broadcast", algo, None, a.shape, a.dtype, moved, tag, t0, like)
        return from_host(out, like)

    def barrier(self, tag: str = "") -> None:
        """Returns once every rank of the group has entered it."""
        t0 = self._begin("barrier", "native", (), np.dtype("uint8"), tag)
        self._native(self.comm.Ibarrier, self.comm.Barrier)
        if self.tracer is not None:
            self._record("barrier", "native", None, (), np.uint8, cost.Bytes(0, 0), tag, t0)

    def gather_object(self, obj, root: int = 0) -> list | None:
        """Small Python objects (trace rows, reports) from every rank to `root`, in rank order; None
        elsewhere. Pickled and untraced: for bookkeeping about a run, never for its tensors."""
        self._check_peer(root, "root")
        self.doing = ("gather_object", "")
        if self.timeout is None:
            return self._private.gather(obj, root)
        self._arrive()
        # No non-blocking pickled gather in MPI: send the pickle's length, then its bytes.
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = self._counts(data.size)
        spec = [np.empty(sum(lengths), np.uint8), (lengths, displacements(lengths, 1))] \
            if self.rank == root else None
        self._wait([self._private.Igatherv(data, spec, root)])
        if self.rank != root:
            return None
        bounds = np.cumsum([0, *lengths])
        return [pickle.loads(spec[0][bounds[i]:bounds[i + 1]].tobytes()) for i in range(self.size)]

    def broadcast_object(self, obj, root: int = 0):
        """Rank `root`'s small Python object on every rank (the others' `obj` is ignored). Pickled
        and untraced, like gather_object: for bookkeeping (whether a checkpoint was written), never
        for a run's tensors."""
        self._check_peer(root, "root")
        self.doing = ("broadcast_object", "")
        if self.timeout is None:
            return self._private.bcast(obj, root)
        self._arrive()
        # No non-blocking pickled broadcast in MPI: broadcast the pickle's length, then its bytes.
        data = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8) if self.rank == root else None
        length = np.array([0 if data is None else data.size], dtype=np.int64)
        self._wait([self._private.Ibcast(length, root)])
        if data is None:
            data = np.empty(int(length[0]), dtype=np.uint8)
        self._wait([self._private.Ibcast(data, root)])
        return pickle.loads(data.tobytes())

    def broadcast_bytes(self, data, root: int = 0) -> np.ndarray:
        """Rank `root`'s uint8 array on every rank (the others pass None). Untraced, like
        gather_object: for bookkeeping that every rank must agree on (refpar/agreement.py's decisions,
        as JSON bytes), never for a run's tensors; nothing is unpickled."""
        self._check_peer(root, "root")
        self.doing = ("broadcast_bytes", "")
        if self.timeout is not None:
            self._arrive()
        length = np.array([0 if data is None else data.size], dtype=np.int64)
        self._native(lambda: self._private.Ibcast(length, root), lambda: self._private.Bcast(length, root))
        out = np.ascontiguousarray(data, dtype=np.uint8) if self.rank == root \
            else np.empty(int(length[0]), dtype=np.uint8)
        self._native(lambda: self._private.Ibcast(out, root), lambda: self._private.Bcast(out, root))
        return out

    def all_gather_bytes(self, data) -> list[np.ndarray]:
        """Every rank's uint8 array, in rank order, on every rank. Untraced bookkeeping, as
        broadcast_bytes."""
        self.doing = ("all_gather_bytes", "")
        if self.timeout is not None:
            self._arrive()
        data = np.ascontiguousarray(data, dtype=np.uint8)
        counts = self._counts(data.size)
        out = np.empty(sum(counts), dtype=np.uint8)
        spec = [out, (counts, displacements(counts, 1))]
        self._native(lambda: self._private.Iallgatherv(data, spec),
                     lambda: self._private.Allgatherv(data, spec))
        bounds = np.cumsum([0, *counts])
        return [out[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    # --- point to point ----------------------------------------------------------------------

    def _tag(self, tag: str) -> int:
        """`_mpi_tag(tag)`, remembered: MPI matches a receive by (source, integer tag), so two refpar
        tags with one hash could take each other's messages, same-shaped data swapped without a
        sound. Both ends of a link see every tag it carries, so refusing a second name for a hash
        here stops every such swap before it can happen (the tags refpar uses are a bounded set)."""
        n = _mpi_tag(tag)
        first = self._tag_names.setdefault(n, tag)
        if first != tag:
            raise diagnosis.TagCollision(f"tags {first!r} and {tag!r} both map to MPI tag {n} on axis "
                                         f"{self.axis}, so their messages could swap; rename one of them")
        return n

    def send(self, x, dest: int, tag: str = "") -> None:
        """Sends x to group rank `dest`; the matching recv names the same tag."""
        a, like = to_host(x)
        self._check_peer(dest, "dest")
        t0 = now()
        self._native(lambda: self.comm.Isend(wire(a), dest, self._tag(tag)),
                     lambda: self.comm.Send(wire(a), dest, self._tag(tag)),
                     late=lambda: diagnosis.late_message(self, "send", dest, tag))
        if self.tracer is not None:
            self._record("send", "p2p", self.group[dest], a.shape, a.dtype, cost.Bytes(a.nbytes, 0), tag, t0,
                         like)

    def recv(self, shape, dtype, source: int, tag: str = "", like=None):
        """Receives a (shape, dtype) array from group rank `source`, sent with the same tag; in
        `like`'s namespace and on its device when given (else NumPy)."""
        self._check_peer(source, "source")
        out = np.empty(shape, dtype=dtype)
        t0 = now()
        self._native(lambda: self.comm.Irecv(wire(out), source, self._tag(tag)),
                     lambda: self.comm.Recv(wire(out), source, self._tag(tag)),
                     late=lambda: diagnosis.late_message(self, "recv", source, tag))
        if self.tracer is not None:
            self._record("recv", "p2p", self.group[source], out.shape, out.dtype, cost.Bytes(0, out.nbytes),
                         tag, t0, like)
        return from_host(out, like)

    def isend(self, x, dest: int, tag: str = "") -> Request:
        """Starts sending x to `dest`; x may be reused at once (its host copy travels)."""
        a, like = to_host(x)
        a = a.copy()  # the caller may overwrite x before the send completes
        self._check_peer(dest, "dest")
        t0 = now()
        return Request(self, self.comm.Isend(wire(a), dest, self._tag(tag)), "isend", dest, a, like, tag, t0)

    def irecv(self, shape, dtype, source: int, tag: str = "", like=None) -> Request:
        """Starts receiving a (shape, dtype) array from `source`; `wait()` returns it, in `like`'s
        namespace and on its device when given (else NumPy)."""
        self._check_peer(source, "source")
        out = np.empty(shape, dtype=dtype)
        t0 = now()
        return Request(self, self.comm.Irecv(wire(out), source, self._tag(tag)), "irecv", source, out, like,
                       tag, t0)

    # --- machinery ---------------------------------------------------------------------------

    def _transported(self, op: str, x, algo: str, even: bool = True) -> bool:
        """Whether the device transport does this call instead of MPI (gpu_backend/transport.py)."""
        return self.transport is not None and algo == "native" and self.transport.takes(op, x, even)

    def _by_transport(self, op: str, x, tag: str, moved, call, **extra):
        """Runs `call` on the transport, traced like a native call: the ring's bytes, not staged."""
        dtype, shape = backend.host_dtype(x), tuple(x.shape)
        t0 = self._begin(op, "native", shape, dtype, tag, **extra)
        if self.timeout is not None:
            self._wait([])  # the transport's calls cannot be polled: wait for the arrivals first
        out = call()
        if self.tracer is not None:
            bytes_moved = moved(dtype.itemsize)
            self.tracer.record(op, self.axis, self.group, self.transport.name, None, dtype.name, shape,
                               bytes_moved.sent, bytes_moved.recv, tag, t0, now())
        return out

    def _begin(self, op: str, algo: str, shape, dtype, tag: str, **extra) -> float:
        """Checks the algo name, notes the op for timeouts (and with one, tells the group this rank
        has reached it: `_arrive`), runs the debug check; returns t_start."""
        if algo != "native":
            cost.resolve_algo(op, algo)
        self.doing = (op, tag)
        if self.timeout is not None:
            self._arrive()
        if self.debug:
            self._check_same(op, algo, shape, np.dtype(dtype).name, tag, extra)
        return now()

    def _native(self, nonblocking, blocking, late=None) -> None:
        """MPI's blocking call, or with a timeout its non-blocking twin, waited for (`_wait`)."""
        if self.timeout is None:
            blocking()
        else:
            self._wait([nonblocking()], late)

    def _wait(self, requests, late=None) -> None:
        """Waits for all requests; with a timeout, polls them and the arrivals of the collective in
        progress (`_arrive`) and says whom it waits for when late (diagnosis.wait_or_explain)."""
        if self.timeout is None:
            MPI.Request.Waitall(requests)
            return
        arrivals, self._arrivals = self._arrivals, None
        diagnosis.wait_or_explain(self, requests, arrivals, MPI.Request.Testall, late)

    def _arrive(self) -> None:
        """Tells every other rank of the group that this one has reached its next collective and
        starts receiving their word of the same; the collective's first wait completes both, so that
        a timeout can name the ranks that have not arrived (a non-blocking collective cannot say
        whom it still waits for), at no extra round trip."""
        self._arrivals = diagnosis.Arrivals(self._private, self.rank, self.size)

    def _counts(self, n: int) -> list[int]:
        mine = np.array([n], dtype=np.int64)
        every = np.empty(self.size, dtype=np.int64)
        self._native(lambda: self._private.Iallgather(mine, every),
                     lambda: self._private.Allgather(mine, every))
        return [int(c) for c in every]

    def _exchange_all_to_all(self, send_counts: list[int]) -> list[int]:
        mine = np.array(send_counts, dtype=np.int64)
        theirs = np.empty(self.size, dtype=np.int64)
        self._native(lambda: self._private.Ialltoall(mine, theirs),
                     lambda: self._private.Alltoall(mine, theirs))
        return [int(c) for c in theirs]

    def _check_same(self, op, algo, shape, dtype, tag, extra) -> None:
        """Debug mode: every rank of the group shows the others what it is about to call."""
        buf = diagnosis.signature(op, algo, shape, dtype, tag, extra)
        every = np.empty((self.size, buf.size), dtype=np.uint8)
        self._native(lambda: self._private.Iallgather(buf, every),
                     lambda: self._private.Allgather(buf, every))
        diagnosis.check_signatures(every, self)

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{what}={peer} is not a rank of axis {self.axis} (0..{self.size - 1})")

    def _record(self, op, algo, peer, shape, dtype, moved: cost.Bytes, tag: str, t0: float,
                like=None) -> None:
        name = _NATIVE_NAMES.get(op, algo) if algo == "native" else algo
        self.tracer.record(op, self.axis, self.group, name, peer, dtype_name(dtype), tuple(shape),
                           moved.sent, moved.recv, tag, t0, now(), staged(like))


_NATIVE_NAMES = {op: f"native({algo})" for op, algo in cost.NATIVE_ALGO.items()}


def _reduce_op(op: str, dtype=None):
    """(NumPy ufunc, MPI operation) of `op`; for a 16-bit float dtype the MPI operation is
    `_op_16bit`'s, since MPI's own would see the bit patterns as integers."""
    if op not in REDUCE_OPS:
        raise ConfigError(f"unknown reduction {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    ufunc, mpi_op = REDUCE_OPS[op]
    if dtype is not None and dtype in SIXTEEN_BIT:
        return ufunc, _op_16bit(op, dtype)
    return ufunc, mpi_op


_OPS_16BIT: dict = {}  # (op, dtype) -> MPI.Op, created once per process


def _op_16bit(op: str, dtype: np.dtype):
    """A user-defined commutative MPI operation that reduces uint16 bit patterns as `dtype`: each
    pairwise combination computes in float32 and rounds to 16 bits (NumPy's float16 and
    ml_dtypes' bfloat16 ufuncs), as NCCL's ring sums bf16 gradients on a GPU. MPI calls it with
    `inoutvec = invec op inoutvec` on pieces of whatever size its algorithm chooses."""
    key = (op, dtype)
    if key not in _OPS_16BIT:
        ufunc = REDUCE_OPS[op][0]

        def combine(invec, inoutvec, datatype) -> None:
            acc = np.frombuffer(inoutvec, dtype=dtype)  # (len,) a writable view of MPI's buffer
            ufunc(np.frombuffer(invec, dtype=dtype), acc, out=acc)

        _OPS_16BIT[key] = MPI.Op.Create(combine, commute=True)
    return _OPS_16BIT[key]


def world(tracer: Tracer | None = None, *, debug: bool | None = None,
          timeout: float | None = None, transport: str = "mpi") -> Communicator:
    """The communicator of all ranks (MPI.COMM_WORLD), axis "world". transport "mpi" stages device
    arrays through host buffers; "torch.distributed" moves torch tensors with NCCL (gloo on the CPU)
    where it can (gpu_backend/transport.py); every rank must choose the same."""
    comm = Communicator(MPI.COMM_WORLD, "world", tracer, debug=debug, timeout=timeout)
    if transport != "mpi":
        from gpu_backend.transport import TorchDistributed, check_transport

        check_transport(transport)
        comm.transport = TorchDistributed.start(comm)
    return comm


def abort_on_error(grace_s: float = 0.5):
    """`with abort_on_error(): main()`: an error on any rank is printed once and ends every rank of
    the job (MPI Abort) instead of leaving the others waiting forever (diagnosis.end_job_on_error)."""
    everyone = MPI.COMM_WORLD
    return diagnosis.end_job_on_error(everyone.Abort, everyone.Get_rank(), everyone.Get_size(), grace_s)
