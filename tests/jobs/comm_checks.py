"""Every collective and algorithm against NumPy, and every traced byte against refpar.comm.cost.

    mpiexec -n 4 python tests/jobs/comm_checks.py [hypothesis_examples]

Run by tests/test_comm.py with 2, 3, 4, 5 and 8 ranks. Each rank builds every rank's input from
(case, rank), so it computes the expected result itself with NumPy; the collective under test is
never used to check itself. Groups: the world, the axes of a mesh, and splits of the world into
parts of sizes 1 .. p-1 (so an 8-rank job also covers groups of 6, 7 and 1). Rank 0 prints one
JSON line: {"ranks", "checks", "group_sizes", "dtypes" (traced), "failures"}.

16-bit floats (bfloat16, float16) run every collective on the world and on one split (2 to 4 ranks;
16-bit dtypes also enter the random examples of every job): integer data
compares exactly; random data checks the rounding: the ring equals a NumPy 16-bit reduction in the
ring's order bit for bit, native MPI (a user-defined operation in MPI's order) stays within one
16-bit rounding per hop of the exact sum.
"""

from __future__ import annotations

import json
import sys
from functools import reduce

import ml_dtypes
import numpy as np

from refpar.comm import algorithms, cost
from refpar.comm.communicator import REDUCE_OPS, abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.mesh import DeviceMesh
from refpar.sharding import shard_range
from tests.numerics import sum_error

DTYPES = (np.float32, np.float64, np.int64)
SIXTEEN_BIT = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
UNIT_ROUNDOFF = {np.dtype(ml_dtypes.bfloat16): 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11}
ROW = (2,)  # the trailing shape of the row-wise ops


def data(case: int, rank: int, shape, dtype) -> np.ndarray:
    """Integers in [-3, 3]: sums and products of up to 8 of them are exact in float32, so every
    algorithm's reduction order gives the same bits and results compare exactly."""
    rng = np.random.default_rng([case, rank])
    return rng.integers(-3, 4, size=shape).astype(dtype)


class Checker:
    def __init__(self, tracer: Tracer):
        self.tracer, self.case, self.checks, self.failures = tracer, 0, 0, []

    def next_case(self) -> int:
        self.case += 1
        return self.case

    def expect(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.failures.append(what)

    def same(self, got, want, what: str) -> None:
        ok = (isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype
              and np.array_equal(got, want))
        self.expect(ok, f"{what}: got {getattr(got, 'shape', None)} {got!r:.200} "
                        f"want {want.shape} {want!r:.200}")

    def traced(self, comm, op: str, algo: str, predicted: cost.Bytes, what: str, dtype) -> None:
        e = self.tracer.events[-1]
        name = f"native({cost.NATIVE_ALGO[op]})" if algo == "native" else algo
        self.expect((e.op, e.axis, e.group, e.algo, e.dtype) == (op, comm.axis, comm.group, name,
                                                                 np.dtype(dtype).name),
                    f"{what}: event {e.op} {e.axis} {e.group} {e.algo} {e.dtype}")
        self.expect((e.bytes_sent, e.bytes_recv) == (predicted.sent, predicted.recv),
                    f"{what}: traced ({e.bytes_sent}, {e.bytes_recv}) != cost {predicted}")


def check_all_reduce(c: Checker, comm, n, dtype, algo, op) -> None:
    p, r = comm.size, comm.rank
    case = c.next_case()
    xs = [data(case, i, (n,), dtype) for i in range(p)]  # (n,) per rank
    mine = xs[r].copy()
    got = comm.all_reduce(xs[r], op=op, algo=algo, tag="ar")
    what = f"all_reduce p={p} n={n} {np.dtype(dtype).name} {algo} {op}"
    c.same(got, reduce(REDUCE_OPS[op][0], xs), what)
    c.expect(np.array_equal(xs[r], mine), f"{what}: input modified")
    c.traced(comm, "all_reduce", algo, cost.all_reduce_bytes(n, p, r, np.dtype(dtype).itemsize, algo), what,
             dtype)


def check_reduce_scatter(c: Checker, comm, n, dtype, algo, rest=ROW) -> None:
    p, r = comm.size, comm.rank
    case = c.next_case()
    xs = [data(case, i, (n, *rest), dtype) for i in range(p)]  # (n, *rest) per rank
    got = comm.reduce_scatter(xs[r], algo=algo, tag="rs")
    start, stop = shard_range(n, p, r)
    what = f"reduce_scatter p={p} n={n} {np.dtype(dtype).name} {algo}"
    c.same(got, sum(xs[1:], xs[0])[start:stop], what)
    c.same(xs[r], data(case, r, (n, *rest), dtype), f"{what}: input unchanged")
    c.traced(comm, "reduce_scatter", algo,
             cost.reduce_scatter_bytes(n, p, r, np.dtype(dtype).itemsize, int(np.prod(rest)), algo), what,
             dtype)


def check_all_gather(c: Checker, comm, counts, dtype, algo, give_counts: bool, rest=ROW) -> None:
    p, r = comm.size, comm.rank
    case = c.next_case()
    xs = [data(case, i, (counts[i], *rest), dtype) for i in range(p)]  # (counts[i], *rest)
    got = comm.all_gather(xs[r], algo=algo, tag="ag", counts=counts if give_counts else None)
    what = f"all_gather p={p} counts={counts} {np.dtype(dtype).name} {algo}"
    c.same(got, np.concatenate(xs), what)
    c.same(xs[r], data(case, r, (counts[r], *rest), dtype), f"{what}: input unchanged")
    predicted = cost.all_gather_bytes(counts, r, np.dtype(dtype).itemsize, int(np.prod(rest)), algo)
    c.traced(comm, "all_gather", algo, predicted, what, dtype)


def check_all_to_all(c: Checker, comm, rows, dtype, algo, give_counts: bool, rest=ROW) -> None:
    """rows[i][j]: the length of the chunk rank i sends to rank j."""
    p, r = comm.size, comm.rank
    case = c.next_case()
    chunks = [[data(case, i * p + j, (rows[i][j], *rest), dtype) for j in range(p)] for i in range(p)]
    recv_counts = [rows[i][r] for i in range(p)] if give_counts else None
    got = comm.all_to_all(chunks[r], algo=algo, tag="a2a", recv_counts=recv_counts)
    what = f"all_to_all p={p} rows={rows} {np.dtype(dtype).name} {algo}"
    c.expect(len(got) == p, f"{what}: {len(got)} results")
    for i in range(p):
        c.same(got[i], chunks[i][r], f"{what} from {i}")
        c.same(chunks[r][i], data(case, r * p + i, (rows[r][i], *rest), dtype), f"{what}: input unchanged")
    itemsize = np.dtype(dtype).itemsize
    unit = int(np.prod(rest))
    predicted = cost.all_to_all_bytes([rows[r][j] * unit for j in range(p)],
                                      [rows[i][r] * unit for i in range(p)], r, itemsize, algo)
    c.traced(comm, "all_to_all", algo, predicted, what, dtype)


def check_broadcast(c: Checker, comm, n, dtype, algo, root) -> None:
    p, r = comm.size, comm.rank
    case = c.next_case()
    x = data(case, root, (n, 3), dtype) if r == root else np.zeros((n, 3), dtype)
    got = comm.broadcast(x, root=root, algo=algo, tag="bc")
    what = f"broadcast p={p} n={n} root={root} {np.dtype(dtype).name} {algo}"
    c.same(got, data(case, root, (n, 3), dtype), what)
    before = data(case, root, (n, 3), dtype) if r == root else np.zeros((n, 3), dtype)
    c.same(x, before, f"{what}: input unchanged")
    c.traced(comm, "broadcast", algo, cost.broadcast_bytes(3 * n, p, r, root, np.dtype(dtype).itemsize, algo),
             what, dtype)


def check_point_to_point(c: Checker, comm, n, dtype=np.float64) -> None:
    """A ring shift both ways: blocking send/recv (even ranks send first) and isend/irecv."""
    p, r = comm.size, comm.rank
    case = c.next_case()
    right, left = (r + 1) % p, (r - 1) % p
    if p == 1:
        return
    size = np.dtype(dtype).itemsize
    mine = data(case, r, (n,), dtype)
    if r % 2 == 0:
        comm.send(mine, right, tag="shift")
        got = comm.recv((n,), dtype, left, tag="shift")
    else:
        got = comm.recv((n,), dtype, left, tag="shift")
        comm.send(mine, right, tag="shift")
    c.same(got, data(case, left, (n,), dtype), f"send/recv p={p} n={n} {np.dtype(dtype).name}")
    e = c.tracer.events[-1] if r % 2 == 0 else c.tracer.events[-2]
    c.expect((e.op, e.peer, e.bytes_recv) == ("recv", comm.group[left], size * n), f"recv event {e}")
    pending = comm.irecv((n,), dtype, right, tag="back")
    sending = comm.isend(mine, left, tag="back")
    c.expect(sending.wait() is None, "isend wait returns None")
    c.same(pending.wait(), data(case, right, (n,), dtype), f"isend/irecv p={p} n={n} {np.dtype(dtype).name}")
    e = c.tracer.events[-1]
    c.expect((e.op, e.peer, e.bytes_recv, e.bytes_sent) == ("irecv", comm.group[right], size * n, 0),
             f"irecv event {e}")


def check_group(c: Checker, comm, dtypes=DTYPES) -> None:
    p = comm.size
    for dtype in dtypes:
        for n in (0, 1, 7, 2 * p + 1):  # empty, fewer than p, odd, more than p
            for algo in ("native", "ring"):
                # 16-bit: products of up to 8 values in [-3, 3] are not exact, sums, max, min are
                ops = ("sum", "prod", "max", "min") if dtype is np.int64 else \
                    ("sum", "max", "min") if dtype in SIXTEEN_BIT else ("sum",)
                for op in ops:
                    check_all_reduce(c, comm, n, dtype, algo, op)
                check_reduce_scatter(c, comm, n, dtype, algo)
                counts = [(n + 2 * i) % 4 for i in range(p)]  # uneven, some empty
                check_all_gather(c, comm, counts, dtype, algo, give_counts=n % 2 == 0)
                check_all_gather(c, comm, [n] * p, dtype, algo, give_counts=n % 2 == 1)  # even
            for algo in ("native", "pairwise"):
                rows = [[(n + i + 2 * j) % 3 for j in range(p)] for i in range(p)]
                check_all_to_all(c, comm, rows, dtype, algo, give_counts=n % 2 == 1)
            for algo in ("native", "tree", "scatter_allgather"):
                for root in sorted({0, p - 1}):
                    check_broadcast(c, comm, n, dtype, algo, root)
    for dtype in dtypes:
        check_point_to_point(c, comm, 5, dtype)
    # Not exactly representable values: the written-out ring sums in another order than MPI.
    rng = np.random.default_rng([99, comm.rank])
    x = rng.standard_normal(1001)
    want = comm.all_reduce(x, algo="native")
    got = comm.all_reduce(x, algo="ring")
    # Each element is a sum of p terms in two orders: within 2 sum_error(p, sum_r |x_r|) of each
    # other (tests/numerics.py); every rank draws every rank's x to know that sum without a message.
    abs_sum = sum(np.abs(np.random.default_rng([99, r]).standard_normal(1001)) for r in range(p))
    bound = 2 * sum_error(p, 1.0) * abs_sum  # (1001,) elementwise
    c.expect(bool(np.all(np.abs(got - want) <= bound)), f"ring vs native float64 p={p}")


def ring_order_sum(xs: list[np.ndarray], c: int) -> np.ndarray:
    """Chunk c of the ring's reduction: it starts at rank c + 1, and each rank after it adds its
    own copy to what arrives, rank c last (algorithms.ring_reduce_steps)."""
    p = len(xs)
    acc = xs[(c + 1) % p]
    for j in range(2, p + 1):
        acc = xs[(c + j) % p] + acc  # one 16-bit rounding per hop
    return acc


def check_16bit_rounding(c: Checker, comm, dtype, n: int = 301) -> None:
    """Random data, whose sums round: ring all-reduce and reduce-scatter equal the NumPy 16-bit
    reduction in the ring's order exactly; native stays within gamma_{p-1} = (p-1)u / (1 - (p-1)u)
    times sum |x_i| of the exact sum (Higham's bound for p - 1 rounded additions, unit roundoff u)."""
    p, r = comm.size, comm.rank
    case = c.next_case()
    xs = [np.random.default_rng([case, i]).standard_normal(n).astype(dtype) for i in range(p)]  # (n,)
    name = np.dtype(dtype).name
    bounds = algorithms.chunk_bounds(n, p)
    want = np.concatenate([ring_order_sum(xs, k)[a:b] for k, (a, b) in enumerate(bounds)])
    c.same(comm.all_reduce(xs[r], algo="ring"), want, f"ring all_reduce rounding p={p} {name}")
    a, b = bounds[r]
    c.same(comm.reduce_scatter(xs[r], algo="ring"), want[a:b], f"ring reduce_scatter rounding p={p} {name}")
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)  # (n,) the sum no rounding spoils
    budget = (p - 1) * UNIT_ROUNDOFF[np.dtype(dtype)]
    bound = budget / (1 - budget) * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    for op, got, ref, limit in (
            ("all_reduce", comm.all_reduce(xs[r]), exact, bound),
            ("reduce_scatter", comm.reduce_scatter(xs[r]), exact[a:b], bound[a:b])):
        error = np.abs(got.astype(np.float64) - ref)
        c.expect(got.dtype == dtype and bool(np.all(error <= limit)),
                 f"native {op} p={p} {name}: error {error.max(initial=0):.3g} beyond one rounding per hop")


def check_mesh(c: Checker, w, sizes) -> DeviceMesh:
    mesh = DeviceMesh(w, sizes)
    full = {a: sizes.get(a, 1) for a in ("pp", "dp", "ep", "cp", "tp")}
    grid = np.arange(w.size).reshape(tuple(full.values()))  # (pp, dp, ep, cp, tp)
    where = [int(i[0]) for i in np.nonzero(grid == w.rank)]
    for k, a in enumerate(full):
        index = tuple(slice(None) if j == k else where[j] for j in range(5))
        c.expect(mesh.group(a) == tuple(int(g) for g in grid[index]), f"mesh {a} group {mesh.group(a)}")
        c.expect(mesh.coords[a] == where[k] == mesh.axis(a).rank, f"mesh {a} coord")
    c.expect(mesh.pp_next == (where[0] + 1 if where[0] + 1 < full["pp"] else None), "pp_next")
    c.expect(mesh.pp_prev == (where[0] - 1 if where[0] > 0 else None), "pp_prev")
    for k, a in enumerate(full):
        neighbours = ((where[k] - 1) % full[a], (where[k] + 1) % full[a])
        c.expect((mesh.ring_prev(a), mesh.ring_next(a)) == neighbours, f"mesh {a} ring neighbours")
    label = "-".join(f"{a.upper()}({s})" for a, s in full.items() if s > 1) + f"-Rank({w.rank})"
    c.expect(str(mesh) == label, f"str(mesh) {mesh} != {label}")
    return mesh


def run_hypothesis(c: Checker, w, groups, examples: int) -> None:
    """Random op, algorithm, dtype, group, trailing shape, lengths and uneven counts. Every rank runs
    the same examples (derandomized, nothing drawn depends on the rank or the group size) and a
    world-wide flag makes them fail together, so shrinking stays in step across ranks."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(group=st.integers(0, len(groups) - 1),
           op=st.sampled_from(sorted(cost.ALGORITHMS)),
           algo_index=st.integers(0, 2),
           dtype=st.sampled_from(["float32", "float64", "int32", "int64", "bfloat16", "float16"]),
           rest=st.lists(st.integers(1, 3), max_size=2),
           n=st.integers(0, 11),
           counts=st.lists(st.integers(0, 4), min_size=64, max_size=64),
           root=st.integers(0, 7))
    def collective_matches_numpy(group, op, algo_index, dtype, rest, n, counts, root):
        comm = groups[group]
        p = comm.size
        algos = ("native", *cost.ALGORITHMS[op])
        algo = algos[algo_index % len(algos)]
        before = len(c.failures)
        if op == "all_reduce":
            check_all_reduce(c, comm, n, dtype, algo, "sum")
        elif op == "reduce_scatter":
            check_reduce_scatter(c, comm, n, dtype, algo, tuple(rest))
        elif op == "all_gather":
            check_all_gather(c, comm, counts[:p], dtype, algo, n % 2 == 0, tuple(rest))
        elif op == "all_to_all":
            rows = [counts[8 * i: 8 * i + p] for i in range(p)]
            check_all_to_all(c, comm, rows, dtype, algo, n % 2 == 0, tuple(rest))
        else:
            check_broadcast(c, comm, n, dtype, algo, root % p)
        failed = w.all_reduce(np.array([len(c.failures) - before]), op="max", tag="hypothesis")
        assert not failed[0], "a rank failed; see its failures"

    try:
        collective_matches_numpy()
    except AssertionError as err:
        c.failures.append(f"hypothesis: {err}")


def main(examples: int) -> None:
    tracer = Tracer()
    w = world(tracer)
    c = Checker(tracer)
    p = w.size
    groups = [w]
    for part in range(1, p // 2 + 1):  # the first `part` ranks and the rest: every size below p
        groups.append(w.split(0 if w.rank < part else 1, key=w.rank, axis=f"split{part}"))
    mesh_axes = []
    outside = w.split(None if w.rank == 0 else 1, axis="without0")  # rank 0 takes no part
    c.expect((outside is None) == (w.rank == 0), "split(None) gives None")
    c.expect(outside is None or outside.group == tuple(range(1, p)), "split group")
    meshes = {2: {"dp": 2}, 4: {"dp": 2, "tp": 2}, 8: {"pp": 2, "dp": 2, "tp": 2}}
    if p in meshes:
        mesh = check_mesh(c, w, meshes[p])
        mesh_axes = [mesh.axis(a) for a in meshes[p]]
    sizes = set()
    for index, comm in enumerate(groups + mesh_axes):
        c.case = 1_000_000 * (index + 1)  # groups run different numbers of cases; restart in step
        # A mesh axis is a sub-communicator like the splits: one dtype shows its groups are right.
        check_group(c, comm, (np.float64,) if comm in mesh_axes else DTYPES)
        sizes.add(comm.size)
    # 16-bit on the world and its first split, in the 2-, 3- and 4-rank jobs (5 and 8 add no new path)
    for index, comm in enumerate(groups[:2] if p <= 4 else []):
        c.case = 1_000_000 * (len(groups) + len(mesh_axes) + 2 + index)
        check_group(c, comm, SIXTEEN_BIT)
        for dtype in SIXTEEN_BIT:
            check_16bit_rounding(c, comm, dtype)
    if examples:
        c.case = 1_000_000 * (len(groups) + len(mesh_axes) + 1)
        run_hypothesis(c, w, groups + mesh_axes, examples)
    # Conservation over the whole job: every byte one rank sent, another received.
    totals = w.gather_object(tracer.bytes_by())
    reports = w.gather_object((c.checks, c.failures, sorted(sizes), sorted({e.dtype for e in tracer.events})))
    if w.rank == 0:
        sent, recv = map(sum, zip(*totals, strict=True))
        failures = [f"rank {i}: {f}" for i, (_, fs, _, _) in enumerate(reports) for f in fs]
        if sent != recv:
            failures.append(f"bytes sent {sent} != bytes received {recv} over the job")
        print(json.dumps({"ranks": p, "checks": sum(r[0] for r in reports),
                          "group_sizes": sorted({s for r in reports for s in r[2]}),
                          "dtypes": sorted({d for r in reports for d in r[3]}),
                          "failures": failures[:40]}), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
