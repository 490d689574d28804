"""What a rank says when communication goes wrong, so that a mismatch or a hang ends in a sentence
instead of a silent wait (Communicator, communicator.py, calls these; nothing here imports mpi4py:
the MPI requests and communicators it touches come in as arguments).

    REFPAR_DEBUG_COLLECTIVES=1 mpiexec -n 2 python -m refpar train --mesh dp=2 --steps 1
    REFPAR_COLLECTIVE_TIMEOUT=30 mpiexec -n 2 python -m refpar train --mesh dp=2 --steps 1

Debug mode: before each collective the ranks of a group exchange their `signature` and
`check_signatures` names the ranks that differ. Timeout: before each collective the ranks tell each
other they have reached it (`Arrivals`, untraced empty messages), and a late wait (`wait_or_explain`)
names the ranks that have not, or the peer and tag of a point-to-point message. Unset, every call is
MPI's blocking one and no extra message is sent. `end_job_on_error`: one rank's error ends the job.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from contextlib import contextmanager

import numpy as np

from refpar.config import ConfigError

SIGNATURE_BYTES = 1024  # room for one rank's (op, algo, shape, dtype, tag) in debug mode
# With a timeout, "I have reached this collective": an empty message on the private duplicate,
# under a tag of its own (the written-out algorithms' messages there use tag 0).
ARRIVAL_TAG = 1
_NOTHING = np.empty(0, dtype=np.uint8)


class CollectiveError(RuntimeError):
    """Ranks of a group disagree about a collective, or one waited too long for the others."""


class CollectiveMismatch(CollectiveError):
    """Debug mode found ranks of one group calling different collectives (op, shape, dtype, tag)."""


class CollectiveTimeout(CollectiveError):
    """A wait took longer than the collective timeout: a deadlock or a rank that stopped."""


class TagCollision(RuntimeError):
    """Two refpar tags hash to one MPI tag on one communicator: their messages could swap."""


def debug_from_env() -> bool:
    return os.environ.get("REFPAR_DEBUG_COLLECTIVES", "") not in ("", "0")


def timeout_from_env() -> float | None:
    text = os.environ.get("REFPAR_COLLECTIVE_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"REFPAR_COLLECTIVE_TIMEOUT={text!r} must be a number of seconds") from None
    if not 0 < seconds < math.inf:  # nan too, which compared false and so disabled the timeout
        raise ConfigError(f"REFPAR_COLLECTIVE_TIMEOUT={text!r} must be a positive finite number of seconds; "
                          "unset it for no timeout")
    return seconds


# ---------------------------------------------------------------- debug mode: the same call everywhere

def signature(op: str, algo: str, shape, dtype: str, tag: str, extra: dict) -> np.ndarray:
    """What this rank is about to call, as SIGNATURE_BYTES bytes the group can all-gather."""
    mine = json.dumps([op, algo, list(shape), dtype, tag, extra]).encode()[:SIGNATURE_BYTES]
    buf = np.zeros(SIGNATURE_BYTES, dtype=np.uint8)  # (SIGNATURE_BYTES,)
    buf[: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    return buf


def check_signatures(every: np.ndarray, comm) -> None:
    """Raises CollectiveMismatch naming the world ranks of each differing call, given every rank's
    signature (size, SIGNATURE_BYTES) on `comm`'s group."""
    calls = [bytes(row).rstrip(b"\0").decode() for row in every]
    if len(set(calls)) == 1:
        return
    by_call: dict[str, list[int]] = {}
    for rank, call in enumerate(calls):
        by_call.setdefault(call, []).append(comm.group[rank])
    described = []
    for call, ranks in by_call.items():
        c_op, c_algo, c_shape, c_dtype, c_tag, c_extra = json.loads(call)
        shape_text = "(" + ", ".join(str(s) for s in c_shape) + ("," if len(c_shape) == 1 else "") + ")"
        more = "".join(f", {k}={v}" for k, v in c_extra.items())
        described.append(f"world ranks {ranks} call {c_op}(shape={shape_text}, dtype={c_dtype}, "
                         f"algo={c_algo}, tag={c_tag!r}{more})")
    raise CollectiveMismatch(f"collective mismatch on axis {comm.axis} (world ranks {list(comm.group)}): "
                             + "; ".join(described))


# ---------------------------------------------------------------- timeouts: who has not arrived

class Arrivals:
    """One collective's arrival messages (Communicator._arrive): an empty message from this rank
    to every other rank of the group on the private duplicate `private`, and one expected from each.
    MPI keeps the messages from one rank to another in order, so the k-th arrival received from a
    peer is its k-th collective on this communicator, whatever the op."""

    def __init__(self, private, rank: int, size: int):
        self.peers = [r for r in range(size) if r != rank]
        self.received = [private.Irecv(_NOTHING, r, ARRIVAL_TAG) for r in self.peers]
        self.requests = self.received + [private.Isend(_NOTHING, r, ARRIVAL_TAG) for r in self.peers]

    def missing(self) -> list[int]:
        """The group ranks whose arrival has not come."""
        return [r for r, got in zip(self.peers, self.received, strict=True) if not got.Test()]


def wait_or_explain(comm, requests: list, arrivals: Arrivals | None, testall, late=None) -> None:
    """Polls `requests` together with the arrivals of the collective in progress until `testall`
    (MPI.Request.Testall) says all are done; raises CollectiveTimeout after `comm.timeout` seconds:
    naming the ranks that have not arrived if there are any, else in the sentence `late()` gives
    (default: `late_message(comm)`, the collective in progress)."""
    pending = requests + (arrivals.requests if arrivals is not None else [])
    deadline = time.monotonic() + comm.timeout
    polls = 0
    while not testall(pending):
        if time.monotonic() > deadline:
            missing = arrivals.missing() if arrivals is not None else []
            raise CollectiveTimeout(not_arrived(comm, missing) if missing
                                    else late() if late is not None else late_message(comm))
        polls += 1
        if polls > 1000:  # after a short spin, yield the core to the other ranks
            time.sleep(1e-4 if polls < 10000 else 1e-3)


def _waiter(comm) -> str:
    return (f"world rank {comm.world_rank} ({comm.axis} rank {comm.rank} of {comm.size}, "
            f"group {list(comm.group)})")


def not_arrived(comm, missing: list[int]) -> str:
    """The timeout's sentence when group ranks `missing` have not reached the collective."""
    op, tag = comm.doing
    ranks = [comm.group[r] for r in missing]
    who = (f"world rank {ranks[0]}, which has" if len(ranks) == 1
           else f"world ranks {', '.join(map(str, ranks))}, which have")
    return (f"{_waiter(comm)} waited more than {comm.timeout:g} s in {op} on axis {comm.axis} "
            f"with tag {tag!r} for {who} not reached it (still computing, stuck, or waiting in "
            "another call)")


def late_message(comm, p2p_op: str | None = None, peer: int = 0, tag: str = "") -> str:
    """The timeout's sentence: a point-to-point wait names its peer and tag; a collective whose
    ranks have all arrived says what else can keep it from completing."""
    if p2p_op in ("recv", "irecv"):
        return (f"{_waiter(comm)} waited more than {comm.timeout:g} s for world rank "
                f"{comm.group[peer]}'s {tag!r} ({p2p_op} on axis {comm.axis}), which that rank has "
                "not sent (still computing, stuck, or waiting elsewhere)")
    if p2p_op in ("send", "isend"):
        return (f"{_waiter(comm)} waited more than {comm.timeout:g} s for world rank "
                f"{comm.group[peer]} to receive {tag!r} ({p2p_op} on axis {comm.axis}), which that "
                "rank has not asked for (still computing, stuck, or waiting elsewhere)")
    op, tag = comm.doing
    return (f"{_waiter(comm)} waited more than {comm.timeout:g} s in {op} on axis {comm.axis} "
            f"with tag {tag!r} after every rank of the group reached its next collective: they "
            "call different ones (REFPAR_DEBUG_COLLECTIVES=1 names them), one stopped inside it, "
            "or it takes longer than the timeout")


# ---------------------------------------------------------------- one rank's error ends the job

@contextmanager
def end_job_on_error(abort, rank: int, size: int, grace_s: float = 0.5):
    """An exception (or a non-zero sys.exit) inside prints rank `rank` of `size` and the error once
    to stderr and calls `abort(code)` (MPI Abort: every rank of the job ends at once), exit status
    2 for a ConfigError, 1 otherwise, instead of leaving the other ranks waiting forever.

    Printed once: when every rank fails alike, rank 0 prints and aborts at once and the others wait
    `grace_s` first, so the abort ends them before they print. A CollectiveTimeout is the exception:
    each rank that times out prints which op, axis and tag it is in, and waits 2 * `grace_s` before
    aborting so that the other stuck ranks can say where they are."""
    where = f"rank {rank} of {size}"
    try:
        yield
    except SystemExit as stop:
        if stop.code in (0, None):
            raise
        code = stop.code if isinstance(stop.code, int) else 1
        _abort(abort, f"refpar: error on {where}: exited with {stop.code!r}\n", code, rank != 0, grace_s)
    except Exception as err:  # noqa: BLE001 - any error on one rank must end every rank
        if isinstance(err, ConfigError | CollectiveError):
            message = f"refpar: error on {where}: {err}\n"
        else:
            message = (f"refpar: {where} failed:\n" + "".join(traceback.format_exception(err))
                       + f"refpar: error on {where}: {type(err).__name__}: {err}\n")
        timed_out = isinstance(err, CollectiveTimeout)
        _abort(abort, message, 2 if isinstance(err, ConfigError) else 1, rank != 0 and not timed_out,
               grace_s, linger=timed_out)


def _abort(abort, message: str, code: int, wait_first: bool, grace_s: float, linger: bool = False) -> None:
    if wait_first:  # let rank 0 speak for a failure every rank shares
        time.sleep(grace_s)
    sys.stdout.flush()
    sys.stderr.write(message)
    sys.stderr.flush()
    if linger:  # let the other stuck ranks say where they are (their clocks ran out about now too)
        time.sleep(2 * grace_s)
    else:
        # The launcher forwards stderr asynchronously and Abort kills its proxies at once: without
        # a pause the one message could be lost (seen under MPICH's hydra). Still well before the
        # other ranks' grace period ends, so they do not print too.
        time.sleep(grace_s / 2)
    abort(code)
