"""Lesson 9: overlap, measured. For each way of running the tiny GPT-2 on 2 ranks, how long the last
step's messages were in flight, how long the rank was blocked waiting for them (exposed), and the
difference: in flight while the rank computed (hidden).

    mpiexec -n 2 python lessons/scripts/09_overlap.py

The trace (refpar/comm/trace.py) gives each message's span: a blocking collective's from its call to
its return, an isend's or irecv's from its post to its completion (refpar/comm/communicator.py,
Request.wait). What the trace does not say is whether the rank computed during an isend's span or
sat in its wait(): this script times every Request.wait and counts a blocking call's whole span as
waiting. Exposed = the union of those intervals; in flight = the union of the message spans; hidden =
in flight - exposed. The same numbers, span by span, are what `refpar train --trace PATH` writes for
Perfetto and the app's executed timeline draws.
"""

import time

from refpar.comm import communicator
from refpar.comm.communicator import world
from refpar.comm.trace import Tracer
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh

WAITS: list[tuple[float, float]] = []  # (start, end) of every Request.wait of this process
_wait = communicator.Request.wait


def timed_wait(self):
    start = time.perf_counter()
    try:
        return _wait(self)
    finally:
        WAITS.append((start, time.perf_counter()))


communicator.Request.wait = timed_wait
NONBLOCKING = ("isend", "irecv")


def union(spans) -> float:
    """Seconds covered by at least one of the (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def clip(spans, lo: float, hi: float) -> list:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


comm = world(Tracer())
model = model_preset("tiny")
cfg = TrainConfig(steps=2)
RUNS = (  # label, mesh, plan
    ("DP, one bucket", {"dp": 2}, Plan()),
    ("DP, 24 KiB buckets", {"dp": 2}, Plan(bucket_elems=3072)),
    ("DP, 24 KiB buckets --overlap", {"dp": 2}, Plan(bucket_elems=3072, overlap=True)),
    ("FSDP", {"dp": 2}, Plan(fsdp=True)),
    ("FSDP --prefetch", {"dp": 2}, Plan(fsdp=True, prefetch=True)),
    ("pp=2 1F1B, 4 microbatches", {"pp": 2}, Plan(schedule="1f1b", microbatches=4)),
)
rows = []
for label, sizes, plan in RUNS:
    first = len(comm.tracer.events)
    par = parallelize(model, cfg, DeviceMesh(comm, sizes), plan)
    WAITS.clear()
    train(par)
    events = [e for e in comm.tracer.events[first:] if e.step == cfg.steps - 1]  # the last step's
    lo = min(e.t_start for e in events)
    hi = max(e.t_end for e in events)
    messages = [(e.t_start, e.t_end) for e in events]
    blocked = [(e.t_start, e.t_end) for e in events if e.op not in NONBLOCKING] + clip(WAITS, lo, hi)
    calls = sum(e.op not in NONBLOCKING for e in events)
    posted = sum(e.op in NONBLOCKING for e in events)
    flight, exposed = union(messages), union(blocked)
    mine = (calls, posted, sum(e.bytes_sent for e in events), flight, exposed)
    rows.append((label, comm.gather_object(mine)))
if comm.rank == 0:
    print("tiny GPT-2 on 2 ranks, the last of 2 steps; per rank: blocking calls, isends and irecvs, bytes")
    print("sent; ms of messages in flight, of them exposed (the rank blocked in a call or a wait) and hidden")
    for label, ranks in rows:
        print(label)
        for r, (calls, posted, sent, flight, exposed) in enumerate(ranks):
            hidden = flight - exposed
            print(f"  rank {r}: {calls:>3} blocking, {posted:>3} isend/irecv, {sent:>9,} B sent;  in flight "
                  f"{flight * 1e3:.2f} ms, exposed {exposed * 1e3:.2f} ms, hidden {hidden * 1e3:.2f} ms")
