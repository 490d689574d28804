"""DeviceMesh: the world's ranks laid on a named grid, one Communicator per axis.

Ranks are laid out as Megatron does, tp fastest-varying, then cp, ep, dp, and pp slowest:

    ranks = arange(world).reshape(pp, dp, ep, cp, tp)

so the ranks of one tp group are neighbours (on a real machine, the GPUs of one node). The group
of an axis is the line through this rank's grid position along that axis; it is built with
MPI's Split (color = the other coordinates, key = the coordinate on the axis).

The mesh also builds the groups that span several axes or part of one, and hands each out by name
(`mesh.axis(name)`), so that no strategy splits a communicator of its own:

    dp_cp      dp x cp: the ranks holding the same weights of a dense model (cp ranks see other
               tokens of the same sequences): rank dp * c + cp, axis "dp_cp"; mesh.dp when cp = 1
    data       dp x ep x cp: every rank of a pipeline stage and tp coordinate, in batch order (rank
               (dp * e + ep) * c + cp): the ranks that see different tokens; a MoE model's dense
               weights are replicated over them (its experts over dp_cp), axis "data"
    embedding  the first and the last pipeline rank, which both hold the tied wte (Megatron's
               embedding group), axis "pp"; None on the other pp ranks and without pp
    mirror     pipeline ranks r and p-1-r, which hold the same parts of the model under DualPipe
               (its two copies; their gradients are summed), axis "pp"; None on a rank that is its
               own mirror (the middle of an odd pipeline) and without pp

    mesh = DeviceMesh(world(), {"pp": 2, "dp": 2, "tp": 2})   # mpiexec -n 8
    mesh.tp.all_reduce(x, tag="h.3.mlp.c_proj:fwd")          # the 2 ranks of this tp group
    str(mesh)  # "PP(2)-DP(2)-TP(2)-Rank(5)" on world rank 5
"""

from __future__ import annotations

import math

import numpy as np

from refpar.comm.communicator import Communicator
from refpar.config import MESH_AXES, ConfigError, ParallelConfig


def check_job_size(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """All five axes of `sizes`, validated, when their product is the job's size; else the same
    ConfigError on every rank, before any communication."""
    full = ParallelConfig(dict(sizes)).sizes
    product = math.prod(full[a] for a in MESH_AXES)  # Python ints: no int64 overflow
    if product == 1 < world_size:
        raise ConfigError(f"the job has {world_size} ranks but the mesh has one; give --mesh sizes that "
                          f"multiply to {world_size} (e.g. --mesh dp={world_size}) or start a single process")
    if product != world_size:
        given = ",".join(f"{a}={full[a]}" for a in MESH_AXES if full[a] > 1)
        raise ConfigError(
            f"the mesh {given} has {product} ranks but the job has {world_size}; "
            f"run mpiexec -n {product} or change the mesh so its sizes multiply to {world_size}"
        )
    return full


class DeviceMesh:
    """`sizes` gives any of the axes pp, dp, ep, cp, tp (missing ones are 1); their product must be
    the world size, else every rank raises the same ConfigError before any communication.

    `coords[axis]` is this rank's position on each axis; `axis(name)` (or `mesh.tp`, ...) its
    Communicator, whose ranks are the positions along that axis; `ranks` the whole grid of world
    ranks, shaped (pp, dp, ep, cp, tp).
    """

    def __init__(self, world: Communicator, sizes: dict[str, int], kv_replicas: int = 1):
        self.sizes = check_job_size(sizes, world.size)  # all five axes, validated
        shape = tuple(self.sizes[a] for a in MESH_AXES)
        self.world = world
        self.rank = world.rank
        self.ranks = np.arange(world.size).reshape(shape)  # (pp, dp, ep, cp, tp)
        position = np.unravel_index(world.rank, shape)
        self.coords = {a: int(c) for a, c in zip(MESH_AXES, position, strict=True)}
        self._comms: dict[str, Communicator] = {}
        for i, a in enumerate(MESH_AXES):  # every rank splits on every axis, in the same order
            others = tuple(c for j, c in enumerate(position) if j != i)
            color = int(np.ravel_multi_index(others, shape[:i] + shape[i + 1:])) if others else 0
            self._comms[a] = world.split(color, key=self.coords[a], axis=a)
        co, sz = self.coords, self.sizes
        self._groups = {
            "dp_cp": self._plane(("dp", "cp"), co["dp"] * sz["cp"] + co["cp"], "dp_cp")
            if sz["cp"] > 1 else self._comms["dp"],
            "data": self._plane(("dp", "ep", "cp"), world.rank, "data"),
        }
        ends = sz["pp"] > 1 and co["pp"] in (0, sz["pp"] - 1)
        others = int(np.ravel_multi_index([c for a, c in co.items() if a != "pp"],
                                          [n for a, n in sz.items() if a != "pp"]))
        self._groups["embedding"] = world.split(others if ends else None, key=co["pp"], axis="pp")
        r, p = co["pp"], sz["pp"]
        self._groups["mirror"] = world.split(others * p + min(r, p - 1 - r) if r != p - 1 - r else None,
                                             key=r, axis="pp")
        self._groups["kv"] = None
        if kv_replicas > 1:  # every rank of the tp group splits alike: tp ranks k b .. k b + b - 1
            tp_color = world.rank - co["tp"]  # the first world rank of this tp group: one per group
            self._groups["kv"] = world.split(tp_color * sz["tp"] + co["tp"] // kv_replicas, key=co["tp"],
                                             axis="tp")

    def _plane(self, axes: tuple[str, ...], key: int, name: str) -> Communicator:
        """The ranks that share this rank's coordinates on every axis but `axes`."""
        rest = [a for a in MESH_AXES if a not in axes]
        color = int(np.ravel_multi_index([self.coords[a] for a in rest], [self.sizes[a] for a in rest]))
        return self.world.split(color, key=key, axis=name)

    def axis(self, name: str) -> Communicator | None:
        """The Communicator of an axis, or of a derived group (module docstring: "dp_cp", "data",
        "embedding", "mirror", "kv"; those three are None on the ranks outside them)."""
        if name in self._groups:
            return self._groups[name]
        if name not in self._comms:
            raise ConfigError(f"unknown mesh axis {name!r}; axes are {', '.join(MESH_AXES)} and the "
                              f"groups {', '.join(self._groups)}")
        return self._comms[name]

    @property
    def pp(self) -> Communicator:
        return self._comms["pp"]

    @property
    def dp(self) -> Communicator:
        return self._comms["dp"]

    @property
    def ep(self) -> Communicator:
        return self._comms["ep"]

    @property
    def cp(self) -> Communicator:
        return self._comms["cp"]

    @property
    def tp(self) -> Communicator:
        return self._comms["tp"]

    @property
    def pp_prev(self) -> int | None:
        """pp rank of the previous pipeline stage (the one that feeds this one), None on the first."""
        return self.coords["pp"] - 1 if self.coords["pp"] > 0 else None

    @property
    def pp_next(self) -> int | None:
        """pp rank of the next pipeline stage, None on the last."""
        return self.coords["pp"] + 1 if self.coords["pp"] < self.sizes["pp"] - 1 else None

    def ring_next(self, name: str) -> int:
        """The right neighbour on axis `name`'s ring (its rank in that axis), wrapping around."""
        return (self.coords[name] + 1) % self.sizes[name]

    def ring_prev(self, name: str) -> int:
        """The left neighbour on axis `name`'s ring, wrapping around."""
        return (self.coords[name] - 1) % self.sizes[name]

    def group(self, name: str) -> tuple[int, ...]:
        """World ranks of this rank's group on axis `name`, in axis order."""
        return self.axis(name).group

    def __str__(self) -> str:
        parts = [f"{a.upper()}({self.sizes[a]})" for a in MESH_AXES if self.sizes[a] > 1]
        return "-".join([*parts, f"Rank({self.rank})"])

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={self.coords[a]}" for a in MESH_AXES)
        return f"DeviceMesh({self}, coords: {coords})"
