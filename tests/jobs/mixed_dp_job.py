"""DP, ZeRO-1/2/3 and FSDP in mixed precision against the ZeRO paper's forms and one device.

    mpiexec -n 3 python tests/jobs/mixed_dp_job.py

Run by tests/test_mixed_precision_dp.py on 3 ranks, so every unit splits unevenly. For each run
(bf16-mixed, bf16-mixed with fp32 gradients, fp16-mixed; an fp16 run whose loss scale starts too
high; bf16 with overlapped buckets, FSDP prefetch and micro-batches) and each strategy it checks,
on every rank:
- the model states held between steps are the paper's 2Ψ + 2Ψ + 4Ψ + 8Ψ and its partitioned forms,
  computed here from Ψ_u and `shard_sizes` alone: P_os 2Ψ + 2Ψ + 12 s, P_os+g 2Ψ + 14 s, P_os+g+p
  16 s, with s = Σ_u s_u this rank's uneven share; with --fp32-grads the Playbook's 20Ψ, partitioned
  as DeepSpeed does: DP and ZeRO-1 keep the 16-bit gradient backward writes beside the fp32
  accumulator (DP 2 + 2 + 4 + 4 + 8 = 20Ψ, ZeRO-1 8Ψ + 12 s), ZeRO-2 2Ψ + 16 s and ZeRO-3/FSDP
  18 s keep only the fp32 gradient shard (a unit's 16-bit gradient lives until its reduce-scatter);
- every measured peak (params, grads, master, optimizer, activations, comm) equals
  refpar.analysis.memory's closed form, and every traced byte refpar.analysis.comm_volume's;
- what moves has the right dtype: gradient reductions in the gradient dtype, parameter gathers in
  16 bits, fp16's overflow flag one float32 per step where shards differ (none for plain DP);
- the losses track the single-device mixed run (tolerances in the test's docstring);
- fp16's skipped steps are the single device's, on every rank.
Rank 0 prints one JSON line: {"failures", "checks", "max_loss_rel_diff": {run: {strategy: x}}}.
"""

from __future__ import annotations

import json
from operator import itemgetter

import numpy as np

from refpar.analysis.memory import unit_sizes
from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import TrainConfig, model_preset
from refpar.engine import Plan
from refpar.engine.run import STATES, collect
from refpar.mesh import DeviceMesh
from refpar.sharding import shard_sizes
from refpar.trainer import train_single_device

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")
STAGE = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
# name: (ModelConfig.dtype, TrainConfig overrides, strategies, loss tolerance (see the test))
RUNS = {
    "bf16": ("bfloat16", {}, STRATEGIES, 2.0 ** -8),
    # ZeRO-2 with micro-batches: a unit's 16-bit gradient comes and goes in every micro-batch.
    "bf16-fp32-grads": ("bfloat16", {"fp32_grads": True},
                        STRATEGIES + ({"strategy": "zero2", "microbatches": 2},), 2.0 ** -8),
    "fp16": ("float16", {}, STRATEGIES, 2.0 ** -11),
    "fp16-overflow": ("float16", {"loss_scale": 2.0 ** 20, "loss_scale_window": 2}, ("dp", "zero2"),
                      2.0 ** -11),
    # The options that change what is held and sent: buckets overlapped as written-out rings,
    # FSDP's prefetch, micro-batches accumulating 16-bit gradients.
    "bf16-options": ("bfloat16", {}, ({"strategy": "dp", "bucket_elems": 3000, "overlap": True},
                                      {"strategy": "fsdp", "prefetch": True},
                                      {"strategy": "zero2", "microbatches": 2}), 2.0 ** -8),
}


def paper_states(psi: int, s: int, stage: int, fp32_grads: bool) -> dict[str, int]:
    """The ZeRO paper's model states per rank for mixed-precision AdamW (Rajbhandari et al. 2020,
    sec. 5.1-5.3): 16-bit parameters and gradients, fp32 master (4) and moments (8), each sharded
    from its stage on; s replaces Ψ/N with this rank's uneven share. `fp32_grads`: the Playbook's
    20Ψ, 2 + 4 bytes of gradient per parameter while gradients are whole (DeepSpeed's
    BF16_Optimizer), the 4-byte fp32 shard alone once they are partitioned."""
    if fp32_grads:
        grads = 6 * psi if stage < 2 else 4 * s
    else:
        grads = 2 * (psi if stage < 2 else s)
    return {"params": 2 * (psi if stage < 3 else s), "grads": grads,
            "master": 4 * (psi if stage == 0 else s), "optimizer": 8 * (psi if stage == 0 else s)}


def plan_of(strategy: str, **knobs) -> Plan:
    return Plan(zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp",
                **knobs)


def main() -> None:
    w, plain = world(Tracer()), world()
    failures, checks, loss_diffs = [], 0, {}

    def expect(ok: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(f"rank {w.rank}: {what}")

    for name, (dtype, overrides, strategies, tolerance) in RUNS.items():
        model = model_preset("tiny", dtype=dtype)
        train = TrainConfig(steps=4 if "overflow" in name else 3, batch_size=7, **overrides)
        ref = train_single_device(model, train)  # every rank: it needs no communication
        sizes = unit_sizes(model)
        psi = sum(sizes.values())
        s = sum(shard_sizes(n_u, w.size)[w.rank] for n_u in sizes.values())
        grad_dtype = "float32" if train.fp32_grads else dtype
        loss_diffs[name] = {}
        for knobs in strategies:
            knobs = {"strategy": knobs} if isinstance(knobs, str) else knobs
            strategy = knobs["strategy"]
            what = f"{name} {knobs}"
            w.tracer.clear()
            summary, par, run, _ = collect(model, train, DeviceMesh(w, {"dp": w.size}),
                                           plan_of(**knobs), plain=plain)
            state = {c: par.ledger.current[c] for c in STATES}
            want = paper_states(psi, s, STAGE[strategy], train.fp32_grads)
            expect(state == want, f"{what}: model states {state} != paper {want}")
            if strategy == "dp":
                total = sum(state.values())
                expect(total == (20 if train.fp32_grads else 16) * psi, f"{what}: DP holds {total} bytes")
            steps = [e for e in w.tracer.events if e.step is not None]  # the training steps'
            for e in steps:
                if e.tag == "loss":
                    want_dtype = "float64"
                elif e.tag.startswith("found_inf"):
                    want_dtype = "float32"
                    expect(e.shape == (1,) and e.op == "all_reduce", f"{what}: flag event {e}")
                elif ":params" in e.tag:  # all-gathers, and FSDP's prefetch rings
                    want_dtype = dtype
                else:
                    want_dtype = grad_dtype
                expect(e.dtype == want_dtype, f"{what}: {e.op} {e.tag} moved {e.dtype}, not {want_dtype}")
            flags = sum(e.tag.startswith("found_inf") for e in steps)
            want_flags = train.steps if dtype == "float16" and strategy != "dp" else 0
            expect(flags == want_flags, f"{what}: {flags} overflow flags exchanged, want {want_flags}")
            if w.rank == 0:
                memory_rows, expected_memory = (summary[k] for k in ("memory_peak_bytes",
                                                                     "expected_memory_peak_bytes"))
                expect(memory_rows == expected_memory,
                       f"{what}: peaks {[r for r in memory_rows if r not in expected_memory][:3]} differ "
                       f"from the closed form {[r for r in expected_memory if r not in memory_rows][:3]}")
                key = itemgetter("rank", "op")
                comm_rows, expected_comm = summary["comm_bytes"], summary["expected_comm_bytes"]
                expect(sorted(comm_rows, key=key) == sorted(expected_comm, key=key),
                       f"{what}: traced bytes {comm_rows} != closed form {expected_comm}")
            diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
            loss_diffs[name][" ".join(f"{v}" for v in knobs.values())] = diff
            expect(diff <= tolerance, f"{what}: loss rel diff {diff:.2e} > {tolerance:.2e}")
            scaling = run.loss_scaling or {"skipped_steps": [], "scales": []}
            every = plain.gather_object(scaling["skipped_steps"])
            if w.rank == 0:
                expect(all(k == ref.skipped_steps for k in every),
                       f"{what}: skipped steps per rank {every} != single device {ref.skipped_steps}")
            if "overflow" in name:
                expect(0 < len(ref.skipped_steps) < train.steps,
                       f"{what}: the forced overflow should skip some steps, not all: {ref.skipped_steps}")
                expect(scaling["scales"] == ref.loss_scales, f"{what}: scales {scaling['scales']}")
    reports = plain.gather_object((checks, failures))
    if w.rank == 0:
        print(json.dumps({"checks": sum(c for c, _ in reports),
                          "failures": [f for _, fs in reports for f in fs][:40],
                          "max_loss_rel_diff": loss_diffs}), flush=True)


if __name__ == "__main__":
    with abort_on_error(), np.errstate(over="ignore", invalid="ignore"):
        main()
