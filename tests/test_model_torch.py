"""refpar's GPT-2 against an independent PyTorch GPT-2 (tests/torch_gpt2.py): autograd gradients,
and the GPT-2 state-dict names and layout in both directions."""

import numpy as np
import pytest

from refpar.config import model_preset
from refpar.model import gpt
from refpar.model.data import MarkovCorpus
from refpar.model.dropout import SITES, keep_mask

torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'refpar[torch]'")
from tests.numerics import CONTRACT, rel_diff, within  # noqa: E402
from tests.torch_gpt2 import GPT2LMHead  # noqa: E402


def torch_model_with(params, config):
    model = GPT2LMHead(config).double()
    state = {"transformer." + k: torch.from_numpy(v) for k, v in gpt.to_gpt2_state_dict(params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Only the tied head and the causal-mask buffers are not in refpar's dict.
    assert not unexpected
    assert all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing), missing
    return model


def test_loss_and_every_gradient_match_torch_autograd_in_float64_with_dropout():
    config = model_preset("tiny", dropout=0.1)
    params = gpt.init_params(config, seed=3)
    T, seed, step, sample_ids = 16, 21, 5, [8, 9, 10, 11]
    tokens, targets = MarkovCorpus(config.vocab_size, 4).batch(step, sample_ids, T)
    loss, grads = gpt.loss_and_grads(params, tokens, targets, config, seed=seed, step=step,
                                     sample_ids=sample_ids)

    shapes = {"embd": (T, config.n_embd), "attn": (config.n_head, T, T),
              "attn_resid": (T, config.n_embd), "mlp_resid": (T, config.n_embd)}
    masks = {(0, "embd"): torch.from_numpy(keep_mask(seed, step, 0, "embd", sample_ids, shapes["embd"], 0.1))}
    for layer in range(config.n_layer):
        for site in SITES:
            if site != "embd":
                masks[layer, site] = torch.from_numpy(
                    keep_mask(seed, step, layer, site, sample_ids, shapes[site], 0.1))
    model = torch_model_with(params, config)
    logits = model(torch.from_numpy(tokens), masks)
    torch_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size),
                                                   torch.from_numpy(targets).reshape(-1))
    torch_loss.backward()
    torch_grads = {k.removeprefix("transformer."): p.grad.numpy() for k, p in model.named_parameters()}

    diffs = {"loss": rel_diff(loss, torch_loss.item())}
    diffs.update({name: rel_diff(grads[name], torch_grads[name]) for name in params})
    worst = max(diffs, key=diffs.get)
    print(f"max relative difference {diffs[worst]:.1e} ({worst})")
    assert within(diffs[worst], CONTRACT), f"{worst}: relative difference {diffs[worst]:.2e}"


def test_gpt2_state_dict_round_trip_is_exact_with_or_without_transformer_prefix():
    config = model_preset("tiny")
    params = gpt.init_params(config, seed=1)
    state = gpt.to_gpt2_state_dict(params)
    assert list(state) == list(gpt.param_shapes(config))
    assert state["h.0.attn.c_attn.weight"].shape == (config.n_embd, 3 * config.n_embd)  # Conv1D [in, out]
    for loaded in (gpt.from_gpt2_state_dict(state, config),
                   gpt.from_gpt2_state_dict({"transformer." + k: v for k, v in state.items()}, config)):
        assert list(loaded) == list(params)
        for name in params:
            assert np.array_equal(loaded[name], params[name]) and loaded[name].dtype == params[name].dtype


def test_loads_the_state_dict_of_an_independent_torch_gpt2_and_gives_its_logits():
    config = model_preset("tiny", dropout=0.0)
    torch.manual_seed(0)
    model = GPT2LMHead(config).double()
    with torch.no_grad():  # LayerNorm gains and biases away from 1 and 0, so a swap would show
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    state = model.state_dict()  # transformer.* names, lm_head.weight, h.{i}.attn.bias buffers
    assert "lm_head.weight" in state and "transformer.h.0.attn.bias" in state
    params = gpt.from_gpt2_state_dict(state, config)
    tokens, _ = MarkovCorpus(config.vocab_size, 0).batch(0, range(3), 12)
    expected = model(torch.from_numpy(tokens)).detach().numpy()
    got = gpt.forward(params, tokens, config)
    assert within(rel_diff(got, expected), CONTRACT)  # torch's kernels sum in their own order


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda s: s.pop("h.1.ln_2.bias"), "lacks h.1.ln_2.bias"),
        (lambda s: s.update({"h.0.mlp.c_fc.weight": np.zeros((128, 32))}), "h.0.mlp.c_fc.weight has shape"),
        (lambda s: s.update({"h.9.ln_1.weight": np.zeros(32)}), "has h.9.ln_1.weight"),
        (lambda s: s.update({"lm_head.weight": np.zeros((96, 32))}), "lm_head.weight differs"),
    ],
)
def test_a_state_dict_that_does_not_fit_names_the_first_offending_tensor(edit, words):
    config = model_preset("tiny")
    state = gpt.to_gpt2_state_dict(gpt.init_params(config, seed=1))
    edit(state)
    with pytest.raises(ValueError, match=words):
        gpt.from_gpt2_state_dict(state, config)
