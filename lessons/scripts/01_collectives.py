"""Lesson 1: the three collectives of training, their results and the bytes each rank sends.

    mpiexec -n 4 python lessons/scripts/01_collectives.py [n]

Every rank holds the vector x = (rank + 1) * [1, 2, ..., n] in float64. The ring algorithms are
refpar's own (refpar/comm/algorithms.py); the trace counts what each rank really sent, and
refpar/comm/cost.py gives the closed form next to it.
"""

import sys

import numpy as np

from refpar.comm import cost
from refpar.comm.communicator import world
from refpar.comm.trace import Tracer

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
tracer = Tracer()
comm = world(tracer)
p, r = comm.size, comm.rank
x = (r + 1) * np.arange(1, n + 1, dtype=np.float64)  # (n,)

summed = comm.all_reduce(x, algo="ring", tag="x")  # (n,) on every rank
shard = comm.reduce_scatter(x, algo="ring", tag="x")  # (n_r,) this rank's chunk of the sum
gathered = comm.all_gather(shard, algo="ring", tag="x")  # (n,) the chunks put back together

closed = {
    "all_reduce": cost.all_reduce_bytes(n, p, r, 8).sent,
    "reduce_scatter": cost.reduce_scatter_bytes(n, p, r, 8).sent,
    "all_gather": cost.all_gather_bytes([cost.chunk(n, p, i) for i in range(p)], r, 8).sent,
}
rows = [(e.op, e.bytes_sent, closed[e.op]) for e in tracer.events]
everyone = comm.gather_object((shard.tolist(), rows))
if r == 0:
    print(f"{p} ranks, n={n} float64 elements each; rank r holds (r+1) * [1..{n}]")
    if n <= 16:  # short enough to read
        print(f"all_reduce      -> {summed.tolist()} on every rank")
        for rank, (piece, _) in enumerate(everyone):
            print(f"reduce_scatter  -> rank {rank} holds {piece}")
        print(f"all_gather      -> {gathered.tolist()} (= the all-reduce)")
    assert np.array_equal(gathered, summed)
    print("bytes each rank sent, traced | closed form:")
    for rank, (_, traced) in enumerate(everyone):
        print(f"  rank {rank}: " + ", ".join(f"{op} {sent:,} | {want:,}" for op, sent, want in traced))
    print(f"ring all-reduce = reduce-scatter + all-gather: rank r sends 2n - c_r - c_r+1 elements "
          f"(c_i: chunk i's length); 2 (n - n/p) x 8 = {2 * (n - n / p) * 8:,.0f} bytes when p divides n")
