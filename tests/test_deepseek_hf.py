"""refpar's DeepSeek-V3 (refpar/model/deepseek.py, refpar/model/mla.py) against Hugging Face
transformers' DeepseekV3ForCausalLM built from a random tiny DeepseekV3Config (no download), in float64
with eager attention: logits, loss and every parameter's gradient.

As for Llama (tests/test_llama_hf.py), transformers rounds RMSNorm, the rotary angles and eager
attention's softmax to float32 in a float64 model; tests/hf_float64.py's patches drop those casts
(DeepseekV3's classes are Llama's under other names). DeepseekV3TopkRouter casts the router's input
and weight to float32 too; `router_forward` below is its code less the casts, and the first test shows
that with the patches transformers' float32 numbers are unchanged bit for bit. The rest (the latent
projections and norms, the interleaved rotary key shared by the heads, the dense and MoE blocks, the
group-limited routing, the shared experts, autograd) is theirs.
"""

import math
from dataclasses import replace

import numpy as np
import pytest

import refpar.model as M
from refpar.config import ConfigError, ModelConfig, model_preset
from refpar.model import deepseek
from refpar.model.data import MarkovCorpus

torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install "
                                   "'refpar[dev]'")
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

from tests.hf_float64 import compute_in_input_dtype  # noqa: E402
from tests.numerics import CONTRACT, rel_diff, within  # noqa: E402

# Every MLA width differs from the others, so a swapped split or transpose cannot line up; norm_eps is
# not 1e-6, the latent norms' own epsilon.
DENSE = dict(arch="deepseek-v3", vocab_size=64, n_positions=16, n_embd=32, n_head=4, n_layer=2, dropout=0.0,
             intermediate_size=48, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6,
             v_head_dim=10, rope_theta=500000.0, norm_eps=1e-5)

# DeepSeek-V3's MoE: a dense first block, then 8 experts of which k = 3 in at most M = 2 of 4 groups
# (k/M = 1.5: HF scores a group by its best 2, whatever k/M), 2 shared experts (one MLP of twice the
# width in HF), sigmoid gates scaled by 2.5, aux-free biases (HF's e_score_correction_bias).
# Its MoE fields under Hugging Face's names, as issue 41's contract gives them.
MOE = dict(DENSE, n_layer=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
           n_shared_experts=2, moe_intermediate_size=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
           moe_gate="sigmoid", moe_balance="aux-free", moe_dropless=True, moe_aux_loss_weight=0.0,
           moe_z_loss_weight=0.0)

# YaRN as DeepSeek-V3's rope_scaling has it, with mscale != mscale_all_dim so that both the rotary
# attention factor and the softmax's mscale^2 differ from 1; with theta 500000 and dr = 6 the ramp runs
# over frequencies 0 to 2 of 3 (low = 0, high = 2), so interpolated, mixed and kept ones all occur.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}


def router_forward(self, hidden_states):
    """DeepseekV3TopkRouter.forward without `.type(torch.float32)` on its input and weight."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def float64_throughout(monkeypatch):
    compute_in_input_dtype(monkeypatch, modeling_deepseek_v3, "DeepseekV3")
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3TopkRouter, "forward", router_forward)


def hf_config(config: ModelConfig):
    """The DeepseekV3Config of refpar's `config`; without experts, every block dense."""
    moe = config.moe_experts > 0
    return transformers.DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_head, max_position_embeddings=config.n_positions,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, rope_interleave=config.rope_interleave,
        first_k_dense_replace=config.first_k_dense_replace if moe else config.n_layer,
        moe_intermediate_size=config.moe_intermediate_size or 8,
        n_routed_experts=config.moe_experts if moe else 4, num_experts_per_tok=config.moe_top_k if moe else 2,
        n_shared_experts=config.moe_shared_experts if moe else 1,
        n_group=config.moe_groups if moe else 1,
        topk_group=(config.moe_group_limit or config.moe_groups) if moe else 1,
        norm_topk_prob=config.moe_norm_topk_prob, routed_scaling_factor=config.moe_routed_scaling_factor,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0)


def hf_model(config: ModelConfig, seed: int = 0):
    """A random HF model (HF's own init) in float64, its RMSNorm gains moved away from 1 so that a
    swapped norm would show, and its routers scaled so that the sigmoid scores spread."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(config)).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    return model


def hf_loss_and_grads(model, tokens, targets):
    """HF's logits, torch's mean cross-entropy on them, and autograd's gradient of every parameter."""
    model.zero_grad()
    logits = model(torch.from_numpy(tokens)).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(targets).reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def batch(config, seed=1):
    return MarkovCorpus(config.vocab_size, seed).batch(0, range(3), config.n_positions)  # (3, 16) each


def compare(config, model, moe=None):
    """The largest relative difference over logits, loss and every gradient, printed with its name."""
    params = M.from_hf_state_dict(model.state_dict(), config)
    tokens, targets = batch(config)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads(model, tokens, targets)
    loss, grads = M.loss_and_grads(params, tokens, targets, config, moe=moe)
    diffs = {"logits": rel_diff(M.forward(params, tokens, config) if moe is None else
                                moe_forward_logits(params, tokens, config, moe), hf_logits.numpy()),
             "loss": rel_diff(loss, hf_loss.item())}
    hf_named = M.from_hf_state_dict({n: g.numpy() for n, g in hf_grads.items()}, config)
    diffs.update({name: rel_diff(grads[name], hf_named[name]) for name in params})
    worst = max(diffs, key=diffs.get)
    print(f"max relative difference {diffs[worst]:.1e} ({worst}); logits {diffs['logits']:.1e}, "
          f"loss {diffs['loss']:.1e}")
    return diffs, worst


def moe_forward_logits(params, tokens, config, moe):
    """The logits with the run's MoE layer (its aux-free biases), as M.forward has none to take."""
    x, _ = deepseek.embed_forward(tokens, params)  # (B, T, C)
    for layer in range(config.n_layer):
        x, _ = deepseek.block_forward(x, params, layer, config, moe=moe)  # (B, T, C)
    return deepseek.logits_forward(x, params, config)[0]  # (B, T, V)


class MultiTokenPrediction(modeling_deepseek_v3.DeepseekV3DecoderLayer):
    """Megatron-Core's MTP layer (refpar/model/mtp.py's docstring) built of transformers' DeepseekV3
    modules under DeepSeek-V3's checkpoint names (model.layers.{L}.enorm, hnorm, eh_proj,
    shared_head.norm and the block's): an implementation independent of refpar's, differentiated by
    torch's autograd."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        C, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = modeling_deepseek_v3.DeepseekV3RMSNorm(C, eps)
        self.hnorm = modeling_deepseek_v3.DeepseekV3RMSNorm(C, eps)
        self.eh_proj = torch.nn.Linear(2 * C, C, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = modeling_deepseek_v3.DeepseekV3RMSNorm(C, eps)

    def predict(self, h, next_ids, model):
        """h (B, T', C), the ids of the tokens one ahead (B, T') -> this depth's hidden state (B, T', C)."""
        T = h.shape[1]
        z = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(next_ids)), self.hnorm(h)], dim=-1))
        causal = torch.full((T, T), float("-inf"), dtype=z.dtype).triu(1)[None, None]  # (1, 1, T', T')
        rope = model.model.rotary_emb(z, torch.arange(T)[None])
        return self.shared_head.norm(self(z, attention_mask=causal, position_embeddings=rope))


def hf_loss_and_grads_with_mtp(model, modules, tokens, targets, weight):
    """HF's logits and main loss plus `weight` / D times each depth's mean cross-entropy, and
    autograd's gradients of the model's and the MTP modules' parameters (the latter by their names)."""
    model.zero_grad()
    modules.zero_grad()
    h = model.model(torch.from_numpy(tokens)).last_hidden_state  # (B, T, C), after model.norm
    logits = model.lm_head(h)  # (B, T, V)
    targets = torch.from_numpy(targets)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    T, D = tokens.shape[1], len(modules)
    for k, module in enumerate(modules, start=1):
        h = module.predict(h[:, :T - k], targets[:, k - 1:T - 1], model)  # (B, T - k, C)
        mtp_logits = model.lm_head(h)  # (B, T - k, V)
        loss = loss + weight / D * torch.nn.functional.cross_entropy(
            mtp_logits.reshape(-1, mtp_logits.shape[-1]), targets[:, k:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    L = model.config.num_hidden_layers
    grads |= {f"model.layers.{L + k}.{name}": p.grad.detach().clone()
              for k, module in enumerate(modules) for name, p in module.named_parameters()}
    return logits.detach(), loss.detach(), grads


def test_multi_token_prediction_matches_megatron_cores_convention_built_of_hf_modules_in_float64(monkeypatch):
    float64_throughout(monkeypatch)
    config = ModelConfig(**{**MOE, "n_layer": 2, "num_nextn_predict_layers": 2, "mtp_loss_weight": 0.3})
    model = hf_model(config)
    torch.manual_seed(1)
    modules = torch.nn.ModuleList(MultiTokenPrediction(model.config, config.n_layer + k) for k in range(2))
    modules = modules.to(torch.float64)
    with torch.no_grad():  # HF's init, which a bare module does not get, with the norms moved from 1
        for name, p in modules.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                continue
            else:
                p.normal_(0.0, 0.4 if name.endswith("mlp.gate.weight") else 0.02)
    L = config.n_layer
    state = model.state_dict() | {f"model.layers.{L + k}.{name}": v for k, m in enumerate(modules)
                                  for name, v in m.state_dict().items()}
    params = M.from_hf_state_dict(state, config)
    tokens, targets = batch(config)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads_with_mtp(model, modules, tokens, targets, 0.3)

    loss, grads = M.loss_and_grads(params, tokens, targets, config)
    diffs = {"logits": rel_diff(M.forward(params, tokens, config), hf_logits.numpy()),
             "loss": rel_diff(loss, hf_loss.item())}
    hf_named = M.from_hf_state_dict({n: g.numpy() for n, g in hf_grads.items()}, config)
    diffs.update({name: rel_diff(grads[name], hf_named[name]) for name in params})
    worst = max(diffs, key=diffs.get)
    print(f"max relative difference {diffs[worst]:.1e} ({worst}); logits {diffs['logits']:.1e}, "
          f"loss {diffs['loss']:.1e}")
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"
    # the MTP losses count: without them the loss is another
    without = M.loss_and_grads(params, tokens, targets, replace(config, mtp_loss_weight=0.0))[0]
    assert abs(loss - without) > 1e-3


def test_the_router_patch_gives_transformers_own_numbers_bit_for_bit_in_float32(monkeypatch):
    config = model_preset("deepseek-tiny", dtype="float64")
    model = hf_model(config).to(torch.float32)  # where every float32 cast the patches drop is a no-op
    tokens, targets = batch(config)
    before = hf_loss_and_grads(model, tokens, targets)
    float64_throughout(monkeypatch)
    after = hf_loss_and_grads(model, tokens, targets)
    # the same torch ops in the same order: bitwise
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert all(torch.equal(before[2][name], after[2][name]) for name in before[2])


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="mla-interleaved"),
    pytest.param({"rope_interleave": False, "q_lora_rank": None, "tie_embeddings": True, "n_layer": 1},
                 id="mla-full-rank-query-halves-tied"),
])
def test_mla_and_dense_blocks_match_hf_deepseek_v3_logits_loss_and_every_gradient_in_float64(
        monkeypatch, overrides):
    float64_throughout(monkeypatch)
    config = ModelConfig(**{**DENSE, **overrides})
    model = hf_model(config)
    params = M.from_hf_state_dict(model.state_dict(), config)
    hf_names = [k for k in model.state_dict() if k != "lm_head.weight" or not config.tie_embeddings]
    assert list(params) == hf_names  # HF's names in HF's order
    diffs, worst = compare(config, model)
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm-topk", "raw-sigmoid-gates"])
def test_moe_blocks_with_shared_experts_and_group_limited_routing_match_hf_deepseek_v3_in_float64(
        monkeypatch, norm_topk_prob):
    float64_throughout(monkeypatch)
    config = ModelConfig(**MOE, norm_topk_prob=norm_topk_prob)
    model = hf_model(config)
    with torch.no_grad():  # aux-free biases of the size of the score gaps, so that they change choices
        for layer in config.moe_blocks:
            model.model.layers[layer].mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    routers = []  # what HF's routers saw and chose: the group limit must change some token's experts
    for layer in config.moe_blocks:
        model.model.layers[layer].mlp.gate.register_forward_hook(
            lambda module, args, out: routers.append((module.e_score_correction_bias, *out)))
    recorder = M.moe_layer(config, bias=deepseek.expert_biases(model.state_dict(), config))
    diffs, worst = compare(config, model, moe=recorder)
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"

    # every expert took tokens, so every expert's gradient is compared with a nonzero one
    assert all(min(int(c) for c in r["tokens_per_expert"]) > 0 for r in recorder.last_routing.values())
    bias, logits, _, chosen = routers[0]
    anywhere = torch.topk(logits.sigmoid() + bias, config.moe_top_k, dim=-1)[1]
    differ = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(anywhere, chosen, strict=True))
    print(f"{differ} of {len(chosen)} tokens chose other experts than without the group limit")
    assert differ > 0


def test_to_hf_state_dict_is_a_checkpoint_hf_loads_and_from_hf_state_dict_reads_it_back():
    config = ModelConfig(**MOE)
    params = M.init_params(config, seed=4)
    state = M.to_hf_state_dict(params, config)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    # HF's loader fuses the per-expert checkpoint keys into its in-memory experts
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(None, config=hf_config(config),
                                                               state_dict=tensors, dtype=torch.float64)
    back = M.from_hf_state_dict(model.state_dict(), config)
    assert list(back) == list(params)
    for name in params:
        # DeepseekV3's loader keeps the routers in float32 (_keep_in_fp32_modules_strict): rounded once
        expected = params[name].astype(np.float32) if name.endswith("mlp.gate.weight") else params[name]
        assert np.array_equal(back[name], expected), name  # copies, no arithmetic


@pytest.mark.parametrize("overrides, message", [
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace=3 dense blocks must lie within the model's "
                                   "n_layer=2"),
    ({"kv_lora_rank": None}, "needs a positive whole kv_lora_rank"),
    ({"n_kv_head": 2}, "leave n_kv_head unset"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1 must be a whole number >= 0"),
    ({"moe_experts": 6, "moe_top_k": 2, "moe_groups": 4, "moe_intermediate_size": 8},
     "moe_groups=4 must divide moe_experts=6"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "must be YaRN's"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "takes factor and original_max_position_embeddings"),
    ({"rope_scaling": {**YARN, "beta_slow": 40}}, "beta_fast > beta_slow > 0"),
])
def test_deepseek_bad_shapes_are_one_sentence_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**DENSE, **overrides})
    with pytest.raises(ConfigError, match="is a DeepSeek-V3 field"):
        ModelConfig(arch="llama", intermediate_size=48, dropout=0.0, kv_lora_rank=4)


@pytest.mark.parametrize("sizes, overrides, message", [
    ({"tp": 2}, {"moe_intermediate_size": 1}, "tp=2 splits moe_intermediate_size=1 into fewer columns"),
    ({"tp": 8}, {}, "tp=8 does not divide n_head=4"),
    ({}, {"num_nextn_predict_layers": 1}, "multi-token prediction trains in refpar.model.loss_and_grads"),
])
def test_what_the_engine_does_not_run_yet_is_one_sentence_before_any_communication(sizes, overrides,
                                                                                   message):
    from refpar.config import MESH_AXES, Plan, TrainConfig
    from refpar.engine.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(model_preset("deepseek-tiny", **overrides), TrainConfig(),
                 dict.fromkeys(MESH_AXES, 1) | sizes, Plan())


def hf_yarn_inv_freq(config, dtype):
    """transformers' _compute_yarn_parameters' inverse frequencies (modeling_rope_utils.py, truncate
    on, factor and both mscales given) in `dtype` where it computes them in float32."""
    rope = config.rope_parameters
    base, dim, factor = rope["rope_theta"], config.head_dim, rope["factor"]

    def find_correction_dim(num_rotations):
        return (dim * math.log(rope["original_max_position_embeddings"] / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low = max(math.floor(find_correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(find_correction_dim(rope["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=dtype) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq_interpolation, inv_freq_extrapolation = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


def yarn_rotary_forward(self, x, position_ids):
    """DeepseekV3RotaryEmbedding.forward with YaRN's frequencies computed in x's dtype."""
    freqs = position_ids[..., None].to(x.dtype) * hf_yarn_inv_freq(self.config, x.dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def hf_yarn_model(config: ModelConfig):
    """hf_model's with DeepSeek-V3's rope_scaling in HF's rope_parameters."""
    hf = hf_config(config)
    hf.rope_parameters = {"rope_type": "yarn", "rope_theta": config.rope_theta,
                          **{k: v for k, v in YARN.items() if k != "type"}}
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_yarn_rope_scaling_matches_hf_deepseek_v3_in_float64(monkeypatch):
    config = ModelConfig(**{**DENSE, "n_layer": 1, "rope_scaling": YARN})
    model = hf_yarn_model(config)  # float32: the transcription must give HF's own frequencies bit for bit
    rotary = model.model.rotary_emb
    assert torch.equal(hf_yarn_inv_freq(rotary.config, torch.float32), rotary.inv_freq)
    assert rotary.attention_scaling != 1.0
    assert model.model.layers[0].self_attn.scaling != (12 + 6) ** -0.5  # mscale_all_dim's square
    float64_throughout(monkeypatch)
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RotaryEmbedding, "forward", yarn_rotary_forward)
    diffs, worst = compare(config, model.to(torch.float64))
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"
    # and YaRN changes the numbers (by ~7e-4 here, small weights): plain RoPE's logits are other ones
    params = M.from_hf_state_dict(model.state_dict(), config)
    tokens, _ = batch(config)
    plain = M.forward(params, tokens, replace(config, rope_scaling=None))
    assert rel_diff(plain, M.forward(params, tokens, config)) > 1e4 * CONTRACT
