"""Decisions every rank must share, made once and sent as JSON bytes (no pickling): which checkpoint
step a resume loads and its manifest, whether a --save DIR may be written, whether a save failed.

    from refpar.agreement import decided, broadcast_json, gather_json
    step = decided(comm, lambda: find_the_step())      # rank 0 decides; every rank returns its answer

Why: a decision each rank makes alone from the file system (the newest step in a directory another
job is writing, whether a path exists) can come out differently on different ranks, which then load
different steps and wait for each other in different collectives (issue 43). So rank 0 looks, and
every rank takes its answer, or its refusal (a `ConfigError` raised on every rank with rank 0's
sentence). `agreed(comm, check)` is the other direction: every rank checks (each reads its own
files), and if any rank's check fails, every rank raises the first failing rank's sentence.

`comm` is a refpar.comm.communicator.Communicator or None (one process: the decision is local).
Everything moves as uint8 arrays through `Communicator.broadcast_bytes` and `all_gather_bytes`, so
ranks never unpickle what another rank sent (docs/internals.md, "Communicator"), and, like the other
bookkeeping, they are not traced: the bytes a run's --check holds against the closed forms are its
training's.
"""

from __future__ import annotations

import json

import numpy as np

from refpar.config import ConfigError


def _to_bytes(doc) -> np.ndarray:
    return np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)


def _from_bytes(a: np.ndarray):
    return json.loads(a.tobytes().decode())


def broadcast_json(comm, doc, root: int = 0):
    """Rank `root`'s JSON-able `doc` on every rank (the others' `doc` is ignored)."""
    if comm is None or comm.size == 1:
        return doc
    return _from_bytes(comm.broadcast_bytes(_to_bytes(doc) if comm.rank == root else None, root=root))


def gather_json(comm, doc) -> list:
    """Every rank's JSON-able `doc`, in rank order, on every rank."""
    if comm is None or comm.size == 1:
        return [doc]
    return [_from_bytes(a) for a in comm.all_gather_bytes(_to_bytes(doc))]


def decided(comm, decide):
    """`decide()` on rank 0 (a JSON-able answer, or a ConfigError), its outcome on every rank: the
    answer returned, or the same ConfigError raised."""
    outcome = None
    if comm is None or comm.rank == 0:
        try:
            outcome = {"answer": decide()}
        except ConfigError as err:
            outcome = {"refused": str(err), "kind": type(err).__name__}
    outcome = broadcast_json(comm, outcome)
    if "refused" in outcome:
        raise _error(outcome["kind"])(outcome["refused"])
    return outcome["answer"]


def agreed(comm, check):
    """`check()` on every rank; if it raises a ConfigError on any rank, every rank raises the first
    failing rank's sentence. Returns this rank's result."""
    result, failure = None, None
    try:
        result = check()
    except ConfigError as err:
        failure = {"refused": str(err), "kind": type(err).__name__}
    failures = [f for f in gather_json(comm, failure) if f is not None]
    if failures:
        raise _error(failures[0]["kind"])(failures[0]["refused"])
    return result


def _error(kind: str) -> type[ConfigError]:
    """The ConfigError subclass the deciding rank raised, by name (a CheckpointError stays one)."""
    return {c.__name__: c for c in ConfigError.__subclasses__()}.get(kind, ConfigError)
