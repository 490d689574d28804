"""torch.distributed.pipelining's schedule CSV, written and read by torch itself, in one process.

torch computes every rank's action list on every rank from the group's size, so one process in a
"fake" process group of p ranks (torch's testing backend, whose collectives do nothing) holds a
whole schedule without any message moving. `dump(name, p, m)` is the CSV torch writes for its
schedule class `Schedule<name>` (`_dump_csv(path, format="compute_only")`); `load(name, p, m, text)`
is what torch's `_load_csv` makes of a CSV: it validates it (every stage on one rank, every
microbatch's F, and B or I and W, in order), infers the stage placement and lowers it with the
sends and receives it would run. Used by tests/test_schedule_csv.py next to refpar's
`formats.to_csv` / `from_csv`.

    TORCH = torch's class name -> (refpar's builder of the same order, or None; the placement)
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipe
from torch.distributed.pipelining import schedules as torch_schedules

TORCH = {
    "ZBVZeroBubble": ("zbv", "v"),  # both follow Qi et al.'s ZB-V (section 6)
    "DualPipeV": ("dualpipev", "v"),  # both follow deepseek-ai/DualPipe's dualpipev.py
    "InterleavedZeroBubble": (None, "loop"),  # refpar has no builder of this order
}


@contextmanager
def fake_group(p: int):
    """A process group of p ranks in which this process is rank 0 and nothing is sent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _schedule(name: str, p: int, m: int):
    """torch's Schedule<name> for p ranks (2 stages each) and m microbatches, as rank 0 builds it."""
    placement = TORCH[name][1]
    stages = (0, 2 * p - 1) if placement == "v" else (0, p)  # rank 0's two stages
    modules = [pipe.PipelineStage(torch.nn.Linear(1, 1), s, 2 * p, torch.device("cpu")) for s in stages]
    cls = getattr(torch_schedules, f"Schedule{name}")
    return cls(modules, m, loss_fn=lambda out, target: out.sum())


def dump(name: str, p: int, m: int) -> str:
    """The CSV torch writes for its schedule `name` (call inside fake_group(p))."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.csv"
        _schedule(name, p, m)._dump_csv(str(path), format="compute_only")
        return path.read_bytes().decode()  # as written: csv's \r\n line ends


def load(name: str, p: int, m: int, text: str) -> dict[int, list[str]]:
    """torch's reading of a CSV into its schedule `name`: each rank's actions as torch prints
    them ("" for an idle tick), after torch's validation and lowering (call inside fake_group(p))."""
    schedule = _schedule(name, p, m)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "schedule.csv"
        path.write_bytes(text.encode())
        schedule._load_csv(str(path), format="compute_only")
    return {rank: ["" if a is None else str(a) for a in row] for rank, row in schedule.pipeline_order.items()}
