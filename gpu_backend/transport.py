"""A device-aware transport for the Communicator: torch.distributed, with NCCL on CUDA tensors
(gloo on CPU tensors, so CI runs the same code), instead of staging through host buffers.

    comm = world(tracer, transport="torch.distributed")  # every rank; sub-communicators inherit it

The Communicator hands a collective to the transport when its input is a torch tensor, its algo
is "native" and the transport can do it (`takes`): all_reduce, broadcast, and all_gather and
reduce_scatter with equal pieces (reduce_scatter needs NCCL; gloo has none). Everything else
(point-to-point, all_to_all, uneven pieces, written-out algorithms) still goes through MPI, staged.
Events record `algo="nccl"` or `"gloo"` with the bytes of the ring, like a native MPI call.
"""

from __future__ import annotations

import socket

import numpy as np

from refpar.config import ConfigError

TRANSPORTS = ("mpi", "torch.distributed")


def check_transport(name: str) -> None:
    if name not in TRANSPORTS:
        raise ConfigError(f"unknown transport {name!r}; choose {' or '.join(TRANSPORTS)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TorchDistributed:
    """One torch.distributed process group per Communicator group; `name` is nccl or gloo."""

    def __init__(self, name: str, group, dist, torch):
        self.name, self.group, self.dist, self.torch = name, group, dist, torch

    @classmethod
    def start(cls, world, name: str | None = None) -> TorchDistributed:
        """Joins every rank of the MPI world `world` (a Communicator) into torch.distributed's
        default group; rank 0's host and a free port travel by MPI. Collective over `world`."""
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise ConfigError("the torch.distributed transport needs PyTorch; install refpar[torch] "
                              "or use the default MPI transport") from None
        name = name or ("nccl" if torch.cuda.is_available() else "gloo")
        available = {"nccl": dist.is_available() and dist.is_nccl_available(),
                     "gloo": dist.is_available() and dist.is_gloo_available()}
        if not available.get(name, False):
            raise ConfigError(f"torch.distributed has no {name} backend here (NCCL needs an NVIDIA GPU "
                              "and a CUDA build of torch); use the default MPI transport")
        if name == "nccl":  # one GPU per rank: NCCL refuses two ranks of a group on one device
            from gpu_backend.torch_backend import local_rank

            torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        if not dist.is_initialized():
            host = np.zeros(256, np.uint8)
            text = socket.gethostname().encode()[:255]
            host[:len(text)] = np.frombuffer(text, np.uint8)
            port = np.array([_free_port()], np.int64)
            host = world.broadcast(host, tag="transport:host")
            port = world.broadcast(port, tag="transport:port")
            address = bytes(host).rstrip(b"\0").decode()
            dist.init_process_group(name, init_method=f"tcp://{address}:{int(port[0])}",
                                    rank=world.world_rank, world_size=world.size)
        return cls(name, dist.group.WORLD, dist, torch)

    def subgroup(self, world_ranks: tuple[int, ...]) -> TorchDistributed:
        """The transport of a sub-communicator; only its members call this (local synchronisation),
        as only they take part in an MPI split's new communicator."""
        group = self.dist.new_group(list(world_ranks), backend=self.name, use_local_synchronization=True)
        return TorchDistributed(self.name, group, self.dist, self.torch)

    def takes(self, op: str, x, even: bool = True) -> bool:
        """Whether this transport does `op` on `x` (else the Communicator stages it through MPI)."""
        if not isinstance(x, self.torch.Tensor) or (self.name == "nccl" and x.device.type != "cuda"):
            return False
        if op == "reduce_scatter":
            return even and self.name == "nccl"
        return op in ("all_reduce", "broadcast") or (op == "all_gather" and even)

    def _op(self, op: str):
        ops = self.dist.ReduceOp
        return {"sum": ops.SUM, "prod": ops.PRODUCT, "max": ops.MAX, "min": ops.MIN}[op]

    def all_reduce(self, x, op: str):
        out = x.clone().contiguous()
        self.dist.all_reduce(out, op=self._op(op), group=self.group)
        return out

    def broadcast(self, x, root: int, world_root: int):
        out = x.clone().contiguous()
        self.dist.broadcast(out, src=world_root, group=self.group)
        return out

    def all_gather(self, x, size: int):
        pieces = [self.torch.empty_like(x) for _ in range(size)]
        self.dist.all_gather(pieces, x.contiguous(), group=self.group)
        return self.torch.cat(pieces)

    def reduce_scatter(self, x, op: str, size: int):
        out = self.torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.dist.reduce_scatter_tensor(out, x.contiguous(), op=self._op(op), group=self.group)
        return out
