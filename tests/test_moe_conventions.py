"""Routing conventions by name (the group score, norm_topk_prob, routed_scaling_factor) and shared
experts of the family's own MLP, against Hugging Face's DeepseekV3TopkRouter and DeepseekV3MoE built
from a config (no download), in float64, and against finite differences. Megatron-Core's router is
the oracle of tests/frameworks/test_megatron_router.py (it needs the megatron extra).

Hugging Face's router casts its input and weight to float32 (`.type(torch.float32)`, for bf16
models); `float64_router` makes exactly that cast a no-op for the test, and the rest of its code runs
as shipped."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from refpar.config import ConfigError, ModelConfig
from refpar.model import llama, moe
from refpar.model.moe import MoESpec, SwiGLUMLP
from refpar.model.routing import route
from tests.mpi import mpiexec, refpar_json
from tests.numerics import CONTRACT, rel_diff, within

C, F, N = 8, 6, 256  # channels, an expert's width, tokens routed
# DeepSeek-V3's layer under Hugging Face's names: one shared MLP of S times the width (no {expert})
DEEPSEEK = MoESpec(router="model.layers.{layer}.mlp.gate.weight",
                   experts="model.layers.{layer}.mlp.experts.{expert}",
                   shared="model.layers.{layer}.mlp.shared_experts", router_out_in=True,
                   mlp=SwiGLUMLP("gate_proj", "up_proj", "down_proj"))
# (E, G, M, k, norm_topk_prob, routed_scaling_factor): k/M other than 2 (floor(k/M) = 1, 1, 4), the
# issue's k = 2, M = 2 (where the former ceil(k/M) = 1 differed from Hugging Face), both norms
ROUTERS = {"k3_M2": (16, 4, 2, 3, True, 2.5), "k6_M4": (32, 8, 4, 6, False, 2.5),
           "k2_M2": (16, 4, 2, 2, True, 1.0), "k8_M2": (32, 8, 2, 8, False, 1.5)}


def cfg(E=8, G=4, M=2, k=3, norm=True, scale=1.0, **kw):
    """A Llama-family MoE config with DeepSeek-V3's routing: sigmoid gates, aux-free bias, dropless,
    no router losses (Hugging Face's layer has none)."""
    base = dict(arch="llama", n_embd=C, n_head=2, n_layer=1, intermediate_size=F, dropout=0.0, moe_experts=E,
                moe_top_k=k, moe_dropless=True, moe_gate="sigmoid", moe_balance="aux-free",
                moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0, moe_groups=G, moe_group_limit=M,
                moe_norm_topk_prob=norm, moe_routed_scaling_factor=scale)
    return ModelConfig(**(base | kw))


@pytest.fixture
def float64_router(monkeypatch):
    original = torch.Tensor.type

    def keep_float64(self, dtype=None, *args, **kwargs):
        if dtype is torch.float32 and self.dtype == torch.float64:
            return self
        return original(self, dtype, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "type", keep_float64)


def hf_layer(config: ModelConfig):
    """Hugging Face's DeepseekV3MoE for `config`, float64, eager experts."""
    hc = DeepseekV3Config(hidden_size=C, intermediate_size=F, moe_intermediate_size=F,
                          n_routed_experts=config.moe_experts, num_experts_per_tok=config.moe_top_k,
                          n_group=config.moe_groups, topk_group=config.moe_group_limit,
                          n_shared_experts=max(config.moe_shared_experts, 1),
                          norm_topk_prob=config.moe_norm_topk_prob,
                          routed_scaling_factor=config.moe_routed_scaling_factor, num_hidden_layers=1,
                          num_attention_heads=2, experts_implementation="eager")
    return hf.DeepseekV3MoE(hc).to(torch.float64)


def dense(experts, gates, E: int) -> np.ndarray:
    """(N, k) experts and gates in any slot order -> (N, E) gates, 0 where not chosen."""
    out = np.zeros((experts.shape[0], E))
    np.put_along_axis(out, np.asarray(experts), np.asarray(gates), axis=1)
    return out


@pytest.mark.parametrize("name", ROUTERS)
def test_deepseek_group_score_is_hugging_faces_router_and_megatrons_is_not(name, float64_router):
    """Expert sets and gates of `moe_group_score="deepseek"` equal DeepseekV3TopkRouter's on 256
    tokens, with a bias that moves the choice; "megatron" (floor(k/M) per group) picks other sets
    here, where floor(k/M) != 2."""
    E, G, M, k, norm, scale = ROUTERS[name]
    config = cfg(E, G, M, k, norm, scale)
    gen = np.random.default_rng(41)
    x = gen.standard_normal((N, C))
    w = gen.standard_normal((E, C)) * 0.5  # (E, C) as torch.nn.Linear stores it
    bias = gen.standard_normal(E) * 0.1
    router = hf_layer(config).gate
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, hf_gates, hf_experts = router(torch.from_numpy(x))
    theirs = dense(hf_experts.numpy(), hf_gates.numpy(), E)  # (N, E)
    routing, _ = route(x, w.T, config, bias=bias)
    mine = dense(routing["experts"], routing["gates"], E)
    np.testing.assert_array_equal(mine > 0, theirs > 0)  # the same expert set, token by token
    assert within(rel_diff(mine, theirs), CONTRACT), rel_diff(mine, theirs)
    other, _ = route(x, w.T, replace(config, moe_group_score="megatron"), bias=bias)
    moved = np.any(dense(other["experts"], other["gates"], E) > 0) != (theirs > 0)
    assert (k // M != 2) == bool(np.any(moved)), int(np.sum(np.any(moved, axis=1)))


def layer_params(config, seed):
    gen = np.random.default_rng(seed)
    return {n: gen.standard_normal(s) * (0.5 if n.endswith("gate.weight") else 0.3)
            for n, s in DEEPSEEK.param_shapes(config, 0).items()}


def load_hf(layer, params, config, bias):
    """refpar's DEEPSEEK params into Hugging Face's layer: routed experts fused as HF 5.x holds them
    (gate_up_proj (E, 2F, C), down_proj (E, C, F))."""
    t = {n: torch.from_numpy(v) for n, v in params.items()}
    p = "model.layers.0.mlp."
    with torch.no_grad():
        layer.gate.weight.copy_(t[p + "gate.weight"])
        layer.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
        for e in range(config.moe_experts):
            q = f"{p}experts.{e}."
            gate_up = torch.cat([t[q + "gate_proj.weight"], t[q + "up_proj.weight"]])  # (2F, C)
            layer.experts.gate_up_proj[e].copy_(gate_up)
            layer.experts.down_proj[e].copy_(t[q + "down_proj.weight"])
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_experts, part).weight.copy_(t[f"{p}shared_experts.{part}.weight"])


def hf_grads(layer, config):
    """Hugging Face's parameter gradients under refpar's names (routed experts unfused)."""
    p, F2 = "model.layers.0.mlp.", layer.experts.gate_up_proj.shape[1] // 2
    out = {p + "gate.weight": layer.gate.weight.grad}
    for e in range(config.moe_experts):
        g = layer.experts.gate_up_proj.grad[e]
        out |= {f"{p}experts.{e}.gate_proj.weight": g[:F2], f"{p}experts.{e}.up_proj.weight": g[F2:],
                f"{p}experts.{e}.down_proj.weight": layer.experts.down_proj.grad[e]}
    for part in ("gate_proj", "up_proj", "down_proj"):
        out[f"{p}shared_experts.{part}.weight"] = getattr(layer.shared_experts, part).weight.grad
    return {n: g.numpy() for n, g in out.items()}


@pytest.mark.parametrize("norm, scale", [(True, 2.5), (False, 2.5)])
def test_moe_layer_with_shared_swiglu_experts_is_hugging_faces_deepseek_v3_moe(norm, scale, float64_router):
    """The whole layer (group-limited routing with k/M = 3/2, 2 shared SwiGLU experts as one MLP of
    twice the width) and every gradient, refpar's hand-written backward against torch's autograd
    through DeepseekV3MoE."""
    config = cfg(8, 4, 2, 3, norm, scale, moe_shared_experts=2)
    gen = np.random.default_rng(7)
    x, G = gen.standard_normal((2, 6, C)), gen.standard_normal((2, 6, C))
    bias = gen.standard_normal(8) * 0.1
    params = layer_params(config, 8)
    out, cache = moe.moe_forward(x, params, 0, config, DEEPSEEK, bias=bias)
    dx, grads = moe.moe_backward(G, cache)
    layer = hf_layer(config)
    load_hf(layer, params, config, bias)
    xt = torch.from_numpy(x).requires_grad_(True)
    yt = layer(xt)
    (yt * torch.from_numpy(G)).sum().backward()
    assert within(rel_diff(out, yt.detach().numpy()), CONTRACT)
    assert within(rel_diff(dx, xt.grad.numpy()), CONTRACT)
    theirs = hf_grads(layer, config)
    assert grads.keys() == theirs.keys()
    worst = max(rel_diff(grads[n], theirs[n]) for n in theirs)
    assert within(worst, CONTRACT), worst


def test_shared_experts_as_one_wide_mlp_equal_llamas_separate_shared_experts():
    """DeepSeek's one MLP of S x F hidden units and Llama's S separate SwiGLU shared experts
    (llama.MOE) are the same function: the same output and, split the same way, the same gradients."""
    config = cfg(8, 4, 2, 3, False, 1.7, moe_shared_experts=3)
    gen = np.random.default_rng(9)
    x, G = gen.standard_normal((2, 6, C)), gen.standard_normal((2, 6, C))
    split = {n: gen.standard_normal(s) * 0.3 for n, s in llama.MOE.param_shapes(config, 0).items()}
    assert sum(".shared_experts." in n for n in split) == 3 * 3  # S MLPs of three matrices each
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    p, q = "model.layers.0.block_sparse_moe.", "model.layers.0.mlp."
    wide = {q + "gate.weight": split[p + "gate.weight"]}
    for e in range(8):
        wide |= {f"{q}experts.{e}.{names[w]}.weight": split[f"{p}experts.{e}.{w}.weight"] for w in names}
    for w, axis in (("w1", 0), ("w3", 0), ("w2", 1)):
        wide[f"{q}shared_experts.{names[w]}.weight"] = np.concatenate(
            [split[f"{p}shared_experts.{s}.{w}.weight"] for s in range(3)], axis=axis)
    out_split, c_split = moe.moe_forward(x, split, 0, config, llama.MOE)
    out_wide, c_wide = moe.moe_forward(x, wide, 0, config, DEEPSEEK)
    assert within(rel_diff(out_split, out_wide), CONTRACT)
    _, g_split = moe.moe_backward(G, c_split)
    _, g_wide = moe.moe_backward(G, c_wide)
    for w, axis in (("w1", 0), ("w3", 0), ("w2", 1)):
        joined = np.concatenate([g_split[f"{p}shared_experts.{s}.{w}.weight"] for s in range(3)], axis=axis)
        assert within(rel_diff(joined, g_wide[f"{q}shared_experts.{names[w]}.weight"]), CONTRACT)


def test_softmax_gates_unnormalised_and_scaled_match_central_differences():
    """The one path Hugging Face's DeepSeek layer does not take: softmax scores, top-2 gates left
    unnormalised (norm_topk_prob False, as Qwen-MoE) and scaled, with a shared SwiGLU expert and the
    router losses on (their gradients through the same backward)."""
    config = cfg(4, 1, None, 2, False, 1.7, moe_gate="softmax", moe_balance="aux",
                 moe_aux_loss_weight=0.3, moe_z_loss_weight=0.2, moe_shared_experts=1)
    gen = np.random.default_rng(11)
    x, G = gen.standard_normal((2, 6, C)), gen.standard_normal((2, 6, C))
    params = {n: gen.standard_normal(s) * (1.0 if "gate.weight" in n else 0.3)
              for n, s in llama.MOE.param_shapes(config, 0).items()}

    def objective():
        out, cache = moe.moe_forward(x, params, 0, config, llama.MOE)
        r = cache["routing"]
        return float(np.sum(out * G) + r["aux_loss"] + r["z_loss"]), cache

    _, cache = objective()
    probs = np.sort(cache["router"][0], axis=-1)[:, ::-1]
    assert np.min(probs[:, 1] - probs[:, 2]) > 1e-4  # away from a tie: eps cannot change the choice
    dx, grads = moe.moe_backward(G, cache)
    eps, worst, pick = 1e-6, 0.0, np.random.default_rng(12)
    for key, analytic in [("x", dx), *grads.items()]:
        flat = (x if key == "x" else params[key]).reshape(-1)
        for i in pick.choice(flat.size, size=min(flat.size, 6), replace=False):
            old = flat[i]
            flat[i] = old + eps
            up, _ = objective()
            flat[i] = old - eps
            down, _ = objective()
            flat[i] = old
            numeric = (up - down) / (2 * eps)
            worst = max(worst, abs(numeric - analytic.reshape(-1)[i]) / max(1.0, abs(numeric)))
    # tests/test_moe.py's FD_TOL: truncation ~1e-12 and rounding ~1e-9 for eps = 1e-6, times 100
    assert within(worst, 1e-7), worst


@pytest.mark.parametrize("fields, says", [
    (dict(moe_group_score="best3"), "unknown moe_group_score"),
    (dict(E=4, G=4, M=2, k=2), "moe_group_score='deepseek' scores a group by its best 2"),
    (dict(E=8, G=4, M=3, k=2, moe_group_score="megatron"), "floor(moe_top_k / moe_group_limit) = 0"),
    (dict(scale=0.0), "moe_routed_scaling_factor=0.0 must be positive"),
    (dict(norm="no"), "moe_norm_topk_prob='no' must be True or False"),
])
def test_convention_options_refuse_bad_values_in_one_sentence(fields, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        cfg(**fields)


def test_sigmoid_top1_is_allowed_unnormalised_and_the_command_line_names_the_options():
    """k = 1 sigmoid gates are refused only where normalising would make them 1; the three options
    reach ModelConfig from `refpar train`'s flags."""
    cfg(8, 1, None, 1, False, 2.5)  # an unnormalised single sigmoid gate keeps its gradient
    from refpar.cli import build_parser
    from refpar.commands.train import model_overrides

    args = build_parser().parse_args(
        ["train", "--moe-experts", "8", "--moe-topk", "3", "--moe-gate", "sigmoid", "--moe-groups", "4",
         "--moe-group-limit", "2", "--moe-group-score", "megatron", "--no-moe-norm-topk-prob",
         "--moe-routed-scaling-factor", "2.5"])
    got = model_overrides(args)
    assert (got["moe_group_score"], got["moe_norm_topk_prob"], got["moe_routed_scaling_factor"]) == (
        "megatron", False, 2.5)


@pytest.mark.parametrize("fields, says", [(dict(moe_shared_experts=1), "has no shared experts"),
                                          (dict(norm=False), "normalises its top-k gates"),
                                          (dict(scale=2.5), "does not scale them")])
def test_export_refuses_what_mixtral_cannot_hold(fields, says):
    """MixtralForCausalLM (refpar export's target for Llama's experts) has no shared experts and
    always normalises, never scales: each is one sentence before anything is written."""
    from refpar.weights import check_exportable

    config = cfg(8, 1, None, 2, **({"moe_gate": "softmax", "moe_balance": "aux"} | fields))
    check_exportable(replace(config, moe_shared_experts=0, moe_norm_topk_prob=True,
                             moe_routed_scaling_factor=1.0))  # Mixtral's own: exportable
    with pytest.raises(ConfigError, match=says):
        check_exportable(config)


def test_conventions_under_ep2_are_the_single_device_run():
    """tests/jobs/ep_conventions_check.py: 3 AdamW steps on ep=2 against one device, Llama's shared
    SwiGLU experts with Megatron's group score and unnormalised scaled sigmoid gates, and GPT-2 with
    DeepSeek's group score, scaled softmax gates and drops by score; in both the other group score
    moves the single device's losses, so a run that ignored the option could not match."""
    proc = mpiexec(2, "tests/jobs/ep_conventions_check.py", timeout=240)
    rows = {r["case"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                   if line.startswith("{")))}
    assert rows.keys() == {"llama_megatron_unnormalised", "gpt2_deepseek_drops"}
    for r in rows.values():
        assert within(r["loss_diff"], CONTRACT) and within(r["param_diff"], CONTRACT), r
        assert r["same_dropped"] and r["same_tokens_per_expert"] and r["same_bias"], r
        assert r["other_convention_loss_diff"] > 1e-6, r  # far above the contract: the option matters
    assert rows["llama_megatron_unnormalised"]["bias_moved"] and rows["gpt2_deepseek_drops"]["dropped"] > 0


def test_train_check_on_ep2_with_the_options_by_flag_meets_every_closed_form():
    """`refpar train --check` with the conventions given by flag (Llama's shared SwiGLU expert,
    unnormalised gates, which the router keeps as the chosen scores themselves, Megatron's group
    score): the single device's losses and parameters, and the memory and communication closed forms
    (refpar/analysis/moe.py: the shared expert's SwiGLU width, one gate array, not two)."""
    summary = refpar_json(2, "train", "--model", "llama-tiny", "--n-layer", "2", "--mesh", "ep=2",
                          "--moe-experts", "8", "--moe-topk", "3", "--moe-shared-experts", "1",
                          "--no-moe-norm-topk-prob", "--moe-groups", "4", "--moe-group-limit", "2",
                          "--moe-group-score", "megatron", "--steps", "2", "--check", timeout=180)
    model = summary["model"]
    assert (model["moe_group_score"], model["moe_norm_topk_prob"], model["moe_shared_experts"]) == (
        "megatron", False, 1)
    assert within(summary["max_loss_rel_diff"], CONTRACT) and within(summary["max_param_rel_diff"], CONTRACT)
    measured = {(r["rank"], r["category"]): r["bytes"] for r in summary["memory_peak_bytes"]}
    assert all(measured[(r["rank"], r["category"])] == r["bytes"]
               for r in summary["expected_memory_peak_bytes"])
    key = ("rank", "op")
    assert sorted(tuple(r[k] for k in key) + (r["bytes_sent"],) for r in summary["comm_bytes"]) == \
        sorted(tuple(r[k] for k in key) + (r["bytes_sent"],) for r in summary["expected_comm_bytes"])
