"""What a run on a given mesh must move and hold, from the closed forms.

The rows are exactly the `expected_comm_bytes` and `expected_memory_peak_bytes` rows `refpar train
--json` prints (DESIGN.md, "Command line"), from refpar.analysis.closed_forms, which composes every
strategy's closed forms for a mesh, so a figure drawn from them can be laid next to a real run's
measured rows.

`calls` lists each collective of one step in program order with every rank's bytes, for the
step-by-step views (dp strategies: refpar.analysis.comm_volume.step_calls; intra-layer ones:
refpar.analysis.intra_layer.expected_calls; the pipeline's messages are per microbatch and are
drawn by the Pipeline page instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpar.config import MESH_AXES, ConfigError, ModelConfig, ParallelConfig, Plan, TrainConfig, model_preset

DP_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")
STRATEGIES = (*DP_STRATEGIES, "tp", "sp", "cp-ring", "cp-ulysses", "pp")
# The mesh axis each strategy splits over (SP shares tp's ranks; cp's two algorithms share cp).
AXIS = {**dict.fromkeys(DP_STRATEGIES, "dp"), "tp": "tp", "sp": "tp", "cp-ring": "cp", "cp-ulysses": "cp",
        "pp": "pp"}
MAX_WORLD = 16  # the Run page's limit too: more ranks than this do not fit this machine or the screen
# The model families the app lets the user pick, each the preset of refpar's it shows and runs:
# GPT-2's tiny, and Llama's, whose 4 query heads over 2 kv heads show GQA (tp=4 replicates kv heads).
FAMILIES = {"GPT-2": "tiny", "Llama": "llama-tiny"}


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


def plan_of(w: Workload) -> Plan:
    """The Plan the workload's strategy runs (refpar train's options for it): microbatches for pp
    (per step) and the dp family (gradient accumulation); tp, sp and cp take the batch at once."""
    piped = w.strategy == "pp"
    m = w.microbatches if piped or AXIS[w.strategy] == "dp" else 1
    return Plan(schedule=w.schedule if piped else None, microbatches=m,
                chunks=w.chunks if piped and w.schedule == "interleaved-1f1b" else None,
                sp=w.strategy == "sp", cp_algo={"cp-ring": "ring", "cp-ulysses": "ulysses"}.get(w.strategy),
                zero=int(w.strategy[-1]) if w.strategy.startswith("zero") else 0, fsdp=w.strategy == "fsdp")


def _checked(w: Workload) -> Plan:
    """The workload's plan, checked as refpar train checks it (ConfigError with the fix)."""
    from refpar.engine.validate import validate

    plan = plan_of(w)
    validate(w.model, w.train, w.sizes, plan)
    return plan


def closed_form_rows(w: Workload) -> tuple[list[dict], list[dict]]:
    """(comm rows, memory rows) of every rank, as `refpar train --json` prints them expected."""
    from refpar.analysis.closed_forms import rank_comm_rows, rank_coords, rank_memory_rows

    plan, comm, memory = _checked(w), [], []
    for rank in range(w.world):
        co = rank_coords(w.sizes, rank)
        comm += [{"rank": rank, **r}
                 for r in rank_comm_rows(w.model, w.train, w.sizes, co, plan, w.train.steps)]
        memory += [{"rank": rank, **r} for r in rank_memory_rows(w.model, w.train, w.sizes, co, plan)]
    return comm, memory


def calls(w: Workload) -> list[dict]:
    """Each collective of one step in program order: axis, op, tag and `bytes_sent[rank]`.
    Empty for pp (see the module docstring)."""
    if w.strategy == "pp":
        return []
    plan = _checked(w)
    if w.strategy in DP_STRATEGIES:
        from refpar.analysis.comm_volume import step_calls
        from refpar.analysis.memory import Options, precision_options

        opts = Options(w.strategy, **precision_options(w.model.dtype, w.train.fp32_grads),
                       optimizer=w.train.optimizer, microbatches=w.microbatches)
        n = w.sizes["dp"]
        per_rank = [step_calls(w.model, n, r, opts) for r in range(n)]
        return [{"axis": row[0][0], "op": row[0][1], "tag": row[0][2], "bytes_sent": [c[3].sent for c in row]}
                for row in zip(*per_rank, strict=True)]
    from refpar.analysis.closed_forms import rank_coords
    from refpar.analysis.intra_layer import expected_calls

    per_rank = [expected_calls(w.model, w.train, w.sizes, rank_coords(w.sizes, r), plan.sp, plan.cp_algo)
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
    name = next((n for n in FAMILIES.values() if model_preset(n) == w.model), None)
    if name is None:
        raise ConfigError(f"the app launches the presets {', '.join(FAMILIES.values())} only")
    if name != "tiny":  # refpar train's default
        args += ["--model", name]
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
