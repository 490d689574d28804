"""The planner's pipeline closed forms (refpar.analysis) agree with the schedules the executor runs:
the makespan of every schedule, and the microbatches whose full activations the first and the last
stage hold at the peak."""

import numpy as np
import pytest

from refpar.analysis.scale import in_flight
from refpar.analysis.step_time import pipeline_time
from refpar.schedules.builders import build
from refpar.schedules.simulate import Costs, simulate, stored

KINDS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]
SHAPES = [(2, 4), (3, 9), (4, 8), (4, 12)]  # m >= 2p - 1, where ZB-H2's closed form holds


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("F, B, W", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2), (1, 2, 0.5)])
def test_analysis_pipeline_time_is_the_simulated_makespan(kind, F, B, W):
    for p, m in SHAPES:
        v = 2 if kind == "interleaved-1f1b" else 1
        # a chunk of an interleaved stage takes a v-th of the stage's time
        timeline = simulate(build(kind, p, m, v), Costs(F / v, B / v, W / v))
        work, bubble, _ = pipeline_time(kind, np.array(p), np.array(m), F, B, W, 0.0, v)
        assert timeline.makespan == pytest.approx(float(work + bubble), rel=1e-12), (p, m)


@pytest.mark.parametrize("kind", KINDS)
def test_analysis_in_flight_is_the_simulated_full_activation_peak(kind):
    # Full activations are held from F until B. What a split backward keeps from B until W (the
    # linear layers' inputs and output gradients) is not counted by `in_flight`: ZB-H1's last
    # stage, for one, holds 1 full activation but up to p microbatches' W inputs.
    for p, m in SHAPES:
        v = 2 if kind == "interleaved-1f1b" else 1
        peak = stored(build(kind, p, m, v), lambda a: 1, lambda a: 0)
        first, last = in_flight(kind, np.array(p), np.array(m), v)
        # an interleaved chunk holds a v-th of a stage's layers
        assert max(peak[0]) / v == pytest.approx(float(first)), (p, m)
        assert max(peak[p - 1]) / v == pytest.approx(float(last)), (p, m)
