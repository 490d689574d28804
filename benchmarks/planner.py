"""How fast the planner searches and prices, and the calibration fit rerun from scratch.

    python benchmarks/planner.py          # search and price timings
    python benchmarks/planner.py --fit    # also rerun calibration.fit() (about a minute)

Prints times, not pass/fail. The search is megatron-1t on 4,096 H100s (the issue's budget: under
2 s); pricing is one given plan, Megatron-LM's published tp=8, pp=64, dp=6 on 3,072 A100s (under
0.1 s), and its rank among the searched plans (one more search). Each is the best of `--repeat`
runs after one warm-up, in wall-clock and in this process's CPU time (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time

from refpar.analysis.calibration import fit, fit_error, validate
from refpar.analysis.efficiency import CALIBRATED, MEGATRON_2021
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.planner import parse_mesh, plan, price
from refpar.analysis.presets import PRESETS


def best_of(repeat: int, work) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of `repeat` calls, after one warm-up call."""
    work()
    times = []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fit", action="store_true", help="rerun calibration.fit() from its grid")
    args = parser.parse_args()

    one_t, h100, a100 = PRESETS["megatron-1t"], HARDWARE["h100"], HARDWARE["a100"]
    wall, cpu = best_of(args.repeat, lambda: plan(one_t, h100, 4096))
    result = plan(one_t, h100, 4096)
    print(f"search megatron-1t on 4096 h100: {wall:.3f} s wall, {cpu:.3f} s CPU "
          f"({result['candidates']:,} candidates, {result['fitting']:,} fit)")

    mesh = parse_mesh("tp=8,pp=64,dp=6", 3072)
    options = dict(schedule="interleaved-1f1b", chunks=2, recompute="full", precision="bf16-fp32-accum",
                   software=MEGATRON_2021)
    wall, cpu = best_of(args.repeat, lambda: price(one_t, a100, 3072, mesh, **options))
    priced = price(one_t, a100, 3072, mesh, **options)
    print(f"price tp=8,pp=64,dp=6 on 3072 a100: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU "
          f"(step {priced['step_time_s']:.2f} s)")
    ranked = {}

    def rank():
        ranked.update(plan(one_t, a100, 3072, top=1, precision="bf16-fp32-accum", software=MEGATRON_2021,
                           priced=priced))

    wall, cpu = best_of(args.repeat, rank)
    print(f"its rank among the searched: {ranked['rank']} of {ranked['fitting']:,} "
          f"({wall:.3f} s wall, {cpu:.3f} s CPU)")
    wall, cpu = best_of(1, validate)
    print(f"validate, {len(validate()['rows'])} published runs: {wall:.2f} s wall, {cpu:.2f} s CPU")

    if args.fit:
        start = time.perf_counter()
        fitted, error = fit()
        print(f"fit: {fitted} with largest fit-row error {error:.4f} in {time.perf_counter() - start:.0f} s; "
              f"stored {CALIBRATED} gives {fit_error(CALIBRATED):.4f}")


if __name__ == "__main__":
    main()
