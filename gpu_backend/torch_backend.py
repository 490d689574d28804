"""torch tensors as refpar's arrays: on the CPU (what CI proves) or on a CUDA device.

Several MPI ranks may share one GPU; `cuda` picks the local rank's device modulo the count.
"""

from __future__ import annotations

import os

import numpy as np

from refpar.backend import NumpyBackend, register
from refpar.config import ConfigError
from refpar.precision import dtype_of


def local_rank() -> int:
    """This process's rank among those on its node, as the MPI launcher set it (0 alone)."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class TorchBackend(NumpyBackend):
    name = "torch"

    def __init__(self, device: str = "cpu"):
        try:
            import torch
        except ImportError:
            raise ConfigError("--backend torch needs PyTorch, which is not installed here; install "
                              "refpar[torch] or use --backend numpy") from None
        self.torch = torch
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--backend torch on cuda needs an NVIDIA GPU and a CUDA build of "
                                  "torch, and this machine has neither; use --device cpu")
            device = f"cuda:{local_rank() % torch.cuda.device_count()}"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--backend torch on {device} needs an NVIDIA GPU and a CUDA build of "
                              "torch, and this machine has neither; use --device cpu")
        elif not device.startswith(("cpu", "cuda")):
            raise ConfigError(f"unknown torch device {device!r}; use cpu or cuda")
        self.device = device

    def _move(self, a):
        # A copy: the run updates its parameters in place, the host array stays the initial one.
        if a.dtype == dtype_of("bfloat16"):  # ml_dtypes' bfloat16, which torch cannot read: its bits
            return self._move(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.asarray(a, device=self.device, copy=True)

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize(self.device)


register("torch", TorchBackend)
