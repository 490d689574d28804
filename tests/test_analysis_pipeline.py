"""The planner's pipeline closed forms agree with refpar's schedule simulator."""

import pytest

from refpar.analysis.step_time import pipeline_time
from refpar.schedules.builders import build
from refpar.schedules.simulate import Costs, simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1)]
# Qi et al. 2023 take F = B = W; Narayanan et al. 2021 a backward of twice the forward; the rest
# cover W > F and a dominant input gradient.
COSTS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (0.5, 1.0, 1.0)]


@pytest.mark.parametrize("kind, v", SCHEDULES)
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_closed_form_step_equals_the_simulated_makespan(kind, v, p, m):
    for F, B, W in COSTS:
        timeline = simulate(build(kind, p, m, v), Costs(F / v, B / v, W / v, 0.0))
        work, bubble, comm = pipeline_time(kind, p, m, F, B, W, 0.0, v)
        assert comm == 0
        assert work + bubble == pytest.approx(timeline.makespan, rel=1e-12), (F, B, W)


@pytest.mark.parametrize("kind, v", SCHEDULES)
def test_blocking_transfers_bound_the_simulated_ones(kind, v):
    p, m, F, B, W, p2p = 4, 8, 1.0, 1.0, 1.0, 0.1
    timeline = simulate(build(kind, p, m, v), Costs(F / v, B / v, W / v, p2p))
    work, bubble, comm = pipeline_time(kind, p, m, F, B, W, p2p, v)
    assert work + bubble < timeline.makespan <= work + bubble + comm


@pytest.mark.parametrize("gpus, model", [(64, "megatron-7.5b"), (32, "gpt2-xl")])
def test_a_plans_simulated_pipeline_is_its_predicted_one(gpus, model):
    # The planner's step = the pipeline's work + bubble (+ blocking transfers) + the rest; the
    # simulator, run on the same schedule with the plan's stage costs, lands in between.
    from refpar.analysis.hardware import HARDWARE
    from refpar.analysis.planner import plan
    from refpar.analysis.presets import PRESETS
    from refpar.analysis.timeline import plan_timeline

    result = plan(PRESETS[model], HARDWARE["a100"], gpus, global_batch=64, top=400)
    piped = [p for p in result["plans"] if p["mesh"]["pp"] > 1][:2]
    assert piped
    for p in piped:
        t = p["time_s"]
        closed = t["compute"] + t["tp"] + t["cp"] + t["ep"] + t["bubble"]
        makespan = plan_timeline(p).makespan
        assert closed * (1 - 1e-9) <= makespan <= closed + t["pp"]


@pytest.mark.parametrize("kind, v", SCHEDULES)
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_micro_batches_held_until_w_are_the_schedules_own_peaks(kind, v, p, m):
    # The memory model holds, on the first and the last stage, the activations of as many
    # micro-batches (in whole stages: an interleaved chunk is a v-th) as the schedule keeps
    # anything of, from F until W (tests/test_pipeline_analysis_agrees.py checks F until B).
    from refpar.analysis.scale import held_until_w
    from refpar.schedules.simulate import peak_inflight_microbatches

    if kind == "zb-h2" and m < 2 * p - 1:
        pytest.skip("the planner offers ZB-H2 only with m >= 2p - 1")
    peaks = peak_inflight_microbatches(build(kind, p, m, v))
    first, last = held_until_w(kind, p, m, v)
    assert (first, last) == (peaks[0] / v, peaks[p - 1] / v)
