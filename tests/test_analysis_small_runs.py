"""For the models refpar runs, the planner's closed forms equal the exact small-run ones.

refpar/analysis/memory.py and comm_volume.py give, to the byte, what the ledger and the trace of a
data-parallel or ZeRO run show (tests/test_zero_closed_forms.py checks them against real runs).
The planner's vectorised forms, fed the same model and a float64 AdamW precision, must give the
same numbers wherever every flat unit splits evenly over the ranks.
"""

import pytest

from refpar.analysis import comm_volume, memory
from refpar.analysis.hardware import HARDWARE
from refpar.analysis.presets import from_model_config
from refpar.analysis.scale import PRECISIONS, memory_per_rank
from refpar.analysis.step_time import step_time
from refpar.config import model_preset

STRATEGIES = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


@pytest.mark.parametrize("strategy, stage", list(STRATEGIES.items()))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_planner_model_states_equal_the_ledger_closed_forms(strategy, stage, n):
    config = model_preset("tiny")
    assert all(size % n == 0 for size in memory.unit_sizes(config).values())
    planned = memory_per_rank(from_model_config(config), micro_batch=1, seq=config.n_positions,
                              dp=n, zero=stage, precision=PRECISIONS["float64"])
    exact = memory.model_state_bytes(config, n, 0, memory.Options(strategy=strategy))
    for category in ("params", "grads", "master", "optimizer"):
        assert planned[category] == exact[category], category


@pytest.mark.parametrize("strategy, stage", list(STRATEGIES.items()))
def test_planner_bf16_model_states_equal_the_mixed_precision_ledger_closed_forms(strategy, stage):
    # The planner's default precision is the ZeRO paper's (2 + 2 + 4 + 8 bytes per parameter):
    # exactly what a bf16-mixed refpar run holds.
    n, config = 4, model_preset("tiny", dtype="bfloat16")
    planned = memory_per_rank(from_model_config(config), micro_batch=1, seq=config.n_positions,
                              dp=n, zero=stage, precision=PRECISIONS["bf16"])
    opts = memory.Options(strategy=strategy, **memory.precision_options("bfloat16"))
    exact = memory.model_state_bytes(config, n, 0, opts)
    for category in ("params", "grads", "master", "optimizer"):
        assert planned[category] == exact[category], category


@pytest.mark.parametrize("strategy, stage", list(STRATEGIES.items()))
@pytest.mark.parametrize("n, microbatches", [(2, 1), (4, 2), (8, 4)])
def test_planner_data_parallel_bytes_equal_the_trace_closed_forms(strategy, stage, n, microbatches):
    config = model_preset("tiny")
    spec = from_model_config(config)
    _, planned, _ = step_time(spec, HARDWARE["a100"], global_batch=n * microbatches, micro_batch=1,
                              seq=config.n_positions, dp=n, zero=stage,
                              precision=PRECISIONS["float64"], dtype="float64")
    opts = memory.Options(strategy=strategy, microbatches=microbatches)
    exact = comm_volume.step_bytes(config, n, 0, opts, loss=False)
    assert planned["dp"] == sum(b.sent for b in exact.values())


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_planner_block_activations_equal_the_tp_closed_forms_term_for_term(t, sp):
    # refpar/analysis/activations.py writes Korthikanti et al.'s terms for refpar's tensors;
    # with the paper's list (PAPER: 1-byte masks, no LayerNorm rstd, no kept tanh) its block is
    # the planner's, for the same model, batch and mesh.
    from refpar.analysis import activations
    from refpar.analysis.intra_layer import rank_shape
    from refpar.analysis.scale import Precision, layer_activation_bytes
    from refpar.config import TrainConfig

    config, train = model_preset("tiny"), TrainConfig(batch_size=4, seq_len=32)
    r = rank_shape(config, train, {"tp": t}, {"tp": 0}, sp, None)
    exact = activations.layer_bytes(config, r, "local", True, activations.PAPER)
    planned = layer_activation_bytes(from_model_config(config), train.batch_size, train.seq_len,
                                     tp=t, sp=sp, precision=Precision(activation=8, mask=1))
    assert planned == exact


@pytest.mark.parametrize("stage", [2, 3])
def test_planner_equals_what_a_real_zero_run_traces_and_its_ledger_holds(stage):
    # A real 2-rank run (`refpar train --mesh dp=2 --zero S --microbatches 2 --json`): the dp
    # bytes its trace shows (less the loss's one-float all-reduce, which the planner leaves out)
    # and its ledger's optimizer state (and weights, unsharded below stage 3) are the planner's.
    from refpar.comm import cost
    from refpar.config import TrainConfig
    from tests.mpi import refpar_json

    summary = refpar_json(2, "train", "--mesh", "dp=2", "--zero", str(stage), "--steps", "1",
                          "--microbatches", "2", timeout=120)
    train, config = TrainConfig(), model_preset("tiny")
    planned_memory = memory_per_rank(from_model_config(config), micro_batch=train.batch_size // 4,
                                     seq=train.seq_len, dp=2, zero=stage,
                                     precision=PRECISIONS["float64"])
    _, planned_bytes, _ = step_time(from_model_config(config), HARDWARE["a100"],
                                    global_batch=train.batch_size, micro_batch=train.batch_size // 4,
                                    seq=train.seq_len, dp=2, zero=stage,
                                    precision=PRECISIONS["float64"], dtype="float64")
    for rank in (0, 1):
        traced = sum(r["bytes_sent"] for r in summary["comm_bytes"] if r["rank"] == rank)
        loss = cost.all_reduce_bytes(1, 2, rank, 8).sent
        assert traced - loss == planned_bytes["dp"]
        held = {r["category"]: r["bytes"] for r in summary["memory_peak_bytes"] if r["rank"] == rank}
        assert held["optimizer"] == planned_memory["optimizer"]
        if stage < 3:
            assert held["params"] == planned_memory["params"]


def test_planner_equals_what_a_real_pipeline_run_traces_and_its_ledger_holds():
    # A real 2-stage 1F1B run: the first stage's pp bytes (its activations out, the tied
    # embedding's gradient all-reduced with the last stage) and its weights and AdamW state.
    from refpar.comm import cost
    from refpar.config import TrainConfig
    from tests.mpi import refpar_json

    summary = refpar_json(2, "train", "--mesh", "pp=2", "--schedule", "1f1b", "--microbatches", "4",
                          "--steps", "1", timeout=120)
    train, config = TrainConfig(), model_preset("tiny")
    spec, micro = from_model_config(config), train.batch_size // 4
    kw = dict(micro_batch=micro, seq=train.seq_len, pp=2, schedule="1f1b",
              precision=PRECISIONS["float64"])
    _, planned_bytes, _ = step_time(spec, HARDWARE["a100"], global_batch=train.batch_size,
                                    dtype="float64", **kw)
    traced = sum(r["bytes_sent"] for r in summary["comm_bytes"] if r["rank"] == 0 and r["axis"] == "pp")
    loss = cost.all_reduce_bytes(1, 2, 0, 8).sent  # the printed loss, summed over the stages
    assert traced - loss == planned_bytes["pp"]
    planned = memory_per_rank(spec, microbatches=4, **kw)
    held = {r["category"]: r["bytes"] for r in summary["memory_peak_bytes"] if r["rank"] == 0}
    assert held["params"] == planned["params"] and held["optimizer"] == planned["optimizer"]


@pytest.mark.parametrize("ep, k", [(2, 1), (4, 2)])
def test_planner_expert_parallel_bytes_equal_the_moe_closed_form(ep, k):
    # refpar/analysis/moe.py's balanced dropless all-to-all bytes (which the MoE tests hold
    # against real runs) per MoE block, summed over the blocks, are the planner's ep bytes.
    from refpar.analysis import moe

    config = model_preset("tiny", moe_experts=4, moe_top_k=k, moe_dropless=True)
    train_batch, seq, micro = 8, 16, 1
    spec = from_model_config(config)
    _, planned, _ = step_time(spec, HARDWARE["a100"], global_batch=train_batch, micro_batch=micro,
                              seq=seq, ep=ep, precision=PRECISIONS["float64"], dtype="float64")
    per_block = moe.expected_all_to_all_bytes(config, train_batch // ep * seq, ep, ep, 8)
    assert planned["ep"] == pytest.approx(len(config.moe_blocks) * per_block, rel=1e-12)


@pytest.mark.parametrize("sizes, sp", [({"tp": 2}, False), ({"tp": 2}, True), ({"tp": 4}, True),
                                       ({"cp": 2}, False), ({"tp": 2, "cp": 2}, False)])
def test_planner_tensor_and_context_bytes_equal_every_call_refpar_makes(sizes, sp):
    # refpar/analysis/intra_layer.py lists every tp and cp call of a step (checked against the
    # trace of real runs); the planner's bytes per axis are their sum, on rank 0. The planner
    # counts the gradients' all-reduce over the ranks that share weights (dp x ep x cp) as dp.
    from refpar.analysis.intra_layer import expected_calls
    from refpar.config import TrainConfig

    config, train = model_preset("tiny"), TrainConfig()
    calls = expected_calls(config, train, sizes, dict.fromkeys(sizes, 0), sp)
    _, planned, _ = step_time(from_model_config(config), HARDWARE["a100"],
                              global_batch=train.batch_size, micro_batch=train.batch_size,
                              seq=train.seq_len, tp=sizes.get("tp", 1), cp=sizes.get("cp", 1),
                              sp=sp, precision=PRECISIONS["float64"], dtype="float64")
    assert planned["tp"] == sum(c.bytes_sent for c in calls if c.axis == "tp")
    assert planned["cp"] == sum(c.bytes_sent for c in calls if c.axis == "cp" and c.op == "isend")
    # the gradients' bucket, summed over the ranks holding the same weights (dp x cp, axis dp_cp)
    grads = [c for c in calls if c.axis == "dp_cp" and c.op == "all_reduce" and c.tag.startswith("bucket")]
    assert planned["dp"] == sum(c.bytes_sent for c in grads)
