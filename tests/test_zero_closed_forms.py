"""Closed forms of data parallelism and ZeRO: the paper's numbers, and exactness for uneven shards."""

import pytest

from refpar.analysis.comm_volume import paper_step_elems, step_bytes
from refpar.analysis.memory import (
    Options,
    bucket_sizes,
    model_state_bytes,
    paper_model_state_bytes,
    unit_sizes,
)
from refpar.config import model_preset

TINY = model_preset("tiny")
PSI = sum(unit_sizes(TINY).values())


def test_zero_paper_figure_1_per_device_memory_for_7_5b_parameters_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12 (mixed-precision Adam) gives
    # 120 GB for DP, 31.4 GB with P_os, 16.6 GB with P_os+g and 1.88 GB with P_os+g+p.
    gb = [paper_model_state_bytes(7.5e9, 64, stage) / 1e9 for stage in range(4)]
    assert [round(gb[0]), round(gb[1], 1), round(gb[2], 1), round(gb[3], 2)] == [120, 31.4, 16.6, 1.88]


def test_float64_dp_model_states_are_32_bytes_per_parameter_as_the_paper_form_with_k_16():
    state = model_state_bytes(TINY, 1, 0, Options("dp"))
    assert state == {"params": 8 * PSI, "grads": 8 * PSI, "master": 0, "optimizer": 16 * PSI}
    assert sum(state.values()) == paper_model_state_bytes(PSI, 1, 0, k=16, param_bytes=8, grad_bytes=8)


@pytest.mark.parametrize("n", [2, 3, 5, 7])
@pytest.mark.parametrize("strategy, stage", [("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp", 3)])
def test_uneven_shards_add_up_to_the_whole_model_and_stay_within_one_element_per_unit_of_psi_over_n(
        n, strategy, stage):
    opts = Options(strategy)
    per_rank = [model_state_bytes(TINY, n, r, opts) for r in range(n)]
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": True}
    for category, is_sharded in sharded.items():
        total = sum(s[category] for s in per_rank)
        bytes_per_param = 16 if category == "optimizer" else 8
        assert total == bytes_per_param * PSI * (1 if is_sharded else n)
    n_units = len(unit_sizes(TINY))
    for r in range(n):
        # Each unit's shard is floor or ceil of Ψ_u/N, so a rank is within n_units elements of Ψ/N.
        assert abs(sum(per_rank[r].values()) - paper_model_state_bytes(
            PSI, n, stage, k=16, param_bytes=8, grad_bytes=8)) <= 32 * n_units


def test_zero3_model_states_per_rank_fall_as_one_over_n_while_dp_stays_flat():
    dp = [sum(model_state_bytes(TINY, n, 0, Options("dp")).values()) for n in (1, 2, 4, 8)]
    z3 = [max(sum(model_state_bytes(TINY, n, r, Options("zero3")).values()) for r in range(n))
          for n in (1, 2, 4, 8)]
    assert len(set(dp)) == 1
    for n, ratio in zip((1, 2, 4, 8), (d / z for d, z in zip(dp, z3, strict=True)), strict=True):
        print(f"N={n}: DP/ZeRO-3 = {ratio:.4f}")
        assert n * (1 - 1e-3) <= ratio <= n


@pytest.mark.parametrize("n", [2, 4])
def test_traced_volume_forms_equal_the_paper_when_n_divides_every_unit(n):
    assert all(size % n == 0 for size in unit_sizes(TINY).values())
    def sent(opts):
        return [sum(b.sent for b in step_bytes(TINY, n, r, opts, loss=False).values()) for r in range(n)]

    for strategy, stage, factor in (("dp", 0, 2), ("zero1", 1, 2), ("zero2", 2, 2), ("zero3", 3, 3)):
        assert paper_step_elems(PSI, n, stage) == factor * (n - 1) / n * PSI
        assert sent(Options(strategy)) == [8 * paper_step_elems(PSI, n, stage)] * n
    # FSDP keeps the ends (wte, and the root of wpe and ln_f) gathered from the embedding to the
    # head: one gather less of each.
    root = unit_sizes(TINY)["wte"] + unit_sizes(TINY)["root"]
    assert sent(Options("fsdp")) == [8 * (paper_step_elems(PSI, n, 3) - (n - 1) / n * root)] * n
    # Without resharding after forward, every unit is gathered once: ZeRO-2's volume.
    assert sent(Options("fsdp", reshard_after_forward=False)) == [8 * paper_step_elems(PSI, n, 2)] * n


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("opts", [Options("dp", bucket_elems=3000), Options("zero2", microbatches=3),
                                  Options("dp", bucket_elems=3000, overlap=True),
                                  Options("zero3", microbatches=2), Options("fsdp", prefetch=True),
                                  Options("fsdp", reshard_after_forward=False)])
def test_every_byte_sent_is_received_by_someone_for_uneven_shards(n, opts):
    per_rank = [step_bytes(TINY, n, r, opts, steps=2) for r in range(n)]
    for op in set(per_rank[0]) - {"isend", "irecv"}:
        assert sum(b[op].sent for b in per_rank) == sum(b[op].recv for b in per_rank)
    if "isend" in per_rank[0]:  # a written-out ring: every isend is some rank's irecv
        assert sum(b["isend"].sent for b in per_rank) == sum(b["irecv"].recv for b in per_rank) > 0


def test_buckets_cover_every_parameter_once_and_respect_the_cap_unless_one_parameter_exceeds_it():
    for cap in (1, 100, 3000, 20000, 1 << 40):
        sizes = bucket_sizes(TINY, cap)
        assert sum(sizes) == PSI
        biggest_param = 96 * 32  # wte
        assert max(sizes) <= max(cap, biggest_param, 4 * 32 * 32)
    assert bucket_sizes(TINY, 1 << 40) == [PSI]
