"""Typical wrong attempts at the course's exercises, each refused by its checker with a sentence that
teaches: what the answer got, what refpar measures, and which idea of the lesson it missed. One
process each (the answer is graded in this process, as `refpar lesson check N` does for them)."""

from __future__ import annotations

import pytest

from lessons import course as lessons
from lessons.checks import EXERCISES, check


def _wrong(n: int, tmp_path, old: str, new: str):
    """The reference solution of exercise n with `old` replaced by `new`: one typical mistake."""
    solution = (lessons.LESSONS / "solutions" / EXERCISES[n].file).read_text()
    assert solution.count(old) == 1, old
    path = tmp_path / EXERCISES[n].file
    path.write_text(solution.replace(old, new))
    return path


def _told(n: int, path, capsys) -> str:
    assert check(n, path) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"lesson {n}: not yet: "), out
    return out[len(f"lesson {n}: not yet: "):].strip()


# ------------------------------------------------------------------------------------- lesson 2
@pytest.mark.parametrize("old, new, told", [
    # the paper's equation 1 as printed: 2-byte activations, 1-byte masks
    ("return paper + square + rstd + tanh", "return B * T * C * (34 + 5 * heads * T // C)",
     "block_activation_bytes(B=8, T=16, C=32, heads=4, e=8) = 180,224; the ledger measures 919,552 for one "
     "block (float64); that is Korthikanti et al.'s sbh (34 + 5as/h), the paper's 2-byte count with 1-byte "
     "masks, not what refpar keeps"),
    # the paper's list, forgetting what refpar's GELU keeps
    ("return paper + square + rstd + tanh", "return paper + square + rstd",
     "block_activation_bytes(B=8, T=16, C=32, heads=4, e=8) = 788,480; the ledger measures 919,552 for one "
     "block (float64); you are short by exactly the GELU's tanh, one (B, T, 4C) array"),
    # one moment instead of AdamW's two
    ('"master": 0, "optimizer": 16 * psi', '"master": 0, "optimizer": 8 * psi',
     "optimizer for Ψ = 54,976 in float64: 439,808 (8 bytes per parameter), the ledger measures 879,616 (16 "
     "per parameter). AdamW keeps two moments per parameter"),
    # mixed precision without its master copy
    ('"master": 4 * psi, "optimizer": 8 * psi', '"master": 0, "optimizer": 8 * psi',
     "master for Ψ = 54,976 in bf16-mixed: 0 (0 bytes per parameter), the ledger measures 219,904 (4 per "
     "parameter). Which of the four needs a copy in another format when the weights are 16-bit?"),
], ids=["paper-at-2-bytes", "no-gelu-tanh", "one-moment", "no-master-copy"])
def test_lesson_2_wrong_memory_counts_are_told_the_missing_term(tmp_path, capsys, old, new, told):
    assert _told(2, _wrong(2, tmp_path, old, new), capsys) == told


# ------------------------------------------------------------------------------------- lesson 5
@pytest.mark.parametrize("old, new, told", [
    # every step of the ring sending the whole buffer
    ("(alpha + nbytes / p / bandwidth)", "(alpha + nbytes / bandwidth)",
     "ring_all_reduce_seconds(439,808 B, p=2, alpha=5e-06 s, bandwidth=1e+10 B/s) = 9.79616e-05 s; "
     "refpar's cost model gives 5.39808e-05 s; that is 2 (p-1) messages of the whole buffer: each step "
     "of the ring moves one chunk, n/p bytes"),
    # a reduce-scatter's time
    ("return 2 * (p - 1) *", "return (p - 1) *",
     "ring_all_reduce_seconds(439,808 B, p=2, alpha=5e-06 s, bandwidth=1e+10 B/s) = 2.69904e-05 s; "
     "refpar's cost model gives 5.39808e-05 s; that is a reduce-scatter's time (or an all-gather's): the "
     "all-reduce is both, one after the other"),
    # compute and memory added, not overlapped
    ("return max(compute, memory)", "return compute + memory",
     "gemm_seconds(M=4096, N=4096, K=4096, 2-byte elements) on an H100 = 0.000168946 s; the roofline gives "
     "0.000138897 s (compute bound); that is compute plus memory: a GEMM reads and writes while it "
     "multiplies, so the slower of the two sets its time"),
    # MFU over one GPU's peak
    ("n_gpus * peak_flops)", "peak_flops)",
     "mfu(1.68e+17 FLOPs, 9.1 s, 512 GPUs, peak 9.895e+14) = 18.6574; PaLM's definition gives 0.0364403; "
     "that is the model FLOPs over one GPU's peak: the step ran on every GPU of the job"),
], ids=["whole-buffer-per-step", "reduce-scatter-only", "compute-plus-memory", "one-gpu-peak"])
def test_lesson_5_wrong_times_are_told_which_formula_they_are(tmp_path, capsys, old, new, told):
    assert _told(5, _wrong(5, tmp_path, old, new), capsys) == told


# ------------------------------------------------------------------------------------- lesson 9
@pytest.mark.parametrize("old, new, told", [
    # the spans' lengths added: the isend and irecv of one round counted twice
    ("_covered([(s, e) for s, e, _ in messages])", "sum(e - s for s, e, _ in messages)",
     "in_flight = 5.9 s for 'the isend and irecv of one ring round, posted together, one wait'; the spans "
     "give 3 s: the spans' lengths add up to 5.9 s, but two messages in flight at the same moment are one "
     "moment of communication"),
    # only the waits: a blocking call's whole span forgotten
    ("_covered([(s, e) for s, e, blocking in messages if blocking] + list(waits))", "_covered(list(waits))",
     "exposed = 0 s for 'one blocking all-reduce after the backward'; the spans give 4 s: a blocking call "
     "blocks the rank for its whole span, a non-blocking message only while the rank waits for it"),
    # a sweep that assumes the spans come sorted
    ("for start, end in sorted(spans):", "for start, end in spans:",
     "in_flight = 2.9 s for 'the isend and irecv of one ring round, posted together, one wait' (the same "
     "spans, listed in another order); the spans give 3 s: is every moment that some message covers counted, "
     "once?"),
], ids=["lengths-added", "waits-only", "unsorted-sweep"])
def test_lesson_9_wrong_splits_are_told_which_span_they_miscount(tmp_path, capsys, old, new, told):
    assert _told(9, _wrong(9, tmp_path, old, new), capsys) == told


# ------------------------------------------------------------------------------------- lesson 16
@pytest.mark.parametrize("old, new, told", [
    # plain data parallelism: the simplest plan, four copies of everything
    ('{"pp": 2, "dp": 2, "tp": 1}, "zero": 1, "microbatches": 4', '{"dp": 4}, "zero": 0, "microbatches": 1',
     "your plan's rank 0 peaks at 3,270,144 bytes (params 439,808, grads 541,440, optimizer 879,616, "
     "activations 969,472, comm 439,808), over the budget of 1,400,000: which category is largest there, and "
     "which strategy divides it?"),
    # a plan that fits, with tensor parallelism's all-reduces instead of ZeRO-1's data parallelism
    ('{"pp": 2, "dp": 2, "tp": 1}, "zero": 1', '{"pp": 2, "dp": 1, "tp": 2}, "zero": 0',
     "your plan fits (at most 1,122,176 bytes on a rank), and its busiest rank sends 343,048 bytes per step; "
     "another plan on 4 ranks fits too and sends 264,720: which axis moves the fewest bytes for the memory "
     "it saves, and what keeps its activations in the budget?"),
    # the right plan, its activations estimated as GPipe's: every microbatch in flight
    ("activations = 2 * (2 * 919_552 // 8 + 4_224)", "activations = 4 * (2 * 919_552 // 8 + 4_224)",
     "your estimate of rank 0's activations, 936448, is +100% off the closed form's 468,224 (5% passes): see "
     "lesson 2's block and embedding, for the rows of one microbatch, times the microbatches 1F1B keeps in "
     "flight on rank 0 (lesson 8)"),
    # ZeRO-1 forgotten in the estimate
    ("16 * psi // 2", "16 * psi",
     "your estimate of rank 0's model states, 944128, is +33% off the closed form's 708,096 (5% passes): see "
     "lesson 2 (bytes per parameter) and lesson 4 (what ZeRO's stage shards), on the parameters of rank 0's "
     "stage only"),
], ids=["plain-dp-over-budget", "tp-fits-but-sends-more", "gpipe-activations", "no-zero-in-estimate"])
def test_lesson_16_wrong_plans_and_estimates_are_told_before_anything_runs(tmp_path, capsys, old, new, told):
    assert _told(16, _wrong(16, tmp_path, old, new), capsys) == told
