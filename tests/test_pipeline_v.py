"""The V-shaped and bidirectional schedules trained on real MPI ranks through the one engine: zbv,
v-half, v-min, dualpipev and dualpipe on p = 4 (and p = 2 with dp, ZeRO, FSDP and tp around them)
reproduce one device; every rank's traced bytes and peak memory are the closed forms; the activation
memory a rank measures is the published multiple of 1F1B's; DualPipe holds both copies of its parts;
a schedule torch dumps runs through `--schedule-csv` as the schedule refpar builds."""

import json

import pytest

from refpar.cli import main
from refpar.schedules.builders import build
from refpar.schedules.formats import to_csv
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, within

P4 = [{"mesh": {"pp": 4}, "schedule": k, "m": 8} for k in ("1f1b", "zbv", "v-half", "v-min", "dualpipev",
                                                          "dualpipe")]
# p = 2 pipelines, two of them over dp (each takes 4 of the 8 sequences, one per microbatch), each
# schedule with another way of keeping the replicas; and two tp=2 pipelines. Three clip to a global
# norm of 0.05 (CLIPPED): the V's wte on rank 0 alone, DualPipe's copies on both mirror ranks
P2 = [{"mesh": {"pp": 2, "dp": 2}, "schedule": "zbv", "m": 4, "zero": 1, "clip": 0.05},
      {"mesh": {"pp": 2, "dp": 2}, "schedule": "v-half", "m": 4},
      {"mesh": {"pp": 2, "dp": 2}, "schedule": "v-min", "m": 4, "zero": 2},
      {"mesh": {"pp": 2, "dp": 2}, "schedule": "dualpipev", "m": 4, "fsdp": True},
      {"mesh": {"pp": 2, "dp": 2}, "schedule": "dualpipe", "m": 4, "zero": 3, "clip": 0.05},
      {"mesh": {"pp": 2, "tp": 2}, "schedule": "dualpipev", "m": 4},
      {"mesh": {"pp": 2, "tp": 2}, "schedule": "dualpipe", "m": 4, "clip": 0.05}]
# torch's own schedule classes, dumped by torch (refpar/conformance/schedule_csv.py) at p=4, m=8
TORCH_CSV = {"ZBVZeroBubble": "zbv", "DualPipeV": "dualpipev", "InterleavedZeroBubble": None}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = P4 + P2
    try:
        from refpar.conformance.schedule_csv import dump, fake_group
    except ImportError:  # torch is the dev extra's; the rest runs without it
        dump = None
    if dump is not None:
        folder = tmp_path_factory.mktemp("csv")
        with fake_group(4):
            for name in TORCH_CSV:
                (folder / f"{name}.csv").write_text(dump(name, 4, 8))
        cases += [{"mesh": {"pp": 4}, "csv": str(folder / f"{name}.csv"), "m": 8, "torch": name}
                  for name in TORCH_CSV]
    proc = mpiexec(4, "tests/jobs/pipeline_v_checks.py", json.dumps(cases), timeout=400)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    return rows


def _row(rows, mesh, kind):
    return next(r for r in rows if r["mesh"] == mesh and r.get("schedule") == kind)


def test_every_schedule_matches_one_device_after_2_adamw_steps_with_dropout(results):
    for r in results:
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["reference_losses"], strict=True))
        # float64, the same weights and keyed dropout masks: only the order in which the
        # microbatches' gradients (and DualPipe's two copies') are summed differs from one device
        assert within(loss_diff, CONTRACT), r
        assert within(r["max_param_rel_diff"], CONTRACT), r


def test_clipping_takes_one_devices_global_norm_on_every_rank_counting_each_copy_once(results):
    # DualPipe holds every part on two ranks whose summed gradients are the same: counted on the
    # lower of the pair only (refpar/parallel/clipping.py); a V holds both ends of the tied wte on
    # rank 0, in one unit. The same gradients up to the order of the microbatch sums: CONTRACT.
    clipped = [r for r in results if r.get("clip")]
    assert len(clipped) == 3
    for r in clipped:
        ref = r["reference_grad_norms"]
        assert min(ref) > 10 * r["clip"]  # every step clips
        for rank_norms in r["grad_norms"]:
            diffs = [abs(a - b) / b for a, b in zip(rank_norms, ref, strict=True)]
            assert within(max(diffs), CONTRACT), (r["mesh"], r["schedule"], diffs)


def test_traced_bytes_and_peak_memory_per_category_are_the_closed_forms(results):
    # activations and input gradients between stages on two ranks, the tied wte where its ends sit
    # on two ranks, DualPipe's copies over the mirror ranks, ZeRO's and FSDP's collectives; memory
    # per category, the activations the replay of each rank's list (refpar/analysis/closed_forms.py)
    for r in results:
        assert r["traced_bytes_equal_closed_form"] and r["memory_equal_closed_form"], r
        assert r["activation_peak"] == r["replayed_peak"], r


@pytest.mark.parametrize("mesh, p", [({"pp": 4}, 4), ({"pp": 2, "dp": 2}, 2)])
def test_activation_memory_is_the_published_multiple_of_1f1bs(results, mesh, p):
    # M_B: what one microbatch leaves on a 1F1B rank, L/p = 8/p blocks of one sequence (each
    # pipeline's microbatches are one sequence, at p = 4 and on p = 2 over dp = 2). Measured per
    # block on the p = 4 1F1B run's rank 1, which holds no embedding or head and p - 1 = 3
    # microbatches of 2 blocks. On the ranks that hold neither end each stage keeps that per block
    # too, so their measured peak is the published multiple of M_B, for a pipeline filled with
    # microbatches:
    #   zero-bubble README, "Activation Memory (Compared to 1F1B)": ZB-V 1x of 1F1B's p M_B
    #   Qi et al. 2024b's playground, "by #micro-batch": V-Half (p+2)//2, V-Min (p+4)//3 M_B
    #   DualPipe README, "Activation Per Device": PP+1 stages of its table, PP = 2p half-size stages
    #   for DualPipeV ((2p+1)/2 M_B), PP = p stages of 1F1B's size for DualPipe (p+1 M_B)
    block = _row(results, {"pp": 4}, "1f1b")["activation_peak"][1] / (3 * 2)
    M_B = 8 // p * block
    published = {"zbv": p, "v-half": (p + 2) // 2, "v-min": (p + 4) // 3, "dualpipev": (2 * p + 1) / 2,
                 "dualpipe": p + 1}
    for kind in [k for k in published if k != "dualpipe" or p > 2]:  # p = 2: both ranks hold an end
        r = _row(results, mesh, kind)
        # the middle ranks: a V's 1..p-1 (stages r and 2p-1-r), DualPipe's 1..p-2 (parts r, p-1-r)
        middle = range(1, p - 1) if kind == "dualpipe" else range(1, p)
        for world, pp in enumerate(r["pp"]):
            if pp in middle:
                assert r["activation_peak"][world] == published[kind] * M_B, (kind, world)


def test_dualpipe_holds_both_copies_of_its_parts(results):
    # DualPipe README, "Parameter Per Device": 2x. Measured: rank r holds 1F1B's parts r and p-1-r,
    # the tied wte once where both ends meet (ranks 0 and p-1: one buffer for embedding and head)
    ofob, dual = _row(results, {"pp": 4}, "1f1b")["params"], _row(results, {"pp": 4}, "dualpipe")["params"]
    wte = 96 * 32 * 8  # vocab x channels, float64
    assert dual == [ofob[r] + ofob[3 - r] - wte * (r in (0, 3)) for r in range(4)]
    assert sum(dual) == 2 * sum(ofob) - 2 * wte


def test_a_schedule_torch_dumps_runs_through_schedule_csv_as_refpars_own(results):
    rows = [r for r in results if r.get("torch")]
    if not rows:
        pytest.skip("torch is not installed")
    for r in rows:
        ours = TORCH_CSV[r["torch"]]
        if ours is not None:
            # torch's ZBVZeroBubble and DualPipeV are refpar's zbv and dualpipev action for action
            # (tests/test_schedule_csv.py), so every rank runs the same operations in the same order:
            # the same numbers, bit for bit
            built = _row(results, {"pp": 4}, ours)
            assert (r["losses"], r["params_digest"]) == (built["losses"], built["params_digest"])
    # InterleavedZeroBubble has no builder in refpar: it runs from its CSV, matching one device
    # (test_every_schedule_matches_one_device_after_2_adamw_steps_with_dropout)
    assert {r["torch"] for r in rows} == set(TORCH_CSV)


def test_train_command_runs_a_users_schedule_csv_and_dualpipe_checkpoints(tmp_path):
    # a V schedule written as CSV (here by refpar schedule zbv --csv), trained from the file
    path = tmp_path / "zbv.csv"
    path.write_text(to_csv(build("zbv", 2, 4)))
    out = refpar_json(2, "train", "--mesh", "pp=2", "--schedule-csv", str(path), "--microbatches", "4",
                      "--steps", "2", "--check")
    assert out["schedule"] == "csv"
    assert within(out["max_loss_rel_diff"], CONTRACT) and within(out["max_param_rel_diff"], CONTRACT)
    rows = {tuple(sorted(r.items())) for r in out["comm_bytes"]}
    assert rows == {tuple(sorted(r.items())) for r in out["expected_comm_bytes"]}
    assert out["memory_peak_bytes"] == out["expected_memory_peak_bytes"]
    # DualPipe saves each element once (one rank of each mirror pair) and resumes on its own mesh
    # bit for bit (the same operations) and on one process within the float64 contract
    common = ("train", "--mesh", "pp=2", "--schedule", "dualpipe", "--microbatches", "4", "--steps", "3",
              "--batch-size", "4", "--seq-len", "8")
    full = refpar_json(2, *common, "--save", str(tmp_path / "ck"), "--save-every", "2")["losses"]
    step2 = str(tmp_path / "ck" / "step-00000002")
    assert refpar_json(2, *common, "--resume", step2)["losses"] == full[2:]
    from refpar.config import TrainConfig, model_preset
    from refpar.trainer import train_single_device

    one = train_single_device(model_preset("tiny"), TrainConfig(steps=3, batch_size=4, seq_len=8),
                              resume=step2).losses
    assert within(abs(one[0] - full[2]) / abs(full[2]), CONTRACT)


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "dualpipe", "--microbatches", "3"], "needs m even and at least 2p = 4"),
    (["--mesh", "pp=3", "--schedule", "dualpipe", "--microbatches", "6"], "needs an even number of ranks"),
    (["--schedule", "zbv", "--chunks", "3", "--microbatches", "4"], "places two stages on every rank"),
    (["--schedule", "zbv", "--microbatches", "4", "--n-layer", "3"],
     "4 pipeline stages need at least 4 blocks"),
    (["--schedule-csv", "no/such.csv"], "no such file"),
    (["--mesh", "pp=2,ep=2", "--moe-experts", "4", "--schedule", "dualpipe", "--microbatches", "4"],
     "sends each microbatch through one copy only"),
])
def test_train_command_bad_v_input_is_one_sentence_before_mpi(argv, words, capsys):
    argv = ["train", "--mesh", "pp=2", *argv] if "--mesh" not in argv else ["train", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


@pytest.mark.parametrize("rows, flags, words", [
    (3, ["--microbatches", "4"], "has 3 ranks but the mesh has pp=2"),
    (2, ["--microbatches", "2"], "runs 4 microbatches; give --microbatches 4"),
    (2, ["--microbatches", "4", "--schedule", "zbv"], "each give the schedule; drop one"),
    (2, ["--microbatches", "4", "--chunks", "2"], "drop --chunks"),
    ("broken", ["--microbatches", "4"], "needs 1F0, which rank 1 runs later"),
])
def test_train_command_bad_schedule_csv_is_one_sentence_before_mpi(tmp_path, capsys, rows, flags, words):
    text = to_csv(build("zbv", 2, 4) if rows != 3 else build("zbv", 3, 4))
    if rows == "broken":  # rank 1's input gradient of microbatch 0 before its forward
        first, second = text.splitlines()
        cells = second.split(",")
        a, b = cells.index("1F0"), cells.index("1I0")
        cells[a], cells[b] = cells[b], cells[a]
        text = "\n".join([first, ",".join(cells)]) + "\n"
    path = tmp_path / "s.csv"
    path.write_text(text)
    assert main(["train", "--mesh", "pp=2", "--schedule-csv", str(path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


def test_a_schedule_csv_whose_ends_or_copies_the_sums_cannot_pair_is_one_sentence(tmp_path, capsys):
    # the tied wte is summed over ranks 0 and p-1, DualPipe's copies over the mirror ranks r, p-1-r
    swapped = to_csv(build("1f1b", 3, 3)).splitlines()
    swapped[0], swapped[1] = swapped[1], swapped[0]  # stage 0 on rank 1: the ends on ranks 1 and 2
    mirrored = to_csv(build("dualpipe", 4, 8)).splitlines()
    mirrored[0], mirrored[1] = mirrored[1], mirrored[0]  # copy 0's part 0 on rank 1, copy 1's still on 3
    cases = [(3, "\n".join(swapped) + "\n", "on ranks [1, 2]; put them on ranks 0 and 2"),
             (4, "\n".join(mirrored) + "\n", "on the mirror rank p-1-r")]
    for p, text, words in cases:
        path = tmp_path / f"p{p}.csv"
        path.write_text(text)
        argv = ["train", "--mesh", f"pp={p}", "--n-layer", "8", "--schedule-csv", str(path),
                "--microbatches", str(p if p == 3 else 8)]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
