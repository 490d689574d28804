"""refpar's Llama, its Mixtral experts and both families' state dicts against Hugging Face
transformers: LlamaForCausalLM, MixtralForCausalLM and GPT2LMHeadModel built from random tiny
configs (no download), in float64 with eager attention.

transformers rounds RMSNorm, the rotary angles and the softmaxes to float32 even in a float64 model
(tests/hf_float64.py says where and why); unpatched, its float64 Llama is 1.8e-7 from refpar's
(logits 9e-8), which is float32's rounding. Each test patches those four casts away (and the first
test shows that the patches change nothing else); the rest, including the grouped-query expansion,
the state-dict conversion of Mixtral's experts, the masks, the residuals and autograd, is theirs.
Logits, loss and gradients then agree to a few ulps, within the float64 contract.
"""

import numpy as np
import pytest

import refpar.model as M
from refpar.config import ModelConfig, model_preset
from refpar.model.data import MarkovCorpus

torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install "
                                   "'refpar[dev]'")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from tests.hf_float64 import compute_in_input_dtype  # noqa: E402
from tests.numerics import CONTRACT, rel_diff, within  # noqa: E402

LLAMA = dict(arch="llama", vocab_size=64, n_positions=16, n_embd=32, n_head=4, n_kv_head=2, n_layer=2,
             intermediate_size=48, rope_theta=500000.0, norm_eps=1e-5, dropout=0.0)
# Mixtral as HF runs it: top-2, no capacity, no router losses in the training loss
MIXTRAL = dict(LLAMA, moe_experts=4, moe_top_k=2, moe_dropless=True, moe_aux_loss_weight=0.0,
               moe_z_loss_weight=0.0)


def hf_config(config: ModelConfig):
    """The Hugging Face config of refpar's `config`: LlamaConfig, or MixtralConfig with experts."""
    shape = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd,
                 intermediate_size=config.intermediate_size, num_hidden_layers=config.n_layer,
                 num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
                 max_position_embeddings=config.n_positions, rope_theta=config.rope_theta,
                 rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
                 attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    if not config.moe_experts:
        return transformers.LlamaConfig(**shape)
    return transformers.MixtralConfig(**shape, num_local_experts=config.moe_experts,
                                      num_experts_per_tok=config.moe_top_k, router_jitter_noise=0.0,
                                      output_router_logits=False, experts_implementation="eager")


def hf_model(config: ModelConfig, seed: int = 0):
    """A random HF model (HF's own init) in float64, its RMSNorm gains moved away from 1 so that a
    swapped norm would show, and Mixtral's routers scaled so that no top-2 choice is near a tie."""
    torch.manual_seed(seed)
    cls = transformers.MixtralForCausalLM if config.moe_experts else transformers.LlamaForCausalLM
    model = cls(hf_config(config)).to(torch.float64).eval()  # eval: no router jitter, no dropout
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    return model


def hf_loss_and_grads(model, tokens, targets):
    """HF's logits, torch's mean cross-entropy on them, and autograd's gradient of every parameter.
    (HF's own loss shifts the labels and upcasts the logits to float32; refpar's targets are shifted
    already.)"""
    model.zero_grad()
    logits = model(torch.from_numpy(tokens)).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(targets).reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def batch(config, seed=1):
    return MarkovCorpus(config.vocab_size, seed).batch(0, range(3), config.n_positions)  # (3, 16) each


@pytest.mark.parametrize("kind, modeling, family", [("llama", modeling_llama, "Llama"),
                                                    ("mixtral", modeling_mixtral, "Mixtral")])
def test_the_float64_patches_give_transformers_own_numbers_bit_for_bit_in_float32(
        monkeypatch, kind, modeling, family):
    config = ModelConfig(**(MIXTRAL if kind == "mixtral" else LLAMA))
    model = hf_model(config).to(torch.float32)  # where every float32 cast the patches drop is a no-op
    tokens, targets = batch(config)
    before = hf_loss_and_grads(model, tokens, targets)
    compute_in_input_dtype(monkeypatch, modeling, family)
    after = hf_loss_and_grads(model, tokens, targets)
    # the same torch ops in the same order: bitwise
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert all(torch.equal(before[2][name], after[2][name]) for name in before[2])


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gqa-untied"),
    pytest.param({"n_kv_head": 1, "tie_embeddings": True, "n_layer": 1}, id="mqa-tied"),
    pytest.param({"n_kv_head": 4}, id="mha"),
])
def test_llama_logits_loss_and_every_gradient_match_hf_llama_for_causal_lm_in_float64(monkeypatch,
                                                                                       overrides):
    compute_in_input_dtype(monkeypatch, modeling_llama, "Llama")
    config = ModelConfig(**{**LLAMA, **overrides})
    model = hf_model(config)
    params = M.from_hf_state_dict(model.state_dict(), config)
    # HF's names in HF's order; a tied head is the embedding (HF's state_dict() lists it twice)
    hf_names = [k for k in model.state_dict() if k != "lm_head.weight" or not config.tie_embeddings]
    assert list(params) == hf_names
    tokens, targets = batch(config)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads(model, tokens, targets)

    loss, grads = M.loss_and_grads(params, tokens, targets, config)
    diffs = {"logits": rel_diff(M.forward(params, tokens, config), hf_logits.numpy()),
             "loss": rel_diff(loss, hf_loss.item())}
    hf_named = M.from_hf_state_dict({n: g.numpy() for n, g in hf_grads.items()}, config)
    diffs.update({name: rel_diff(grads[name], hf_named[name]) for name in params})
    worst = max(diffs, key=diffs.get)
    print(f"max relative difference {diffs[worst]:.1e} ({worst}); logits {diffs['logits']:.1e}, "
          f"loss {diffs['loss']:.1e}")
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"


def test_mixtral_logits_loss_and_every_gradient_match_hf_mixtral_for_causal_lm_in_float64(monkeypatch):
    compute_in_input_dtype(monkeypatch, modeling_mixtral, "Mixtral")
    config = ModelConfig(**MIXTRAL)
    model = hf_model(config)
    # transformers >= 5 fuses the experts in memory: refpar reads that layout as well
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    params = M.from_hf_state_dict(model.state_dict(), config)
    tokens, targets = batch(config)
    hf_logits, hf_loss, hf_grads = hf_loss_and_grads(model, tokens, targets)

    recorder = M.moe_layer(config)
    loss, grads = M.loss_and_grads(params, tokens, targets, config, moe=recorder)
    # every expert took tokens, so every expert's gradient is compared with a nonzero one
    assert all(min(int(c) for c in r["tokens_per_expert"]) > 0 for r in recorder.last_routing.values())
    diffs = {"logits": rel_diff(M.forward(params, tokens, config), hf_logits.numpy()),
             "loss": rel_diff(loss, hf_loss.item())}
    hf_named = M.from_hf_state_dict({n: g.numpy() for n, g in hf_grads.items()}, config)
    diffs.update({name: rel_diff(grads[name], hf_named[name]) for name in params})
    worst = max(diffs, key=diffs.get)
    print(f"max relative difference {diffs[worst]:.1e} ({worst}); logits {diffs['logits']:.1e}, "
          f"loss {diffs['loss']:.1e}")
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"


def loaded_by_hf(cls, hf_cfg, state_dict):
    """HF's own checkpoint loader on refpar's dict (it renames and fuses Mixtral's experts)."""
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict.items()}
    return cls.from_pretrained(None, config=hf_cfg, state_dict=tensors, dtype=torch.float64)


@pytest.mark.parametrize("overrides", [pytest.param(LLAMA, id="llama"),
                                       pytest.param({**LLAMA, "tie_embeddings": True}, id="llama-tied"),
                                       pytest.param(MIXTRAL, id="mixtral")])
def test_to_hf_state_dict_is_a_checkpoint_hf_loads_and_from_hf_state_dict_reads_it_back_exactly(overrides):
    config = ModelConfig(**overrides)
    params = M.init_params(config, seed=4)
    state = M.to_hf_state_dict(params, config)
    cls = transformers.MixtralForCausalLM if config.moe_experts else transformers.LlamaForCausalLM
    model = loaded_by_hf(cls, hf_config(config), state)
    back = M.from_hf_state_dict(model.state_dict(), config)
    assert list(back) == list(params)
    for name in params:
        assert np.array_equal(back[name], params[name]), name  # copies, no arithmetic


def test_gpt2_loads_from_and_saves_to_gpt2_lm_head_model_with_its_logits():
    config = model_preset("tiny", dropout=0.0)
    hf_cfg = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                     n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                                     layer_norm_epsilon=config.layer_norm_eps, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_cfg).to(torch.float64).eval()  # eval: no dropout
    with torch.no_grad():  # LayerNorm gains and biases away from 1 and 0, so a swap would show
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    params = M.from_hf_state_dict(model.state_dict(), config)  # transformer.* and the tied lm_head
    tokens, _ = batch(config)
    hf_logits = model(torch.from_numpy(tokens)).logits.detach().numpy()
    diff = rel_diff(M.forward(params, tokens, config), hf_logits)
    print(f"logits relative difference {diff:.1e}")
    assert within(diff, CONTRACT)

    state = M.to_hf_state_dict(params, config)
    assert all(k.startswith("transformer.") for k in state) and "lm_head.weight" not in state
    again = loaded_by_hf(transformers.GPT2LMHeadModel, hf_cfg, state).state_dict()
    original = model.state_dict()
    assert list(again) == list(original)
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_greedy_serving_with_a_gqa_kv_cache_gives_hf_generates_greedy_tokens(monkeypatch):
    """refpar's KV-cache decoding against HF's (its own DynamicCache), both greedy, float64."""
    from refpar.serving.batching import serve
    from refpar.serving.requests import make_requests
    from refpar.serving.sampling import parse_sampling

    compute_in_input_dtype(monkeypatch, modeling_llama, "Llama")
    config = ModelConfig(**LLAMA)
    model = hf_model(config)
    params = M.from_hf_state_dict(model.state_dict(), config)
    requests = make_requests(config, [5, 9], [8, 6], [0, 1], seed=2)
    out = serve(params, config, requests, parse_sampling("greedy", seed=0), max_batch=2)
    for r in requests:
        ids = torch.tensor([r.prompt])
        hf = model.generate(ids, max_new_tokens=r.max_new_tokens, min_new_tokens=r.max_new_tokens,
                            do_sample=False, pad_token_id=0)
        assert out.tokens[r.rid] == hf[0, len(r.prompt):].tolist(), r.rid
