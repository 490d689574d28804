"""The Whole mesh view (refpar/viz/mesh_grid.py) held against a real run of the engine: what it says
each rank holds and moves must be what the run's ledger measured and its trace recorded."""

from __future__ import annotations

import json
from pathlib import Path

from refpar.comm import cost
from refpar.viz import mesh_grid

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def assert_mesh_view_matches_the_run(s: dict, model, cfg, plan, trace: Path | None = None) -> None:
    """`s`: the run's --json summary (every step alike: float64, no fp16 skips); `trace`: its
    --trace file, whose JSON lines hold every message with the pass ("fwd", "bwd") it was sent in."""
    sizes, steps = s["mesh"], len(s["losses"])
    events = ([json.loads(x) for x in trace.with_name(trace.name + ".jsonl").read_text().splitlines()]
              if trace is not None else [])
    for rank in range(s["world_size"]):
        facts = mesh_grid.rank_facts(model, cfg, sizes, plan, rank)
        measured = {r["category"]: r["bytes"] for r in s["memory_peak_bytes"] if r["rank"] == rank}
        assert facts.memory == measured, (rank, facts.memory, measured)
        moments = mesh_grid.step_moments(model, cfg, sizes, plan, rank)
        drawn: dict = {}
        for m in moments:
            for c in m.calls:
                cost.add(drawn, (c["axis"], c["op"]), (c["bytes_sent"], c["bytes_recv"]), steps)
        sent = {(r["axis"], r["op"]): (r["bytes_sent"], r["bytes_recv"]) for r in s["comm_bytes"]
                if r["rank"] == rank}
        assert {k: v for k, v in drawn.items() if v != (0, 0)} == sent, rank
        # the forward's and the backward's collectives, as the trace saw them in each pass of step 0
        for label, phase in (("forward", "fwd"), ("backward", "bwd")):
            moment = next(m for m in moments if m.label == label)
            want: dict = {}
            for c in moment.calls:
                if c["op"] in COLLECTIVES and c["axis"] != "pp":
                    cost.add(want, (c["axis"], c["op"]), (c["bytes_sent"], c["bytes_recv"]))
            seen: dict = {}
            for e in events:  # the pipeline's messages are tagged by microbatch, not by pass
                if (e["rank"], e["step"], e["phase"]) == (rank, 0, phase) and e["op"] in COLLECTIVES \
                        and e["axis"] != "pp":
                    cost.add(seen, (e["axis"], e["op"]), (e["bytes_sent"], e["bytes_recv"]))
            if trace is not None:
                assert seen == want, (rank, label, seen, want)
