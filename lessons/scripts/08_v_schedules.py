"""Lesson 8: schedules at p = 4 ranks and m = 8 microbatches, simulated next to what their papers
publish, every pass through one stage 1 tick (F = B = W = 1).

    python lessons/scripts/08_v_schedules.py

peak: the busiest rank's stored activations in M_B, what one microbatch leaves on a 1F1B rank (a
quarter of the model); a V's stage holds half a rank's layers, so a microbatch on it M_B / 2.
Stored from F to W (or to the full B), the papers' count.
rate: the zero-bubble README's bubble rate, 1 - work / the longest span from a rank's first to its
last action; B is 1F1B's, (p-1)/(m+p-1).
idle: ticks the rank that idles most idles, over the step (DualPipe README's table) or between
its first and last action (the zero-bubble schedules, whose steps run back to back).
"""

from fractions import Fraction

from refpar.schedules import stage_map
from refpar.schedules.builders import build
from refpar.schedules.published import expected_v_bubble
from refpar.schedules.simulate import Costs, simulate, stored

p, m = 4, 8
unit = Costs(1, 1, 1)
B = (p - 1) / (m + p - 1)
# what the papers say, at p = 4, m = 8: (peak, rate, idle, idle between first and last action?)
PUBLISHED = {
    "1f1b": ("p = 4", f"B = {B:.4f}", (p - 1) * (1 + 2), False),  # DualPipe README: (PP-1)(F+B)
    "zb-h1": ("p = 4", f"B/3 = {B / 3:.4f}", (p - 1) * (1 + 2 - 2), False),  # (PP-1)(F+B-2W)
    "zbv": ("1x = 4", "0", 0, True),
    "v-half": ("(p+2)//2 = 3", f"B/2 = {B / 2:.4f}", expected_v_bubble(p, 6), True),
    "v-min": ("(p+4)//3 = 2", f"2B/3 = {2 * B / 3:.4f} + O(p)", expected_v_bubble(p, 4), True),
    # DualPipe README: (PP/2-1)(F&B+B-3W), F&B = F + B + W = 3 run one after the other, B = B + W = 2
    "dualpipev": ("(PP+1)/2 = 9/2", "-", (2 * p / 2 - 1) * (3 + 2 - 3), False),
    "dualpipe": ("PP+1 = 5", "-", (p / 2 - 1) * (3 + 2 - 3), False),
}

print(f"{'schedule':10} {'peak':>5} {'published':>15}   {'rate':>6} {'published':>20}   {'idle':>4} "
      f"{'published':>9}")
for kind, (peak_said, rate_said, idle_said, steady) in PUBLISHED.items():
    schedule = build(kind, p, m)
    lay = stage_map(schedule)
    share = Fraction(1, 2) if lay.n_stages == 2 * p and lay.copies == 1 else Fraction(1)
    peak = share * max(max(trace) for trace in stored(schedule).values())
    timeline = simulate(schedule, unit)
    span = max(timeline.busy_time(r) + timeline.inner_idle_time(r) for r in schedule)
    rate = 1 - timeline.busy_time(0) / span
    idle = max(map(timeline.inner_idle_time if steady else timeline.idle_time, schedule))
    print(f"{kind:10} {str(peak):>5} {peak_said:>15}   {rate:6.4f} {rate_said:>20}   {idle:4g} "
          f"{idle_said:9g}{'  (first to last action)' if steady else ''}")
