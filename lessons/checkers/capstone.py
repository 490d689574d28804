"""Lesson 16's checker, the capstone: the learner's plan for the tiny GPT-2 on 4 ranks is refused if
refpar refuses it, if a rank's peaks add up to more than the budget, or if another plan that fits sends
fewer bytes from its busiest rank (all of them priced by refpar/analysis/closed_forms.py, which
tests/test_*closed*.py hold to the measured runs); then the learner's paper estimates for rank 0 are
compared with the closed forms, and the plan is run on 4 ranks with --check: the run must match one
device and its bytes and memory must be the closed forms'."""

from __future__ import annotations

import functools
import json
import subprocess

from lessons.checkers.common import Wrong
from lessons.course import ROOT, argv, command_env
from refpar.analysis import closed_forms as cf
from refpar.config import ConfigError, Plan, TrainConfig, model_preset

RANKS = 4
BUDGET = 1_400_000  # bytes: the sum of a rank's peaks
# Estimates on paper are accepted within 5%: a grading choice, so that an estimate which leaves out a
# term the lessons name but the exercise does not stress (the loss's 8 bytes, the head's tied embedding)
# still passes, while a wrong model (a missing category, the wrong schedule's activations) does not.
WITHIN = 0.05
AXES = ("pp", "dp", "tp")
# `refpar plan`'s view of the same job: the tiny GPT-2 as a --model-spec, on H100s given the budget as
# their memory (the H100 preset's other figures, refpar/analysis/hardware.py), priced in float64
PLANNER = ("--model-spec layers=4,hidden=32,heads=4,vocab=96,seq=16 --gpus 4 --global-batch 8 --precision "
           "float64 --hardware-spec memory=0.0014,flops=989.5,hbm=3350,nvlink=450,ib=50,gpus_per_node=8")


def _sizes(mesh: dict) -> dict:
    return {"pp": mesh.get("pp", 1), "dp": mesh.get("dp", 1), "ep": 1, "cp": 1, "tp": mesh.get("tp", 1)}


def _coords(sizes: dict, rank: int) -> dict:
    dp, tp = sizes["dp"], sizes["tp"]
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "ep": 0, "cp": 0, "tp": rank % tp}


def _plan(zero: int, m: int, pp: int) -> Plan:
    return Plan(zero=zero, microbatches=m, schedule="1f1b" if pp > 1 else None)


def _figures(model, cfg, sizes: dict, plan: Plan) -> tuple[list[int], list[int]]:
    """Every rank's sum of peaks and bytes sent per step, from the closed forms."""
    peaks, sent = [], []
    for r in range(RANKS):
        c = _coords(sizes, r)
        peaks.append(sum(row["bytes"] for row in cf.rank_memory_rows(model, cfg, sizes, c, plan)))
        sent.append(sum(s for s, _ in cf.rank_comm_bytes(model, cfg, sizes, c, plan).values()))
    return peaks, sent


def _candidates(model, cfg):
    from refpar.engine.validate import validate

    meshes = [(a, b, RANKS // (a * b)) for a in (1, 2, 4) for b in (1, 2, 4) if RANKS % (a * b) == 0]
    for pp, dp, tp in meshes:
        for zero in (0, 1, 2, 3) if dp > 1 else (0,):
            for m in (1, 2, 4) if pp > 1 else (1,):
                sizes, plan = _sizes({"pp": pp, "dp": dp, "tp": tp}), _plan(zero, m, pp)
                try:
                    validate(model, cfg, sizes, plan)
                except ConfigError:
                    continue
                yield sizes, plan


@functools.cache
def _fitting_plans_sent() -> tuple[int, ...]:
    """The busiest rank's bytes per step of every plan that refpar accepts and that fits the budget."""
    model, cfg = model_preset("tiny"), TrainConfig(steps=1)
    return tuple(max(sent) for sizes, plan in _candidates(model, cfg)
                 for peaks, sent in [_figures(model, cfg, sizes, plan)] if max(peaks) <= BUDGET)


def _read_plan(mod) -> tuple[dict, int, int]:
    chosen = mod.plan()
    if not isinstance(chosen, dict) or set(chosen) != {"mesh", "zero", "microbatches"}:
        raise Wrong("plan() must return {'mesh': {'pp': ..., 'dp': ..., 'tp': ...}, 'zero': ..., "
                    f"'microbatches': ...}}; it returned {chosen!r}")
    mesh, zero, m = chosen["mesh"], chosen["zero"], chosen["microbatches"]
    if not isinstance(mesh, dict) or not set(mesh) <= set(AXES) or \
            not all(isinstance(v, int) and v >= 1 for v in mesh.values()):
        raise Wrong(f"plan()['mesh'] must give whole sizes for pp, dp and tp; it is {mesh!r}")
    ranks = mesh.get("pp", 1) * mesh.get("dp", 1) * mesh.get("tp", 1)
    if ranks != RANKS:
        raise Wrong(f"your mesh {mesh} has {ranks} ranks; the job has {RANKS}")
    return _sizes(mesh), zero, m


def _mesh_text(sizes: dict) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1)


def _estimates(mod, model, cfg, sizes, plan) -> str:
    guess = mod.estimate()
    c = _coords(sizes, 0)
    sent = {a: 0 for a in AXES}
    for (axis, _), (s, _) in cf.rank_comm_bytes(model, cfg, sizes, c, plan).items():
        sent[axis] = sent.get(axis, 0) + s
    want = {"model_states": cf.model_state_bytes(model, cfg, sizes, c, plan),
            "activations": cf.activation_peak(model, cfg, sizes, c, plan)}
    if not isinstance(guess, dict) or set(guess) != {"model_states", "activations", "sent"} or \
            not isinstance(guess["sent"], dict):
        raise Wrong("estimate() must return {'model_states': bytes, 'activations': bytes, 'sent': {'pp': "
                    f"bytes, 'dp': bytes, 'tp': bytes}}}}; it returned {guess!r}")
    why = {"model_states": "lesson 2 (bytes per parameter) and lesson 4 (what ZeRO's stage shards), on the "
                           "parameters of rank 0's stage only",
           "activations": "lesson 2's block and embedding, for the rows of one microbatch, times the "
                          "microbatches 1F1B keeps in flight on rank 0 (lesson 8)",
           "sent": "lessons 3-8's bytes per collective on each axis"}
    pairs = [(k, guess[k], want[k]) for k in want] + [(f"sent on {a}", guess["sent"].get(a, 0), sent[a])
                                                     for a in AXES]
    for name, got, right in pairs:
        if not isinstance(got, int | float) or abs(got - right) > WITHIN * right:
            off = f"{(got - right) / right:+.0%} off" if right and isinstance(got, int | float) else "not it"
            raise Wrong(f"your estimate of rank 0's {name.replace('_', ' ')}, {got!r}, is {off} the closed "
                        f"form's {right:,} (5% passes): see {why[name if name in why else 'sent']}")
    return ", ".join(f"{n.replace('_', ' ')} {g:,} | {r:,}" for n, g, r in pairs)


def _run(sizes: dict, plan: Plan) -> dict:
    cmd = (f"mpiexec -n {RANKS} python -m refpar train --mesh {_mesh_text(sizes)} --steps 1 --check --json"
           + (f" --zero {plan.zero}" if plan.zero else "")
           + (f" --schedule 1f1b --microbatches {plan.microbatches}" if sizes["pp"] > 1 else ""))
    proc = subprocess.run(argv(cmd), cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise Wrong(f"`{cmd}` failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return {"command": cmd, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _planner(sizes: dict, plan: Plan, peaks: list[int], sent: list[int]) -> str:
    """What `refpar plan` says of the same plan (pure Python, under a second): its memory per GPU and the
    bytes a rank sends, beside the ledger's, and where its own ranking, by predicted seconds, puts it."""
    from refpar.analysis.hardware import parse_hardware_spec
    from refpar.analysis.planner import plan as rank_plans
    from refpar.analysis.planner import price
    from refpar.analysis.presets import parse_model_spec

    spec = parse_model_spec(PLANNER.split()[1])
    hw = parse_hardware_spec(PLANNER.split()[-1])
    micro_batch = 8 // (sizes["dp"] * plan.microbatches)
    mesh = {"dp": sizes["dp"], "tp": sizes["tp"], "pp": sizes["pp"], "cp": 1, "ep": 1}
    common = dict(global_batch=8, seq=16, precision="float64")
    priced = price(spec, hw, RANKS, mesh, zero=plan.zero, micro_batch=micro_batch, **common)
    ranked = rank_plans(spec, hw, RANKS, top=1, priced=priced, **common)
    best = ranked["plans"][0]
    best_text = (",".join(f"{a}={v}" for a, v in best["mesh"].items() if v > 1) + f" ZeRO-{best['zero']} "
                 f"micro-batch {best['micro_batch']} recompute {best['recompute']}")
    cmd = (f"refpar plan {PLANNER} --mesh {_mesh_text(sizes)}" + (f" --zero {plan.zero}" if plan.zero else "")
           + f" --micro-batch {micro_batch}")
    memory, sends = sum(priced["memory_bytes"].values()), sum(priced["comm_bytes"].values())
    return (f"`{cmd}` prices it at {memory:,.0f} bytes per GPU (the ledger's busiest rank: {max(peaks):,}) "
            f"and {sends:,.0f} bytes sent per step by its first stage's rank (the run's busiest: "
            f"{max(sent):,}), and ranks it {ranked['rank']} of the {ranked['fitting']} plans it fits under "
            f"the budget by predicted seconds; its fastest: {best_text}")


def check_16(mod, comm) -> str:
    model, cfg = model_preset("tiny"), TrainConfig(steps=1)
    sizes, zero, m = _read_plan(mod)
    plan = _plan(zero, m, sizes["pp"])
    from refpar.engine.validate import validate

    try:
        validate(model, cfg, sizes, plan)
    except ConfigError as err:
        raise Wrong(f"refpar refuses your plan: {err}") from None
    peaks, sent = _figures(model, cfg, sizes, plan)
    if max(peaks) > BUDGET:
        r = peaks.index(max(peaks))
        rows = cf.rank_memory_rows(model, cfg, sizes, _coords(sizes, r), plan)
        said = ", ".join(f"{row['category']} {row['bytes']:,}" for row in rows if row["bytes"])
        raise Wrong(f"your plan's rank {r} peaks at {max(peaks):,} bytes ({said}), over the budget of "
                    f"{BUDGET:,}: which category is largest there, and which strategy divides it?")
    fewer = [s for s in _fitting_plans_sent() if s < max(sent)]
    if fewer:
        raise Wrong(f"your plan fits (at most {max(peaks):,} bytes on a rank), and its busiest rank sends "
                    f"{max(sent):,} bytes per step; another plan on {RANKS} ranks fits too and sends "
                    f"{min(fewer):,}: which axis moves the fewest bytes for the memory it saves, and what "
                    "keeps its activations in the budget?")
    if not isinstance(getattr(mod, "WHY", None), str) or len(mod.WHY.split()) < 20:
        raise Wrong("write WHY: a few sentences (20 words or more) on why this plan, and what it gives up")
    estimates = _estimates(mod, model, cfg, sizes, plan)
    run = _run(sizes, plan)
    def rows(key: str, fields: tuple) -> list:
        return sorted(tuple(row[f] for f in fields) for row in run[key])

    comm_fields = ("rank", "axis", "op", "bytes_sent", "bytes_recv")
    memory_fields = ("rank", "category", "bytes")
    if rows("comm_bytes", comm_fields) != rows("expected_comm_bytes", comm_fields) or \
            rows("memory_peak_bytes", memory_fields) != rows("expected_memory_peak_bytes", memory_fields) or \
            max(run["max_loss_rel_diff"], run["max_param_rel_diff"]) > 1e-10:
        raise Wrong(f"`{run['command']}` did not match its closed forms or one device: please report it, "
                    "with your plan")
    return (f"{_mesh_text(sizes)}, ZeRO-{zero}, {m} microbatches: every rank under {BUDGET:,} bytes (at "
            f"most {max(peaks):,}), the busiest sends {max(sent):,} bytes per step, no plan that fits sends "
            f"fewer; rank 0, your estimate | the closed form: {estimates}; `{run['command']}` matched one "
            f"device (loss rel diff {run['max_loss_rel_diff']:.1e}, parameters "
            f"{run['max_param_rel_diff']:.1e}) and its bytes and memory were the closed forms'; "
            + _planner(sizes, plan, peaks, sent))
