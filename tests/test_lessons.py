"""The course in lessons/ runs as written: every command of every lesson prints what the lesson
shows (timings masked, non-integers to 1e-10, integers such as bytes exactly; lessons/course.py),
every reference solution passes its checker and every untouched exercise fails it, saying so."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from lessons import course as lessons
from lessons.checks import EXERCISES, check
from tests.mpi import ROOT, mpi_env

LESSON_FILES = lessons.lesson_files()


@pytest.mark.parametrize("path", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_every_command_of_the_lesson_prints_what_the_lesson_shows(path):
    found = lessons.blocks(path.read_text())
    assert found and all(b.commands for b in found), f"{path.name} has no ```console command"
    for block in found:
        for command, shown in zip(block.commands, block.outputs, strict=True):
            proc = lessons.run(command, timeout=240)
            problem = lessons.compare(shown, proc.stdout + proc.stderr, block.varies, block.tolerance)
            assert problem is None, f"{path.name}: `{command}`: {problem}"
            if CHECK.fullmatch(command):  # a grade: its exit status too, as a script would read it
                assert proc.returncode == (0 if ": passed: " in shown else 1), f"{path.name}: `{command}`"


CHECK = re.compile(r"python -m refpar lesson check (\d+)")


def _shown_check(n: int) -> str | None:
    """What lesson n shows `python -m refpar lesson check n` print on the untouched exercise (the test
    above runs it and compares output and exit status), or None where the lesson does not show it."""
    for block in lessons.blocks(lessons.lesson_path(n).read_text()):
        for command, shown in zip(block.commands, block.outputs, strict=True):
            if command == f"python -m refpar lesson check {n}":
                return shown
    return None


def _check(n: int, folder: str, capsys) -> tuple[int, str]:
    """Grades lessons/<folder>/<exercise n> as `refpar lesson check n --file` does."""
    path = lessons.LESSONS / folder / EXERCISES[n].file
    if EXERCISES[n].ranks > 1:
        # the command itself starts mpiexec -n ranks, as a learner's would
        proc = subprocess.run([sys.executable, "-m", "refpar", "lesson", "check", str(n), "--file",
                               str(path)], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                              timeout=180)
        return proc.returncode, proc.stdout + proc.stderr
    code = check(n, path)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("n", sorted(EXERCISES))
def test_the_reference_solution_passes_its_checker(n, capsys):
    code, out = _check(n, "solutions", capsys)
    assert code == 0 and out.startswith(f"lesson {n}: passed: "), out


@pytest.mark.parametrize("n", sorted(EXERCISES))
def test_the_untouched_exercise_fails_its_checker_saying_it_is_blank(n, capsys):
    # where the lesson shows the grade of the untouched exercise, the lesson's own test has run it (its
    # output and exit status): no second launch of its ranks
    out = _shown_check(n)
    if out is None:
        code, out = _check(n, "exercises", capsys)
        assert code == 1, out
    assert out.startswith(f"lesson {n}: not yet: the exercise is still blank: write "), out
    assert EXERCISES[n].file in out, out


def test_a_wrong_answer_is_told_what_is_wrong(tmp_path, capsys):
    wrong = tmp_path / "mean_of_means.py"
    wrong.write_text("def global_mean_loss(loss_sums, token_counts):\n"
                     "    return sum(s / c for s, c in zip(loss_sums, token_counts)) / len(loss_sums)\n")
    assert check(12, wrong) == 1
    out = capsys.readouterr().out
    assert "lesson 12: not yet: global_mean_loss = " in out and "mean of the microbatches' means" in out


def test_lesson_6_part_2_checks_the_v_schedule_written_as_csv(tmp_path):
    # part 1 done; part 2, the CSV next to it: blank, then a 1F1B-like V that idles, then broken.
    # Parts 1 and 2 are judged before any message (part 3 runs on 2 ranks): one process suffices.
    from lessons.checks import _verdict

    def said():  # the sentence `refpar lesson check 8` would print after "not yet: "
        verdict = _verdict(EXERCISES[8], answer, None)
        assert not verdict.ok, verdict
        return verdict.sentence

    answer = tmp_path / EXERCISES[8].file
    answer.write_text((lessons.LESSONS / "solutions" / EXERCISES[8].file).read_text())
    schedule = tmp_path / "08_v_schedule.csv"
    schedule.write_text("")
    assert said().startswith("the exercise is still blank: write part 2, ")
    from refpar.schedules.builders import build
    from refpar.schedules.formats import to_csv

    # V-Half with its last two weight gradients swapped, so not refpar's own: valid, but it idles a tick
    schedule.write_text(to_csv(build("v-half", 2, 4)).replace("0W2,0W3", "0W3,0W2"))
    assert "rank 0 idles 1 tick between its first and its last action" in said()
    # refpar's own: zbv as the learner's command prints it (the shortcut), v-half as to_csv writes it
    for kind, text in (("zbv", lessons.run("refpar schedule zbv -p 2 -m 4 --csv").stdout),
                       ("v-half", to_csv(build("v-half", 2, 4)))):
        schedule.write_text(text)
        assert said().startswith(f"{schedule} is the schedule `refpar schedule {kind} -p 2 -m 4 --csv` "
                                 "prints; part 2 asks for one you build yourself")
    schedule.write_text("0F0,3F0,3B0,0B0\r\n1F0,2F0,1B0,2B0\r\n")  # 1B0 before 2B0 on rank 1
    out = said()
    assert "rank 1 tick 2: 1B0 needs 2B0, which rank 1 runs later at tick 3" in out
    assert "refpar schedule --from-csv" in out


def test_an_executor_in_gpipe_order_is_told_its_order_not_its_numbers(tmp_path):
    # every forward first, then every backward: the same gradients, in GPipe's order and memory
    gpipe = tmp_path / EXERCISES[8].file
    solution = (lessons.LESSONS / "solutions" / EXERCISES[8].file).read_text()
    gpipe.write_text(solution.replace("    warmup = min(p - r - 1, m)", "    warmup = m"))
    assert gpipe.read_text() != solution
    part_2 = (lessons.LESSONS / "solutions" / "08_v_schedule.csv").read_text()
    (tmp_path / "08_v_schedule.csv").write_text(part_2)
    proc = _check_mpi(8, gpipe)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ("lesson 8: not yet: with m=4 microbatches on 2 stages, rank 0 ran F0 F1 F2 F3 B0 "
                           "B1 B2 B3; 1F1B runs 8 passes, at most 2 microbatches held at once here: how many "
                           "forwards before the first backward, and then? (rank 0)\n"), proc.stdout


def test_the_paper_formula_with_even_shards_is_told_about_uneven_units(tmp_path, capsys):
    even = tmp_path / "even_shards.py"
    even.write_text("def model_state_bytes(unit_sizes, n, rank, stage, fp32_grads=False):\n"
                    "    psi = sum(unit_sizes.values())\n"
                    "    s = psi // n  # the paper's Ψ/N: wrong where units do not split evenly\n"
                    "    return {'params': 2 * (psi if stage < 3 else s),\n"
                    "            'grads': 2 * (psi if stage < 2 else s),\n"
                    "            'master': 4 * (psi if stage == 0 else s),\n"
                    "            'optimizer': 8 * (psi if stage == 0 else s)}\n")
    assert check(13, even) == 1
    out = capsys.readouterr().out
    assert out.startswith("lesson 13: not yet: master on rank 0 of n=3, ZeRO-1"), out
    assert "part of every unit" in out


def test_compare_masks_timings_and_holds_numbers_to_their_tolerance():
    shown = "loss 4.567039131706693, 1,024 bytes, 12.5 ms\n"
    assert lessons.compare(shown, "loss 4.567039131706694, 1,024 bytes, 3.1 ms\n") is None
    assert "integers must be equal" in lessons.compare(shown, "loss 4.567039131706693, 1,025 bytes, 1 ms")
    assert "tolerance" in lessons.compare(shown, "loss 4.567139131706693, 1,024 bytes, 12.5 ms")
    assert "line 1 differs" in lessons.compare(shown, "loss 4.567039131706693, 1,024 kB, 12.5 ms")
    # a slower run's wider time shifts the padding of its column (refpar verify's table)
    row = "zero-3        2   4.4e-05     ok     ok    1.1s  pass"
    assert lessons.compare(row, "zero-3        2   4.4e-05     ok     ok   11.1s  pass") is None
    assert "line 1 differs" in lessons.compare(row, "zero-3        2   4.4e-05     ok     ok   11.1s  FAIL")
    # a block marked <!-- tolerance: 1e-2 --> (16-bit runs) holds non-integers to 1e-2, bytes exactly
    assert lessons.compare(shown, "loss 4.56, 1,024 bytes, 1 ms", tolerance=1e-2) is None
    assert "tolerance 0.01" in lessons.compare(shown, "loss 4.4, 1,024 bytes, 1 ms", tolerance=1e-2)
    assert "integers must be equal" in lessons.compare(shown, "loss 4.56, 1,023 bytes, 1 ms", tolerance=1e-2)
    marked = "<!-- varies: x -->\n<!-- tolerance: 2e-2 -->\n```console\n$ echo 1\n1\n```\n"
    assert [(b.tolerance, b.varies) for b in lessons.blocks(marked)] == [(2e-2, ["x"])]
    reasoned = "<!-- tolerance: 5e-2; bf16's u = 3.9e-3 per rounding -->\n```console\n$ echo 1\n1\n```\n"
    assert [b.tolerance for b in lessons.blocks(reasoned)] == [5e-2]  # the reason is not the number


def test_the_app_shows_each_lesson_and_its_exercise():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(lessons.ROOT / "app" / "Home.py"), default_timeout=60)
    at.run()
    at.switch_page("views/lessons.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.selectbox[0].set_value(1).run()
    assert not at.exception, [e.value for e in at.exception]
    text = "\n".join(m.value for m in at.markdown)
    assert "Lesson 1: collectives" in text and "reduce-scatter" in text
    assert "def ring_all_reduce" in at.code[0].value
    at.selectbox[0].set_value(13).run()  # lesson 13 marks seven blocks; a reader sees none of the markers
    text = "\n".join(m.value for m in at.markdown)
    assert "Lesson 13" in text and "<!--" not in text and "tolerance:" not in text


def test_lesson_list_and_show_print_the_course(capsys):
    from refpar.cli import main

    assert main(["lesson", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(LESSON_FILES) and listed[1].startswith(" 1  Lesson 1: collectives")
    assert "exercise: lessons/exercises/01_ring_all_reduce.py" in listed[1]
    assert main(["lesson", "show", "8"]) == 0
    # the lesson's text less its six comparison markers (varies, tolerance), which a reader has no use for
    shown, source = capsys.readouterr().out, (lessons.LESSONS / "08-pipeline-parallelism.md").read_text()
    assert "<!--" in source and "<!--" not in shown
    assert shown.splitlines() == [x for x in source.splitlines() if not x.startswith("<!-- ")]
    assert len(source.splitlines()) - len(shown.splitlines()) == 6
    assert main(["lesson", "show", "42"]) == 2
    assert "there is no lesson 42; the lessons are 0, 1" in capsys.readouterr().err


def test_a_ring_that_sends_too_much_is_told_its_bytes(tmp_path):
    wrong = tmp_path / "pass_everything.py"
    wrong.write_text(
        "def ring_all_reduce(link, x):\n"
        "    p, r = link.size, link.rank\n"
        "    total, passing = x.copy(), x.copy()\n"
        "    for _ in range(p - 1):  # pass whole vectors around the ring: right sum, too many bytes\n"
        "        incoming = passing.copy()\n"
        "        link.sendrecv(passing, (r + 1) % p, incoming, (r - 1) % p)\n"
        "        total += incoming\n"
        "        passing = incoming\n"
        "    return total\n")
    proc = subprocess.run([sys.executable, "-m", "refpar", "lesson", "check", "1", "--file", str(wrong)],
                          cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "lesson 1: not yet: rank 0 sent 480 bytes for n=20" in proc.stdout, proc.stdout
    assert "a ring all-reduce sends 2 (p-1) chunks" in proc.stdout


def test_a_ring_whose_rank_stops_is_reported_not_left_hanging(tmp_path):
    stops = tmp_path / "rank0_stops.py"
    stops.write_text(
        "def ring_all_reduce(link, x):\n"
        "    if link.rank == 0:\n"
        "        raise ValueError('rank 0 gave up')\n"
        "    out = x.copy()  # the others wait for rank 0's message\n"
        "    link.sendrecv(x, (link.rank + 1) % link.size, out, (link.rank - 1) % link.size)\n"
        "    return out\n")
    proc = subprocess.run([sys.executable, "-m", "refpar", "lesson", "check", "1", "--file", str(stops)],
                          cwd=ROOT, env=mpi_env({"REFPAR_COLLECTIVE_TIMEOUT": "3"}), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("lesson 1: not yet: your code raised ValueError: rank 0 gave up (rank 0)")
    # its own frame of the traceback, not the checker's, and the others' waiting put after it
    assert proc.stdout.splitlines()[1:] == [f'  File "{stops}", line 3, in ring_all_reduce',
                                            "    raise ValueError('rank 0 gave up')",
                                            "(ranks 1, 2 and 3 then waited for rank 0: fix its error first)"]


def test_a_ring_that_deadlocks_is_told_in_the_learners_words_and_soon(tmp_path):
    # rank 0 skips the all-gather: ranks 1-3 wait for its messages, rank 0 for them in the checker's
    # comparison. A 1 s wait (what REFPAR_COLLECTIVE_TIMEOUT sets) is told as 1 s, in one line that names
    # where each rank waits in the learner's file (rank 0 in none of it), neither refpar's ranks-in-groups
    # nor a collective the learner never called, and no MPICH shutdown noise
    stuck = tmp_path / "ring.py"
    solution = (lessons.LESSONS / "solutions" / EXERCISES[1].file).read_text()
    stuck.write_text(solution.replace("    for k in range(p - 1):  # all-gather",
                                      "    for k in range(p - 1 if r else 0):  # all-gather"))
    assert stuck.read_text() != solution
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "refpar", "lesson", "check", "1", "--file", str(stuck)],
                          cwd=ROOT, env={**mpi_env(), "REFPAR_COLLECTIVE_TIMEOUT": "1"}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 1 and proc.stderr == "", proc.stdout + proc.stderr
    assert proc.stdout == ("lesson 1: not yet: your code did not finish on every rank and no rank raised: "
                           "after 1 s without the message it waited for, rank 0 had returned from your code; "
                           "ranks 1, 2 and 3 waited at line 28, `link.sendrecv(buf[s0:s1], right, "
                           "buf[r0:r1], left)`. Every rank must make the same calls in the same order (in a "
                           "ring, each rank sends right exactly as often as its right neighbour receives "
                           "from the left)\n"), proc.stdout
    assert time.monotonic() - started < 60  # the launch, a 1 s wait and the gather, not a 120 s kill


def _check_mpi(n: int, path, timeout_s: str | None = None) -> subprocess.CompletedProcess:
    """`refpar lesson check n --file path` as a learner runs it (it starts mpiexec itself)."""
    env = mpi_env({"REFPAR_COLLECTIVE_TIMEOUT": timeout_s} if timeout_s else None)
    return subprocess.run([sys.executable, "-m", "refpar", "lesson", "check", str(n), "--file", str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_an_error_on_the_last_rank_of_exercise_0_is_shown_with_its_traceback_not_a_hang(tmp_path):
    # the others wait for it in the checker's exchange, under the checker's default timeout (not
    # REFPAR_COLLECTIVE_TIMEOUT's): told in seconds, not after 120, and no call the exercise never makes
    raises = tmp_path / "last_rank_raises.py"
    raises.write_text("def my_rows(n, size, rank):\n"
                      "    base, extra = divmod(n, size)\n"
                      "    start = rank * base + min(rank, extra)\n"
                      "    if rank == size - 1:\n"
                      "        return (start, start + base, 0)[3]\n"
                      "    return start, start + base + (rank < extra)\n")
    started = time.monotonic()
    proc = _check_mpi(0, raises)
    assert time.monotonic() - started < 60  # the launch and one 4 s wait (checks.WAIT_S)
    assert proc.returncode == 1 and proc.stderr == "", proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "lesson 0: not yet: your code raised IndexError: tuple index out of range (rank 2)",
        f'  File "{raises}", line 5, in my_rows',
        "    return (start, start + base, 0)[3]",
        "(ranks 0 and 1 then waited for rank 2: fix its error first)"], proc.stdout


def test_collectives_in_a_different_order_on_each_rank_are_named_not_summed(tmp_path):
    # rank 1 all-reduces the gradients in the other order: MPI would add w to b; the teaching
    # communicator compares the calls first and names the array each rank passed
    swapped = tmp_path / "swapped.py"
    swapped.write_text("def average_gradients(grads, dp):\n"
                       "    names = sorted(grads, reverse=dp.rank == 1)\n"
                       "    return {name: dp.all_reduce(grads[name]) / dp.size for name in names}\n")
    proc = _check_mpi(3, swapped)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = "line 3, `return {name: dp.all_reduce(grads[name]) / dp.size for name in names}`"
    assert proc.stdout == (
        "lesson 3: not yet: your ranks' collective number 1 differs: rank 0 all_reduce(grads['b'] of shape "
        f"(1,), float64, op='sum') at {line}; rank 1 all_reduce(grads['w'] of shape (5,), float64, "
        f"op='sum') at {line}. Every rank must call the same collectives in the same order on matching "
        "arrays, or MPI combines the wrong ones\n"), proc.stdout


@pytest.mark.parametrize("merge, told", [
    # exp(800) overflows: the naive sum of exps is refused at scores of 800
    ("s1, s2 = np.exp(lse1), np.exp(lse2)\n"
     "    return (s1[:, None] * o1 + s2[:, None] * o2) / (s1 + s2)[:, None], np.log(s1 + s2)",
     "the merged log-sum-exp (keys split at 1, every score and lse 800 higher) is off by up to inf at 6 of "
     "6 elements; the first is [0] (query 0): inf where the right answer is 809.692"),
    # stable at 800, but -inf - -inf is NaN where block 1 is hidden from a query
    ("lse = lse1 + np.log1p(np.exp(lse2 - lse1))\n"
     "    return np.exp(lse1 - lse)[:, None] * o1 + np.exp(lse2 - lse)[:, None] * o2, lse",
     "the merged log-sum-exp (query 1 sees no key of block 1, queries 3 and 4 none of block 2 (o 0, lse "
     "-inf there)) is not a number at 1 of 6 elements; the first is [1] (query 1)"),
    # weighted by the number of keys, not by the blocks' sums of exp: located, query and element
    ("lse = np.logaddexp(lse1, lse2)\n"
     "    return (1 * o1 + 5 * o2) / 6, lse",
     "the merged attention output (keys split at 1) is off by up to "),
], ids=["overflows-at-800", "nan-on-a-hidden-block", "weighted-by-key-count"])
def test_an_unstable_or_unweighted_merge_is_refused_and_located(tmp_path, merge, told):
    # part 1 is judged before any message (part 2, the ring, runs on 2 ranks): one process suffices
    from lessons.checks import _verdict

    wrong = tmp_path / "merge.py"
    wrong.write_text(f"import numpy as np\n\n\ndef merge_attention(o1, lse1, o2, lse2):\n    {merge}\n")
    with np.errstate(all="ignore"):
        verdict = _verdict(EXERCISES[7], wrong, None)
    assert not verdict.ok and verdict.sentence.startswith(told), verdict
    assert "the first is [" in verdict.sentence and "(query " in verdict.sentence


def test_a_zero2_step_that_all_reduces_the_gradient_is_refused(tmp_path):
    # the right numbers by the wrong route: every rank would hold the whole summed gradient
    all_reduces = tmp_path / "all_reduce.py"
    all_reduces.write_text((lessons.LESSONS / "solutions" / EXERCISES[4].file).read_text().replace(
        'g = dp.reduce_scatter(grad, tag="param:grad") / dp.size',
        'g = dp.all_reduce(grad)[slice(*shard_range(param.size, dp.size, dp.rank))] / dp.size'))
    assert "dp.all_reduce" in all_reduces.read_text()
    proc = _check_mpi(4, all_reduces)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ("lesson 4: not yet: your step calls all_reduce, all_gather: an all-reduce leaves "
                           "every rank the whole summed gradient, which ZeRO-2 never holds; which collective "
                           "gives each rank only its rows of the sum?\n"), proc.stdout


def test_a_capacity_queue_that_ignores_the_other_ranks_is_told_which_assignment(tmp_path):
    # each rank queues its own tokens only: rank 1's first choices then sit ahead of rank 0's second
    # ones nowhere, and an expert keeps too many; the message names the token, its choice and the queue
    local = tmp_path / "local_queue.py"
    solution = (lessons.LESSONS / "solutions" / EXERCISES[10].file).read_text()
    gathered = '    every = ep.all_gather(counts[None], tag="moe.counts").reshape(ep.size, k, n_experts)'
    local.write_text(solution.replace(gathered, "    every = counts[None]  # (1, k, E): this rank's only")
                     .replace("every[:ep.rank]", "every[:0]"))
    assert local.read_text() != solution
    proc = _check_mpi(10, local)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ("lesson 10: not yet: rank 0's kept(...) is wrong for 2 of 16 assignments (16 "
                           "tokens on 2 ranks, 4 experts, top-2, capacity 3); the first is token 5's choice "
                           "2, expert 2: you keep it, but 3 assignments are ahead of it in that expert's "
                           "queue (rank 0)\n"), proc.stdout


def test_mesh_groups_split_by_the_wrong_color_are_told_which_ranks_they_hold(tmp_path):
    # color and key swapped: the ranks with the same coordinate on the axis end up together
    swapped = tmp_path / "swapped_split.py"
    solution = (lessons.LESSONS / "solutions" / EXERCISES[11].file).read_text()
    swapped.write_text(solution.replace("world.split(first, key=mine[axis], axis=axis)",
                                        "world.split(mine[axis], key=first, axis=axis)"))
    assert swapped.read_text() != solution
    proc = _check_mpi(11, swapped)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ("lesson 11: not yet: on mesh {'pp': 1, 'dp': 2, 'tp': 2}, rank 0's pp group holds "
                           "world ranks [0, 1, 2, 3] in that order; it should hold [0]: which ranks share a "
                           "color, and what orders them?\n"), proc.stdout


def test_a_ring_that_keeps_its_own_block_is_told_which_query_misses(tmp_path):
    # it sends its block on but never takes the one arriving: it merges its own keys twice, so even
    # position 0, which sees only itself, counts its key twice
    stuck = tmp_path / "own_block.py"
    solution = (lessons.LESSONS / "solutions" / EXERCISES[7].file).read_text()
    stuck.write_text(solution.replace("            block = coming.wait()", "            coming.wait()"))
    assert stuck.read_text() != solution
    proc = _check_mpi(7, stuck)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("lesson 7: not yet: rank 0's log-sum-exp (T=8 over 2 ranks, rank 0 "
                                  "holding positions [0, 1, 6, 7]) is off by up to "), proc.stdout
    assert "the first is [0] (the query at position 0)" in proc.stdout, proc.stdout


def test_a_wrong_sum_is_located_by_chunk_and_element():
    # exercise 1's check: a ring that skipped one chunk's reduction is told which chunk, not just "off"
    from lessons.checkers.common import Wrong, close
    from lessons.checkers.ring_all_reduce import chunk_of

    want = np.arange(20.0)
    got = want.copy()
    got[5:10] += 1.0  # chunk 1 of 4 (elements 5..9) never got the other ranks' part
    with pytest.raises(Wrong) as told:
        close(got, want, "rank 2's sum of 20 elements", lambda i: chunk_of(i, 20, 4))
    assert str(told.value) == ("rank 2's sum of 20 elements is off by up to 1 at 5 of 20 elements; the first "
                               "is [5] (in chunk 1 of 4, elements 5..9): 6 where the right answer is 5")
    close(want * (1 + 1e-12), want, "a sum in another order")  # within the float64 contract: silent


def test_the_capstone_prints_what_refpar_plan_says_of_the_same_plan():
    # the example plan of lesson 16, whose `refpar plan` command and output the lesson shows (and the
    # first test runs): the checker's in-process pricing must name that command and agree with it
    import json

    from lessons.checkers.capstone import _figures, _plan, _planner, _sizes
    from refpar.config import TrainConfig, model_preset

    sizes, plan = _sizes({"pp": 2, "dp": 2}), _plan(1, 2, 2)
    peaks, sent = _figures(model_preset("tiny"), TrainConfig(steps=1), sizes, plan)
    said = _planner(sizes, plan, peaks, sent)
    command = said.split("`")[1]
    printed = json.loads(lessons.run("python -m " + command + " --json").stdout)
    assert command.endswith("--mesh pp=2,dp=2 --zero 1 --micro-batch 2"), command
    memory, sends = (sum(printed["plan"][k].values()) for k in ("memory_bytes", "comm_bytes"))
    assert f"prices it at {memory:,.0f} bytes per GPU (the ledger's busiest rank: {max(peaks):,})" in said
    assert f"and {sends:,.0f} bytes sent per step" in said
    assert f"ranks it {printed['rank']} of the {printed['fitting']} plans" in said
