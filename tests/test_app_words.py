"""Errors in the page's own words (issue 44): on the Whole mesh, Run for real (any mesh) and Plan pages,
each bad input gets one sentence that names a control of that page, never a command-line flag, with
any choices it lists in order; a typed value the page cannot use (the boxes have no limits) is refused
by its box's label, not silently replaced. The Pipeline page's: tests/test_fuzz_app.py.

Each page is one AppTest session driven through its cases (a page of errors draws no figures, so a
case costs a fraction of a second); the mesh sentences are also fuzzed through the function the two
mesh pages say them with (app/page_words.py), on refpar's own checks (refpar.viz.mesh_grid.check_mesh).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from streamlit.testing.v1 import AppTest

from tests.test_app import HOME, TIMEOUT
from tests.test_fuzz_cli import fuzz_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))  # the app's modules


def controls(at: AppTest) -> set[str]:
    """The labels of every control on the page now."""
    kinds = ("number_input", "selectbox", "checkbox", "toggle", "radio", "select_slider")
    return {w.label for kind in kinds for w in getattr(at, kind)}


def assert_in_page_words(sentence: str, labels: set[str]) -> None:
    """One line, no flag, a control of the page named (its label as words), listed choices in order."""
    assert "\n" not in sentence.strip() and "--" not in sentence, sentence
    assert any(re.search(rf"(^|\W){re.escape(label)}(\W|$)", sentence) for label in labels), \
        (sentence, sorted(labels))
    for listed in re.findall(r"\{([\d, ]+)\}", sentence):
        numbers = [int(n) for n in listed.split(",")]
        assert numbers == sorted(numbers), sentence


def widget(at: AppTest, name: str):
    """The page's number box or choice whose key, or else label, is `name`."""
    boxes = [w for kind in ("number_input", "selectbox") for w in getattr(at, kind)]
    return next(w for w in boxes if w.key == name or (w.key is None and w.label == name))


def drive(path: str, cases: tuple, before: dict | None = None) -> None:
    """Opens `path` (its toggles set to `before` first), then for each (widget key or label -> value, the
    start of the one error wanted): sets them, checks the sentence, and sets them back as they were."""
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(path)
    at.run()
    for key, value in (before or {}).items():
        at.toggle(key=key).set_value(value).run()
    assert not at.exception, [e.value for e in at.exception]
    defaults = {name: widget(at, name).value for settings, _ in cases for name in settings}
    for settings, wanted in cases:
        for name, value in settings.items():
            widget(at, name).set_value(value)
        at.run()
        assert not at.exception, (settings, [e.value for e in at.exception])
        errors = [e.value for e in at.error]
        assert len(errors) == 1 and errors[0].startswith(wanted), (settings, errors)
        assert_in_page_words(errors[0], controls(at))
        for name in settings:
            widget(at, name).set_value(defaults[name])


MESH_CASES = (  # the page's default: pp=2 x dp=2 x tp=2, ZeRO-3, 2 microbatches, batch 8 of 16 tokens
    ({"mesh_tp": 17}, "tp = 17: choose 1 to 16"),
    ({"mesh_dp": 0}, "dp = 0: choose 1 to 16"),
    ({"mesh_m": 17}, "microbatches = 17: choose 1 to 16"),
    ({"mesh_seq": 0}, "sequence length = 0: choose 1 to"),
    ({"mesh_tp": 3}, "tp=3 does not divide n_head=4; choose tp in {1, 2, 4}"),
    ({"mesh_dp": 1}, "data parallelism zero3 shards over the dp (and cp) ranks; set dp to 2 or more, or "
                     "choose data parallelism dp"),
    ({"mesh_pp": 8, "mesh_tp": 1}, "8 pipeline stages need at least 8 blocks"),
    ({"mesh_tp": 8}, "pp x dp x ep x cp x tp = 32 ranks; choose sizes that multiply to at most 16"),
    ({"mesh_seq": 40}, "sequence length = 40: choose 1 to 32"),  # tiny's 32 positions
    ({"mesh_batch": 1}, "batch size"),
    ({"mesh_ep": 8, "mesh_pp": 1, "mesh_tp": 1}, "ep=8 is more than the 4 experts of the page's MoE model"),
)


@pytest.mark.timeout(300)
def test_whole_mesh_page_refuses_bad_inputs_in_its_own_words():
    drive("views/mesh.py", MESH_CASES)


@pytest.mark.timeout(300)
def test_run_page_any_mesh_refuses_bad_inputs_in_its_own_words():
    drive("views/run.py", (
        ({"run_tp": 17}, "tp = 17: choose 1 to 16"),
        ({"run_steps": 50}, "steps = 50: choose 1 to 20"),
        ({"run_batch": 0}, "batch size = 0: choose 1 or more"),
        ({"run_tp": 3}, "tp=3 does not divide n_head=4; choose tp in {1, 2, 4}"),
        ({"run_dp": 1, "run_strategy": "zero3"}, "data parallelism zero3 shards"),
        ({"run_seq": 40}, "sequence length 40 is longer than n_positions"),
    ), before={"run_whole": True})


@pytest.mark.timeout(300)
def test_plan_page_refuses_bad_inputs_in_its_own_words():
    drive("views/plan.py", (  # "price your own plan" first: an error above it stops the page
        ({"price-tp": 0}, "tp = 0: choose 1 to 1,024"),
        ({"price-chunks": 1}, "chunks (interleaved) = 1: choose 2 or more"),
        ({"price-pp": 1}, "schedule 1f1b needs pp > 1; set schedule to none"),
        ({"price-micro": 64}, "the global batch"),
        ({"price-pp": 1, "price-schedule": "none"}, "dp=128,tp=8 does not fit"),
        ({"plan_top": 11}, "plans shown = 11: choose 1 to 10"),
        ({"plan_gpus": 0}, "GPUs = 0: choose 1 to 65,536"),
        ({"plan_gpus": 7}, "GPUs 7 is neither a power of two"),
    ))


@pytest.mark.timeout(300)
def test_memory_communication_serving_and_sharding_refuse_bad_inputs_in_their_own_words():
    drive("views/memory.py", (
        ({"memory_n": 0}, "ranks on the strategy's axis = 0: choose 1 to 16"),
        ({"memory_m": 9}, "microbatches (pp) = 9: choose 1 to 8"),
    ))
    drive("views/communication.py", (
        ({"comm_n": 0}, "ranks on its axis = 0: choose 1 or more"),
        ({"comm_m": -1}, "microbatches = -1: choose 1 or more"),
        ({"comm_strategy": "zero3", "comm_n": 1},
         "zero3 splits the work over its axis; choose 2 or more ranks on its axis"),
        ({"comm_n": 3}, "3 ranks on its axis does not divide n_head=4; choose ranks on its axis in "
                        "{1, 2, 4}"),
    ))
    drive("views/serving.py", (
        ({"serve_n": 0}, "requests = 0: choose 1 to"),
        ({"serve_new": 1000}, "new tokens per request = 1,000: choose 1 to"),
        ({"serve_batch": 1025}, "requests decoded together = 1,025: choose 1 to 1,024"),
        ({"serve_context": 0}, "cached tokens per request = 0: choose 1 to"),
    ))
    drive("views/sharding.py", (
        ({"ranks": 9}, "9 ranks cannot be told apart on screen; choose 1 to 8"),
    ))


@pytest.mark.timeout(120)
def test_fuzzed_meshes_are_refused_in_the_mesh_pages_words():
    """Any mesh, plan, batch and sequence the Whole mesh page can be given: refpar train's refusal, said
    by app/page_words.py's mesh_in_page_words, names one of the page's controls and no flag."""
    from page_words import mesh_in_page_words

    from refpar.config import MESH_AXES, ConfigError, Plan, TrainConfig
    from refpar.viz import mesh_grid
    from refpar.viz.expected import DP_STRATEGIES

    labels = {*MESH_AXES, "data parallelism", "schedule", "microbatches", "batch size", "sequence length",
              "sequence parallel (sp)"}
    said = []
    size = st.sampled_from((1, 1, 2, 2, 3, 4, 8))

    @fuzz_settings(80)
    @given(st.fixed_dictionaries({a: size for a in MESH_AXES}), st.sampled_from(DP_STRATEGIES),
           st.sampled_from(("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "dualpipev")),
           st.sampled_from((1, 2, 3, 4, 8, 16)), st.sampled_from((1, 2, 8, 9, 64)),
           st.sampled_from((1, 8, 16, 33)), st.booleans(), st.sampled_from(("tiny", "llama-tiny")))
    def one_case(sizes, strategy, schedule, m, batch, seq, sp, preset):
        plan = Plan(schedule=schedule if sizes["pp"] > 1 else None, microbatches=m, sp=sp and sizes["tp"] > 1,
                    zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp",
                    chunks=2 if schedule == "interleaved-1f1b" and sizes["pp"] > 1 else None)
        try:
            model = mesh_grid.mesh_model(preset, sizes["ep"])
            mesh_grid.check_mesh(model, TrainConfig(steps=1, batch_size=batch, seq_len=seq), sizes, plan)
        except ConfigError as err:
            sentence = mesh_in_page_words(str(err), strategy)
            assert_in_page_words(sentence, labels)
            said.append(sentence)

    one_case()
    assert said
