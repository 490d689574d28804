"""What moved, recorded: one `CommEvent` per communication call per rank, kept by a `Tracer`.

A `Communicator` given `tracer=None` never builds an event, so tracing switched off costs one
`is None` test per call. Events export as JSON lines (one event a line) and as Chrome trace
events (open in https://ui.perfetto.dev or chrome://tracing): one process per rank, one track each.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from refpar.files import write_atomically


@dataclass(slots=True)
class CommEvent:
    """One call on one rank. Bytes are what this rank put on (sent) and took off (recv) the wire;
    a rank's copy of its own chunk is not counted. `algo` names the algorithm whose bytes these are:
    a written-out one (`"ring"`) counts what it really sent, a native MPI call records the bytes of
    the bandwidth-optimal algorithm and says so (`"native(ring)"`)."""

    rank: int  # world rank that recorded the event
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, isend, ...
    axis: str  # the communicator's axis: world, pp, dp, ep, cp, tp
    group: tuple[int, ...]  # world ranks of the communicator, in group-rank order
    algo: str
    peer: int | None  # world rank of the other side of a point-to-point call, else None
    dtype: str
    shape: tuple[int, ...]  # of this rank's input (of the received array for recv)
    bytes_sent: int
    bytes_recv: int
    tag: str  # what moves and why, e.g. "h.3.mlp.c_proj:bwd"
    step: int | None
    microbatch: int | None
    phase: str | None
    t_start: float  # seconds, time.perf_counter() of this process
    t_end: float
    staged: bool = False  # device arrays copied to host buffers and back around the MPI call

    def to_dict(self) -> dict:
        d = asdict(self)
        d["group"], d["shape"] = list(self.group), list(self.shape)
        return d


@dataclass
class Tracer:
    """Collects this rank's events. `with tracer.context(step=3, microbatch=1, phase="bwd"):` labels
    every event recorded inside it; contexts nest, inner values win."""

    rank: int | None = None  # world rank; the first Communicator given this tracer fills it in
    events: list[CommEvent] = field(default_factory=list)
    _context: dict = field(default_factory=lambda: {"step": None, "microbatch": None, "phase": None})

    @contextmanager
    def context(self, **labels):
        unknown = set(labels) - set(self._context)
        if unknown:
            raise ValueError(f"unknown trace label {sorted(unknown)[0]!r}; use step, microbatch, phase")
        saved = dict(self._context)
        self._context.update(labels)
        try:
            yield self
        finally:
            self._context = saved

    def record(self, op: str, axis: str, group: tuple, algo: str, peer: int | None, dtype: str,
               shape: tuple, bytes_sent: int, bytes_recv: int, tag: str, t_start: float,
               t_end: float, staged: bool = False) -> CommEvent:
        """Appends one event labelled with the current context. Positional and unconverted on
        purpose: it runs on every traced call, and tracing should cost microseconds."""
        context = self._context
        event = CommEvent(self.rank, op, axis, group, algo, peer, dtype, shape, bytes_sent, bytes_recv,
                          tag, context["step"], context["microbatch"], context["phase"], t_start, t_end,
                          staged)
        self.events.append(event)
        return event

    def clear(self) -> None:
        self.events.clear()

    def bytes_by(self, axis: str | None = None, op: str | None = None) -> tuple[int, int]:
        """(bytes_sent, bytes_recv) summed over the events of `axis` and `op` (None: any)."""
        sent = recv = 0
        for e in self.events:
            if (axis is None or e.axis == axis) and (op is None or e.op == op):
                sent += e.bytes_sent
                recv += e.bytes_recv
        return sent, recv

    def totals(self, step: int | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """{(axis, op): (bytes_sent, bytes_recv)} over all events, or those of training step `step`
        (recorded inside `context(step=step)`), in first-seen order."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for e in self.events:
            if step is not None and e.step != step:
                continue
            sent, recv = out.get((e.axis, e.op), (0, 0))
            out[(e.axis, e.op)] = (sent + e.bytes_sent, recv + e.bytes_recv)
        return out


def chrome_trace(events: list[CommEvent], t0: float | None = None) -> dict:
    """Chrome trace JSON (the "Trace Event Format") for events of any number of ranks: one process
    per rank, so Perfetto draws one track per rank; times in microseconds from `t0` (default: the
    earliest event). `time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for all the
    processes of a machine, so the ranks' tracks line up."""
    if t0 is None:
        t0 = min((e.t_start for e in events), default=0.0)
    trace = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"name": f"rank {rank}"}})
    for e in events:
        args = {k: v for k, v in e.to_dict().items() if k not in ("rank", "op", "t_start", "t_end")}
        trace.append({"name": f"{e.op} {e.axis} {e.tag}".rstrip(), "cat": e.axis, "ph": "X",
                      "pid": e.rank, "tid": 0, "ts": (e.t_start - t0) * 1e6,
                      "dur": max(e.t_end - e.t_start, 0.0) * 1e6, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_trace(path, events: list[CommEvent]) -> None:
    """Writes events as JSON lines when `path` ends in .jsonl, else as a Chrome trace (.json)."""
    if str(path).endswith(".jsonl"):
        text = "".join(json.dumps(e.to_dict()) + "\n" for e in events)
    else:
        text = json.dumps(chrome_trace(events))
    write_atomically(path, lambda f: f.write(text.encode()))  # whole or not at all (refpar/files.py)


def event_of(d: dict) -> CommEvent:
    """A CommEvent from its `to_dict()` (a JSON line of `write_trace` or `refpar train --trace`)."""
    return CommEvent(**{**d, "group": tuple(d["group"]), "shape": tuple(d["shape"])})


def read_trace(path) -> list[CommEvent]:
    """The events of a JSON-lines trace (PATH.jsonl: every message of a `refpar train` run)."""
    with open(path) as f:
        return [event_of(json.loads(line)) for line in f if line.strip()]


now = time.perf_counter  # the clock of every event (CLOCK_MONOTONIC on Linux)
