"""A schedule written out: the ranks x ticks grid (`format_grid`, what `refpar schedule` prints) and
torch.distributed.pipelining's schedule CSV (`to_csv`, `from_csv`).
"""

from __future__ import annotations

import csv
import io
import re

from refpar.schedules import OVERLAP, Action, Schedule, ScheduleError, StageMap, stage_map


def action_name(a: Action, split) -> str:
    """An action as the grid and torch's CSV name it: F the forward, I the backward for the input only
    (refpar's B where a W of the same stage and microbatch follows: `(stage, microbatch) in split`),
    W the weights' backward, B a full backward; an overlapped pair "0F5&7I2"."""
    if a.parts:
        return "&".join(action_name(part, split) for part in a.parts)
    kind = "I" if a.kind == "B" and (a.stage, a.microbatch) in split else a.kind
    return f"{a.stage}{kind}{a.microbatch}"


def format_grid(schedule: Schedule, error: ScheduleError | None = None) -> str:
    """Ranks x ticks, `.` for idle, each action named by `action_name`; the action an error names is
    marked `!`, and the error follows the grid."""
    try:
        split = stage_map(schedule).split
    except ScheduleError:  # a schedule of the wrong shape: its backwards are shown as given
        split = set()
    width = max([len(str(a)) for row in schedule.values() for a in row if a is not None] + [3]) + 1
    width += error is not None  # room for the mark
    n_ticks = max((len(row) for row in schedule.values()), default=0)
    lines = ["tick    " + "".join(f"{t:<{width}}" for t in range(n_ticks)).rstrip()]
    for rank, row in sorted(schedule.items()):
        cells = []
        for tick, a in enumerate(row):
            text = "." if a is None else action_name(a, split)
            if error is not None and (error.rank, error.tick) == (rank, tick):
                text = "!" + text
            cells.append(f"{text:<{width}}")
        lines.append(f"rank {rank:<3}" + "".join(cells).rstrip())
    if error is not None:
        lines.append(f"error: {error}")
    return "\n".join(lines)


# torch's PipelineScheduleMulti._dump_csv(path, format="compute_only") writes one row per rank with
# csv.writer, a cell per list entry: an _Action's repr ("0F0"), empty for an idle tick (None). Its
# kinds: F; I, the backward for the input only (refpar's B where a W follows); B, the full backward
# (refpar's B with no W); W; and OVERLAP_F_B, a forward and a backward as one action, written
# "(0F5;7B2)OVERLAP_F_B". _load_csv reads the rows back, row k being rank k.
_CELL = re.compile(r"(\d{1,6})([FIBW])(\d{1,6})")  # a longer number is no stage or microbatch of a grid
# Bounds on what a CSV may hold, checked before its cells are read (issue 43: a 20 MB CSV of idle
# cells took 108 s and 2.2 GB). `refpar schedule` shows at most 256 ranks x 16,384 actions; its
# busiest schedules run about 3 ticks per action, so 1 << 20 cells is room to spare.
MAX_CSV_CHARS, MAX_CSV_CELLS, MAX_CSV_RANKS, MAX_CELL_CHARS = 8 << 20, 1 << 20, 4096, 200
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMMS = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def _torch_name(a: Action, smap: StageMap) -> str:
    if a.parts:
        return f"({';'.join(_torch_name(part, smap) for part in a.parts)})OVERLAP_F_B"
    return action_name(a, smap.split)


def to_csv(schedule: Schedule) -> str:
    """The schedule as torch.distributed.pipelining writes a compute-only schedule: what
    `refpar schedule KIND --csv` prints and torch's _load_csv reads."""
    smap = stage_map(schedule)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(schedule):
        writer.writerow(["" if a is None else _torch_name(a, smap) for a in schedule[rank]])
    return out.getvalue()


def _read_cell(cell: str, rank: int, tick: int) -> tuple[bool, list[tuple[Action, str]]]:
    """Whether the cell is an overlapped pair, and its computations with the kind torch wrote
    (I or B for refpar's B)."""
    pair = _PAIR.fullmatch(cell)
    out = []
    for name in (pair.group(1).split(";") if pair else [cell] if cell else []):
        found = _CELL.fullmatch(name.strip())
        if found is None:
            hint = (" (torch's compute_comms format: dump with format='compute_only')"
                    if _COMMS.fullmatch(name.strip()) else "")
            shown = repr(cell if len(cell) <= 40 else cell[:37] + "...")  # a file that is no CSV: its start
            raise ScheduleError(f"rank {rank} tick {tick}: {shown} is not a computation{hint}; a cell "
                                "holds an action such as 0F0 (kinds F, I, B, W), an overlapped pair "
                                "such as (0F1;3B0)OVERLAP_F_B, or nothing for an idle tick", rank, tick)
        stage, kind, mb = int(found[1]), found[2], int(found[3])
        out.append((Action(stage, "B" if kind == "I" else kind, mb), kind))
    return pair is not None, out


def _rows(text: str) -> list[list[str]]:
    """The CSV's rows, refused in one sentence past the bounds above (before anything is built) or
    where Python's csv module would raise (a cell past its field limit, a NUL)."""
    if len(text) > MAX_CSV_CHARS:
        raise ScheduleError(f"the CSV is {len(text):,} characters, more than the {MAX_CSV_CHARS:,} a "
                            "schedule's can be; give torch's CSV of one schedule")
    rows, cells = [], 0
    try:
        for row in csv.reader(io.StringIO(text)):
            cells += len(row)
            long = next((c for c in row if len(c) > MAX_CELL_CHARS), None)
            if long is not None:
                raise ScheduleError(f"rank {len(rows)}: a cell of {len(long):,} characters is not an "
                                    "action; a cell holds one such as 0F0 or (0F1;3B0)OVERLAP_F_B")
            if cells > MAX_CSV_CELLS or len(rows) >= MAX_CSV_RANKS:
                raise ScheduleError(f"the CSV holds more than {MAX_CSV_RANKS:,} rows or {MAX_CSV_CELLS:,} "
                                    "cells (idle ones too), more than a schedule refpar runs or shows")
            rows.append(row)
    except csv.Error as err:
        raise ScheduleError(f"the CSV cannot be read as CSV (row {len(rows)}: {err}); give torch's "
                            "compute-only schedule CSV") from None
    return rows


def from_csv(text: str) -> Schedule:
    """A schedule from torch's compute-only CSV: row k is rank k, an empty cell an idle tick.
    Raises ScheduleError naming the first cell that is not a computation, an I with no W, or a W
    after a full backward B."""
    schedule: Schedule = {}
    backward: dict[Action, tuple[str, int, int]] = {}  # refpar's B -> (torch's I or B, rank, tick)
    weight: dict[Action, tuple[int, int]] = {}  # the B whose W it is -> (rank, tick)
    rows = _rows(text)
    while rows and not any(cell.strip() for cell in rows[-1]):  # blank lines at the end
        rows.pop()
    for rank, row in enumerate(rows):
        schedule[rank] = []
        for tick, cell in enumerate(row):
            pair, found = _read_cell(cell.strip(), rank, tick)
            for a, kind in found:
                if a.kind == "B":
                    backward[a] = (kind, rank, tick)
                elif a.kind == "W":
                    weight[Action(a.stage, "B", a.microbatch)] = (rank, tick)
            parts = tuple(a for a, _ in found)
            # a pair of other than two parts goes in as written, for stage_map() to name
            schedule[rank].append(Action(-1, OVERLAP, -1, parts) if pair else parts[0] if parts else None)
    if not any(a is not None for row in schedule.values() for a in row):
        raise ScheduleError("the CSV holds no action; write one row per rank, its cells the rank's "
                            "actions in order, e.g. 0F0,0I0,0W0")
    for b, (kind, rank, tick) in sorted(backward.items(), key=lambda item: item[1][1:]):
        s, i = b.stage, b.microbatch
        if kind == "I" and b not in weight:
            raise ScheduleError(f"rank {rank} tick {tick}: {s}I{i} computes the input gradient only, "
                                f"and no {s}W{i} computes the weights'; add {s}W{i} or write {s}B{i}, "
                                "the full backward", rank, tick)
        if kind == "B" and b in weight:
            r, t = weight[b]
            raise ScheduleError(f"rank {r} tick {t}: {s}W{i} computes the weight gradient that the "
                                f"full backward {s}B{i} already computed; write {s}I{i} for the input "
                                "gradient only", r, t)
    return schedule
