"""The planner's step-time model held against published measured runs, and fitted on some of them.

Every run of published_runs.RUNS is priced by the same model (step_time.step_time with
efficiency.CALIBRATED); what differs between runs is only what their papers say they ran: the
model's shape, the mesh,
the batch, recomputation, sequence parallelism and the software (`Software`: which attention
kernel, what overlaps what). What a paper leaves open (most often the micro-batch size and the
chunks of the interleaved schedule) is the planner's best choice among the options that fit in
memory: a published run was tuned, and so is its prediction. Each run's `assumed` says which.

The three fractions of `Efficiency` are the model's only free parameters. `fit()` chooses them to
make the largest relative error over the runs marked `fit=True` as small as it can be; the other
runs (`held_out`) test the model. `validate()` gives every run's prediction, its published figure
and the signed relative error predicted / published - 1.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from refpar.analysis.efficiency import CALIBRATED, Efficiency
from refpar.analysis.flops import model_flops, step_flops
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.planner import UNPRICED, plan
from refpar.analysis.published_runs import METRICS, RUNS, Run, source_group
from refpar.analysis.scale import PRECISIONS, memory_per_rank, stage_layers
from refpar.analysis.step_time import step_time


def _options(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """schedule -> (chunks, micro-batch) arrays of what the run may have used: what it published,
    else every power-of-two micro-batch dividing a replica's share and every chunk count that
    divides the blocks of a stage (interleaving wants micro-batches in multiples of the depth)."""
    d, p = run.mesh["dp"], run.mesh["pp"]
    share = run.global_batch // d
    micro = [run.micro_batch] if run.micro_batch else [2 ** k for k in range(share.bit_length())
                                                       if share % 2 ** k == 0]
    if p == 1:
        return {"1f1b": (np.ones(len(micro), int), np.array(micro))}
    per_stage = int(stage_layers(run.model.n_layer, p)[1])
    out = {}
    for schedule in [run.schedule] if run.schedule else ["1f1b", "interleaved-1f1b"]:
        if schedule == "1f1b":
            pairs = [(1, b) for b in micro]
        else:
            chunks = [run.chunks] if run.chunks else [v for v in range(2, per_stage + 1)
                                                      if per_stage % v == 0]
            pairs = [(v, b) for v in chunks for b in micro if (share // b) % p == 0]
        if pairs:
            out[schedule] = tuple(np.array(column) for column in zip(*pairs, strict=True))
    return out


def price(run: Run, eff: Efficiency = CALIBRATED) -> dict:
    """The run priced by the model: its metric, step time by cause and the options chosen (the
    fastest that fits in memory, or the fastest if none does)."""
    hw, mesh = HARDWARE[run.hardware], run.mesh
    best = None
    for schedule, (chunks, micro) in _options(run).items():
        kw = dict(micro_batch=micro, seq=run.seq, tp=mesh["tp"], pp=mesh["pp"], dp=mesh["dp"],
                  cp=mesh["cp"], zero=run.zero, schedule=schedule, chunks=chunks,
                  recompute=run.recompute, sp=run.sp, precision=PRECISIONS[run.precision])
        times, _, _ = step_time(run.model, hw, global_batch=run.global_batch, eff=eff,
                                software=run.software, **kw)
        memory = memory_per_rank(run.model, microbatches=run.global_batch // (mesh["dp"] * micro),
                                 software=run.software, **kw)
        needed = np.broadcast_to(sum(memory.values()), micro.shape)
        total = np.broadcast_to(times["total"], micro.shape)
        for i in range(len(micro)):
            key = (bool(needed[i] > hw.memory_bytes), float(total[i]))
            if best is None or key < best[0]:
                best = (key, schedule, i, chunks, micro, times, needed)
    (unfit, seconds), schedule, i, chunks, micro, times, needed = best

    def at(x):
        return float(np.broadcast_to(x, micro.shape)[i])

    gpus, batch, seq = run.gpus, run.global_batch, run.seq
    per_gpu = seconds * gpus
    value = {"step_s": seconds,
             "tflops_hardware": step_flops(run.model, batch, seq, "full") / per_gpu / 1e12,
             "tflops_model": model_flops(run.model, batch, seq) / per_gpu / 1e12,
             "mfu": model_flops(run.model, batch, seq) / per_gpu / hw.flops("bfloat16"),
             "block_ms": 1e3 * (at(times["block"]["F"]) + at(times["block"]["B"])),
             "tokens_per_gpu_s": batch * seq / per_gpu}[run.metric]
    return {"predicted": float(value), "schedule": schedule, "chunks": int(chunks[i]),
            "micro_batch": int(micro[i]), "step_s": seconds, "fits": not unfit,
            "memory_bytes": float(needed[i]),
            "time_s": {k: at(v) for k, v in times.items() if k not in ("stage", "block", "total")}}


def validate(eff: Efficiency = CALIBRATED, runs: list[Run] = RUNS, search: bool = False) -> dict:
    """Every run's prediction against its published figure (the `refpar plan --validate --json`
    object): rows of name, source, predicted, published, relative_error, held_out and more; with
    `search`, each whole-step run also gets "search", its plan next to the search's fastest."""
    rows = []
    for run in runs:
        priced = price(run, eff)
        rows.append({"name": run.name, "source": run.source, "metric": METRICS[run.metric],
                     "predicted": priced["predicted"], "published": run.published,
                     "relative_error": priced["predicted"] / run.published - 1, "held_out": not run.fit,
                     "tolerance": run.tolerance, "hardware": run.hardware, "mesh": dict(run.mesh),
                     "chosen": {k: priced[k] for k in ("schedule", "chunks", "micro_batch")},
                     "fits": priced["fits"], "memory_bytes": priced["memory_bytes"],
                     "source_group": source_group(run), "assumed": run.assumed, "outside": run.outside})
        if search and run.metric != "block_ms":
            rows[-1]["search"] = against_search(run, eff)
    held = [abs(r["relative_error"]) for r in rows if r["held_out"]]
    fitted = [abs(r["relative_error"]) for r in rows if not r["held_out"]]
    return {"efficiency": vars(eff), "rows": rows,
            "largest_error": max(abs(r["relative_error"]) for r in rows),
            "largest_fit_error": max(fitted, default=0.0), "largest_held_out_error": max(held, default=0.0)}


def summary(rows: list[dict], within: float = 0.15) -> dict:
    """The error of a table of validate() rows, whole and by source: rows, median and worst
    |relative error|, how many are within `within`, how many plans are accepted as fitting."""

    def stats(group: list[dict]) -> dict:
        errors = [abs(r["relative_error"]) for r in group]
        return {"rows": len(group), "median_abs_error": float(np.median(errors)),
                "worst_abs_error": max(errors), "within": sum(e <= within for e in errors),
                "fitting": sum(bool(r["fits"]) for r in group)}

    groups = sorted({r["source_group"] for r in rows})
    return {**stats(rows), "within_bound": within,
            "by_source": {g: stats([r for r in rows if r["source_group"] == g]) for g in groups}}


def fit_error(eff: Efficiency, runs: list[Run] = RUNS) -> float:
    """The largest |relative error| over the runs marked fit: what fit() makes small."""
    return max(abs(price(r, eff)["predicted"] / r.published - 1) for r in runs if r.fit)


GRID = {"matmul": (0.80, 0.85, 0.90, 0.95, 1.0), "memory": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
        "network": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)}


def fit(runs: list[Run] = RUNS, grid: dict = GRID, smallest: float = 0.0025,
        start: Efficiency | None = None) -> tuple[Efficiency, float]:
    """The three fractions that make fit_error smallest. A minimax objective has corners and
    several local minima, so: the best point of a coarse grid over (0, 1] (or `start`), then a
    pattern search from it (Hooke and Jeeves 1961): move one fraction by the step while that lowers
    the error, halve the step when no move does, stop below `smallest`."""
    if start is None:
        points = [Efficiency(*p) for p in itertools.product(*grid.values())]
        best = min(points, key=lambda e: fit_error(e, runs))
    else:
        best = start
    error, step = fit_error(best, runs), 0.025
    while step >= smallest:
        moved = False
        for field in ("matmul", "memory", "network"):
            for sign in (1, -1):
                value = round(getattr(best, field) + sign * step, 6)
                if not 0 < value <= 1:
                    continue
                trial = replace(best, **{field: value})
                trial_error = fit_error(trial, runs)
                if trial_error < error:
                    best, error, moved = trial, trial_error, True
        if not moved:
            step /= 2
    return best, error


# What the model may leave out of a plan the published runs did not use, by the feature that
# makes the search prefer it.
MISSING = {
    **UNPRICED,  # these two the search also ranks last (planner.plan)
    "zero": "ZeRO-2/3's per-micro-batch collectives are priced as hidden where compute covers them; "
            "NCCL's kernels take SMs from that compute",
    "chunks": "every extra interleaved chunk adds transfers priced at bandwidth and latency but not "
              "their kernel launches or the ranks' skew",
}


NEUTRAL = Efficiency(matmul=0.9, memory=0.75, network=0.7)  # GRID's middle: a start no source chose


def cross_validate(runs: list[Run] = RUNS, held_out: list[Run] = (), smallest: float = 0.0025) -> dict:
    """Leave one source out: for each source with fit rows, the fractions fitted without it (a
    pattern search from NEUTRAL over the other sources' fit rows) and every row of it predicted
    with them; sources without fit rows (`held_out` and the calibration set's held-out-only ones)
    are predicted with CALIBRATED, which never saw them. Returns {"folds": {source: {efficiency,
    fit_error, rows, median_abs_error, worst_abs_error}}, "median_abs_error", "worst_abs_error"}."""
    every = list(runs) + list(held_out)
    groups = sorted({source_group(r) for r in every})
    folds, errors = {}, []
    for group in groups:
        rows = [r for r in every if source_group(r) == group]
        others = [r for r in runs if source_group(r) != group]
        if any(r.fit for r in rows):
            eff, error = fit(others, start=NEUTRAL, smallest=smallest)
        else:
            eff, error = CALIBRATED, fit_error(CALIBRATED, others)
        group_errors = [abs(price(r, eff)["predicted"] / r.published - 1) for r in rows]
        errors += group_errors
        folds[group] = {"efficiency": vars(eff), "fit_error": error, "rows": len(rows),
                        "median_abs_error": float(np.median(group_errors)),
                        "worst_abs_error": max(group_errors)}
    return {"folds": folds, "median_abs_error": float(np.median(errors)), "worst_abs_error": max(errors)}


def against_search(run: Run, eff: Efficiency = CALIBRATED) -> dict:
    """The published plan next to the search's fastest for the same model, batch, GPUs and
    software: each one's predicted step time by cause, their difference, and what the model may
    be missing where the search prefers a plan the run did not use."""
    published = price(run, eff)
    result = plan(run.model, HARDWARE[run.hardware], run.gpus, global_batch=run.global_batch, seq=run.seq,
                  top=1, precision=run.precision, eff=eff, software=run.software,
                  priced={"step_time_s": published["step_s"]})
    searched = result["plans"][0]
    missing = []
    if searched["schedule"] in ("zb-h1", "zb-h2"):
        missing.append(MISSING["zero-bubble"])
    if searched["mesh"]["cp"] > run.mesh["cp"]:
        missing.append(MISSING["context"])
    if searched["zero"] >= 2 > run.zero:
        missing.append(MISSING["zero"])
    if searched["chunks"] > published["chunks"]:
        missing.append(MISSING["chunks"])
    return {"published": {"mesh": dict(run.mesh), "schedule": published["schedule"],
                          "chunks": published["chunks"], "micro_batch": published["micro_batch"],
                          "recompute": run.recompute, "sp": run.sp, "zero": run.zero,
                          "step_time_s": published["step_s"], "time_s": published["time_s"]},
            "fastest": {key: searched[key] for key in ("mesh", "schedule", "chunks", "micro_batch",
                                                       "recompute", "sp", "zero", "step_time_s", "time_s")},
            "difference_s": {k: published["time_s"][k] - searched["time_s"][k] for k in published["time_s"]},
            "rank": result["rank"], "fitting": result["fitting"], "missing": missing}
