"""ModelConfig's families (refpar/config.py's FAMILIES): DeepSeek-V3's MoE fields under Hugging Face
DeepseekV3Config's names (issue 41's contract) are refpar's moe_* fields, and a field of another
family is one sentence naming the family that has it."""

from dataclasses import replace

import pytest

from refpar.config import DEEPSEEK_MOE_NAMES, ConfigError, ModelConfig, model_preset

# DeepSeek-V3's MoE fields of deepseek-tiny under both names: every value differs from ModelConfig's
# default, so a field moved to the wrong place, or not moved, makes the configs differ.
HF = dict(n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2,
          norm_topk_prob=False, routed_scaling_factor=2.5)
REFPAR = dict(moe_experts=8, moe_shared_experts=2, moe_top_k=3, moe_groups=4, moe_group_limit=2,
              moe_norm_topk_prob=False, moe_routed_scaling_factor=2.5)


def deepseek(**moe) -> ModelConfig:
    dense = {k: v for k, v in model_preset("deepseek-tiny").to_dict().items()
             if k not in REFPAR and k not in HF}
    return ModelConfig(**dense, **moe)


def test_deepseek_moe_fields_under_hugging_faces_names_make_the_config_refpars_names_make():
    assert {DEEPSEEK_MOE_NAMES[k]: v for k, v in HF.items()} == REFPAR  # the two columns above line up
    by_hf, by_refpar = deepseek(**HF), deepseek(**REFPAR)
    assert by_hf == by_refpar
    assert {k: getattr(by_hf, k) for k in REFPAR} == REFPAR
    assert all(getattr(by_hf, k) is None for k in HF)  # one name inside: refpar's
    # the same value under both names is no conflict
    assert deepseek(**HF, **REFPAR) == by_refpar


def test_replace_on_a_deepseek_config_given_hugging_faces_names_changes_only_what_it_is_given():
    config = deepseek(**HF)
    assert replace(config, dtype="float32").to_dict() == {**config.to_dict(), "dtype": "float32"}
    assert replace(config, moe_top_k=2).moe_top_k == 2
    assert model_preset("deepseek-tiny", moe_top_k=2, moe_experts=4, moe_groups=2).moe_experts == 4


@pytest.mark.parametrize("hf", list(HF))
def test_a_deepseek_field_given_differently_under_both_names_is_one_sentence(hf):
    ours = DEEPSEEK_MOE_NAMES[hf]
    other = {bool: lambda v: not v, int: lambda v: v // 2, float: lambda v: v * 2}[type(HF[hf])](HF[hf])
    with pytest.raises(ConfigError) as err:
        deepseek(**{**REFPAR, hf: other})
    assert str(err.value) == (f"{hf}={other!r} and {ours}={REFPAR[ours]!r} are Hugging Face's and refpar's "
                              "names for one field but differ; give one of them")


@pytest.mark.parametrize("arch, fields, words", [
    ("llama", dict(intermediate_size=48, dropout=0.0, n_routed_experts=4),
     "n_routed_experts is a DeepSeek-V3 field but arch='llama' (Llama has grouped-query attention and "
     "Mixtral's experts); give moe_experts, refpar's name for it, or set arch='deepseek-v3'"),
    ("gpt2", dict(q_lora_rank=8),
     "q_lora_rank is a DeepSeek-V3 field but arch='gpt2' (GPT-2 has multi-head attention, a 4C GELU MLP, "
     "learned positions and a tied head); leave q_lora_rank unset or set arch='deepseek-v3'"),
    ("gpt2", dict(rope_theta=1e4), "rope_theta is a Llama field but arch='gpt2'"),
])
def test_a_field_of_another_family_is_one_sentence_naming_the_family_that_has_it(arch, fields, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig(arch=arch, **fields)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)
