"""Every pipeline schedule at p = 4 ranks and m = 8 microbatches, trained on MPI: activation memory
and bubble simulated, measured and published, side by side (lesson 8's table with the runs added).

    mpiexec -n 4 python benchmarks/pipeline_schedules.py [--steps 2]

The model has 8 blocks, one sequence of 8 tokens per microbatch, so that a V's stage is one block
and a loop's (or DualPipe's part) two, and on the ranks that hold neither the embedding nor the
head every stage of a microbatch keeps the same bytes per block.

peak: rank 1's stored activations in M_B, what one microbatch leaves on a 1F1B rank (L/p = 2
blocks), from its F to its W (or to its full B). simulated: the replay of rank 1's list
(simulate.stored) in stage-microbatches, a V's stage being M_B / 2; measured: the run's ledger
peak over M_B, M_B measured on the 1F1B run (rank 1 holds p - 1 microbatches); published: the
papers' count for rank 1 (1F1B p - 1; ZB-H1 at most 1F1B's p, its W's kept a while longer; ZB-V
1x of 1F1B's p; V-Half (p+2)//2; V-Min (p+4)//3; DualPipe(V) PP+1 stages of its table).
rate: the zero-bubble README's bubble rate, 1 - rank 0's work / the longest span from a rank's
first to its last action. unit: simulated with every pass one tick; durations: simulated with the
durations the run measured for each action and free transfers (the bubble the schedule leaves
when its actions take what refpar's take); run: the executed last step (4 ranks sharing this
machine's cores, so inflated by waiting for a core); published: the zero-bubble README's, with
B = 1F1B's (p-1)/(m+p-1), F = B = W ("-": none stated for these costs). Prints, not pass/fail.
"""

from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # before NumPy loads: one thread per rank

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

P, M = 4, 8
B = (P - 1) / (M + P - 1)  # 1F1B's bubble rate
# kind -> (rank 1's published peak in M_B, the published rate)
PUBLISHED = {"1f1b": ("3", B), "zb-h1": ("<= 4", B / 3), "zbv": ("4", 0.0), "v-half": ("3", B / 2),
             "v-min": ("2", 2 * B / 3), "dualpipev": ("9/2", None), "dualpipe": ("5", None)}


def rate(timeline, schedule) -> float:
    span = max(timeline.busy_time(r) + timeline.inner_idle_time(r) for r in schedule)
    return 1 - timeline.busy_time(0) / span


def main(steps: int) -> None:
    from refpar.comm.communicator import abort_on_error, world
    from refpar.config import ModelConfig, TrainConfig
    from refpar.engine import Plan, parallelize, train
    from refpar.mesh import DeviceMesh
    from refpar.schedules import stage_map
    from refpar.schedules.simulate import simulate, stored

    model = ModelConfig(n_layer=8, dtype="float64")
    cfg = TrainConfig(steps=steps, batch_size=8, seq_len=8)
    with abort_on_error():
        comm = world()
        mesh = DeviceMesh(comm, {"pp": P})
        rows, M_B = [], None
        for kind in PUBLISHED:
            par = parallelize(model, cfg, mesh, Plan(schedule=kind, microbatches=M))
            run = train(par)
            peak = comm.all_gather(np.array([[par.ledger.peak["activations"]]]))[1, 0]  # rank 1's
            if kind == "1f1b":
                M_B = peak / (P - 1)
            schedule = par.executor.schedule
            lay = stage_map(schedule)
            share = Fraction(1, 2) if lay.n_stages == 2 * P and lay.copies == 1 else Fraction(1)
            simulated = share * max(stored(schedule)[1])
            rates = [rate(t, schedule) for t in (simulate(schedule), run.simulated, run.measured)]
            rows.append((kind, simulated, peak / M_B, PUBLISHED[kind][0], *rates, PUBLISHED[kind][1]))
        if comm.rank == 0:
            print(f"p={P}, m={M}: rank 1's peak activations in M_B, and the bubble rate")
            print(f"{'schedule':10} {'peak: simulated':>15} {'measured':>8} {'published':>9}   "
                  f"{'rate: unit':>10} {'durations':>9} {'run':>6} {'published':>9}")
            for kind, sim, meas, pub, unit, durations, executed, said in rows:
                print(f"{kind:10} {str(sim):>15} {meas:8.3g} {pub:>9}   {unit:10.4f} {durations:9.4f} "
                      f"{executed:6.4f} {'-' if said is None else f'{said:.4f}':>9}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps per schedule (default 2)")
    main(parser.parse_args().steps)
