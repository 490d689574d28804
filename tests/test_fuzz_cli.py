"""Fuzzed command lines: whatever flags and values a user types, `refpar train | schedule | plan |
generate | lesson` either proceeds (runs, or gets as far as its first collective or its first
training step, where tests/fuzz.py stops it) or refuses with exit status 2 and one sentence, never
a traceback; and every rank of the job decides alike before any communication (DESIGN.md, "Errors").

What "one sentence" means, for both kinds of refusal: exactly one line on stderr,

    refpar <command>: error: <what is wrong and what to change>

printed by rank 0 only. A ConfigError (refpar's own checks) is its sentence after that prefix.
An argparse error (an unknown flag, a value that is not a number, a choice not offered, two
mutually exclusive flags) is argparse's own message in the same form, followed by `; see refpar
<command> --help` instead of argparse's usage block (refpar/cli.py OneLineParser): the message
names the flag, and the help lists what it takes.

The values are drawn from pools of valid ones, edge ones (0, negative, huge, nan, inf, empty) and
junk text, so that most flags are right and one or two are wrong: then the fuzz reaches the checks
that only run once the earlier ones pass. Each test asserts that its command both proceeded and
refused at least once, so a pool that stopped reaching one side would fail. And a number that is
not finite (nan, inf) is refused wherever it is given: a check written `value <= 0` lets nan
through, and a run with a nan learning rate proceeds to train on nothing.

Reproducibility: `derandomize=True` draws the same examples from the test's source on every
machine, and `database=None` keeps a failure found on one machine from changing what the next run
tries; CI sees exactly what a developer sees.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import Outcome, assert_one_sentence, run_as_rank

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz_settings(examples: int) -> settings:
    return settings(FUZZ, max_examples=examples)
AXES = ("pp", "dp", "ep", "cp", "tp")
MAX_JOB = 1024  # a mesh larger than any job this machine could start is run as a job of 1 rank

# Value pools, as the strings a shell hands over: valid ones first and most often.
INTS = ("1", "2", "4", "8", "3", "16", "0", "-1", "33", "1000000000000", "x", "1.5", "")
FLOATS = ("0.01", "0.1", "1", "1.25", "2", "0", "-0.5", "nan", "inf", "-inf", "1e308", "x", "")
JUNK = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6)
SWITCH = None  # a flag that takes no value
NOT_FINITE = re.compile(r"(^|[=,])-?(nan|inf)$")  # "nan", "--lr=-inf", "temperature=nan"


def pool(*values: str) -> st.SearchStrategy:
    return st.sampled_from(values)


def mesh_texts() -> st.SearchStrategy:
    """`--mesh` values: well-formed entries mostly, then unknown axes, bad sizes, repeats, bare names."""
    entry = st.one_of(
        st.builds(lambda a, s: f"{a}={s}", st.sampled_from(AXES), pool("2", "1", "2", "4", "3", "8")),
        st.builds(lambda a, s: f"{a}={s}", pool("xx", "DP", "", "dp "), pool("2", "1")),
        st.builds(lambda a, s: f"{a}={s}", st.sampled_from(AXES), pool("0", "-1", "x", "1.5", "", "999999")),
        pool("dp", "=2", " tp = 2 ", ""),
    )
    return st.lists(entry, max_size=4).map(",".join)


def mesh_ranks(text: str) -> int:
    """The job a user would start for this mesh (mpiexec -n product); 1 when the text is not a mesh
    (refpar refuses it before asking) or the product is more ranks than a job could have."""
    size = 1
    for part in filter(None, (p.strip() for p in text.split(","))):
        entry = re.fullmatch(r"(pp|dp|ep|cp|tp)\s*=\s*(\d+)", part)
        if entry is None:
            return 1
        size *= int(entry.group(2))
    return size if 1 <= size <= MAX_JOB else 1


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """Paths a user may give: fine ones, and every way a path can be wrong."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "a_file.txt").write_text("not a directory\n")
    shutil.copy(ROOT / "tests" / "fuzz.py", root / "answer.py")  # some Python file, never run
    return {"new_dir": str(root / "out" / "run"), "new_file": str(root / "figure.html"),
            "existing_dir": str(root), "file": str(root / "a_file.txt"),
            "under_file": str(root / "a_file.txt" / "x"), "no_parent": str(root / "missing" / "x.html"),
            "python_file": str(root / "answer.py"), "empty": ""}


def path_pool(places: dict, *names: str) -> st.SearchStrategy:
    return st.sampled_from([places[n] for n in names])


def command_line(data, command: str, flags: dict, max_flags: int = 5) -> list[str]:
    """`command` and up to `max_flags` distinct flags, each with a value drawn from its pool."""
    argv = [command]
    for flag in data.draw(st.lists(st.sampled_from(sorted(flags)), max_size=max_flags, unique=True)):
        argv.append(flag)
        if flags[flag] is not SWITCH:
            value = data.draw(flags[flag])
            # A value that starts with '-' goes as --flag=VALUE, as a user must write it for argparse
            argv[-1:] = [f"{flag}={value}"] if value.startswith("-") else [flag, value]
    if data.draw(st.integers(0, 19)) == 0:  # now and then a stray word or an unknown flag
        argv.append(data.draw(st.one_of(pool("--bogus", "extra", "--steps"), JUNK)))
    return argv


def judge(outcome: Outcome, command: str, finish_codes=(0,)) -> None:
    """The one property every run must have: it proceeds, or it refuses in one sentence."""
    assert outcome.kind != "crashed", outcome.where
    assert not outcome.warned, outcome.describe()
    if outcome.kind == "refused":
        assert outcome.code == 2
        assert_one_sentence(outcome, command)
    else:  # proceeded or finished: quietly
        assert outcome.stderr == "", outcome.describe()
        if outcome.kind == "finished":
            assert outcome.code in finish_codes, outcome.describe()


def on_every_rank(argv: list[str], size: int, launched: bool) -> Outcome:
    """Rank 0 and the last rank of a job of `size` decide alike; only rank 0 speaks."""
    first = run_as_rank(argv, 0, size, launched)
    judge(first, argv[0])
    if size > 1:
        last = run_as_rank(argv, size - 1, size, launched)
        assert (last.kind, last.code, last.where) == (first.kind, first.code, first.where), \
            f"rank 0: {first.describe()}\nrank {size - 1}: {last.describe()}"
        assert last.stderr == "", last.describe()
    return first


def fuzz_command(command: str, draw_case, examples: int) -> Counter:
    """Runs `examples` drawn cases (argv, job size, launched) and tallies their outcomes."""
    tally: Counter = Counter()

    @fuzz_settings(examples)
    @given(st.data())
    def one_case(data):
        argv, size, launched = draw_case(data)
        outcome = on_every_rank(argv, size, launched)
        if any(NOT_FINITE.search(arg) for arg in argv):
            assert outcome.kind == "refused", f"{argv} took a number that is not finite: {outcome.describe()}"
        tally[outcome.kind] += 1

    one_case()
    print(f"refpar {command}: {sum(tally.values())} cases, {dict(tally)}")
    return tally


def job(data, mesh_text: str | None) -> tuple[int, bool]:
    """The job the user starts: mpiexec -n (the mesh's ranks), now and then one rank too many or a
    job of one under mpiexec."""
    size = (mesh_ranks(mesh_text) if mesh_text is not None else 1) + data.draw(st.sampled_from([0, 0, 0, 1]))
    return size, size > 1 or data.draw(st.booleans())


def mesh_of(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--mesh="):
            return arg[len("--mesh="):]
        if arg == "--mesh" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def test_train_flags_proceed_or_refuse_in_one_sentence_alike_on_every_rank(places):
    files = ("new_file", "existing_dir", "no_parent", "empty")
    flags = {
        "--model": pool("tiny", "tiny", "small", "huge", ""), "--steps": pool(*INTS),
        "--batch-size": pool(*INTS), "--seq-len": pool("16", "32", "33", *INTS),
        "--lr": pool(*FLOATS), "--optimizer": pool("adamw", "sgd", "adam", ""),
        "--dtype": pool("float64", "float32", "bfloat16", "float16", "int8", ""),
        "--precision": pool("fp64", "fp32", "bf16-mixed", "fp16-mixed", "fp8"), "--fp32-grads": SWITCH,
        "--loss-scale": pool(*FLOATS), "--loss-scale-window": pool(*INTS), "--seed": pool(*INTS),
        "--dropout": pool("0", "0.1", "0.5", "1", "-0.1", "nan", "x"), "--mesh": mesh_texts(),
        "--backend": pool("numpy", "numpy", "torch", "cupy", "jax"),
        "--device": pool("cpu", "cuda", "tpu", ""), "--json": SWITCH, "--check": SWITCH,
        "--save": path_pool(places, "new_dir", "existing_dir", "file", "under_file", "empty"),
        "--save-every": pool(*INTS), "--resume": path_pool(places, "new_dir", "file", "empty"),
        "--trace": path_pool(places, *files), "--microbatches": pool(*INTS),
        "--zero": pool("0", "1", "2", "3", "4", "-1"), "--fsdp": SWITCH, "--prefetch": SWITCH,
        "--no-reshard-after-forward": SWITCH, "--overlap": SWITCH, "--bucket-kb": pool(*FLOATS),
        "--sp": SWITCH, "--cp-algo": pool("ring", "ulysses", "x"),
        "--schedule": pool("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-min", "dualpipe",
                           "foo", ""),
        "--schedule-csv": path_pool(places, "file", "python_file", "existing_dir", "no_parent", "empty"),
        "--chunks": pool(*INTS), "--n-layer": pool(*INTS), "--moe-experts": pool("4", "2", "8", *INTS),
        "--moe-topk": pool(*INTS), "--moe-layers": pool("0", "1,3", "9", "x", "", "1,1", "0,1,2,3"),
        "--capacity-factor": pool(*FLOATS), "--dropless": SWITCH, "--aux-loss-weight": pool(*FLOATS),
        "--z-loss-weight": pool(*FLOATS),
    }

    def case(data):
        argv = command_line(data, "train", flags, max_flags=6)
        return (argv, *job(data, mesh_of(argv)))

    tally = fuzz_command("train", case, examples=400)
    assert tally["refused"] and tally["proceeds"], tally


def test_schedule_flags_finish_or_refuse_in_one_sentence(places):
    flags = {"--chunks": pool(*INTS), "--cost-f": pool(*FLOATS), "--cost-b": pool(*FLOATS),
             "--cost-w": pool(*FLOATS), "--cost-p2p": pool("0", *FLOATS), "--json": SWITCH,
             "--figure": path_pool(places, "new_file", "existing_dir", "no_parent", "empty")}
    kinds = pool("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "dualpipev",
                 "dualpipe", "foo", "", "1F1B")
    sizes = pool("1", "2", "4", "3", "8", "5", "0", "-1", "300", "1000000000000", "x")

    def case(data):
        argv = command_line(data, "schedule", flags, max_flags=3)
        argv += [data.draw(kinds), f"--stages={data.draw(sizes)}", f"--microbatches={data.draw(sizes)}"]
        return argv, 1, False

    tally = fuzz_command("schedule", case, examples=250)
    assert tally["refused"] and tally["finished"], tally


def test_plan_flags_finish_or_refuse_in_one_sentence(places):
    from refpar.analysis.presets import PRESETS

    flags = {"--hardware": pool("h100", "a100", "h200", "tpu", ""),
             "--global-batch": pool("8", "64", "512", "3", "0", "-4", "x"),
             "--seq": pool("512", "1024", "2048", "0", "-1", "1000000000000"),
             "--top": pool("1", "3", "0", "-1", "x"),
             "--precision": pool("bf16", "bf16-fp32-accum", "float64", "fp8"),
             "--dtype": pool("bfloat16", "float16", "float64", "int8"),
             "--software": pool("modern", "megatron-2021", "llama3", "x"),
             "--mesh": pool("tp=8,pp=8", "tp=2,dp=4", "dp=8", "tp=3", "pp=0", "nan", "x"),
             "--zero": pool("0", "1", "3", "4", "-1"), "--schedule": pool("1f1b", "zb-h2", "x"),
             "--micro-batch": pool("1", "4", "0", "nan"), "--recompute": pool("none", "selective", "x"),
             "--sp": SWITCH, "--json": SWITCH,
             "--figure": path_pool(places, "new_file", "existing_dir", "no_parent")}
    models = st.sampled_from([*PRESETS, "foo", ""])
    gpus = pool("8", "1", "2", "16", "64", "3", "7", "0", "-8", "1000000000000", "x")
    specs = st.sampled_from(["layers=4,hidden=512,heads=8,vocab=32000,seq=1024",
                             "layers=2,hidden=256,heads=4,vocab=1000,seq=512,kv_heads=2,arch=llama",
                             "layers=0,hidden=512,heads=8,vocab=32000,seq=1024", "layers=4", "x", ""])

    def case(data):
        argv = command_line(data, "plan", flags, max_flags=3)
        if data.draw(st.integers(0, 4)):  # a preset, now and then a spec without one
            argv += ["--model", data.draw(models)]
        else:
            argv += ["--model-spec", data.draw(specs)]
        argv += [f"--gpus={data.draw(gpus)}"]
        return argv, 1, False

    tally = fuzz_command("plan", case, examples=80)
    assert tally["refused"] and tally["finished"], tally


def test_generate_flags_proceed_or_refuse_in_one_sentence_alike_on_every_rank(places):
    lengths = pool("12,5,20,8", "12", "5,5", "0", "-1", "40", "x", "", "12,,5")
    flags = {
        # not the small preset: its 2048-token Markov chain takes seconds to draw each prompt from
        "--mesh": mesh_texts(), "--model": pool("tiny", "foo", ""),
        "--dtype": pool("float64", "float32", "bfloat16", "int8", ""), "--prompt-lens": lengths,
        "--new-tokens": pool("6", "1", "2,3", "0", "-1", "30", "1000000000000", "x"),
        "--arrivals": pool("0,0,1,3", "0", "0,1", "-1", "1000000000000", "x"),
        "--max-batch": pool("3", "1", "0", "-1", "1000000000000", "x"),
        "--sampling": pool("greedy", "temperature=0.8,top_k=20", "temperature=0", "temperature=-1",
                           "temperature=nan", "temperature=inf", "top_k=0", "top_k=-3", "top_k=x",
                           "temperature=1,temperature=2", "temperature", "", "nucleus=0.9"),
        "--seed": pool(*INTS), "--check": SWITCH, "--json": SWITCH,
        "--hardware": pool("h100", "a100", "tpu"), "--scale-model": pool("llama2-70b", "gpt2", "foo"),
        "--scale-gpus": pool("8", "1", "3", "0", "-1"), "--scale-batch": pool("1", "64", "0", "-1"),
        "--scale-context": pool("4096", "1", "0", "-1"),
        "--figure": path_pool(places, "new_file", "existing_dir", "no_parent", "empty"),
        "--paged": SWITCH, "--prefix-sharing": SWITCH,
        "--block-size": pool("16", "4", "1", "0", "-1", "1000000000000", "x"),
        "--kv-blocks": pool("8", "3", "1", "0", "-1", "1000000000000", "x"),
        "--system-prompt": pool("4", "0", "-1", "32", "1000000000000", "x"),
    }

    def case(data):
        argv = command_line(data, "generate", flags)
        return (argv, *job(data, mesh_of(argv)))

    tally = fuzz_command("generate", case, examples=300)
    assert tally["refused"] and tally["proceeds"], tally


def test_lesson_arguments_finish_proceed_or_refuse_in_one_sentence_alike_on_every_rank(places):
    actions = pool("list", "show", "check", "foo", "")
    numbers = pool("1", "3", "0", "10", "11", "-1", "1000000000000", "x")
    files = path_pool(places, "python_file", "no_parent", "existing_dir", "file")

    def case(data):
        argv = ["lesson", data.draw(actions)]
        if data.draw(st.booleans()):
            argv.append(data.draw(numbers))  # argparse reads "-1" as a number: no option looks like it
        if data.draw(st.booleans()):
            argv += ["--file", data.draw(files)]
        size = data.draw(st.sampled_from([1, 1, 2, 3, 4]))
        return argv, size, size > 1

    tally = fuzz_command("lesson", case, examples=150)
    assert tally["refused"] and tally["finished"] and tally["proceeds"], tally


def test_a_typo_is_told_the_nearest_name_and_the_help_of_its_command(capsys):
    """The commonest mistakes, each told in the user's own words: the flag they typed and the one
    they meant, the command's own --help, the flag (not the config field) a bad value came in by;
    and a bare `refpar` shows the help instead of an error."""
    from refpar.cli import main

    def status(argv: list[str]) -> int:  # argparse's refusals exit, refpar's own return 2
        try:
            return main(argv)
        except SystemExit as stop:
            return stop.code

    told = {"train --stpes 3": "--stpes 3 (did you mean --steps?); see refpar train --help",
            "train --pecision=bf16": "(did you mean --precision?); see refpar train --help",
            "tran": "there is no command 'tran' (did you mean train?)",
            "train --steps -3": "refpar train: error: --steps -3 must be positive",
            "train --lr nan": "refpar train: error: --lr nan must be positive"}
    for argv, words in ((line.split(), words) for line, words in told.items()):
        assert status(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "TrainConfig" not in err, (argv, err)
    assert status([]) == 0
    assert "usage: refpar" in capsys.readouterr().out
