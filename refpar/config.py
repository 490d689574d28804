"""Configuration as dataclasses that check themselves.

Every invalid combination raises `ConfigError` with one sentence that says what to change, so a
learner can act on it. Checks run on every rank before any communication (DESIGN.md, "Errors").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from refpar.precision import PRECISIONS

DTYPES = ("float64", "float32", "bfloat16", "float16")  # the last two: mixed precision
MAX_RUN_BYTES = 1 << 40  # 1 TiB: no run of refpar's holds its parameters or a step's logits in more
LLAMA_FIELDS = ("n_kv_head", "intermediate_size", "rope_theta", "norm_eps", "tie_embeddings")
# DeepSeek-V3's MoE fields under Hugging Face DeepseekV3Config's names (issue 41's contract) -> refpar's,
# the one name the code reads: ModelConfig moves the first into the second.
DEEPSEEK_MOE_NAMES = {"n_routed_experts": "moe_experts", "n_shared_experts": "moe_shared_experts",
                      "num_experts_per_tok": "moe_top_k", "n_group": "moe_groups",
                      "topk_group": "moe_group_limit", "norm_topk_prob": "moe_norm_topk_prob",
                      "routed_scaling_factor": "moe_routed_scaling_factor"}
DEEPSEEK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "moe_intermediate_size", "first_k_dense_replace", "rope_interleave",
                   "num_nextn_predict_layers", "mtp_loss_weight", "rope_scaling", *DEEPSEEK_MOE_NAMES)
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")  # refpar/model/optim.py learning_rate
RECOMPUTE = ("none", "selective", "full")  # refpar/parallel/recompute.py; the planner prices each


class ConfigError(ValueError):
    """A configuration or command-line mistake; its message is one sentence saying what to change."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN's RoPE scaling (Peng et al. 2023), DeepSeek-V3's rope_scaling under Hugging Face's keys;
    refpar/model/rope_yarn.py computes it. ModelConfig takes it as HF's dict too."""

    factor: float  # the context extension (DeepSeek-V3: 40)
    original_max_position_embeddings: int  # the pretraining context (DeepSeek-V3: 4096)
    beta_fast: float = 32.0  # rotations below which a frequency is interpolated ...
    beta_slow: float = 1.0  # ... and above which it is kept: a linear ramp between
    mscale: float | None = None  # the rotary cos and sin's scale, get_mscale(factor, mscale) / ...
    mscale_all_dim: float | None = None  # ... get_mscale(factor, mscale_all_dim); the softmax's, squared

    @staticmethod
    def of(value) -> RopeScaling:
        """From HF's dict ({"type" or "rope_type": "yarn", ...}) or a RopeScaling, in one sentence if not."""
        if isinstance(value, RopeScaling):
            return value
        keys = {f.name for f in fields(RopeScaling)}
        # HF's dict names its type; to_dict's (asdict) does not, and YaRN is the only one
        if not isinstance(value, dict) or value.get("type", value.get("rope_type", "yarn")) != "yarn":
            raise ConfigError(f"rope_scaling={value!r} must be YaRN's, a dict with 'type': 'yarn' "
                              "(DeepSeek-V3's rope_scaling), or None")
        extra = sorted(set(value) - keys - {"type", "rope_type"})
        if extra or "factor" not in value or "original_max_position_embeddings" not in value:
            raise ConfigError(f"rope_scaling takes factor and original_max_position_embeddings, and "
                              f"optionally beta_fast, beta_slow, mscale, mscale_all_dim; got {sorted(value)}")
        scaling = RopeScaling(**{k: v for k, v in value.items() if k in keys})
        if not (scaling.factor >= 1 and scaling.original_max_position_embeddings >= 1
                and scaling.beta_fast > scaling.beta_slow > 0):
            raise ConfigError(f"rope_scaling needs factor >= 1, original_max_position_embeddings >= 1 and "
                              f"beta_fast > beta_slow > 0 (DeepSeek-V3: 40, 4096, 32, 1); got {value}")
        return scaling


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require_positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        if not 0 < value < math.inf:  # False for nan too
            raise ConfigError(f"{owner}.{name} must be positive and finite, got {value}; set it "
                              "to a value > 0")


MOE_GATES = ("softmax", "sigmoid")
MOE_BALANCES = ("aux", "aux-free", "none")
MOE_DROP_POLICIES = ("position", "probs")
MOE_GROUP_SCORES = ("deepseek", "megatron")  # routing.group_score_size: a group's best 2, or floor(k/M)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape. arch="gpt2" (Radford et al. 2019): pre-LayerNorm blocks, learned positions,
    tanh-GELU MLP of width 4C, LayerNorm, tied head. arch="llama" (Touvron et al. 2023, as Hugging
    Face's LlamaForCausalLM): RMSNorm, rotary positions, SwiGLU MLP of width intermediate_size,
    grouped-query attention, no biases, no dropout, untied head unless tie_embeddings; with
    moe_experts, Mixtral's experts (Jiang et al. 2024). The Llama fields stay None for GPT-2."""

    vocab_size: int = 96  # V
    n_positions: int = 32  # longest sequence the position table holds
    n_embd: int = 32  # C
    n_head: int = 4  # nh; head size hs = C // nh
    n_layer: int = 4  # L transformer blocks
    dropout: float = 0.1  # GPT-2's embd/attn/resid dropout probability
    dtype: str = "float64"  # float64 for exact checks; float32 for speed; bfloat16/float16: mixed
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02  # GPT-2's initializer_range
    # Mixture of Experts (refpar/model/moe.py); moe_experts=0 means every block keeps its MLP.
    moe_experts: int = 0  # E experts per MoE block
    moe_top_k: int = 1  # k experts per token: 1 is Switch, 2 is Mixtral-style
    moe_capacity_factor: float = 1.25  # capacity = ceil(tokens * k * factor / E) per expert
    moe_dropless: bool = False  # True: no capacity, no token is ever dropped
    moe_layers: tuple[int, ...] | None = None  # blocks whose MLP becomes MoE; None: all blocks
    moe_aux_loss_weight: float = 0.01  # alpha of the Switch load-balancing loss
    moe_z_loss_weight: float = 0.001  # beta of the ST-MoE router z-loss
    moe_shared_experts: int = 0  # S experts every token passes through (DeepSeekMoE, Dai et al. 2024)
    moe_gate: str = "softmax"  # router scores: "softmax" (Switch, Mixtral) or "sigmoid" (DeepSeek-V3)
    moe_balance: str = "aux"  # "aux" (Switch loss), "aux-free" (DeepSeek-V3's bias) or "none"
    moe_bias_rate: float = 0.001  # gamma of the aux-free bias update (DeepSeek-V3 used 0.001)
    moe_seq_aux_weight: float = 0.0  # alpha of DeepSeek-V3's sequence-wise balance loss (it used 1e-4)
    moe_groups: int = 1  # G groups of E / G consecutive experts (DeepSeek-V3: one per node)
    moe_group_limit: int | None = None  # M: a token's experts lie in at most M groups; None: any
    moe_drop_policy: str = "position"  # past the capacity, drop the latest ("position") or least
    # probable ("probs") assignments (Megatron-Core's moe_token_drop_policy)
    moe_group_score: str = "deepseek"  # a group's score for moe_group_limit: its best 2 biased scores
    # ("deepseek": DeepSeek-V3's code, HF's DeepseekV3TopkRouter) or best floor(k/M) ("megatron")
    moe_norm_topk_prob: bool = True  # divide the k chosen scores by their sum (HF's norm_topk_prob)
    moe_routed_scaling_factor: float = 1.0  # the gates' factor (DeepSeek-V3's routed_scaling_factor: 2.5)
    arch: str = "gpt2"  # one of FAMILIES
    # Llama only: None for GPT-2; for Llama, None takes the default given as "None:" on each line.
    n_kv_head: int | None = None  # kv heads, grouped-query attention (Ainslie et al. 2023); None: n_head
    intermediate_size: int | None = None  # F, the SwiGLU width (Llama's is ~8C/3); no default
    rope_theta: float | None = None  # the RoPE base (Su et al. 2021); None: 10000.0, Llama 2's
    norm_eps: float | None = None  # RMSNorm's epsilon (HF's rms_norm_eps); None: 1e-6, HF's
    tie_embeddings: bool | None = None  # the head reuses model.embed_tokens (Llama 3.2 1B); None: False
    # DeepSeek-V3 only (arch="deepseek-v3", refpar/model/deepseek.py), under Hugging Face DeepseekV3Config's
    # names; it also takes the Llama fields but n_kv_head. None for the other families.
    q_lora_rank: int | None = None  # the query's low-rank width; None: a full q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int | None = None  # the key-value latent's width, what MLA's cache keeps per token
    qk_nope_head_dim: int | None = None  # a head's query and key channels without position
    qk_rope_head_dim: int | None = None  # its rotary channels; the key's are one set shared by the heads
    v_head_dim: int | None = None  # a head's value width
    moe_intermediate_size: int | None = None  # a routed or shared expert's SwiGLU width
    first_k_dense_replace: int | None = None  # the first k blocks keep a dense MLP; None: 0
    rope_interleave: bool | None = None  # RoPE pairs channels (0, 1), (2, 3)... as DeepSeek's
    # checkpoints do, else (i, i + dr/2) as Llama; None: True, Hugging Face's default
    num_nextn_predict_layers: int | None = None  # D multi-token prediction depths (model/mtp.py); None: 0
    mtp_loss_weight: float | None = None  # lambda, the MTP losses' weight; None: 0.3 (V3's first 10T tokens)
    rope_scaling: RopeScaling | None = None  # YaRN (HF's rope_scaling dict, or RopeScaling); None: none
    # DeepSeek-V3's MoE fields under HF's names (DEEPSEEK_MOE_NAMES), another spelling of the moe_* fields
    # above: a value given here is moved there (a moe_* field left at its default counts as unset), so
    # these read None once the config is made and `dataclasses.replace`, which passes every field back
    # in, passes no second value (replace by refpar's names: a deepseek config's moe_* are set).
    n_routed_experts: int | None = None  # moe_experts
    n_shared_experts: int | None = None  # moe_shared_experts
    num_experts_per_tok: int | None = None  # moe_top_k
    n_group: int | None = None  # moe_groups
    topk_group: int | None = None  # moe_group_limit
    norm_topk_prob: bool | None = None  # moe_norm_topk_prob
    routed_scaling_factor: float | None = None  # moe_routed_scaling_factor

    def __post_init__(self) -> None:
        _require_positive("ModelConfig", vocab_size=self.vocab_size, n_positions=self.n_positions,
                          n_embd=self.n_embd, n_head=self.n_head, n_layer=self.n_layer)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1); use e.g. 0.0 or 0.1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)} "
                              f"(or --precision {'|'.join(PRECISIONS)})")
        if self.arch not in FAMILIES:
            raise ConfigError(f"unknown arch {self.arch!r}; choose one of {', '.join(FAMILIES)}")
        family = FAMILIES[self.arch]
        if family.heads_share_channels and self.n_embd % self.n_head != 0:
            choices = [h for h in _divisors(self.n_embd) if h <= 64]
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                              f"choose n_head in {choices}")
        self._refuse_other_families_fields(family)
        self._take_hf_moe_names()
        if family.check is not None:
            family.check(self)
        self._check_moe()

    def _refuse_other_families_fields(self, family: Family) -> None:
        """A field of another family (FAMILIES' `takes`) set for this one is one sentence."""
        for name in FAMILY_FIELDS:
            if name in family.takes or getattr(self, name) is None:
                continue
            owner = next(arch for arch, fam in FAMILIES.items() if name in fam.takes)
            instead = (f"give {DEEPSEEK_MOE_NAMES[name]}, refpar's name for it, or"
                       if name in DEEPSEEK_MOE_NAMES else f"leave {name} unset or")
            raise ConfigError(f"{name} is a {FAMILIES[owner].title} field but arch={self.arch!r} "
                              f"({family.is_}); {instead} set arch={owner!r}")

    def _take_hf_moe_names(self) -> None:
        """Moves DeepSeek-V3's MoE fields given under HF's names into refpar's (DEEPSEEK_MOE_NAMES);
        both names set to different values is one sentence."""
        defaults = {f.name: f.default for f in fields(self)}
        for hf, ours in DEEPSEEK_MOE_NAMES.items():
            value, mine = getattr(self, hf), getattr(self, ours)
            if value is None:
                continue
            if mine != defaults[ours] and mine != value:
                raise ConfigError(f"{hf}={value!r} and {ours}={mine!r} are Hugging Face's and refpar's names "
                                  f"for one field but differ; give one of them")
            object.__setattr__(self, ours, value)
            object.__setattr__(self, hf, None)

    def _check_llama(self) -> None:
        """Llama's fields: None becomes Llama's default, then each is checked in one sentence."""
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ConfigError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (each kv "
                              "head serves the same number of query heads); choose n_kv_head in "
                              f"{_divisors(self.n_head)}")
        if self.head_size % 2:
            raise ConfigError(f"the head size n_embd / n_head = {self.head_size} must be even (RoPE "
                              "rotates pairs of channels); choose n_head so that n_embd / n_head is even")
        self._check_llama_shared()

    def _check_llama_shared(self) -> None:
        """The fields Llama shares with DeepSeek-V3: None becomes Llama's default, then each is checked."""
        defaults = {"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.intermediate_size is None or self.intermediate_size < 1:
            raise ConfigError(f"arch={self.arch!r} needs a positive intermediate_size, the SwiGLU width "
                              f"(Llama uses about 8/3 n_embd, e.g. {16 * -(-8 * self.n_embd // 48)} for "
                              f"n_embd={self.n_embd})")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be positive; Llama 2 uses 10000.0, "
                              "Llama 3 500000.0")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps} must be positive; Llama uses 1e-5 or 1e-6")
        if self.dropout != 0.0:
            raise ConfigError(f"{FAMILIES[self.arch].title} trains without dropout but dropout="
                              f"{self.dropout}; set dropout=0.0 (--dropout 0)")
        if self.moe_experts and self.moe_top_k == 1 and self.moe_norm_topk_prob:
            raise ConfigError("Mixtral's router renormalises the top-k gates to sum to 1, which with "
                              "moe_top_k=1 makes every gate 1 and cuts the router off from the loss; "
                              "use moe_top_k=2 (--moe-topk 2) or moe_norm_topk_prob=False "
                              "(--no-moe-norm-topk-prob)")

    def _check_deepseek(self) -> None:
        """DeepSeek-V3's fields (multi-head latent attention, dense first blocks), each in one sentence;
        the shared ones are checked as Llama's."""
        if self.first_k_dense_replace is None:
            object.__setattr__(self, "first_k_dense_replace", 0)
        if self.rope_interleave is None:
            object.__setattr__(self, "rope_interleave", True)
        if self.num_nextn_predict_layers is None:
            object.__setattr__(self, "num_nextn_predict_layers", 0)
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", RopeScaling.of(self.rope_scaling))
        if self.mtp_loss_weight is None:
            object.__setattr__(self, "mtp_loss_weight", 0.3)
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers!r} must be a whole "
                              "number >= 0, the multi-token prediction depths (DeepSeek-V3: 1)")
        if not 0 <= self.mtp_loss_weight < math.inf:
            raise ConfigError(f"mtp_loss_weight={self.mtp_loss_weight} must be 0 or positive, and finite; "
                              "DeepSeek-V3 used 0.3, then 0.1")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"arch='deepseek-v3' needs a positive whole {name}, got {value!r} "
                                  "(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim "
                                  "64, v_head_dim 128)")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ConfigError(f"q_lora_rank={self.q_lora_rank!r} must be a positive whole number "
                              "(DeepSeek-V3: 1536), or unset for a full-rank query projection")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs "
                              "of channels); DeepSeek-V3 uses 64")
        dense = self.first_k_dense_replace
        if not isinstance(dense, int) or not 0 <= dense <= self.n_layer:
            raise ConfigError(f"first_k_dense_replace={self.first_k_dense_replace} dense blocks must lie "
                              f"within the model's n_layer={self.n_layer}; choose 0 to {self.n_layer}")
        if self.moe_experts and self.moe_layers is not None:
            raise ConfigError("DeepSeek's MoE blocks are those after the first first_k_dense_replace; leave "
                              "moe_layers unset and set first_k_dense_replace")
        if self.moe_experts and (self.moe_intermediate_size is None or self.moe_intermediate_size < 1):
            raise ConfigError(f"arch='deepseek-v3' with moe_experts={self.moe_experts} needs a positive "
                              "moe_intermediate_size, an expert's SwiGLU width (DeepSeek-V3: 2048)")
        self._check_llama_shared()

    def _check_moe(self) -> None:
        if self.moe_experts < 0:
            raise ConfigError(f"moe_experts={self.moe_experts} must be 0 (no MoE) or a positive count")
        if self.moe_experts == 0:
            return
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(f"moe_top_k={self.moe_top_k} must be between 1 and "
                              f"moe_experts={self.moe_experts}")
        if not self.moe_dropless and not 0 < self.moe_capacity_factor < math.inf:
            raise ConfigError(f"moe_capacity_factor={self.moe_capacity_factor} must be a positive finite "
                              "number; use e.g. 1.25, or dropless routing")
        if self.moe_layers is not None:
            layers = tuple(self.moe_layers)
            in_range = all(isinstance(i, int) and 0 <= i < self.n_layer for i in layers)
            if not layers or len(set(layers)) != len(layers) or not in_range:
                raise ConfigError(f"moe_layers={layers} must list distinct block indices in "
                                  f"0..{self.n_layer - 1}")
            object.__setattr__(self, "moe_layers", tuple(sorted(layers)))
        if not (0 <= self.moe_aux_loss_weight < math.inf and 0 <= self.moe_z_loss_weight < math.inf):
            raise ConfigError(f"moe_aux_loss_weight={self.moe_aux_loss_weight} and moe_z_loss_weight="
                              f"{self.moe_z_loss_weight} must be 0 or positive, and finite")
        self._check_routing()

    def _check_routing(self) -> None:
        """The DeepSeekMoE / DeepSeek-V3 / Megatron-Core routing options (refpar/model/routing.py)."""
        E, k, G, M = self.moe_experts, self.moe_top_k, self.moe_groups, self.moe_group_limit
        if self.moe_shared_experts < 0:
            raise ConfigError(f"moe_shared_experts={self.moe_shared_experts} must be 0 or a positive count")
        if self.moe_gate not in MOE_GATES:
            raise ConfigError(f"unknown moe_gate {self.moe_gate!r}; choose one of {', '.join(MOE_GATES)}")
        if self.moe_gate == "sigmoid" and k == 1 and self.moe_norm_topk_prob:
            raise ConfigError("sigmoid gates are normalised over the chosen experts, which with "
                              "moe_top_k=1 makes every gate 1 and cuts the router off from the loss; "
                              "use moe_top_k >= 2 (--moe-topk 2) or moe_norm_topk_prob=False "
                              "(--no-moe-norm-topk-prob)")
        if self.moe_balance not in MOE_BALANCES:
            raise ConfigError(f"unknown moe_balance {self.moe_balance!r}; choose one of "
                              f"{', '.join(MOE_BALANCES)}")
        if self.moe_balance == "aux-free" and not 0 < self.moe_bias_rate < math.inf:
            raise ConfigError(f"moe_bias_rate={self.moe_bias_rate} must be positive and finite for "
                              "aux-free balancing; DeepSeek-V3 used 0.001")
        if not 0 <= self.moe_seq_aux_weight < math.inf:
            raise ConfigError(f"moe_seq_aux_weight={self.moe_seq_aux_weight} must be 0 or positive, "
                              "and finite; DeepSeek-V3 used 0.0001")
        if G < 1 or E % G:
            raise ConfigError(f"moe_groups={G} must divide moe_experts={E}; choose one of {_divisors(E)}")
        if M is not None and not 1 <= M <= G:
            raise ConfigError(f"moe_group_limit={M} must be between 1 and moe_groups={G}")
        if M is not None and M * (E // G) < k:
            raise ConfigError(f"moe_group_limit={M} groups of {E // G} experts hold fewer than "
                              f"moe_top_k={k}; allow at least {-(-k // (E // G))} groups")
        if self.moe_drop_policy not in MOE_DROP_POLICIES:
            raise ConfigError(f"unknown moe_drop_policy {self.moe_drop_policy!r}; choose one of "
                              f"{', '.join(MOE_DROP_POLICIES)}")
        if self.moe_group_score not in MOE_GROUP_SCORES:
            raise ConfigError(f"unknown moe_group_score {self.moe_group_score!r}; choose one of "
                              f"{', '.join(MOE_GROUP_SCORES)}")
        if M is not None and self.moe_group_score == "deepseek" and E // G < 2:
            raise ConfigError(f"moe_group_score='deepseek' scores a group by its best 2 experts, but "
                              f"moe_groups={G} groups of moe_experts={E} hold 1 each; use at most {E // 2} "
                              "groups or moe_group_score='megatron'")
        if M is not None and self.moe_group_score == "megatron" and k < M:
            raise ConfigError(f"moe_group_score='megatron' scores a group by its best floor(moe_top_k / "
                              f"moe_group_limit) = 0 experts with moe_top_k={k} < moe_group_limit={M}; "
                              f"use moe_group_limit <= {k} or moe_group_score='deepseek'")
        if not isinstance(self.moe_norm_topk_prob, bool):
            raise ConfigError(f"moe_norm_topk_prob={self.moe_norm_topk_prob!r} must be True or False")
        if not 0 < self.moe_routed_scaling_factor < math.inf:
            raise ConfigError(f"moe_routed_scaling_factor={self.moe_routed_scaling_factor} must be positive "
                              "and finite; DeepSeek-V3 uses 2.5, 1.0 leaves the gates as they are")

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        """The blocks whose MLP is a Mixture of Experts (empty without MoE)."""
        if self.moe_experts == 0:
            return ()
        if self.first_k_dense_replace is not None:  # DeepSeek-V3: dense first blocks, then MoE
            return tuple(range(self.first_k_dense_replace, self.n_layer))
        return tuple(range(self.n_layer)) if self.moe_layers is None else self.moe_layers

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Family:
    """What ModelConfig checks of one family (refpar/model/__init__.py's FAMILIES implements it,
    refpar/holdings.py's FAMILIES names its parameters)."""

    title: str  # the family as a sentence names it
    is_: str  # what sets it apart, for the sentence refusing another family's field
    takes: tuple[str, ...]  # the fields of FAMILY_FIELDS it reads; the others must stay None
    check: Callable[[ModelConfig], None] | None  # fills in the defaults of `takes` and checks them
    heads_share_channels: bool = True  # a head is n_embd / n_head channels (MLA's widths are its own)


FAMILIES = {  # the values of ModelConfig.arch; refpar/model/: gpt.py, llama.py, deepseek.py
    "gpt2": Family("GPT-2", "GPT-2 has multi-head attention, a 4C GELU MLP, learned positions and a tied "
                   "head", (), None),
    "llama": Family("Llama", "Llama has grouped-query attention and Mixtral's experts", LLAMA_FIELDS,
                    ModelConfig._check_llama),
    "deepseek-v3": Family("DeepSeek-V3", "DeepSeek-V3's latent attention gives every head its own key and "
                          "value", LLAMA_FIELDS[1:] + DEEPSEEK_FIELDS, ModelConfig._check_deepseek,
                          heads_share_channels=False),
}
FAMILY_FIELDS = tuple(dict.fromkeys(name for fam in FAMILIES.values() for name in fam.takes))


@dataclass(frozen=True)
class TrainConfig:
    """One training run: global batch, sequence, optimizer and seed."""

    steps: int = 30
    batch_size: int = 8  # B, global: the number of sequences per optimizer step
    seq_len: int = 16  # T
    lr: float = 1e-2
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 1234
    # Mixed precision (refpar/precision.py), for 16-bit ModelConfig.dtype only:
    fp32_grads: bool = False  # accumulate gradients in fp32 instead of the 16-bit dtype
    loss_scale: float | None = None  # fp16: the initial dynamic loss scale (None: 2^16)
    loss_scale_window: int | None = None  # fp16: good steps before the scale doubles (None: 1000)
    # Production training (refpar/model/optim.py):
    clip_grad_norm: float = 0.0  # clip the gradients to this global L2 norm; 0: no clipping
    lr_schedule: str = "constant"  # constant, cosine, linear or wsd (optim.learning_rate)
    warmup_steps: int = 0  # steps of linear warmup to lr
    min_lr: float = 0.0  # where cosine, linear and wsd decay to, at the last step
    wsd_decay_steps: int | None = None  # wsd: steps of its final decay (None: a fifth after warmup)
    decay_all: bool = False  # weight decay on every tensor, not only matrices and embeddings
    # What it trains on (refpar/data; trainer.corpus_for): None is the synthetic Markov corpus.
    data: str | None = None  # a UTF-8 text file, a folder of them, or nanoGPT's train.bin/val.bin
    tokenizer: str | None = None  # bytes, bpe, gpt2 or a tokenizer.json (None: bytes for text)
    tokenizer_vocab: int | None = None  # the BPE's vocabulary, or the token files' (None: their default)
    eval_every: int = 0  # the validation loss every N steps and after the last; 0: never
    # Weights (refpar/weights.py): an HF model folder or .safetensors file to start from instead of
    # init_params(seed); each rank reads only its slices of it.
    init_from: str | None = None

    def __post_init__(self) -> None:
        _require_positive("TrainConfig", steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
                          lr=self.lr)
        if self.loss_scale is not None and not 0 < self.loss_scale < float("inf"):
            raise ConfigError(f"loss_scale={self.loss_scale} must be a positive finite number; "
                              "use e.g. --loss-scale 65536")
        if self.loss_scale_window is not None and (
                not isinstance(self.loss_scale_window, int) or self.loss_scale_window < 1):
            raise ConfigError(f"loss_scale_window={self.loss_scale_window} must be a whole number "
                              ">= 1; use e.g. --loss-scale-window 1000")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed} must be a non-negative integer")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every} must be a whole number >= 0; use e.g. "
                              "--eval-every 50")
        if self.data is None and (self.tokenizer is not None or self.tokenizer_vocab is not None):
            raise ConfigError("--tokenizer and --vocab-size tokenize text; add --data PATH or drop them")
        self._check_schedule()

    def _check_schedule(self) -> None:
        """--clip-grad-norm, --lr-schedule, --warmup-steps, --min-lr and --wsd-decay-steps."""
        if not 0 <= self.clip_grad_norm < math.inf:  # nan too
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm} must be 0 (no clipping) or a positive "
                              "finite norm; use e.g. --clip-grad-norm 1.0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown learning-rate schedule {self.lr_schedule!r}; choose one of "
                              f"{', '.join(LR_SCHEDULES)}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be a whole number >= 0; use e.g. "
                              "--warmup-steps 2")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr={self.min_lr} must lie between 0 and lr={self.lr}; the schedule "
                              "decays from lr down to it")
        if self.min_lr and self.lr_schedule == "constant":
            raise ConfigError("--min-lr is where a decaying schedule ends; add --lr-schedule cosine, "
                              "linear or wsd, or drop --min-lr")
        if self.wsd_decay_steps is not None and self.lr_schedule != "wsd":
            raise ConfigError("--wsd-decay-steps sets the decay of --lr-schedule wsd; add --lr-schedule wsd "
                              "or drop it")
        if self.wsd_decay_steps is not None and (not isinstance(self.wsd_decay_steps, int)
                                                 or not 1 <= self.wsd_decay_steps <= self.steps):
            raise ConfigError(f"wsd_decay_steps={self.wsd_decay_steps} must be a whole number from 1 to "
                              f"--steps {self.steps}")

    def check_model(self, model: ModelConfig) -> None:
        """Checks that need both configs."""
        if self.seq_len <= (model.num_nextn_predict_layers or 0):  # DeepSeek-V3's MTP depths
            D = model.num_nextn_predict_layers
            raise ConfigError(f"seq_len={self.seq_len} leaves no position for multi-token prediction depth "
                              f"{D}; use --seq-len {D + 1} or more")
        if self.seq_len > model.n_positions:
            raise ConfigError(f"seq_len={self.seq_len} is longer than n_positions={model.n_positions}; "
                              f"use --seq-len {model.n_positions} or less")
        if self.fp32_grads and model.dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"--fp32-grads applies to bf16-mixed and fp16-mixed; {model.dtype} "
                              "gradients already have the parameters' precision, so drop it")
        if (self.loss_scale is not None or self.loss_scale_window is not None) \
                and model.dtype != "float16":
            raise ConfigError(f"loss scaling applies to fp16-mixed only ({model.dtype} needs none: "
                              "bf16 has fp32's exponent range); drop --loss-scale and "
                              "--loss-scale-window or use --precision fp16-mixed")
        # Every run holds all its parameters and a step's logits in host memory; beyond a tebibyte
        # of them (float64) the sizes are a typo, refused here rather than a hang or MemoryError.
        C, E = model.n_embd, max(1, model.moe_experts)
        # the embeddings, attention's 4C^2 and each MLP's (or expert's) 8C^2 per block: biases aside
        params = (model.vocab_size + model.n_positions) * C + model.n_layer * (4 + 8 * E) * C * C
        logits = self.batch_size * self.seq_len * model.vocab_size
        if 8 * params > MAX_RUN_BYTES:
            experts = f" and {E} experts" if E > 1 else ""
            raise ConfigError(f"{model.n_layer} blocks of {C} channels{experts} hold over {params:.1e} "
                              f"parameters, {8 * params:.0e} bytes; use fewer layers or experts")
        if 8 * logits > MAX_RUN_BYTES:
            raise ConfigError(f"a batch of {self.batch_size} x {self.seq_len} tokens makes {logits:.1e} "
                              f"logits a step, {8 * logits:.0e} bytes; use a smaller --batch-size")

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # A step takes milliseconds on one core: the model of every test and of the demo.
    "tiny": ModelConfig(),
    # Large enough that matmuls dominate: the benchmark preset (3.7M parameters), not GPT-2 small.
    "small": ModelConfig(vocab_size=2048, n_positions=256, n_embd=256, n_head=8, n_layer=4, dtype="float32"),
    # Hugging Face's GPT-2 small ("gpt2", Radford et al. 2019): 124,439,808 parameters with the tied
    # head, its dropout 0.1; float32, as it is trained.
    "gpt2": ModelConfig(vocab_size=50257, n_positions=1024, n_embd=768, n_head=12, n_layer=12,
                        dtype="float32"),
    # Llama's tiny twin: 4 query heads share 2 kv heads, so tensor parallelism over 4 ranks must
    # replicate each kv head on 2 of them. F = 176 is 8C/3 rounded up to a multiple of 16.
    "llama-tiny": ModelConfig(
        arch="llama", vocab_size=96, n_positions=32, n_embd=64, n_head=4, n_kv_head=2, n_layer=4,
        intermediate_size=176, dropout=0.0
    ),
    # The benchmark size of "small" with Llama's blocks: 8 query heads over 2 kv heads.
    "llama-small": ModelConfig(
        arch="llama", vocab_size=2048, n_positions=256, n_embd=256, n_head=8, n_kv_head=2, n_layer=4,
        intermediate_size=688, dropout=0.0, dtype="float32"
    ),
    # DeepSeek-V3's tiny twin (refpar/model/deepseek.py): latent attention with every width its own,
    # one dense block then three of 8 fine-grained experts (k = 3 of them in at most 2 of 4 groups)
    # beside one shared expert, sigmoid gates normalised and scaled by 2.5 and aux-free balancing, as
    # V3 routes.
    "deepseek-tiny": ModelConfig(
        arch="deepseek-v3", vocab_size=96, n_positions=32, n_embd=64, n_head=4, n_layer=4, dropout=0.0,
        intermediate_size=176, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5, moe_gate="sigmoid",
        moe_balance="aux-free", moe_dropless=True, moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0,
        moe_seq_aux_weight=1e-4
    ),
    # The benchmark size of "small" with DeepSeek-V3's blocks (3.7M parameters): 8 heads whose query and
    # key are 32 + 16 rotary channels and value 32, a 64-wide latent; one dense block then three of 16
    # fine-grained experts (k = 4 of them in at most 2 of 4 groups) beside one shared expert, routed as V3.
    "deepseek-small": ModelConfig(
        arch="deepseek-v3", vocab_size=2048, n_positions=256, n_embd=256, n_head=8, n_layer=4, dropout=0.0,
        dtype="float32", intermediate_size=688, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, moe_gate="sigmoid", moe_balance="aux-free", moe_dropless=True,
        moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0, moe_seq_aux_weight=1e-4
    ),
}


@dataclass(frozen=True)
class Recipe:
    """The optimizer settings `refpar train --model NAME` uses unless a flag gives its own: peak
    learning rate, linear warmup steps (at most a tenth of a run's steps, so a short run still
    reaches its peak) and the schedule, decaying to min_lr_ratio x lr at the last step."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0  # the decay's floor over the peak (nanoGPT and Chinchilla: 0.1)
    source: str = ""  # where the numbers come from

    def warmup_for(self, steps: int) -> int:
        return min(self.warmup_steps, steps // 10)


RECIPES: dict[str, Recipe] = {
    # The course's models (55K and 119K parameters) learn fastest at a constant 1e-2 (measured: tiny
    # 4.57 -> 3.14 over 30 steps, at 1e-3 only to 4.12); constant, so that every lesson's numbers hold.
    "tiny": Recipe(1e-2, source="measured on the Markov corpus"),
    "llama-tiny": Recipe(1e-2, source="measured on the Markov corpus"),
    "deepseek-tiny": Recipe(1e-2, source="measured on the Markov corpus"),
    # nanoGPT's "baby GPT" (config/train_shakespeare_char.py: 10.7M parameters, lr 1e-3, 100 warmup
    # iterations, cosine to min_lr = lr / 10); 1e-2 makes these 3.7M-parameter models' loss rise
    # (7.70 -> 8.07 over 30 steps), 1e-3 lowers it.
    "small": Recipe(1e-3, 100, "cosine", 0.1, "nanoGPT train_shakespeare_char"),
    # Llama's schedule (Touvron et al. 2023, section 2.2: 2,000 warmup steps, cosine to 10% of the
    # peak) at the baby GPT's peak for a model of this size.
    "llama-small": Recipe(1e-3, 100, "cosine", 0.1, "Touvron et al. 2023's schedule, nanoGPT's peak"),
    # DeepSeek-V3's schedule (DeepSeek-AI 2024, section 4.2: linear warmup over 2K steps, a cosine
    # decay to a tenth of the peak) at the baby GPT's peak for a model of this size.
    "deepseek-small": Recipe(1e-3, 100, "cosine", 0.1, "DeepSeek-V3 sec. 4.2's schedule, nanoGPT's peak"),
    # GPT-3's 125M model (Brown et al. 2020, table 2.1: 6e-4), as nanoGPT trains GPT-2 small
    # (train_gpt2.py: 2,000 warmup iterations, cosine to 6e-5).
    "gpt2": Recipe(6e-4, 2000, "cosine", 0.1, "Brown et al. 2020 table 2.1; nanoGPT train_gpt2"),
}
# Weights loaded with --init-from are fine-tuned, not trained from scratch: nanoGPT's
# config/finetune_shakespeare.py (GPT-2 from its checkpoint: lr 3e-5, constant).
FINETUNE_RECIPE = Recipe(3e-5, source="nanoGPT finetune_shakespeare")


def describe_preset(name: str) -> str:
    """A preset's size in words, for --help: "small (4 layers, 256 channels, 8 heads, ...)"."""
    m = MODEL_PRESETS[name]
    return (f"{name} ({m.arch}, {m.n_layer} layers, {m.n_embd} channels, {m.n_head} heads, vocabulary "
            f"{m.vocab_size}, {m.n_positions} positions, {m.dtype})")


def model_preset(name: str, **overrides) -> ModelConfig:
    """A named preset with fields replaced, e.g. `model_preset("tiny", dtype="float32")`."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}")
    return replace(MODEL_PRESETS[name], **overrides)


MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # slowest- to fastest-varying, as Megatron lays ranks


@dataclass(frozen=True)
class ParallelConfig:
    """How a run is split over ranks: axis sizes and the options of each strategy."""

    sizes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MESH_AXES, 1))

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sizes) - set(MESH_AXES))
        if unknown:
            raise ConfigError(f"unknown mesh axis {unknown[0]!r}; axes are {', '.join(MESH_AXES)}")
        for axis, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"mesh axis {axis}={size} must be a positive integer")
        full = dict.fromkeys(MESH_AXES, 1)
        full.update(self.sizes)
        object.__setattr__(self, "sizes", full)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())


def parse_mesh(text: str) -> dict[str, int]:
    """`"dp=2,tp=2"` -> {"dp": 2, "tp": 2}; every mistake is one sentence."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"mesh entry {part!r} needs the form axis=size, e.g. dp=2")
        if name not in MESH_AXES:
            raise ConfigError(f"unknown mesh axis {name!r}; axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ConfigError(f"mesh axis {name!r} is given twice; give each axis once")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"mesh axis {name}={value!r} needs a whole number") from None
        if size < 1:
            raise ConfigError(f"mesh axis {name}={size} must be at least 1")
        sizes[name] = size
    if not sizes:
        raise ConfigError("the mesh is empty; give it as e.g. --mesh dp=2,tp=2")
    return sizes


@dataclass(frozen=True)
class Plan:
    """What a run does on its mesh beyond the mesh's sizes (the defaults: no strategy asked for)."""

    schedule: str | None = None  # pipeline schedule (refpar/schedules/__init__.py); 1f1b
    microbatches: int = 1  # per step: pipeline microbatches, gradient accumulation, MoE routing
    chunks: int | None = None  # v, model chunks per pipeline rank (interleaved-1f1b: 2)
    sp: bool = False  # Megatron sequence parallelism over tp
    cp_algo: str | None = None  # ring (default) or ulysses, when the mesh has cp
    zero: int = 0  # ZeRO stage 0 (plain DP), 1, 2 or 3 over each unit's replica group
    fsdp: bool = False  # ZeRO-3 by FSDP's policy (refpar/parallel/fsdp.py)
    prefetch: bool = False  # FSDP: gather the next block one piece early
    reshard_after_forward: bool = True  # FSDP: free a block's parameters after its forward
    bucket_elems: int = 1 << 62  # DP: the gradient all-reduce bucket cap, in elements
    overlap: bool = False  # DP: buckets all-reduced as ring rounds interleaved with the backward
    schedule_csv: str | None = None  # a schedule of one's own instead: the text of torch's schedule CSV
    recompute: str = "none"  # none, selective or full: what a block reruns (refpar/parallel/recompute.py)

    @property
    def kind(self) -> str:
        """The schedule's builder, "csv" for one read from a file."""
        return "csv" if self.schedule_csv is not None else self.schedule or "1f1b"

    @property
    def stage(self) -> int:
        """The ZeRO stage the plan runs (FSDP is stage 3)."""
        return 3 if self.fsdp else self.zero

    @property
    def strategy(self) -> str:
        """dp, zero1, zero2, zero3 or fsdp: how each unit's replicas are kept."""
        return "fsdp" if self.fsdp else ("dp" if self.zero == 0 else f"zero{self.zero}")


def check_output_path(flag: str, path: str, directory: bool = False, overwrite: bool | None = None) -> None:
    """Refuses, before a run starts, a `--figure PATH`, `--trace PATH`, `--log PATH` or (`directory`)
    `--save DIR` that the run could not write at its end: a path too long for the system, a missing
    folder, a folder where a file goes, a file where a folder goes, an existing file that is not
    writable, a folder where no file can be created, and (`overwrite` False) an existing file. A
    directory is created with its parents, so only its nearest existing ancestor must be a writable
    folder."""
    from refpar.reading import check_path_length

    if not path:
        raise ConfigError(f"{flag} needs a path; give the {'directory' if directory else 'file'} to write")
    check_path_length(flag, path, ConfigError)
    target = Path(path)
    if directory:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"{flag} {path!r} is a file; give a directory (it is created if missing)")
        where = next(p for p in (target, *target.parents) if p.exists())
        if not where.is_dir():
            raise ConfigError(f"{flag} {path!r} lies under the file {str(where)!r}; give a path in a "
                              "directory")
    else:
        if target.is_dir():
            raise ConfigError(f"{flag} {path!r} is a directory; give the path of a file to write in it")
        where = target.parent
        if not where.is_dir():
            raise ConfigError(f"{flag} {path!r}: the directory {str(where)!r} does not exist; create it "
                              "or give a file in an existing directory")
        if overwrite is False and (target.exists() or target.is_symlink()):
            raise ConfigError(f"{flag} {path!r} exists; pass --overwrite to replace it, or give another path")
        if target.exists() and not os.access(target, os.W_OK):  # it would fail at the run's end
            raise ConfigError(f"{flag} {path!r} exists and is not writable; give another path or make it "
                              "writable")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {str(where)!r} is not writable; give a path in a directory "
                          "you can write to")
    _try_creating_a_file(flag, path, where)


def add_overwrite_argument(parser) -> None:
    """--overwrite, for a command that writes a file (--figure): an existing one is refused without it."""
    parser.add_argument("--overwrite", action="store_true", help="replace a --figure file that exists")


def _try_creating_a_file(flag: str, path: str, where: Path) -> None:
    """What access() cannot tell (it answers yes to root everywhere): a folder where no file can be
    made (/proc, NFS with root squashed, a security policy) refuses here, not after the run. The file
    is removed at once, in one file operation, so an interruption cannot leave it."""
    import tempfile

    from refpar import interrupt

    with interrupt.file_operation():
        try:
            fd, probe = tempfile.mkstemp(dir=where, prefix=".refpar-check-")
        except OSError as err:
            raise ConfigError(f"{flag} {path!r}: no file can be created in {str(where)!r} "
                              f"({(err.strerror or str(err)).lower()}); give a path in a directory you can "
                              "write to") from None
        os.close(fd)
        os.unlink(probe)
