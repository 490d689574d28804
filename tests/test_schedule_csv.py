"""Schedules exchanged with torch.distributed.pipelining as CSV, torch 2.13 on each side: what
torch's own schedule classes dump with torch's CSV writer loads into refpar, validates and
simulates (and for ZB-V and DualPipeV is refpar's builder, action for action); what refpar writes
loads in torch's loader, passes torch's validation and comes back as written."""

import pytest

pytest.importorskip("torch")

from refpar.conformance.schedule_csv import TORCH, dump, fake_group, load  # noqa: E402
from refpar.schedules.builders import build  # noqa: E402
from refpar.schedules.formats import from_csv, to_csv  # noqa: E402
from refpar.schedules.simulate import Costs, simulate, validate  # noqa: E402

MICROBATCHES = {2: 4, 3: 6, 4: 8}  # p -> m: 2p, what DualPipeV needs (torch: m >= the 2p stages)


@pytest.fixture(scope="module", params=sorted(MICROBATCHES), ids=lambda p: f"p{p}")
def group(request):
    with fake_group(request.param):
        yield request.param


def _orders(schedule):
    return {r: [a for a in row if a is not None] for r, row in schedule.items()}


@pytest.mark.parametrize("name", sorted(TORCH))
def test_a_schedule_torch_dumps_loads_into_refpar_and_runs(group, name):
    p, m = group, MICROBATCHES[group]
    text = dump(name, p, m)
    schedule = from_csv(text)
    lay = validate(schedule)
    assert lay.n_stages == 2 * p and lay.n_microbatches == m
    assert to_csv(schedule) == text  # refpar writes back what torch wrote, byte for byte
    # every rank runs F, B and W of its two stages for every microbatch: 6m ticks of work (an
    # overlapped pair priced as its sum: F + the full backward's B + W)
    timeline = simulate(schedule, Costs(1, 1, 1, overlap="sum"))
    assert [timeline.busy_time(r) for r in range(p)] == [6 * m] * p
    ours = TORCH[name][0]
    if ours is not None:  # the same paper's order: the same actions on every rank, in order
        assert _orders(schedule) == _orders(build(ours, p, m))


def test_zbv_with_fewer_microbatches_than_its_pattern_is_torchs_too(group):
    # Qi et al.'s ZB-V fills its phases with 2p-1 microbatches; with fewer, torch builds the
    # pattern for 2p-1 and drops the missing ones, and so does refpar
    p, m = group, group
    schedule = from_csv(dump("ZBVZeroBubble", p, m))
    validate(schedule)
    assert _orders(schedule) == _orders(build("zbv", p, m))


LOADERS = [("ZBVZeroBubble", "zbv"), ("ZBVZeroBubble", "v-half"), ("ZBVZeroBubble", "v-min"),
           ("DualPipeV", "dualpipev"), ("InterleavedZeroBubble", "interleaved-1f1b")]


@pytest.mark.parametrize("name, kind", LOADERS)
def test_a_schedule_refpar_dumps_loads_in_torchs_loader(group, name, kind):
    # torch's loader takes any compute-only schedule of its class's placement (V, or the loop's
    # stage = chunk * p + rank), checks it and infers where each stage runs
    p, m = group, MICROBATCHES[group]
    text = to_csv(build(kind, p, m))
    read = load(name, p, m, text)  # torch validates it and lowers it with its sends and receives
    assert [",".join(read[r]) for r in sorted(read)] == text.splitlines()


def test_torchs_loader_refuses_dualpipes_two_copies(group):
    # torch has no bidirectional schedule: a stage must run every microbatch, where each of
    # DualPipe's copies runs half of them. Its CSV is refpar's own.
    p, m = group, 2 * MICROBATCHES[group]
    if p % 2:
        pytest.skip("dualpipe needs an even p")
    refused = f"Got {m // 2} .*FORWARD microbatches for stage 0, expected {m}"
    with pytest.raises(AssertionError, match=refused):
        load("ZBVZeroBubble", p, m, to_csv(build("dualpipe", p, m)))
