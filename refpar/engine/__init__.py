"""The one engine: every mesh through one composition of the strategies.

    validate.py     validate: every check of a refpar.config.Plan (schedule, microbatches, sp, cp_algo,
                    zero, fsdp, ...) on a mesh, before any communication
    parallelize.py  the strategies applied to GPT-2 or Llama in one fixed order: Parallel
    train.py        THE training loop, `train`, for every mesh (the all-ones mesh included)
    checkpoint.py   what a rank holds as pieces of the global tensors: one save, one resume
    run.py          `refpar train` on this job's ranks: the mesh, --check's single device, parallelize,
                    train, every rank's measurements gathered, --trace's files
    report.py       the JSON summary: every rank's measurements next to the closed forms
    header.py       what rank 0 prints before the first step: what runs where
    lines.py        what rank 0 prints during and after: the step table, the closing lines
    runlog.py       --log, --tensorboard, the progress bar and --log-every's clock
"""

from refpar.config import Plan
from refpar.records import Run

from .parallelize import Parallel, parallelize
from .train import train
from .validate import validate

__all__ = ["Parallel", "Plan", "Run", "parallelize", "train", "validate"]
