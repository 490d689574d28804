"""What a run on a given mesh must move and hold, from each strategy's own closed forms.

The rows are exactly the `expected_comm_bytes` and `expected_memory_peak_bytes` rows `refpar train
--json` prints (DESIGN.md, "Command line"), taken from the same functions the runners call, so a
figure drawn from them can be laid next to a real run's measured rows:

    dp, zero1-3, fsdp   refpar.parallel.dp_runner.expected_rows
    tp, sp, cp          refpar.analysis.intra_layer.expected_comm_rows, intra_layer_runner.expected_memory
    pp (with dp)        refpar.parallel.pipeline.runner.expected_comm_rows / expected_memory_rows

`calls` lists each collective of one step in program order with every rank's bytes, for the
step-by-step views (dp and intra-layer strategies; the pipeline's messages are per microbatch and
are drawn by the Pipeline page instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.config import MESH_AXES, ConfigError, ModelConfig, ParallelConfig, TrainConfig

DP_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")
STRATEGIES = (*DP_STRATEGIES, "tp", "sp", "cp-ring", "cp-ulysses", "pp")
# The mesh axis each strategy splits over (SP shares tp's ranks; cp's two algorithms share cp).
AXIS = {**dict.fromkeys(DP_STRATEGIES, "dp"), "tp": "tp", "sp": "tp", "cp-ring": "cp", "cp-ulysses": "cp",
        "pp": "pp"}
MAX_WORLD = 16  # the Run page's limit too: more ranks than this do not fit this machine or the screen


@dataclass(frozen=True)
class Workload:
    """A strategy on a mesh, with the model and training settings of the run it describes."""

    strategy: str
    sizes: dict[str, int]  # every axis of MESH_AXES
    model: ModelConfig
    train: TrainConfig
    schedule: str = "1f1b"  # pp only
    microbatches: int = 1  # pp: m; dp strategies: gradient accumulation
    chunks: int = 1  # pp: v

    @property
    def world(self) -> int:
        return int(np.prod([self.sizes[a] for a in MESH_AXES]))


def workload(strategy: str, n: int, model: ModelConfig, train: TrainConfig, dp: int = 1,
             schedule: str = "1f1b", microbatches: int = 1, chunks: int = 1) -> Workload:
    """`strategy` over n ranks of its own axis (dp for the ZeRO family), times `dp` data-parallel
    replicas for tp, sp, cp and pp. Raises ConfigError with the fix for a mesh refpar cannot run."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    axis = AXIS[strategy]
    sizes = ParallelConfig({axis: n} if axis == "dp" else {axis: n, "dp": dp}).sizes
    w = Workload(strategy, sizes, model, train, schedule, microbatches, chunks)
    if w.world > MAX_WORLD:
        raise ConfigError(f"the mesh has {w.world} ranks; use at most {MAX_WORLD}")
    return w


def _intra_options(w: Workload) -> tuple[bool, str | None]:
    return w.strategy == "sp", {"cp-ring": "ring", "cp-ulysses": "ulysses"}.get(w.strategy)


def _dp_options(w: Workload):
    from refpar.parallel.dp_runner import check_options, options

    opts = options(w.strategy, w.model, w.train, microbatches=w.microbatches)
    check_options(opts, w.train, w.sizes["dp"])
    return opts


def closed_form_rows(w: Workload) -> tuple[list[dict], list[dict]]:
    """(comm rows, memory rows) of every rank, as `refpar train --json` prints them expected."""
    if w.strategy in DP_STRATEGIES:
        from refpar.parallel.dp_runner import expected_rows

        return expected_rows(_dp_options(w), w.model, w.train, w.sizes["dp"])
    if w.strategy == "pp":
        from refpar.parallel.pipeline.runner import expected_comm_rows, expected_memory_rows, validate

        validate(w.model, w.train, w.sizes, w.schedule, w.microbatches, w.chunks)  # a bad run says why
        return (expected_comm_rows(w.model, w.train, w.sizes, w.microbatches, w.chunks),
                expected_memory_rows(w.model, w.train, w.sizes, w.schedule, w.microbatches, w.chunks))
    from refpar.analysis.intra_layer import expected_comm_rows
    from refpar.parallel.intra_layer import validate
    from refpar.parallel.intra_layer_runner import expected_memory, rank_coords

    sp, cp_algo = _intra_options(w)
    validate(w.model, w.train, w.sizes, sp, cp_algo)
    comm, memory = [], []
    for rank in range(w.world):
        comm += expected_comm_rows(w.model, w.train, w.sizes, rank_coords(w.sizes, rank), rank, sp, cp_algo)
        memory += [{"rank": rank, "category": c, "bytes": b}
                   for c, b in expected_memory(w.model, w.train, w.sizes, rank, sp, cp_algo).items()]
    return comm, memory


def calls(w: Workload) -> list[dict]:
    """Each collective of one step in program order: axis, op, tag and `bytes_sent[rank]`.
    Empty for pp (see the module docstring)."""
    if w.strategy == "pp":
        return []
    if w.strategy in DP_STRATEGIES:
        from refpar.analysis.comm_volume import FOUND_INF, LOSS, collective_bytes, itemsize, step_collectives

        opts, n = _dp_options(w), w.sizes["dp"]
        out = []
        for call in step_collectives(w.model, n, opts):
            op, elems, repeat = call
            sent = [collective_bytes(op, elems, n, r, itemsize(call, opts)).sent for r in range(n)]
            tag = "loss" if call is LOSS else "found_inf" if call is FOUND_INF else f"{elems:,} elements"
            out += [{"axis": "dp", "op": op, "tag": tag, "bytes_sent": sent}] * repeat
        return out
    from refpar.analysis.intra_layer import expected_calls
    from refpar.parallel.intra_layer import validate
    from refpar.parallel.intra_layer_runner import rank_coords

    sp, cp_algo = _intra_options(w)
    validate(w.model, w.train, w.sizes, sp, cp_algo)
    per_rank = [expected_calls(w.model, w.train, w.sizes, rank_coords(w.sizes, r), sp, cp_algo)
                for r in range(w.world)]
    # Every rank runs the same calls in the same order (each group's members call together).
    return [{"axis": row[0].axis, "op": row[0].op, "tag": row[0].tag,
             "bytes_sent": [c.bytes_sent for c in row]} for row in zip(*per_rank, strict=True)]


def train_args(w: Workload, trace: str | None = None) -> list[str]:
    """The `refpar train` arguments that run this workload (after `mpiexec -n w.world`); with
    `trace`, rank 0 writes the run's communication events there as a Chrome trace."""
    mesh = ",".join(f"{a}={w.sizes[a]}" for a in MESH_AXES if w.sizes[a] > 1) or "dp=1"
    args = ["--mesh", mesh, "--steps", str(w.train.steps), "--batch-size", str(w.train.batch_size),
            "--seq-len", str(w.train.seq_len), "--json"]
    if w.strategy in ("zero1", "zero2", "zero3"):
        args += ["--zero", w.strategy[-1]]
    elif w.strategy == "fsdp":
        args += ["--fsdp"]
    elif w.strategy == "sp":
        args += ["--sp"]
    elif w.strategy.startswith("cp-"):
        args += ["--cp-algo", w.strategy[3:]]
    elif w.strategy == "pp":
        args += ["--schedule", w.schedule, "--microbatches", str(w.microbatches)]
        if w.schedule == "interleaved-1f1b":
            args += ["--chunks", str(w.chunks)]
    if w.strategy in DP_STRATEGIES and w.microbatches > 1:
        args += ["--microbatches", str(w.microbatches)]
    return args + (["--trace", trace] if trace else [])
