"""A plan's pipeline, action by action: refpar's schedule builders timed with the plan's costs.

`refpar plan` ranks with the closed forms of step_time.pipeline_time; this runs the schedule
itself through `simulate.simulate`, with each micro-batch's forward, input-gradient,
weight-gradient and transfer times from the FLOPs and the hardware (`stage_costs_s` of a plan),
so the app can draw where each rank idles. The simulator walks every action: a 64-stage,
384-micro-batch 1F1B takes seconds, so it is run for a plan being looked at, not in the search.
"""

from __future__ import annotations

from refpar.schedules.builders import build
from refpar.schedules.simulate import Costs, Timeline, simulate


def plan_timeline(plan: dict) -> Timeline:
    """The timeline of one plan of `planner.plan(...)["plans"]` (one stage: a single rank)."""
    p, m, v = plan["mesh"]["pp"], plan["microbatches"], plan["chunks"]
    kind = "1f1b" if plan["schedule"] == "none" else plan["schedule"]
    c = plan["stage_costs_s"]
    # A chunk of an interleaved stage holds a v-th of its layers: a v-th of each cost.
    return simulate(build(kind, p, m, v), Costs(c["F"] / v, c["B"] / v, c["W"] / v, c["p2p"]))
