"""Configuration checks, sharding-invariant randomness and the memory ledger."""

import numpy as np
import pytest

from refpar import rng
from refpar.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, parse_mesh
from refpar.memory import MemoryLedger


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"n_embd": 30, "n_head": 4}, "not divisible by n_head=4"),
        ({"n_layer": 0}, "n_layer must be positive"),
        ({"dtype": "float8"}, "unknown dtype"),
        ({"dropout": 1.0}, "dropout=1.0 must be in [0, 1)"),
    ],
)
def test_bad_model_config_names_what_to_change(kwargs, words):
    with pytest.raises(ConfigError, match=None) as err:
        ModelConfig(**kwargs)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_sequence_longer_than_context_is_refused():
    with pytest.raises(ConfigError, match="seq_len=64 is longer than n_positions=32"):
        TrainConfig(seq_len=64).check_model(ModelConfig(n_positions=32))


@pytest.mark.parametrize(
    "text, words",
    [("dp=2,xx=2", "unknown mesh axis 'xx'"), ("dp", "axis=size"), ("dp=two", "whole number"),
     ("dp=0", "at least 1"), ("dp=2,dp=2", "given twice"), ("", "mesh is empty")],
)
def test_bad_mesh_text_is_one_sentence(text, words):
    with pytest.raises(ConfigError) as err:
        parse_mesh(text)
    assert words in str(err.value)


def test_parallel_config_fills_missing_axes_and_multiplies():
    config = ParallelConfig(parse_mesh("dp=2, tp=3"))
    assert config.sizes == {"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 3}
    assert config.world_size == 6


def test_slice_of_full_draw_equals_draw_of_slice():
    full = rng.uniform(7, "dropout", 3, 1, 2, shape=(16, 12))
    index = (slice(4, 12), slice(6, 12))
    np.testing.assert_array_equal(
        rng.uniform(7, "dropout", 3, 1, 2, shape=(16, 12), index=index), full[index]
    )


def test_streams_depend_on_every_key_part_and_only_on_it():
    base = rng.normal(1, "init", 5, shape=(8,))
    np.testing.assert_array_equal(base, rng.normal(1, "init", 5, shape=(8,)))
    for other in (rng.normal(2, "init", 5, shape=(8,)), rng.normal(1, "data", 5, shape=(8,)),
                  rng.normal(1, "init", 6, shape=(8,)), rng.normal(1, "init", 5, 0, shape=(8,))):
        assert not np.array_equal(base, other)


def test_a_stream_is_philox_keyed_by_the_seed_sequence_of_its_key_words():
    # The documented key (rng.py): Philox's 128-bit key = SeedSequence([seed, purpose number, count
    # of ids, *ids]).generate_state(2, uint64). Written out here, so a faster construction that
    # changed a stream (and every recorded loss of the course) would fail.
    words = [7, rng.PURPOSES["dropout"], 3, 3, 1, 2]
    key = np.random.SeedSequence(words).generate_state(2, dtype=np.uint64)
    expected = np.random.Generator(np.random.Philox(key=key)).random((16, 12))
    np.testing.assert_array_equal(rng.uniform(7, "dropout", 3, 1, 2, shape=(16, 12)), expected)


def test_ledger_tracks_current_and_peak_per_category():
    ledger = MemoryLedger(record_events=True)
    ledger.alloc("w", np.zeros(10), "params")  # 80 bytes
    ledger.alloc("a0", np.zeros(4, dtype=np.float32), "activations")  # 16 bytes
    ledger.alloc("a1", 24, "activations")
    ledger.free("a0")
    ledger.free_prefix("a")
    assert ledger.current == {"params": 80, "grads": 0, "master": 0, "optimizer": 0, "activations": 0,
                              "comm": 0}
    assert ledger.peak["activations"] == 40
    assert ledger.peak_total == 120
    assert [e.delta for e in ledger.events] == [80, 16, 24, -16, -24]
    with pytest.raises(ValueError, match="already in the ledger"):
        ledger.alloc("w", 8, "params")


def test_shard_range_covers_every_item_once_with_sizes_differing_by_at_most_one():
    from refpar.sharding import shard_range, shard_sizes

    for n in range(0, 23):
        for parts in range(1, 9):
            ranges = [shard_range(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            sizes = shard_sizes(n, parts)
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
