"""Lesson 16, the capstone: plan a mesh for a memory budget, estimate it on paper, run it.

    refpar lesson check 16

The job: train the tiny GPT-2 (`refpar train`'s default: float64, 54,976 parameters, 4 blocks,
batch 8 x 16 tokens, AdamW) on 4 ranks, where no rank may hold more than 1,400,000 bytes: the sum of
its ledger's peaks (params, grads, master, optimizer, activations, comm), an upper bound on what it
holds at once. Among the plans that fit, choose one whose busiest rank sends the fewest bytes per
step. You may combine pipeline (pp, with the 1F1B schedule and m microbatches), data (dp, with ZeRO
stage 0-3) and tensor (tp) parallelism; pp x dp x tp = 4.

Then estimate, on paper, with the formulas of lessons 2-8, for rank 0 and one step: its model states
(params + grads + master + optimizer, held between steps), its activations peak, and the bytes it
sends on each axis. The checker accepts estimates within 5% of the closed forms, runs your plan on 4
ranks with --check and shows you the exact figures beside yours.
"""


def plan() -> dict:
    """{"mesh": {"pp": ..., "dp": ..., "tp": ...}, "zero": 0-3, "microbatches": m}"""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write plan(), estimate() and WHY: a mesh for 4 ranks under 1,400,000 bytes "
                              "each that sends the fewest bytes")
    # ---- end of your part -----------------------------------------------------------------------


def estimate() -> dict:
    """Rank 0, one step: {"model_states": bytes, "activations": bytes, "sent": {"pp": ..., "dp": ...,
    "tp": ...}} (bytes sent on each axis, 0 where the axis has size 1)."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write estimate()")
    # ---- end of your part -----------------------------------------------------------------------


# A few sentences: why this plan, and what it gives up (memory, bytes, the pipeline's bubble).
WHY = ""
