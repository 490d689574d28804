"""Several answers to the course's exercises graded in one MPI launch, each as `refpar lesson check N
--file PATH` grades it (lessons/checks.py: every rank runs the checker, rank 0 combines the verdicts);
rank 0 prints one JSON line, {PATH: "passed: ..." or "not yet: ..."}.

    mpiexec -n 2 python tests/jobs/lesson_wrong_attempts.py N PATH [N PATH ...]

Only answers that finish on every rank belong here (wrong values, wrong collectives): a rank left
waiting would leave the next answer's messages to the wrong call.
"""

import json
import sys
from pathlib import Path

from lessons.checks import EXERCISES, WAIT_S, _combine, _verdict
from refpar.comm.communicator import world

comm, gather = world(timeout=WAIT_S), world(timeout=3 * WAIT_S)
said = {}
for n, path in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
    ex = EXERCISES[int(n)]
    assert ex.ranks == comm.size, f"exercise {n} runs on {ex.ranks} ranks, this job on {comm.size}"
    verdicts = gather.gather_object(_verdict(ex, Path(path), comm))
    if comm.rank == 0:
        ok, sentence = _combine(verdicts, WAIT_S, ex.hint)
        said[path] = ("passed: " if ok else "not yet: ") + sentence
if comm.rank == 0:
    print(json.dumps(said))
