"""Run by tests/test_pipeline_executor.py under `mpiexec -n P python tests/pipeline_checks.py CASES`:
trains with every schedule in CASES on a pp=P mesh and prints, on rank 0, one JSON line per case
with the differences from the single-device run, the activation peaks next to the replay of the
schedule, and the measured, simulated and bounding times of the last step.

CASES is a JSON list of [kind, microbatches, chunks]."""

import json
import sys

import numpy as np

from refpar.comm.communicator import abort_on_error, world
from refpar.comm.trace import Tracer
from refpar.config import ModelConfig, TrainConfig
from refpar.mesh import DeviceMesh
from refpar.model.data import MarkovCorpus
from refpar.model.gpt import init_params
from refpar.parallel.pipeline.runner import (
    expected_comm_rows,
    microbatch_bytes,
    microbatches,
    run_pipeline,
)
from refpar.parallel.pipeline.schedules import critical_path_gap, stored
from refpar.parallel.pipeline.stage import Stage
from refpar.trainer import train_single_device
from tests.numerics import rel_diff

# 8 blocks so that p=4 ranks x v=2 chunks get one block per stage; dropout on, so every mask must
# be drawn by global sample id and global layer to match.
MODEL = ModelConfig(n_layer=8, dropout=0.1, dtype="float64")
TRAIN = TrainConfig(steps=3, batch_size=8, seq_len=8, seed=7)


def main(cases) -> None:
    comm = world(Tracer())
    mesh = DeviceMesh(comm, {"pp": comm.size})
    reference = train_single_device(MODEL, TRAIN)
    params0 = init_params(MODEL, TRAIN.seed)
    corpus = MarkovCorpus(MODEL.vocab_size, TRAIN.seed)
    tokens, targets = corpus.batch(0, range(TRAIN.batch_size), TRAIN.seq_len)
    for kind, m, v in cases:
        comm.tracer.clear()  # each case's bytes alone
        run = run_pipeline(MODEL, TRAIN, mesh, kind, m, v)
        diff = max(rel_diff(p, reference.params[n]) for n, p in run.params.items())
        mbs = microbatches(tokens, targets, 0, m)
        ex = run.executor
        n_stages = ex.layout.n_stages
        # measured apart from the run: one stage on one microbatch of zeros, here
        sizes = {(s, i): microbatch_bytes(Stage(MODEL, n_stages, s), len(mbs[i].sample_ids), MODEL,
                                          TRAIN, params0)
                 for s in range(n_stages) for i in range(m)}
        replay = stored(ex.schedule, lambda a, sizes=sizes: sizes[a.stage, a.microbatch][0],
                        lambda a, sizes=sizes: sizes[a.stage, a.microbatch][1])[ex.rank]
        mine = np.array([[diff, run.ledger.peak["activations"], max(replay),
                          sizes[min(ex.stages), 0][0]]])
        every = comm.all_gather(mine)
        expected = {(e["axis"], e["op"]): (e["bytes_sent"], e["bytes_recv"])
                    for e in expected_comm_rows(MODEL, TRAIN, {"pp": comm.size, "dp": 1}, m, v)
                    if e["rank"] == comm.rank}
        traced = {key: run.tracer.totals().get(key) for key in expected}
        bytes_ok = comm.all_reduce(np.array([float(traced == expected)]), op="min")[0] == 1.0
        if comm.rank == 0:
            print(json.dumps({
                "kind": kind, "m": m, "v": v,
                "losses": run.losses, "reference_losses": reference.losses,
                "max_param_rel_diff": float(every[:, 0].max()),
                "traced_bytes_equal_closed_form": bool(bytes_ok),
                "activation_peak": every[:, 1].astype(int).tolist(),
                "replayed_peak": every[:, 2].astype(int).tolist(),
                "bytes_per_microbatch": every[:, 3].astype(int).tolist(),
                "measured_makespan": run.measured.makespan,
                "simulated_makespan": run.simulated.makespan,
                "gap": critical_path_gap(run.measured, ex.schedule),
                "measured_bubble": run.measured.bubble_fraction,
                "simulated_bubble": run.simulated.bubble_fraction,
            }), flush=True)


if __name__ == "__main__":
    with abort_on_error():
        main(json.loads(sys.argv[1]))
