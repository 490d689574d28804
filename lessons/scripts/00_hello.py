"""Lesson 0: every rank says who it is; rank 0 prints what it gathered.

    mpiexec -n 4 python lessons/scripts/00_hello.py
"""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# Each rank owns a different number; the sum over ranks arrives on every rank.
total = comm.allreduce(rank + 1, op=MPI.SUM)
said = comm.gather(f"rank {rank} of {size}: I hold {rank + 1}, the sum over all ranks is {total}")
if rank == 0:  # output from several ranks interleaves in any order, so one rank prints
    print("\n".join(said), flush=True)
