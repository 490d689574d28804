"""torch.distributed (gloo) on the ranks of an MPI job, its rank and size taken from refpar's
Communicator (only refpar/comm/communicator.py touches mpi4py)."""

from __future__ import annotations

import socket
from contextlib import contextmanager

import numpy as np
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process_group(comm):
    """gloo over every rank of `comm`: rank 0 picks a free port and broadcasts it."""
    port = int(comm.broadcast(np.array([free_port() if comm.rank == 0 else 0]), tag="torch:port")[0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)
    try:
        yield
    finally:
        # Without this barrier one rank was seen to abort (signal 6) at exit (ENVIRONMENT.md).
        dist.barrier()
        dist.destroy_process_group()
