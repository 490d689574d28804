"""`refpar lesson check 11`: lesson 11's checker, mesh coordinates and the groups made by Comm_split."""

from __future__ import annotations

import numpy as np

from lessons.checkers.common import Wrong, allgather


def check_11(mod, comm) -> str:
    for sizes in ({"pp": 2, "dp": 2, "tp": 2}, {"pp": 4, "dp": 1, "tp": 2}, {"pp": 2, "dp": 3, "tp": 4}):
        grid = np.arange(sizes["pp"] * sizes["dp"] * sizes["tp"]).reshape(
            sizes["pp"], sizes["dp"], sizes["tp"])
        for rank in range(grid.size):
            pp, dp, tp = (int(c) for c in np.unravel_index(rank, grid.shape))
            want = {"pp": pp, "dp": dp, "tp": tp}
            got = mod.coords(rank, dict(sizes))
            if got != want:
                raise Wrong(f"coords({rank}, {sizes}) = {got}, expected {want}: tp varies fastest, "
                            "then dp, and pp slowest (ranks = arange(world).reshape(pp, dp, tp))")
    r = comm.rank
    for sizes in ({"pp": 1, "dp": 2, "tp": 2}, {"pp": 2, "dp": 1, "tp": 2}, {"pp": 2, "dp": 2, "tp": 1}):
        grid = np.arange(comm.size).reshape(sizes["pp"], sizes["dp"], sizes["tp"])
        pp, dp, tp = (int(c) for c in np.unravel_index(r, grid.shape))
        lines = {"pp": grid[:, dp, tp], "dp": grid[pp, :, tp], "tp": grid[pp, dp, :]}
        groups = mod.mesh_groups(comm, dict(sizes))
        if not isinstance(groups, dict) or set(groups) != set(lines):
            raise Wrong("mesh_groups must return a dict with a communicator for each of pp, dp and tp")
        problem = None
        for axis, line in lines.items():
            g, want = groups[axis], tuple(int(x) for x in line)
            if problem is None and (g is None or tuple(g.group) != want):
                problem = (f"on mesh {sizes}, rank {r}'s {axis} group holds world ranks "
                           f"{None if g is None else list(g.group)} in that order; it should hold "
                           f"{list(want)}: which ranks share a color, and what orders them?")
        problems = [m for m in allgather(comm, problem) if m]  # all ranks stop before talking in groups
        if problems:
            raise Wrong(problems[0])
        for axis, line in lines.items():
            g, want = groups[axis], tuple(int(x) for x in line)
            total = g.all_reduce(np.array([float(r)]), tag=f"{axis}:check")  # (1,) it really talks
            if total[0] != sum(want):
                raise Wrong(f"rank {r}'s {axis} communicator summed {total[0]:g}, not {sum(want)}")
    return ("coords and mesh_groups lay ranks out as refpar's DeviceMesh (and Megatron) do, each "
            "group a working communicator made by Comm_split")
