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


# ------------------------------------------------------------------- lessons 12-14, one process each
@pytest.mark.parametrize("n, old, new, told", [
    (12, "return sum(loss_sums) / sum(token_counts)", "return sum(loss_sums) / len(loss_sums)",
     "global_mean_loss = 35.669570 for microbatches of [16, 16, 16] tokens; the mean over every token is "
     "2.229348 (each token's loss counts once, over the number of tokens of the whole batch)"),
    (12, "return sum(loss_sums) / sum(token_counts)",
     "return sum(loss_sums) / max(token_counts) / len(token_counts)",
     "global_mean_loss = 0.882800 for microbatches of [16, 3, 9, 1] tokens; the mean over every token is "
     "1.948249 (each token's loss counts once, over the number of tokens of the whole batch)"),
    (13, "(grad_bytes + 2 * fp32_grads) * psi", "grad_bytes * psi",
     "grads on rank 0 of n=1, ZeRO-0 with fp32_grads, units {'wte': 3072, 'root': 1088, 'h.0': 12704, 'h.1': "
     "12704, 'h.2': 12704, 'h.3': 12704}: 219904, the ledger measures 329856."),
    (13, '"master": 4 * (psi if stage == 0 else shard)', '"master": 4 * (psi if stage < 3 else shard)',
     "master on rank 0 of n=2, ZeRO-1, units {'wte': 3072, 'root': 1088, 'h.0': 12704, 'h.1': 12704, 'h.2': "
     "12704, 'h.3': 12704}: 219904, the ledger measures 109952."),
    (14, "return 3 * (linears + core + head) + forwards", "return linears + core + head + forwards",
     "step_flops(B=8, s=16, L=4, h=32, V=96, 'none') = 14417920; refpar's ranks run 43253760 together "
     "(0.3333 "
     "of it): count each product of the docstring's list once in the forward and twice in the backward"),
    (14, "core = 2 * 2 * tokens * s * h * L", "core = 0",
     "step_flops(B=8, s=16, L=4, h=32, V=96, 'none') = 40108032; refpar's ranks run 43253760 together "
     "(0.9273 "
     "of it): "),
    (14, '"full": linears + core}[recompute]', '"full": linears + core + head}[recompute]',
     "step_flops(B=8, s=16, L=4, h=32, V=96, 'full') = 57671680; refpar's ranks run 56885248 together "
     "(1.0138 "
     "of it): what runs again is each block's whole forward, not the head's"),
], ids=["12-over-microbatches", "12-over-the-longest", "13-fp32-grads-without-bf16", "13-master-kept-whole",
        "14-forward-only", "14-no-attention-core", "14-full-reruns-the-head"])
def test_lessons_12_to_14_wrong_answers_are_told_what_they_count(tmp_path, capsys, n, old, new, told):
    assert _told(n, _wrong(n, tmp_path, old, new), capsys).startswith(told)


# ------------------------------------------- the exercises on ranks: one MPI launch per rank count
RANKED = [  # (exercise, id, old, new, what rank 0 prints after "lesson N: ")
    (0, "no-extra-rows", "start = rank * base + min(rank, extra)", "start = rank * base",
     "not yet: with n=10 rows on 3 ranks the ranks got [(0, 4), (3, 6), (6, 9)]: together they must "
     "cover rows "
     "0..10 once, in rank order, with no gap or overlap"),
    (0, "ceil-division", "base, extra = divmod(n, size)", "base, extra = -(-n // size), 0",
     "not yet: with n=10 rows on 3 ranks the ranks got [(0, 4), (4, 8), (8, 12)]: together they must cover "
     "rows 0..10 once, in rank order, with no gap or overlap"),
    (0, "extras-to-the-last-ranks",
     "min(rank, extra)\n    return start, start + base + (1 if rank < extra else 0)",
     "max(0, rank - (size - extra))\n    return start, start + base + (1 if rank >= size - extra else 0)",
     "not yet: with n=10 rows on 3 ranks the sizes are [3, 3, 4]: they should differ by at most one, the "
     "extra "
     "rows going to the first ranks"),
    (3, "summed-not-averaged", "/ dp.size for name", "for name",
     "not yet: the average of gradients 1 and 2 is off by up to 1.5 at 1 of 1 elements; the first is [0]: 3 "
     "where the right answer is 1.5"),
    (3, "local-gradient", 'dp.all_reduce(g, tag=f"{name}:grad") / dp.size', "g",
     "not yet: the average of gradients 1 and 2 is off by up to 0.5 at 1 of 1 elements; the first is [0]: 1 "
     "where the right answer is 1.5 (rank 0)"),
    (3, "max-not-sum", 'dp.all_reduce(g, tag=f"{name}:grad")',
     'dp.all_reduce(g, op="max", tag=f"{name}:grad")',
     "not yet: the average of gradients 1 and 2 is off by up to 0.5 at 1 of 1 elements; the first is [0]: 1 "
     "where the right answer is 1.5"),
    (4, "summed-gradient", 'tag="param:grad") / dp.size', 'tag="param:grad")',
     "not yet: rank 0's new m, rows 0..4 of n=10, step t=1 is off by up to 0.0578 at 5 of 5 elements; "
     "the first "
     "is [0] (row 0): -0.115637 where the right answer is -0.0578186 (rank 0)"),
    (4, "rows-not-shared", 'return dp.all_gather(p, tag="param"), m, v', "return p, m, v",
     "not yet: rank 0's new parameter (n=10, step t=1) has shape (5,), it should be (10,) (rank 0)"),
    (4, "rank-0s-rows", "shard_range(param.size, dp.size, dp.rank)", "shard_range(param.size, dp.size, 0)",
     "not yet: rank 0's new parameter (n=10, step t=1) is off by up to 2.52 at 5 of 10 elements; the "
     "first is "
     "[5] (row 5, which rank 1 updates): 0.365744 where the right answer is -0.626068 (rank 0)"),
    (6, "no-all-reduce", 'return tp.all_reduce(partial, tag="mlp.c_proj:fwd")', "return partial",
     "not yet: rank 0's MLP output is off by up to 9.44 at 48 of 48 elements; the first is [0, 0] (row "
     "(0, 0) "
     "of the batch): -5.5132 where the right answer is 3.92669 (rank 0)"),
    (6, "averaged", 'tag="mlp.c_proj:fwd")', 'tag="mlp.c_proj:fwd") / tp.size',
     "not yet: rank 0's MLP output is off by up to 4.19 at 48 of 48 elements; the first is [0, 0] (row "
     "(0, 0) "
     "of the batch): 1.96335 where the right answer is 3.92669 (rank 0)"),
    (6, "hidden-units-summed-too", "h = np.tanh(x @ w_fc_shard)",
     "h = np.tanh(tp.all_reduce(x @ w_fc_shard))",
     "not yet: rank 0's MLP output is off by up to 12 at 48 of 48 elements; the first is [0, 0] (row (0, "
     "0) of "
     "the batch): 7.15814 where the right answer is 3.92669 (rank 0)"),
    (10, "capacity-rounded-down", "return math.ceil(n_tokens * top_k * factor / n_experts)",
     "return int(n_tokens * top_k * factor / n_experts)",
     "not yet: capacity(n_tokens=10, experts=4, top_k=1, factor=1.25) = 3, expected 4"),
    (10, "capacity-without-top-k", "math.ceil(n_tokens * top_k * factor / n_experts)",
     "math.ceil(n_tokens * factor / n_experts)",
     "not yet: capacity(n_tokens=16, experts=4, top_k=2, factor=1.0) = 4, expected 8"),
    (10, "earlier-ranks-ignored", " + every[:ep.rank].sum(axis=0)", "",
     "not yet: rank 1's kept(...) is wrong for 7 of 16 assignments (16 tokens on 2 ranks, 4 experts, top-2, "
     "capacity 3); the first is token 8's choice 1, expert 0: you keep it, but 4 assignments are ahead of it "
     "in that expert's queue (rank 1)\n(rank 0 then waited for rank 1 in your code: fix its answer first)"),
    (11, "tp-slowest", "for axis in reversed(AXES):", "for axis in AXES:",
     "not yet: coords(1, {'pp': 2, 'dp': 2, 'tp': 2}) = {'pp': 1, 'dp': 0, 'tp': 0}, expected {'pp': 0, "
     "'dp': "
     "0, 'tp': 1}: tp varies fastest, then dp, and pp slowest (ranks = arange(world).reshape(pp, dp, tp))"),
    (11, "stride-forgotten", "first = world.rank - mine[axis] * stride", "first = world.rank - mine[axis]",
     "not yet: on mesh {'pp': 1, 'dp': 2, 'tp': 2}, rank 0's dp group holds world ranks [0] in that "
     "order; it "
     "should hold [0, 2]: which ranks share a color, and what orders them?"),
    (11, "reversed-in-the-group", "key=mine[axis]", "key=-mine[axis]",
     "not yet: on mesh {'pp': 1, 'dp': 2, 'tp': 2}, rank 0's dp group holds world ranks [2, 0] in that "
     "order; "
     "it should hold [0, 2]: which ranks share a color, and what orders them?"),
]


@pytest.fixture(scope="module")
def ranked_verdicts(tmp_path_factory) -> dict[str, str]:
    """Every attempt of RANKED graded by tests/jobs/lesson_wrong_attempts.py: one launch per rank count
    (3 launches, not 18), each attempt as `refpar lesson check N --file` grades it."""
    import json

    from tests.mpi import mpiexec

    folder, by_ranks, path_of = tmp_path_factory.mktemp("attempts"), {}, {}
    for n, name, old, new, _ in RANKED:
        (folder / f"{n}-{name}").mkdir()
        path = _wrong(n, folder / f"{n}-{name}", old, new)
        path_of[str(path)] = f"{n}-{name}"
        by_ranks.setdefault(EXERCISES[n].ranks, []).extend([str(n), str(path)])
    said = {}
    for ranks, args in by_ranks.items():
        proc = mpiexec(ranks, "tests/jobs/lesson_wrong_attempts.py", *args,
                       env={"REFPAR_COLLECTIVE_TIMEOUT": "4"})
        said.update({path_of[k]: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()})
    return said


@pytest.mark.parametrize("n, name, told", [(n, name, told) for n, name, _, _, told in RANKED],
                         ids=[f"{n}-{name}" for n, name, *_ in RANKED])
def test_wrong_answers_on_ranks_are_told_what_is_wrong_where(ranked_verdicts, n, name, told):
    assert ranked_verdicts[f"{n}-{name}"] == told
