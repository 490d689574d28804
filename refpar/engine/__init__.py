"""The one engine: every mesh through one composition of the strategies.

    plan.py         validate: every check of a refpar.config.Plan (schedule, microbatches, sp, cp_algo,
                    zero, fsdp, ...) on a mesh, before any communication
    parallelize.py  the strategies applied to GPT-2 in one fixed order: Parallel
    train.py        THE training loop, `train`, for every mesh (the all-ones mesh included)
    checkpoint.py   what a rank holds as pieces of the global tensors: one save, one resume
    report.py       one report, printed and --json: every rank's measurements next to the closed forms
    lines.py        what rank 0 prints of it
"""

from refpar.config import Plan

from .parallelize import Parallel, parallelize
from .plan import validate
from .train import Run, train

__all__ = ["Parallel", "Plan", "Run", "parallelize", "train", "validate"]
