"""MemoryLedger: what one rank holds, in bytes, by category, with peaks.

Strategies register every array they keep (parameters, gradients, fp32 master weights, optimizer
moments, activations saved for backward, communication buffers) and free it when they let it go.
The ledger is the truth a learner reads, and tests compare its peaks with the closed forms in
`refpar.analysis`.

    ledger.alloc("h.0.attn.c_attn.weight", w, "params")
    ledger.free("h.0.attn.c_attn.weight")
    ledger.peak["params"]
"""

from __future__ import annotations

from dataclasses import dataclass

from array_api_compat import array_namespace, size

# "master": the fp32 master weights of a mixed-precision run (0 in float64/float32 runs, whose
# parameters are already full precision); "optimizer": the optimizer's moments (AdamW's m and v).
CATEGORIES = ("params", "grads", "master", "optimizer", "activations", "comm")


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (+bytes) or release (-bytes), in order; the app draws these."""

    seq: int
    name: str
    category: str
    delta: int
    total_after: int


def nbytes_of(obj) -> int:
    """Bytes of an array of any namespace, or an int taken as bytes."""
    if isinstance(obj, int):
        return obj
    # array_api_compat.size: torch's `.size` is a method, not the element count.
    return int(size(obj)) * _itemsize(obj)


def _itemsize(obj) -> int:
    """Bytes per element from the array API's finfo/iinfo, which every namespace has."""
    itemsize = getattr(obj.dtype, "itemsize", None)  # NumPy, CuPy and torch dtypes carry it
    if itemsize is not None:
        return int(itemsize)
    xp = array_namespace(obj)
    if obj.dtype == xp.bool:
        return 1
    info = xp.finfo(obj.dtype) if xp.isdtype(obj.dtype, "real floating") else xp.iinfo(obj.dtype)
    return info.bits // 8


class MemoryLedger:
    def __init__(self, record_events: bool = False):
        self._live: dict[str, tuple[str, int]] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.events: list[MemoryEvent] | None = [] if record_events else None
        self._seq = 0

    @property
    def total(self) -> int:
        return sum(self.current.values())

    def alloc(self, name: str, array_or_nbytes, category: str):
        """Counts `array_or_nbytes` under `category`; returns the array so calls can be inlined."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; use one of {CATEGORIES}")
        if name in self._live:
            raise ValueError(f"{name!r} is already in the ledger; free it first or use another name")
        nbytes = nbytes_of(array_or_nbytes)
        self._live[name] = (category, nbytes)
        self.current[category] += nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, self.total)
        self._record(name, category, nbytes)
        return array_or_nbytes

    def free(self, name: str) -> None:
        if name not in self._live:
            raise ValueError(f"{name!r} is not in the ledger")
        category, nbytes = self._live.pop(name)
        self.current[category] -= nbytes
        self._record(name, category, -nbytes)

    def free_prefix(self, prefix: str) -> None:
        """Frees every entry whose name starts with `prefix` (a layer's saved activations)."""
        for name in [n for n in self._live if n.startswith(prefix)]:
            self.free(name)

    def holds(self, name: str) -> bool:
        return name in self._live

    def live(self, category: str | None = None) -> dict[str, int]:
        """Names and bytes of what is held now, optionally of one category."""
        return {n: b for n, (c, b) in self._live.items() if category in (None, c)}

    def _record(self, name: str, category: str, delta: int) -> None:
        if self.events is not None:
            self.events.append(MemoryEvent(self._seq, name, category, delta, self.total))
        self._seq += 1
