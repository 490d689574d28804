"""Mixed precision on one device: fp32 compute around 16-bit arrays, master weights, loss scaling.

Unit roundoff u (half an ulp at 1, the largest relative error of one rounding): bf16 has 8
significand bits, u = 2^-8 ~ 0.39%; fp16 has 11, u = 2^-11 ~ 0.049%. Every bound below is a small
multiple of u, with the reason next to it.
"""

import json

import numpy as np
import pytest

from refpar import checkpoint
from refpar.cli import main
from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.model import init_params, loss_and_grads
from refpar.model.attention import attention_backward, attention_forward
from refpar.model.data import MarkovCorpus
from refpar.model.layers import (
    cross_entropy_backward,
    cross_entropy_forward,
    gelu_backward,
    gelu_forward,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
)
from refpar.model.optim import mixed_adamw_update, optimizer_init, optimizer_step
from refpar.precision import MASTER_DTYPE, LossScaler, dtype_of, is_16bit
from refpar.trainer import train_single_device
from tests.numerics import within

UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
U32 = 2.0 ** -24  # fp32's, for what is computed in fp32 (MASTER_DTYPE)
SIXTEEN = tuple(UNIT_ROUNDOFF)


def _rounded(rng, shape, dtype, scale=1.0):
    """A random array rounded to `dtype`, and the same values in float64."""
    a = (rng.standard_normal(shape) * scale).astype(dtype_of(dtype))
    return a, a.astype(np.float64)


def _float_arrays(tree):
    if isinstance(tree, tuple | list):
        for x in tree:
            yield from _float_arrays(x)
    elif hasattr(tree, "dtype") and tree.dtype.kind in "fV" and tree.ndim >= 1:
        yield tree


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_each_layer_computes_in_fp32_and_rounds_its_outputs_once(dtype):
    """Given inputs already in 16 bits, a forward output is the float64 result on the same values
    rounded once: elementwise error <= u |ref| plus fp32's own error (relative 2^-24 per operation,
    so <= 1e-5 of the output's scale for these sizes). Backward reads 16-bit caches (xhat, the
    attention probabilities), which each carry one rounding, so its gradients are within 4u of
    float64 normwise. Caches and outputs are 16-bit; the loss stays fp32."""
    u, rng = UNIT_ROUNDOFF[dtype], np.random.default_rng(0)
    x16, x64 = _rounded(rng, (2, 8, 16), dtype)
    w16, w64 = _rounded(rng, (16, 24), dtype, 0.3)
    b16, b64 = _rounded(rng, (24,), dtype)
    g16, g64 = _rounded(rng, (16,), dtype)
    q16, q64 = _rounded(rng, (2, 2, 8, 8), dtype)
    k16, k64 = _rounded(rng, (2, 2, 8, 8), dtype)
    v16, v64 = _rounded(rng, (2, 2, 8, 8), dtype)
    pos = np.arange(8)
    targets = rng.integers(0, 24, (2, 8))
    cases = {  # name: (forward, backward, 16-bit inputs, float64 inputs)
        "linear": (linear_forward, linear_backward, (x16, w16, b16), (x64, w64, b64)),
        "layernorm": (layernorm_forward, layernorm_backward, (x16, g16, g16), (x64, g64, g64)),
        "gelu": (gelu_forward, gelu_backward, (x16,), (x64,)),
        "attention": (attention_forward, attention_backward, (q16, k16, v16, pos, pos),
                      (q64, k64, v64, pos, pos)),
    }
    for name, (fwd, bwd, in16, in64) in cases.items():
        out16, cache16 = fwd(*in16)
        out64, cache64 = fwd(*in64)
        err = np.abs(out16.astype(np.float64) - out64)
        allowed = u * np.abs(out64) + 1e-5 * np.abs(out64).max()
        print(f"{name}: forward max err / allowed {np.max(err / allowed):.2f}")
        assert out16.dtype == dtype_of(dtype) and within(np.max(err / allowed), 1.0), name
        assert all(is_16bit(a.dtype) for a in _float_arrays(cache16)), name
        dout16, _ = _rounded(rng, out16.shape, dtype)
        grads16 = bwd(dout16, cache16)
        grads64 = bwd(dout16.astype(np.float64), cache64)
        grads16 = grads16 if isinstance(grads16, tuple) else (grads16,)
        grads64 = grads64 if isinstance(grads64, tuple) else (grads64,)
        for a, r in zip(grads16, grads64, strict=True):
            rel = np.linalg.norm(a.astype(np.float64) - r) / np.linalg.norm(r)
            print(f"{name}: backward rel err {rel / u:.2f} u")
            assert a.dtype == dtype_of(dtype) and within(rel, 4 * u), name

    logits16, logits64 = _rounded(rng, (2, 8, 24), dtype)
    loss16, c16 = cross_entropy_forward(logits16, targets, 16)
    loss64, c64 = cross_entropy_forward(logits64, targets, 16)
    # The same 16-bit logits, the loss in fp32: per token, V = 24 exponentials (z = l - max l is
    # exact) summed within (V + 1) u32 relative, so log(sum) within (V + 1) u32 absolute plus its own
    # rounding; the mean of N = 16 terms log(sum) - z_target >= 0 adds (N + 1) u32 relative.
    V, N = logits16.shape[-1], targets.size
    ce_bound = U32 * ((V + 1) + (N + 2) * float(loss64))
    assert loss16.dtype == MASTER_DTYPE and within(abs(float(loss16) - float(loss64)), ce_bound)
    d16, d64 = cross_entropy_backward(1.0, c16), cross_entropy_backward(1.0, c64)
    assert d16.dtype == dtype_of(dtype)
    assert within(np.linalg.norm(d16.astype(np.float64) - d64), 2 * u * np.linalg.norm(d64))


def test_16bit_init_is_the_float64_init_rounded_once_and_master_is_that_value_in_fp32():
    p64 = init_params(model_preset("tiny"), 3)
    for dtype in SIXTEEN:
        p16 = init_params(model_preset("tiny", dtype=dtype), 3)
        state = optimizer_init(p16, TrainConfig())
        for name, p in p16.items():
            assert p.dtype == dtype_of(dtype)
            assert np.array_equal(p.view(np.uint16), p64[name].astype(p.dtype).view(np.uint16)), name
            assert state["master"][name].dtype == MASTER_DTYPE
            assert np.array_equal(state["master"][name], p.astype(np.float32)), name
            assert state["m"][name].dtype == MASTER_DTYPE == state["v"][name].dtype


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype, dloss", [("bfloat16", 1.0), ("float16", 2.0 ** 12)])
def test_16bit_gradients_are_the_float64_gradients_within_8_unit_roundoffs(dtype, dloss, preset):
    """The whole model (4 blocks, GPT-2's with dropout on) on the same rounded weights: each
    parameter's gradient is within 8u of float64's, normwise. Each op adds about one rounding of its
    output, and a gradient passes through ~10 ops per block (measured worst: GPT-2 2.3u bf16, ~2u
    fp16; Llama, whose RoPE tables are rounded to 16 bits as HF rounds them, 3.0u and 3.1u). fp16 runs
    with a loss scale, as it trains: unscaled, gradients below 2^-14 lose bits as subnormals."""
    u = UNIT_ROUNDOFF[dtype]
    model16, model64 = model_preset(preset, dtype=dtype), model_preset(preset)
    p16 = init_params(model16, 1234)
    p64 = {n: a.astype(np.float64) for n, a in p16.items()}
    tokens, targets = MarkovCorpus(96, 1234).batch(0, range(8), 16)
    loss16, g16 = loss_and_grads(p16, tokens, targets, model16, seed=1234, dloss=dloss)
    loss64, g64 = loss_and_grads(p64, tokens, targets, model64, seed=1234)
    assert within(abs(loss16 - loss64), u * loss64)
    worst = 0.0
    for name, g in g64.items():
        assert g16[name].dtype == dtype_of(dtype)
        rel = np.linalg.norm(g16[name].astype(np.float64) / dloss - g) / np.linalg.norm(g)
        worst = max(worst, rel)
        assert within(rel, 8 * u), (name, rel / u)
    print(f"{dtype}: worst gradient rel err {worst / u:.2f} u")


def test_bf16_and_fp16_loss_curves_track_float64_for_30_steps():
    """Same init (rounded), data and dropout: step 1's losses differ by ~1e-6 (rounded weights);
    then AdamW, which moves each weight by about lr whatever the gradient's size, turns the rounding
    differences of near-zero gradients into different steps, so the curves drift apart slowly.
    Measured over 30 steps of the tiny model: bf16 max 1.9% (mean 0.4%), fp16 max 0.36%. Bands:
    4% per step for bf16 and 1% for fp16, and the last ten steps' mean within 1% for both."""
    train = TrainConfig(steps=30)
    ref = np.array(train_single_device(model_preset("tiny"), train).losses)
    for dtype, band in (("bfloat16", 0.04), ("float16", 0.01)):
        run = train_single_device(model_preset("tiny", dtype=dtype), train)
        losses = np.array(run.losses)
        rel = np.abs(losses - ref) / ref
        tail = abs(losses[-10:].mean() - ref[-10:].mean()) / ref[-10:].mean()
        print(f"{dtype}: max rel {rel.max():.4f} at step {rel.argmax()}, last-ten mean rel {tail:.5f}")
        assert within(rel.max(), band) and within(tail, 0.01)
        assert run.params["wte.weight"].dtype == dtype_of(dtype)
        assert ref[-10:].mean() < ref[0] - 1.0  # it learned: the comparison is not of two flat lines
    assert run.skipped_steps == [] and run.loss_scales == [2.0 ** 16] * 30


def test_fp16_loss_scaling_skips_overflowing_steps_halves_the_scale_and_grows_after_the_window():
    """Starting at 2^30 the scaled gradients overflow fp16 (max 65504): those steps are skipped
    (params, master and moments untouched: a run of only such steps ends on its init, bit for bit)
    and the scale halves each time; once it fits, training proceeds, and every `window` good steps in
    a row the scale doubles (and may overflow and halve again): the recorded scales follow that
    rule exactly."""
    model, window = model_preset("tiny", n_layer=2, dtype="float16"), 4
    train = TrainConfig(steps=30, batch_size=4, seq_len=8, loss_scale=2.0 ** 30, loss_scale_window=window)
    run = train_single_device(model, train)
    skipped, scales = run.skipped_steps, run.loss_scales
    first_good = next(s for s in range(train.steps) if s not in skipped)
    print(f"skipped {skipped}; scales {scales}")
    assert first_good >= 5 and skipped[:first_good] == list(range(first_good))
    scaler = LossScaler(2.0 ** 30, window)
    for step, scale in enumerate(scales):
        assert scale == scaler.scale, step
        scaler.update(step in skipped)
    assert any(b == 2 * a for a, b in zip(scales, scales[1:], strict=False))  # it grew
    assert np.mean(run.losses[-5:]) < run.losses[0] - 0.3  # and trained after recovering

    only_skipped = train_single_device(model, TrainConfig(**{**train.to_dict(), "steps": first_good}))
    init = init_params(model, train.seed)
    assert only_skipped.skipped_steps == list(range(first_good))
    for name, p in init.items():
        assert np.array_equal(only_skipped.params[name].view(np.uint16), p.view(np.uint16)), name


def test_loss_scaler_backs_off_on_overflow_and_grows_after_growth_interval_good_steps():
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    for found_inf, expected in [(False, 1024), (False, 1024), (False, 2048), (True, 1024),
                                (False, 1024), (False, 1024), (True, 512), (False, 512)]:
        s.update(found_inf)
        assert s.scale == expected
    assert s.skipped == 2
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizer_keeps_16bit_params_equal_to_the_rounded_fp32_master_and_skips_untouched(optimizer):
    """After every step p16 == round(master); an update smaller than half a bf16 ulp leaves p16 as
    it is but moves master (why master weights exist); a skipped step returns every state as is."""
    cfg = TrainConfig(lr=1e-4, optimizer=optimizer, weight_decay=0.1)
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((8, 4)).astype(dtype_of("bfloat16")),
              "b": rng.standard_normal((4,)).astype(dtype_of("bfloat16"))}
    state = optimizer_init(params, cfg)
    master0 = {n: a.copy() for n, a in state["master"].items()}
    for step in range(3):
        grads = {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in params.items()}
        new, new_state = optimizer_step(params, grads, state, cfg, lr=cfg.lr, grad_factor=0.5)
        for n, p in new.items():
            assert p.dtype == params[n].dtype and new_state["master"][n].dtype == MASTER_DTYPE
            assert np.array_equal(p, new_state["master"][n].astype(p.dtype)), (step, n)
        assert new_state["t"] == state["t"] + 1
        same, same_state = optimizer_step(new, grads, new_state, cfg, lr=cfg.lr, skip=True)
        assert same is new and same_state is new_state
        params, state = new, new_state
    for n, p in params.items():  # steps of ~1e-4 against bf16's half ulp of 2^-9 near 1:
        master_moved = state["master"][n] != master0[n]
        p16_moved = p != master0[n].astype(p.dtype)
        assert master_moved.mean() > 0.9 and (master_moved & ~p16_moved).mean() > 0.5, n


def test_mixed_adamw_update_on_a_flat_shard_equals_the_dict_step():
    """ZeRO and FSDP update flat shards: elementwise, so two halves give the whole array's bits."""
    cfg = TrainConfig()
    rng = np.random.default_rng(2)
    p = rng.standard_normal((6, 5)).astype(dtype_of("bfloat16"))
    g = rng.standard_normal((6, 5)).astype(p.dtype)
    state = optimizer_init({"w": p}, cfg)
    whole, whole_state = optimizer_step({"w": p}, {"w": g}, state, cfg, lr=cfg.lr, grad_factor=0.25)
    flat = [a.reshape(-1) for a in (p, g, state["master"]["w"], state["m"]["w"], state["v"]["w"])]
    parts = [mixed_adamw_update(*(a[s] for a in flat), 1, cfg, True, cfg.lr, grad_factor=0.25)
             for s in (slice(0, 13), slice(13, 30))]
    for i, key in enumerate(["p16", "master", "m", "v"]):
        joined = np.concatenate([part[i] for part in parts])
        want = whole["w"] if key == "p16" else whole_state[key]["w"]
        assert np.array_equal(joined, want.reshape(-1)), key


@pytest.mark.parametrize("dtype, loss_scale", [("bfloat16", None), ("float16", 2.0 ** 24)])
def test_16bit_checkpoint_stores_bit_patterns_and_resumes_bit_for_bit(tmp_path, dtype, loss_scale):
    """bf16 cannot go through .npy without pickle: shards hold uint16 bit patterns, the manifest the
    true dtype, plus fp32 master weights, the optimizer's t and the loss scaler. fp16 starts at
    2^24, so steps are skipped before and after the save (t != step, the scale must resume)."""
    model = model_preset("tiny", n_layer=1, dtype=dtype)
    train = TrainConfig(steps=6, batch_size=4, seq_len=8, loss_scale=loss_scale,
                        loss_scale_window=2 if loss_scale else None)
    full = train_single_device(model, train, save=str(tmp_path), save_every=3)
    resumed = train_single_device(model, train, resume=str(tmp_path / "step-00000003"))
    assert resumed.losses == full.losses[3:] and resumed.skipped_steps == [
        s for s in full.skipped_steps if s >= 3]
    for name, p in full.params.items():
        assert resumed.params[name].dtype == p.dtype
        assert np.array_equal(resumed.params[name].view(np.uint16), p.view(np.uint16)), name
    man = json.loads((tmp_path / "step-00000006" / "manifest.json").read_text())
    assert man["tensors"]["params/wte.weight"]["dtype"] == dtype
    assert man["tensors"]["master/wte.weight"]["dtype"] == "float32"
    assert man["tensors"]["adamw.m/wte.weight"]["dtype"] == "float32"
    with np.load(tmp_path / "step-00000006" / "rank00000.npz", allow_pickle=False) as npz:
        assert {npz[k].dtype for k in npz.files} == {np.dtype(np.uint16), np.dtype(np.float32)}
    if loss_scale:
        assert full.skipped_steps and man["optimizer_t"] == 6 - len(full.skipped_steps)
        replay = LossScaler(2.0 ** 24, 2)
        for step in range(6):
            replay.update(step in full.skipped_steps)
        assert man["loss_scaler"] == replay.state_dict()
    assert checkpoint.find(tmp_path).name == "step-00000006"


def test_fp16_progress_line_and_json_show_the_precision_scale_and_skipped_steps(capsys):
    assert main(["train", "--precision", "fp16-mixed", "--steps", "3", "--batch-size", "2",
                 "--seq-len", "4", "--loss-scale", "1e30", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "fp16-mixed" in out[0] and "loss scale" in out[3] and "skipped" in out[3]
    assert out[4].split()[-2:] == ["1e+30", "1"]
    summary = json.loads(out[-1])
    assert summary["precision"] == "fp16-mixed" and summary["dtype"] == "float16"
    assert summary["loss_scaling"] == {"scales": [1e30, 5e29, 2.5e29], "final_scale": 2.5e29,
                                       "skipped_steps": [0, 1, 2]}


@pytest.mark.parametrize("args, words", [
    (["--precision", "bf16"], "invalid choice: 'bf16'"),
    (["--precision", "fp32", "--dtype", "float64"], "--dtype and --precision both set the precision"),
    (["--precision", "bf16-mixed", "--loss-scale", "1024"], "loss scaling applies to fp16-mixed only"),
    (["--precision", "fp16-mixed", "--loss-scale", "0"], "loss_scale=0.0 must be a positive finite"),
    (["--precision", "fp16-mixed", "--loss-scale-window", "0"], "loss_scale_window=0 must be a whole"),
    (["--precision", "fp64", "--fp32-grads"], "--fp32-grads applies to bf16-mixed and fp16-mixed"),
    (["--precision", "fp16-mixed", "--loss-scale", "inf"], "loss_scale=inf must be a positive finite"),
])
def test_bad_precision_flags_are_one_sentence(capsys, args, words):
    try:
        code = main(["train", "--steps", "1", *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_dtype_is_a_config_error():
    # (fp16 with experts runs: refpar/parallel/expert_parallel.py scales the router losses)
    TrainConfig().check_model(model_preset("tiny", dtype="float16", moe_experts=2))
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        model_preset("tiny", dtype="float8")


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("moe_experts", [0, 4])
def test_gradients_from_a_power_of_two_loss_scale_are_the_unscaled_ones_times_it_exactly(moe_experts,
                                                                                         preset):
    """In float64, scaling by 2^k commutes with every rounding, so loss scaling is exact: the
    gradients of dloss=8 are 8 times those of dloss=1 bit for bit, MoE router losses included (their
    gradients must scale with the task loss's; Llama's experts are Mixtral's), and the loss itself
    is unscaled."""
    model = model_preset(preset, n_layer=2, moe_experts=moe_experts, moe_top_k=2 if moe_experts else 1)
    params = init_params(model, 5)
    tokens, targets = MarkovCorpus(96, 5).batch(0, range(4), 8)
    loss1, g1 = loss_and_grads(params, tokens, targets, model, seed=5)
    loss8, g8 = loss_and_grads(params, tokens, targets, model, seed=5, dloss=8.0)
    assert loss8 == loss1
    for name, g in g1.items():
        assert np.array_equal(g8[name], 8.0 * g), name


def test_fp32_grads_keep_each_ops_16bit_gradient_and_sum_the_tied_wte_in_fp32():
    """--fp32-grads: each op's gradient still leaves it rounded to 16 bits (so every untied
    gradient is the 16-bit one, upcast), but sums happen in fp32: the tied wte's head and embedding
    shares add in fp32, and rounding that sum once gives the default run's 16-bit gradient."""
    model = model_preset("tiny", n_layer=1, dtype="bfloat16")
    params = init_params(model, 9)
    tokens, targets = MarkovCorpus(96, 9).batch(0, range(4), 8)
    _, g16 = loss_and_grads(params, tokens, targets, model, seed=9)
    _, g32 = loss_and_grads(params, tokens, targets, model, seed=9, grad_dtype=MASTER_DTYPE)
    for name, g in g32.items():
        assert g.dtype == MASTER_DTYPE
        if name != "wte.weight":
            assert np.array_equal(g, g16[name].astype(np.float32)), name
    assert np.array_equal(g32["wte.weight"].astype(g16["wte.weight"].dtype), g16["wte.weight"])
    run = train_single_device(model, TrainConfig(steps=2, batch_size=4, seq_len=8, fp32_grads=True))
    assert run.params["wte.weight"].dtype == dtype_of("bfloat16")
