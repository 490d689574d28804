"""A run that reports as it goes, from rank 0: a progress bar with an ETA at a terminal, one JSON line
per step (--log), TensorBoard event files (--tensorboard), and the step table's elapsed, ETA and
MFU columns (--log-every); refpar/engine/run.py puts them around the loop's on_step.

    refpar train --model small --steps 2000 --log-every 100 --log run.jsonl --tensorboard tb
    tail -f run.jsonl        # a line as each step ends; a killed run keeps the lines it wrote

When each shows:
- the bar (tqdm) only where rank 0's stderr is a terminal (the rule of tqdm's `disable=None`): a
  log file, a pipe and the tests get no carriage returns; under mpiexec a rank's stderr is a pipe
  (MPICH's Hydra forwards it), so the bar is one process's, and a multi-rank run reports by its rows;
- the step rows: about a dozen (every steps // 12) plus the first and the last, as before, and a
  row whenever HEARTBEAT_S have passed since the last one, so a slow run's log is never silent
  for longer than that and a step; with --log-every N exactly the steps N, 2N, ..., the first and
  the last (and fp16's skipped steps, as always). The columns depend on flags, never on timings:
  --log-every N adds elapsed, ETA and MFU, so the short runs of docs/ and lessons/ print the
  tables their pages show.

MFU, model FLOPs utilization (Chowdhery et al. 2022, PaLM, Appendix B): the FLOPs the model needs
for a step over the step's time and the peak FLOP/s of the processes that ran it. The model's FLOPs
are the planner's closed form without recomputation (refpar/analysis/flops.py model_flops:
Narayanan et al.'s count, 72 B s L h^2 (1 + s/6h + V/12Lh) for GPT-2): PaLM's definition leaves
out rematerialization (counted in, it is HFU), and this count leaves out ring attention's second
QK^T too; on a dense model it is exactly the GEMM FLOPs the ranks' tallies add up to without recomputation
(refpar/model/gemm.py; tests/test_runlog.py), and it costs no message per step. A MoE model is
priced as if no token were dropped. The peak is measured, not looked up: a few large matrix
products in the dtype the run's GEMMs compute in, on every process at the same moment (ranks
sharing cores share them in the run too), best of PEAK_REPEATS; MFU divides by world size x rank
0's peak.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from refpar import interrupt
from refpar.analysis.flops import model_flops
from refpar.analysis.presets import from_model_config
from refpar.model.optim import learning_rate
from refpar.precision import MASTER_DTYPE, dtype_of, is_16bit

from .report import summary_line

HEARTBEAT_S = 60.0  # without --log-every, the longest a run's table stays silent (plus one step)
PEAK_REPEATS = 5  # timed products, after one untimed (BLAS threads, a GPU's handles start)


@dataclass(frozen=True)
class Peak:
    """The GEMM FLOP/s one process reached: n x n by n x n products in `dtype`, best of `repeats`."""

    flops_per_s: float
    n: int
    dtype: str
    repeats: int
    seconds: float  # the whole measurement, the untimed product included

    def line(self, world: int) -> str:
        """The header's line: the peak and what MFU divides by."""
        return (f"peak GEMM {self.flops_per_s / 1e9:,.3f} GFLOP/s per process ({self.dtype}, {self.n} x "
                f"{self.n} products, best of {self.repeats}, {self.seconds:.2f} s); MFU = model FLOPs "
                f"/ (step time x {world} x peak)")


def gemm_dtype(dtype) -> np.dtype:
    """What the run's matrix products compute in: a 16-bit run's in fp32 (precision.fp32_compute)."""
    return MASTER_DTYPE if is_16bit(dtype) else dtype_of(dtype)


def measure_peak(dtype, repeats: int = PEAK_REPEATS) -> Peak:
    """This process's peak GEMM FLOP/s in the backend the run computes with (refpar/backend.py):
    1024 x 1024 products on a CPU (2.1 GFLOP each, tens of ms on one core), 4096 x 4096 on a GPU
    (137 GFLOP, milliseconds), where smaller ones measure the launches more than the arithmetic."""
    from refpar import backend

    device = backend.current()
    n = 4096 if str(device.device).startswith("cuda") else 1024
    rng = np.random.default_rng(0)
    a, b = (device.from_host(rng.standard_normal((n, n)).astype(dtype)) for _ in range(2))  # (n, n)
    start = time.perf_counter()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        _ = a @ b  # (n, n)
        device.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    return Peak(2 * n ** 3 / best, n, np.dtype(dtype).name, repeats, time.perf_counter() - start)


@dataclass(frozen=True)
class Measured:
    """One step's throughput and where the run stands."""

    tokens_per_s: float
    mfu: float | None  # None without a measured peak
    elapsed_s: float  # since the first step of this run began
    eta_s: float  # to the last step, at the pace of the steps after the first


class Clock:
    """Measures each step: tokens/s, MFU, the time since the run began and the ETA."""

    def __init__(self, cfg, flops: int, world: int, peak: Peak | None):
        self.cfg, self.flops, self.world, self.peak = cfg, flops, world, peak
        self.started = self.first_done = None
        self.first = 0

    def tick(self, step: int, seconds: float) -> Measured:
        now = time.perf_counter()
        if self.started is None:  # the first step of this run (a resumed run's is not 0)
            self.started, self.first_done, self.first = now - seconds, now, step
        left = self.cfg.steps - 1 - step
        # the first step warms up (allocations, BLAS threads, caches): the pace is the steps after it
        pace = (now - self.first_done) / (step - self.first) if step > self.first else seconds
        mfu = self.flops / (seconds * self.world * self.peak.flops_per_s) if self.peak else None
        return Measured(self.cfg.batch_size * self.cfg.seq_len / seconds, mfu, now - self.started,
                        pace * left)


def duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour (the step table's elapsed and ETA)."""
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def wants_peak(args) -> bool:
    """Whether the run reports MFU: with --log, --tensorboard or --log-every."""
    return args.log is not None or args.tensorboard is not None or args.log_every is not None


class RunLog:
    """Rank 0's reports as the run goes (module docstring); on any other rank it only passes the
    loop's calls on to the step table, whose `say` prints nothing there."""

    def __init__(self, model, cfg, world: int, args, peak: Peak | None, speak: bool):
        spec = from_model_config(model)
        self.cfg, self.moe = cfg, bool(model.moe_experts)
        self.clock = Clock(cfg, int(model_flops(spec, cfg.batch_size, cfg.seq_len)), world, peak)
        self.speak, self.terminal = speak, speak and sys.stderr.isatty()
        self.file = self.events = self.bar = None
        if not speak:
            return
        if args.log is not None:  # a resumed run continues its log; any other starts it afresh
            self.file = open(args.log, "a" if args.resume is not None else "w")
        if args.tensorboard is not None:
            from tensorboardX import SummaryWriter

            self.events = SummaryWriter(logdir=args.tensorboard)  # makes the folder and its parents

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def say(self, text: str = "") -> None:
        """Rank 0 prints a line; above the bar while there is one."""
        if not self.speak:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def on_step(self, row):
        """The loop's on_step (refpar/engine/train.py): the table's `row` (refpar/engine/lines.py
        progress), then the bar, the JSON line and the events."""
        def step(step, loss, seconds, totals, moe_step, scaling=None, *, val_loss=None, grad_norm=None):
            measured = self.clock.tick(step, seconds)
            row(step, loss, seconds, totals, moe_step, scaling, measured=measured, val_loss=val_loss)
            if not self.speak:
                return
            self._advance(step, loss)
            record = {"step": step + 1, "loss": loss, "val_loss": val_loss,
                      "lr": learning_rate(self.cfg, step), "grad_norm": grad_norm,
                      "tokens_per_s": measured.tokens_per_s, "mfu": measured.mfu,
                      "model_flops": self.clock.flops, "step_time_s": seconds,
                      "elapsed_s": measured.elapsed_s, "eta_s": measured.eta_s}
            if moe_step is not None:
                record |= {"aux_loss": moe_step.aux_loss, "z_loss": moe_step.z_loss}
            if scaling is not None:
                record |= {"loss_scale": scaling[0], "skipped": bool(scaling[1])}
            self._write(record)

        return step

    def _advance(self, step: int, loss: float) -> None:
        """The bar: made at the first step (a resumed run's starts at its checkpoint), one tick a step."""
        if not self.terminal:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.steps, initial=step, unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=False)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(1)

    def _write(self, record: dict) -> None:
        if self.file is not None:
            # One file operation (refpar/interrupt.py): Ctrl-C or SIGTERM ends the process after the
            # line is out or before it starts, never inside the write (the kernel may end a write to
            # a file at a page boundary when the process is killed, leaving half a line).
            with interrupt.file_operation():
                self.file.write(summary_line(record) + "\n")  # strict JSON: a diverged loss is null
                self.file.flush()  # as each step ends: `tail -f` sees it, a killed run keeps it
        if self.events is not None:
            for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "aux_loss", "z_loss"):
                if record.get(key) is not None:
                    self.events.add_scalar(key, record[key], record["step"])
            self.events.flush()

    def close(self) -> None:
        for thing in (self.bar, self.file, self.events):
            if thing is not None:
                thing.close()
        self.bar = self.file = self.events = None
