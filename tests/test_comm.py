"""The communication layer: collectives against NumPy, traced bytes against the closed forms, the
mesh layout, fail-fast errors and the Chrome trace. MPI jobs run as subprocesses (tests/mpi.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from refpar.comm import cost
from refpar.config import ConfigError
from refpar.sharding import shard_sizes
from tests.mpi import mpiexec

HYPOTHESIS_EXAMPLES = 8  # per job; five jobs, so 40 random collectives per run


# The 3-rank job runs with debug checks and a timeout on, so their polling paths carry real traffic.
CHECKED = {"REFPAR_DEBUG_COLLECTIVES": "1", "REFPAR_COLLECTIVE_TIMEOUT": "120"}


@pytest.mark.parametrize("ranks,env", [(2, None), (3, CHECKED), (4, None), (5, None), (8, None)],
                         ids=["2", "3-debug-timeout", "4", "5", "8"])
def test_every_collective_matches_numpy_and_traced_bytes_equal_cost(ranks, env):
    proc = mpiexec(ranks, "tests/jobs/comm_checks.py", str(HYPOTHESIS_EXAMPLES), timeout=240, env=env)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], "\n".join(report["failures"])
    assert report["group_sizes"] == list(range(1, ranks + 1))  # the splits cover every smaller group
    assert report["checks"] > 1000 * ranks
    if ranks <= 4:  # the 16-bit section ran: its events carry the 16-bit dtypes
        assert {"bfloat16", "float16"} <= set(report["dtypes"]), report["dtypes"]


# --- closed forms, without MPI ---------------------------------------------------------------

CASES = [(p, n) for p in range(1, 9) for n in (0, 1, 5, 8, 13, 64)]


@pytest.mark.parametrize("p,n", CASES)
def test_every_byte_sent_is_received_in_each_closed_form(p, n):
    counts = [(n + 3 * i) % 5 for i in range(p)]
    matrix = [[(n + i + 2 * j) % 4 for j in range(p)] for i in range(p)]
    forms = {
        "all_reduce ring": [cost.all_reduce_bytes(n, p, r, 8) for r in range(p)],
        "reduce_scatter ring": [cost.reduce_scatter_bytes(n, p, r, 4, 3) for r in range(p)],
        "all_gather ring": [cost.all_gather_bytes(counts, r, 8, 2) for r in range(p)],
        "all_to_all pairwise": [cost.all_to_all_bytes(matrix[r], [matrix[i][r] for i in range(p)], r, 8)
                                for r in range(p)],
    }
    for algo in ("tree", "scatter_allgather"):
        for root in range(p):
            forms[f"broadcast {algo} root {root}"] = [cost.broadcast_bytes(n, p, r, root, 8, algo)
                                                      for r in range(p)]
    for name, per_rank in forms.items():
        assert sum(b.sent for b in per_rank) == sum(b.recv for b in per_rank), name


@pytest.mark.parametrize("p", range(1, 9))
def test_ring_all_reduce_sends_2_n_p_minus_1_over_p_when_p_divides_n(p):
    n = 24 * 35  # divisible by every p in 1..8
    for r in range(p):
        each_way = 2 * n * (p - 1) // p * 8
        assert cost.all_reduce_bytes(n, p, r, 8) == cost.Bytes(each_way, each_way)


def test_uneven_ring_reduce_scatter_skips_own_and_left_neighbours_chunk():
    n, p = 10, 4  # chunks 3, 3, 2, 2
    assert shard_sizes(n, p) == [3, 3, 2, 2]
    assert [cost.reduce_scatter_bytes(n, p, r, 1) for r in range(p)] == [
        cost.Bytes(7, 8), cost.Bytes(7, 7), cost.Bytes(8, 7), cost.Bytes(8, 8)]


@pytest.mark.parametrize("p", range(1, 9))
def test_binomial_tree_reaches_every_rank_once(p):
    for root in range(p):
        children = [cost.tree_children(p, r, root) for r in range(p)]
        assert sum(children) == p - 1
        assert children[root] == (p - 1).bit_length()  # the root sends in every round


def test_alpha_beta_time_of_ring_all_reduce_is_the_textbook_formula():
    p, n, alpha, bw = 4, 8e6, 1e-5, 1e9
    t = cost.alpha_beta_time("all_reduce", "ring", n, p, alpha=alpha, bandwidth=bw)
    assert t == pytest.approx(2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw)
    assert cost.alpha_beta_time("all_reduce", "native", n, p, alpha=alpha, bandwidth=bw) == t
    tree = cost.alpha_beta_time("broadcast", "tree", n, 8, alpha=alpha, bandwidth=bw)
    assert tree == pytest.approx(3 * (alpha + n / bw))
    assert cost.alpha_beta_time("all_gather", "ring", n, 1) == 0.0


def test_unknown_algorithm_is_one_sentence():
    with pytest.raises(ConfigError, match="algorithm 'tree' for all_reduce; choose one of native, ring"):
        cost.all_reduce_bytes(8, 2, 0, 8, algo="tree")


# --- failing fast ----------------------------------------------------------------------------

def _run(tmp_path, ranks, source, env=None):
    script = tmp_path / "job.py"
    script.write_text(source)
    start = time.perf_counter()
    proc = mpiexec(ranks, str(script), timeout=60, env=env, check=False)
    return proc, time.perf_counter() - start


def test_an_exception_on_one_rank_ends_the_job_within_10_s_with_one_message(tmp_path):
    proc, seconds = _run(tmp_path, 3, """
import numpy as np
from refpar.comm.communicator import abort_on_error, world
with abort_on_error():
    comm = world()
    if comm.rank == 1:
        raise ValueError("rank one has a bad batch")
    comm.all_reduce(np.ones(3), tag="loss")  # ranks 0 and 2 wait here for rank 1
""")
    assert proc.returncode != 0
    assert seconds < 10
    assert proc.stderr.count("refpar: error on rank") == 1, proc.stderr
    assert proc.stderr.count("refpar: error on rank 1 of 3: ValueError: rank one has a bad batch") == 1


def test_a_non_zero_exit_on_one_rank_ends_the_job_with_its_status(tmp_path):
    proc, seconds = _run(tmp_path, 2, """
import sys
from refpar.comm.communicator import abort_on_error, world
with abort_on_error():
    comm = world()
    if comm.rank == 1:
        sys.exit(3)
    comm.barrier()
""")
    assert proc.returncode == 3 and seconds < 10
    assert proc.stderr.count("refpar: error on rank 1 of 2: exited with 3") == 1, proc.stderr


def test_debug_mode_names_the_ranks_whose_collective_differs(tmp_path):
    proc, seconds = _run(tmp_path, 3, """
import numpy as np
from refpar.comm.communicator import abort_on_error, world
with abort_on_error():
    comm = world()
    comm.all_reduce(np.ones(4), tag="fine")
    comm.all_reduce(np.ones(5 if comm.rank == 2 else 4), tag="h.0.mlp.c_fc:bwd")
""", env={"REFPAR_DEBUG_COLLECTIVES": "1"})
    assert proc.returncode != 0 and seconds < 10
    lines = [line for line in proc.stderr.splitlines() if line.startswith("refpar: error")]
    assert len(lines) == 1, proc.stderr
    assert "collective mismatch on axis world" in lines[0]
    assert "world ranks [0, 1] call all_reduce(shape=(4,), dtype=float64" in lines[0]
    assert "world ranks [2] call all_reduce(shape=(5,), dtype=float64" in lines[0]
    assert "tag='h.0.mlp.c_fc:bwd'" in lines[0]


def test_timeout_reports_the_op_axis_and_tag_each_deadlocked_rank_is_in(tmp_path):
    proc, seconds = _run(tmp_path, 2, """
import numpy as np
from refpar.comm.communicator import abort_on_error, world
with abort_on_error():
    comm = world()
    if comm.rank == 0:
        comm.recv((3,), "float64", source=1, tag="activations:fwd")  # rank 1 never sends
    else:
        comm.all_reduce(np.ones(3), tag="grads:bwd")
""", env={"REFPAR_COLLECTIVE_TIMEOUT": "1"})
    assert proc.returncode != 0 and seconds < 10
    assert "world rank 0 (world rank 0 of 2, group [0, 1]) waited more than 1 s for world rank 1's " \
           "'activations:fwd' (recv on axis world)" in proc.stderr
    assert "waited more than 1 s in all_reduce on axis world with tag 'grads:bwd' for world rank 0, " \
           "which has not reached it" in proc.stderr


def test_two_tags_with_one_mpi_tag_are_refused_before_their_messages_can_swap(tmp_path):
    """String tags hash to MPI tags; a birthday search finds two that collide. Without the check
    the second pair of messages would be matched by MPI tag alone; with it, the job ends naming both."""
    proc, seconds = _run(tmp_path, 2, """
import numpy as np
from refpar.comm.communicator import _mpi_tag, abort_on_error, world
seen = {}
for i in range(10 ** 6):
    tag = f"t{i}"
    if _mpi_tag(tag) in seen:
        a, b = seen[_mpi_tag(tag)], tag
        break
    seen[_mpi_tag(tag)] = tag
with abort_on_error():
    comm = world()
    if comm.rank == 0:
        comm.send(np.zeros(2), dest=1, tag=a)
        comm.send(np.ones(2), dest=1, tag=b)
    else:
        comm.recv((2,), "float64", source=0, tag=a)
        comm.recv((2,), "float64", source=0, tag=b)
""")
    assert proc.returncode != 0 and seconds < 20
    lines = [line for line in proc.stderr.splitlines() if line.startswith("refpar: error")]
    assert len(lines) == 1, proc.stderr
    assert "both map to MPI tag" in lines[0] and "rename one of them" in lines[0]


def test_a_mesh_that_does_not_match_the_world_is_one_sentence_and_exit_2(tmp_path):
    proc, seconds = _run(tmp_path, 3, """
from refpar.comm.communicator import abort_on_error, world
from refpar.mesh import DeviceMesh
with abort_on_error():
    DeviceMesh(world(), {"dp": 2, "tp": 2})
""")
    assert proc.returncode == 2 and seconds < 10
    message = ("the mesh dp=2,tp=2 has 4 ranks but the job has 3; run mpiexec -n 4 or change the mesh "
               "so its sizes multiply to 3")
    assert proc.stderr.count(message) == 1, proc.stderr


# --- traces ----------------------------------------------------------------------------------

def test_chrome_trace_of_a_small_run_is_valid_json_with_one_track_per_rank(tmp_path):
    proc, _ = _run(tmp_path, 3, f"""
import numpy as np
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer, write_trace
from refpar.mesh import DeviceMesh
with abort_on_error():
    tracer = Tracer()
    comm = world(tracer)
    if comm.rank == 0:
        import torch
    for step in range(2):
        for mb in range(2):
            with tracer.context(step=step, microbatch=mb, phase="bwd"):
                comm.all_reduce(np.ones(6) * comm.rank, tag="grads")
                comm.all_gather(np.ones((comm.rank + 1, 2)), algo="ring", tag="params")
    # One rank passes a torch tensor (importing torch on every rank would dominate the test's time).
    x = torch.arange(4, dtype=torch.float64) if comm.rank == 0 else np.arange(4.0)
    t = comm.all_reduce(x, algo="ring", tag="torch")
    if comm.rank == 0:
        assert isinstance(t, torch.Tensor) and torch.equal(t, 3 * torch.arange(4, dtype=torch.float64))
    write_trace("{tmp_path}/rank%d.jsonl" % comm.rank, tracer.events)
    events = comm.gather_object(tracer.events)
    if comm.rank == 0:
        write_trace("{tmp_path}/trace.json", [e for rank in events for e in rank])
""")
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((tmp_path / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert {e["pid"] for e in slices} == {0, 1, 2}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in slices)
    lines = [json.loads(line) for r in range(3)
             for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
    assert len(lines) == len(slices) == 3 * 9
    grads = [e for e in lines if e["tag"] == "grads"]
    labels = sorted((e["step"], e["microbatch"], e["phase"]) for e in grads if e["rank"] == 1)
    assert labels == [(0, 0, "bwd"), (0, 1, "bwd"), (1, 0, "bwd"), (1, 1, "bwd")]
    assert {e["algo"] for e in lines} == {"native(ring)", "ring"}


def test_heavy_yield_is_set_where_ranks_outnumber_cores_more_than_twice_and_an_explicit_setting_stays():
    from refpar.comm.communicator import wait_policy

    key = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
    assert wait_policy({"MPI_LOCALNRANKS": "8"}, cores=2)[key] == "1"  # 8 > 2 x 2
    assert key not in wait_policy({"MPI_LOCALNRANKS": "4"}, cores=2)  # 4 = 2 x 2: busy-polling pays
    assert key not in wait_policy({"MPI_LOCALNRANKS": "8"}, cores=4)
    assert key not in wait_policy({}, cores=1)  # not launched by hydra: one rank
    assert wait_policy({"MPI_LOCALNRANKS": "8", key: "0"}, cores=2)[key] == "0"  # the user's choice


@pytest.mark.parametrize("ranks", [2, 8])
def test_the_ranks_start_mpi_with_the_wait_policy_of_this_machine(tmp_path, monkeypatch, ranks):
    monkeypatch.delenv("MPIR_CVAR_ENABLE_HEAVY_YIELD", raising=False)
    proc, _ = _run(tmp_path, ranks, """
import os
from refpar.comm.communicator import abort_on_error, world
with abort_on_error():
    comm = world()
    every = comm.gather_object(os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD"))
    if comm.rank == 0:
        print(" ".join(map(str, every)))
""")
    assert proc.returncode == 0, proc.stderr
    expected = "1" if ranks > 2 * len(os.sched_getaffinity(0)) else "None"
    assert proc.stdout.split() == [expected] * ranks
