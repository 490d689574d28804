"""refpar's router set to Megatron-Core's conventions against Megatron-Core 0.16.1's own
`topk_routing_with_score_function` (megatron/core/transformer/moe/moe_utils.py), one process, no
distributed setup: expert sets and gates on 256 tokens, float64. `make conformance` runs this folder.

Megatron computes the router's sigmoid and softmax in float32 whatever the logits' dtype
(`torch.sigmoid(logits.float())`, `torch.softmax(logits, dtype=torch.float32)`, for bf16 models);
`float64_scores` makes exactly these two casts no-ops for the test, the rest runs as shipped.
The conventions matched:
- sigmoid: `moe_group_score="megatron"` (a group's best floor(k/M) biased scores) with the expert
  bias, gates normalised over the k (Megatron always normalises sigmoid gates for k > 1), times
  `scaling_factor` (refpar's moe_routed_scaling_factor);
- softmax: `use_pre_softmax=True` is refpar's softmax (top-k of the probabilities, group scores from
  them) with `moe_norm_topk_prob=False`; `use_pre_softmax=False` (a softmax over the k chosen logits)
  is `moe_norm_topk_prob=True` without groups, and with groups where floor(k/M) = 1 (a group's best
  logit and best probability rank the groups alike). Where floor(k/M) >= 2 it ranks groups by summed
  logits, which refpar does not (it sums scores): other experts for some tokens
  (`test_megatron_post_softmax_groups_sum_logits`)."""

import numpy as np
import pytest

from refpar.config import ModelConfig
from refpar.model.routing import route
from tests.numerics import CONTRACT, rel_diff, within

pytest.importorskip("megatron.core")
import torch  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

C, N = 8, 256
# (gate, E, G, M, k, norm_topk_prob, scaling, use_pre_softmax): floor(k/M) = 1, 1, 4, 1 (never
# DeepSeek's 2), scaling 2.5 and 1.5 and none
CASES = {
    "sigmoid_k3_M2": ("sigmoid", 16, 4, 2, 3, True, 2.5, None),
    "sigmoid_k6_M4": ("sigmoid", 32, 8, 4, 6, True, 1.5, None),
    "sigmoid_k8_M2": ("sigmoid", 32, 8, 2, 8, True, 2.5, None),
    "softmax_pre_k3_M2": ("softmax", 16, 4, 2, 3, False, 2.5, True),
    "softmax_pre_k6_nogroups": ("softmax", 16, 1, None, 6, False, 1.0, True),
    "softmax_post_k3_nogroups": ("softmax", 16, 1, None, 3, True, 2.5, False),
}


@pytest.fixture
def float64_scores(monkeypatch):
    float_, softmax = torch.Tensor.float, torch.softmax

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else float_(self, *args, **kwargs)

    def softmax_in_input_dtype(x, *args, dtype=None, **kwargs):
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", keep_float64)
    monkeypatch.setattr(torch, "softmax", softmax_in_input_dtype)


def routings(case, convention="megatron"):
    """refpar's (N, E) gates and Megatron's (N, E) gates and (N, E) expert map for one case."""
    gate, E, G, M, k, norm, scale, pre = case
    config = ModelConfig(n_embd=C, n_head=2, n_layer=1, moe_experts=E, moe_top_k=k, moe_dropless=True,
                         moe_gate=gate, moe_groups=G, moe_group_limit=M, moe_group_score=convention,
                         moe_norm_topk_prob=norm, moe_routed_scaling_factor=scale)
    gen = np.random.default_rng(16)
    x, w = gen.standard_normal((N, C)), gen.standard_normal((C, E)) * 0.5
    bias = gen.standard_normal(E) * 0.1 if gate == "sigmoid" else None
    logits = torch.from_numpy(x @ w)
    probs, chosen = moe_utils.topk_routing_with_score_function(
        logits, k, use_pre_softmax=bool(pre), num_groups=G if M else None, group_topk=M,
        scaling_factor=scale if scale != 1.0 else None, score_function=gate,
        expert_bias=None if bias is None else torch.from_numpy(bias))
    theirs = probs.numpy()  # (N, E), 0 where not chosen
    routing, _ = route(x, w, config, bias=bias)
    mine = np.zeros((N, E))
    np.put_along_axis(mine, routing["experts"], routing["gates"], axis=1)
    return mine, theirs, chosen.numpy()


@pytest.mark.parametrize("name", CASES)
def test_megatron_group_score_is_megatron_cores_router(name, float64_scores):
    mine, theirs, chosen = routings(CASES[name])
    np.testing.assert_array_equal(mine > 0, chosen)  # the same expert set, token by token
    assert within(rel_diff(mine, theirs), CONTRACT), rel_diff(mine, theirs)
    if CASES[name][3]:  # with a group limit, DeepSeek's best 2 per group picks other experts
        other, _, _ = routings(CASES[name], "deepseek")
        assert np.any((other > 0) != chosen)


def test_megatron_post_softmax_groups_sum_logits(float64_scores):
    """use_pre_softmax=False with k = 4, M = 2: Megatron ranks groups by their best 2 logits summed,
    refpar (either convention) by scores; the docs' table (docs/checking-a-framework.md) counts the
    tokens this moves."""
    _, _, chosen = routings(("softmax", 16, 4, 2, 4, True, 1.0, False))
    for convention in ("megatron", "deepseek"):
        mine, _, _ = routings(("softmax", 16, 4, 2, 4, True, 1.0, False), convention)
        assert int(np.sum(np.any((mine > 0) != chosen, axis=1))) == 39
