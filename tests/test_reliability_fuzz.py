"""Files and environment variables drawn by hypothesis (issue 43): a checkpoint manifest, a schedule
CSV, a dump's layout.json and refpar's environment variables, each hand-edited, truncated or
hostile (tests/fuzz.py draws them), are taken or refused in one sentence, never a traceback.

    python -m pytest -q tests/test_reliability_fuzz.py

Example counts are small (the suite's budget); the draws are derandomized as in tests/test_fuzz_cli.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refpar import checkpoint
from refpar.comm import diagnosis
from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.schedules import ScheduleError
from refpar.schedules.formats import from_csv
from refpar.trainer import train_single_device
from tests.fuzz import hostile_csv_cell, mutate_json, run_as_rank
from tests.test_fuzz_cli import fuzz_settings, judge

MODEL, TRAIN = model_preset("tiny", n_layer=1), TrainConfig(steps=1, batch_size=2, seq_len=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-step checkpoint of one process and its manifest."""
    root = tmp_path_factory.mktemp("saved")
    train_single_device(MODEL, TRAIN, save=str(root))
    step = root / "step-00000001"
    return step, json.loads((step / checkpoint.MANIFEST).read_text())


def _resigned(text: str) -> str:
    """The manifest with its checksum made to match again (as a forger who knew the format would):
    then the type and range checks, not the checksum, must catch what was changed."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(doc, dict):
        return text
    return json.dumps({**doc, checkpoint.CHECKSUM: checkpoint._checksum(doc)})


@fuzz_settings(40)
@given(st.data())
def test_a_drawn_manifest_resumes_or_is_refused_in_one_sentence(saved, tmp_path_factory, data):
    step, manifest = saved
    text = mutate_json(data, manifest)
    if data.draw(st.booleans()):
        text = _resigned(text)
    if data.draw(st.booleans()):  # or cut short, as a copy that did not finish
        text = text[:data.draw(st.integers(0, len(text)))]
    folder = tmp_path_factory.mktemp("drawn")
    for shard in step.glob("rank*.npz"):
        shutil.copy(shard, folder)
    (folder / checkpoint.MANIFEST).write_text(text)
    try:
        resumed_at, params, _ = checkpoint.load_whole(folder, MODEL, replace(TRAIN, steps=3))
    except checkpoint.CheckpointError as err:
        assert "\n" not in str(err) and str(folder) in str(err), err
        return
    # taken: then what it says is what was saved (a change the run does not read, or none)
    assert resumed_at == 1 and set(params) == {n.split("/", 1)[1] for n in manifest["tensors"]
                                               if n.startswith("params/")}


@fuzz_settings(8)
@given(st.data())
def test_a_drawn_manifest_given_to_resume_proceeds_or_is_refused(saved, tmp_path_factory, data):
    step, manifest = saved
    folder = tmp_path_factory.mktemp("cli") / "step-00000001"
    shutil.copytree(step, folder)
    (folder / checkpoint.MANIFEST).write_text(_resigned(mutate_json(data, manifest)))
    judge(run_as_rank(["train", "--n-layer", "1", "--batch-size", "2", "--seq-len", "4", "--steps", "3",
                       "--resume", str(folder.parent)]), "train")


@fuzz_settings(40)
@given(st.lists(st.lists(hostile_csv_cell(), max_size=6), max_size=4))
def test_a_drawn_schedule_csv_is_read_or_refused_in_one_sentence(rows):
    text = "\n".join(",".join(row) for row in rows)
    try:
        from_csv(text)
    except ScheduleError as err:
        assert "\n" not in str(err) and len(str(err)) < 1000, err


@fuzz_settings(10)
@given(st.lists(st.lists(hostile_csv_cell(), max_size=6), min_size=1, max_size=3))
def test_a_drawn_schedule_csv_file_finishes_or_is_refused_in_one_sentence(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("csv") / "s.csv"
    path.write_text("\n".join(",".join(row) for row in rows))
    outcome = run_as_rank(["schedule", "--from-csv", str(path)])
    assert outcome.kind != "crashed", outcome.where
    assert outcome.kind == "finished" and outcome.code == 0 or outcome.code == 2, outcome.describe()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Correct dumps of both layouts (tests/test_fuzz_check.py writes them)."""
    from tests.test_fuzz_check import correct_dump

    root = tmp_path_factory.mktemp("dumps")
    return [correct_dump(root, kind) for kind in ("tp", "dp")]


@fuzz_settings(12)
@given(st.data())
def test_a_drawn_layout_is_checked_or_refused_in_one_sentence(dumps, tmp_path_factory, data):
    dump = tmp_path_factory.mktemp("layout") / "dump"
    shutil.copytree(data.draw(st.sampled_from(dumps)), dump)
    layout = json.loads((dump / "layout.json").read_text())
    (dump / "layout.json").write_text(mutate_json(data, layout))
    judge(run_as_rank(["check", str(dump)]), "check", finish_codes=(0, 1))


ENV_VALUES = ("", "0", "1", "30", "-1", "nan", "inf", "-inf", "1e308", "1e-308", "x", " 5 ", "0x10", "٣")


@fuzz_settings(30)
@given(st.sampled_from(ENV_VALUES), st.sampled_from(ENV_VALUES))
def test_refpars_environment_variables_are_taken_or_refused_in_one_sentence(timeout, debug):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFPAR_COLLECTIVE_TIMEOUT", timeout)
        mp.setenv("REFPAR_DEBUG_COLLECTIVES", debug)
        try:
            seconds = diagnosis.timeout_from_env()
        except ConfigError as err:
            assert "REFPAR_COLLECTIVE_TIMEOUT" in str(err) and "\n" not in str(err)
        else:  # none, or a timeout that can pass: positive and finite
            assert seconds is None or 0 < seconds < float("inf"), seconds
        assert diagnosis.debug_from_env() in (True, False)
