"""CuPy arrays as refpar's arrays, on the NVIDIA GPU of this rank (local rank modulo the count)."""

from __future__ import annotations

from gpu_backend.torch_backend import local_rank
from refpar.backend import NumpyBackend, register
from refpar.config import ConfigError


class CupyBackend(NumpyBackend):
    name = "cupy"

    def __init__(self, device: str | None = None):
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - no CuPy, or a CuPy without a driver or device: both say no
            raise ConfigError("--backend cupy needs CuPy and an NVIDIA GPU, and this machine has no "
                              "usable CuPy; install cupy-cuda12x on a GPU machine or use --backend "
                              "torch") from None
        if device not in (None, "cuda") and not str(device).startswith("cuda:"):
            raise ConfigError(f"the cupy backend runs on a GPU, not on {device!r}; use --device cuda")
        index = local_rank() % count if device in (None, "cuda") else int(str(device)[5:])
        self.cupy, self.device = cupy, f"cuda:{index}"
        cupy.cuda.Device(index).use()

    def _move(self, a):
        return self.cupy.asarray(a)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


register("cupy", CupyBackend)
