"""Model presets for planning at scale: the shapes of published models, as the formulas read them.

refpar trains GPT-2 and Llama models (refpar.config.ModelConfig). The planner also needs the models
people actually train at scale, which differ from GPT-2 in ways the memory and FLOP formulas must
see. Each difference is a field of `ModelSpec`, not a separate code path:

    mlp="swiglu"          three (h, f) matrices instead of two (Shazeer 2020); Llama's f is ~8h/3
    n_kv_head < n_head    grouped-query attention (Ainslie et al. 2023): K and V are (h, n_kv*hs)
    norm="rmsnorm"        weight only, no bias (Zhang & Sennrich 2019)
    bias=False            no biases in the linear layers (Llama, Mixtral)
    tied_embeddings=False a separate (h, V) LM head (Llama)
    learned_positions     GPT-2/3 learn an (s, h) table; rotary embeddings (Llama) have no parameters
    dropout               GPT-2/3 and Megatron keep dropout masks for backward; Llama trains without
    n_experts > 0         MoE MLPs: n_experts routed experts of width moe_d_ff, top_k per token,
                          n_shared_experts always-on experts (DeepSeekMoE, Dai et al. 2024), the
                          first n_dense_layers blocks keep a dense MLP of width d_ff
    kv_lora_rank > 0      multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, §2.1): Q and
                          K/V pass through low-rank latents (q_lora_rank, kv_lora_rank), each head
                          has qk_nope_head_dim + qk_rope_head_dim query/key and v_head_dim value
                          channels. Its parameters (flops.attention_params), GEMMs
                          (efficiency._attention_linears), attention core (qk_head_size, v_head_size)
                          and context-parallel K/V are priced with these shapes, not K/V of width h

Legend: L layers, h = d_model, a heads, s sequence, V vocabulary, f MLP width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from refpar.config import ConfigError, ModelConfig

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class ModelSpec:
    """One model's shape; every field is an input of the parameter, FLOP and memory formulas."""

    name: str
    n_layer: int  # L
    d_model: int  # h
    n_head: int  # a
    vocab_size: int  # V
    seq_len: int  # s the model was trained with (the default of `refpar plan --seq`)
    global_batch: int  # sequences per step in the published run (the default of --global-batch)
    d_ff: int = 0  # f; 0 means 4h (GPT)
    n_kv_head: int = 0  # 0 means n_head (multi-head attention)
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = True
    dropout: bool = True
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    moe_d_ff: int = 0
    n_dense_layers: int = 0
    q_lora_rank: int = 0  # multi-head latent attention (DeepSeek-V2/V3); 0: Q is one (h, h) matrix
    kv_lora_rank: int = 0  # 0: no MLA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.mlp not in MLPS:
            raise ConfigError(f"unknown mlp {self.mlp!r}; choose one of {', '.join(MLPS)}")
        if self.norm not in NORMS:
            raise ConfigError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ConfigError(
                f"{self.name}: n_head={self.n_head} must divide d_model={self.d_model} and be a "
                f"multiple of n_kv_head={self.n_kv_head}"
            )
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ConfigError(f"{self.name}: top_k={self.top_k} must be in 1..n_experts={self.n_experts}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_head

    @property
    def qk_head_size(self) -> int:
        """A head's query and key width: the head size, or MLA's qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.kv_lora_rank else self.head_size

    @property
    def v_head_size(self) -> int:
        """A head's value width: the head size, or MLA's v_head_dim."""
        return self.v_head_dim if self.kv_lora_rank else self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): n_kv_head * head_size, h for multi-head attention."""
        return self.n_kv_head * self.head_size

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layer - self.n_dense_layers if self.is_moe else 0


def _gpt2(name: str, n_layer: int, d_model: int, n_head: int) -> ModelSpec:
    # Radford et al. 2019, Table 2 (layers, d_model); heads from the released configs
    # (n_head = d_model / 64). GPT-2 trained on 1024-token sequences, 512 per batch.
    return ModelSpec(name, n_layer, d_model, n_head, vocab_size=50257, seq_len=1024,
                     global_batch=512, source="Radford et al. 2019, Table 2")


def _megatron(name: str, n_head: int, d_model: int, n_layer: int, batch: int) -> ModelSpec:
    # Narayanan et al. 2021 (SC'21), Table 1: heads, hidden size, layers, batch size; the
    # parameter formula of their eq. 2 uses V = 51,200 and s = 2048 (Section 5.1).
    return ModelSpec(name, n_layer, d_model, n_head, vocab_size=51200, seq_len=2048,
                     global_batch=batch, source="Narayanan et al. 2021, Table 1")


def _llama(name: str, n_layer: int, d_model: int, n_head: int, n_kv_head: int, d_ff: int,
           vocab: int, seq: int, batch: int, source: str, **fields) -> ModelSpec:
    """Llama's shape; `fields` sets other ModelSpec fields (experts, a tied head)."""
    shape = {"mlp": "swiglu", "norm": "rmsnorm", "bias": False, "tied_embeddings": False,
             "learned_positions": False, "dropout": False, **fields}
    return ModelSpec(name, n_layer, d_model, n_head, vocab_size=vocab, seq_len=seq,
                     global_batch=batch, d_ff=d_ff, n_kv_head=n_kv_head, source=source, **shape)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        _gpt2("gpt2", 12, 768, 12),
        _gpt2("gpt2-medium", 24, 1024, 16),
        _gpt2("gpt2-large", 36, 1280, 20),
        _gpt2("gpt2-xl", 48, 1600, 25),
        # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, 2048 context; batch
        # 3.2M tokens (~1536 sequences, the batch Narayanan et al. 2021 Section 5.2 uses).
        ModelSpec("gpt3-175b", 96, 12288, 96, vocab_size=50257, seq_len=2048, global_batch=1536,
                  source="Brown et al. 2020, Table 2.1"),
        _megatron("megatron-1.7b", 24, 2304, 24, 512),
        _megatron("megatron-3.6b", 32, 3072, 30, 512),
        _megatron("megatron-7.5b", 32, 4096, 36, 512),
        _megatron("megatron-18.4b", 48, 6144, 40, 1024),
        _megatron("megatron-39.1b", 64, 8192, 48, 1536),
        _megatron("megatron-76.1b", 80, 10240, 60, 1792),
        _megatron("megatron-145.6b", 96, 12288, 80, 2304),
        _megatron("megatron-310.1b", 128, 16384, 96, 2160),
        _megatron("megatron-529.6b", 128, 20480, 105, 2520),
        _megatron("megatron-1t", 160, 25600, 128, 3072),
        # Touvron et al. 2023 (Llama 2), Table 1 and the released config.json: 4k context, 4M-token
        # batches; the 70B uses GQA with 8 KV heads.
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1024,
               "Touvron et al. 2023, Table 1; Llama-2-7b config.json"),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1024,
               "Touvron et al. 2023, Table 1; Llama-2-70b config.json"),
        # Llama Team 2024 (The Llama 3 Herd of Models), Table 3: layers, width, FFN, heads, KV heads,
        # vocabulary 128,000 (+256 special tokens in config.json); 8k context in pre-training. The
        # 8B/70B batch is not published: 4M tokens (512 x 8192) is refpar's choice.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 512,
               "Llama Team 2024, Table 3; Meta-Llama-3-8B config.json"),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 512,
               "Llama Team 2024, Table 3; Meta-Llama-3-70B config.json"),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 2048,
               "Llama Team 2024, Table 3 and Section 3.4.1 (batch 16M tokens)"),
        # Jiang et al. 2024 (Mixtral of Experts), Table 1: Mistral-7B's shape with 8 experts, top-2;
        # the batch is not published (4M tokens here, as Llama 2).
        replace(_llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, 1024,
                       "Jiang et al. 2024, Table 1; Mixtral-8x7B-v0.1 config.json"),
                n_experts=8, top_k=2, moe_d_ff=14336),
        # Dai et al. 2024 (DeepSeekMoE), Section 5 and the released deepseek-moe-16b config.json:
        # 28 layers, first dense (f = 10944), then 64 fine-grained routed experts (f = 1408), top-6,
        # plus 2 shared experts; multi-head attention, 4k context. The paper's batch is 4.5M tokens;
        # 1024 x 4096 (4.2M) here so that it divides by powers of two.
        replace(_llama("deepseek-moe-16b", 28, 2048, 16, 16, 10944, 102400, 4096, 1024,
                       "Dai et al. 2024, Section 5; deepseek-moe-16b-base config.json"),
                n_experts=64, top_k=6, n_shared_experts=2, moe_d_ff=1408, n_dense_layers=1),
        # DeepSeek-AI 2024 (DeepSeek-V3 Technical Report), §4.2 and the released config.json: 61
        # layers, h = 7168, 128 heads of MLA (q_lora_rank 1536, kv_lora_rank 512, 128 + 64 query/key
        # and 128 value channels per head), the first 3 blocks dense (f = 18432), then 256 routed
        # experts of width 2048, top-8, and 1 shared; vocabulary 129,280, untied head; 4k context,
        # batch 15,360 sequences (§4.2: ramped up to 15360). 671B total, 37B active per token (the
        # paper's figures, without the 14B multi-token-prediction module); tests/test_analysis_published.py.
        replace(_llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, 15360,
                       "DeepSeek-AI 2024, DeepSeek-V3 Technical Report §4.2; DeepSeek-V3 config.json"),
                n_experts=256, top_k=8, n_shared_experts=1, moe_d_ff=2048, n_dense_layers=3,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128),
    ]
}


def from_model_config(config: ModelConfig, global_batch: int = 1) -> ModelSpec:
    """The spec of a model refpar trains (refpar.config.ModelConfig), so a small run's ledger and trace
    can be set against the same formulas the planner uses: the family's row of SPEC_OF.

    refpar's MoE blocks are MLPs of the family's kind behind a router without bias: GPT-2 MLPs of
    width 4C (refpar/model/moe.py), Mixtral's SwiGLU experts of width intermediate_size
    (refpar/model/llama.py), DeepSeek-V3's of moe_intermediate_size with S shared experts
    (refpar/model/deepseek.py). The spec counts its MoE blocks and puts its dense ones first, so
    per-stage splits (pp > 1) are refpar's own when the MoE blocks are the last ones.
    """
    moe = len(config.moe_blocks)
    experts = dict(n_experts=config.moe_experts if moe else 0, top_k=config.moe_top_k if moe else 0,
                   n_dense_layers=config.n_layer - moe)
    return SPEC_OF[config.arch](config, global_batch, bool(moe), experts)


def _gpt2_spec(config: ModelConfig, global_batch: int, moe: bool, experts: dict) -> ModelSpec:
    return ModelSpec("refpar", config.n_layer, config.n_embd, config.n_head,
                     vocab_size=config.vocab_size, seq_len=config.n_positions,
                     global_batch=global_batch, dropout=config.dropout > 0,
                     moe_d_ff=4 * config.n_embd if moe else 0, **experts)


def _llama_spec(config: ModelConfig, global_batch: int, moe: bool, experts: dict) -> ModelSpec:
    F = config.intermediate_size
    return _llama("refpar", config.n_layer, config.n_embd, config.n_head, config.n_kv_head, F,
                  config.vocab_size, config.n_positions, global_batch, "refpar.config.ModelConfig",
                  tied_embeddings=config.tie_embeddings, moe_d_ff=F if moe else 0, **experts)


def _deepseek_spec(config: ModelConfig, global_batch: int, moe: bool, experts: dict) -> ModelSpec:
    """Latent attention's widths, every head its own key (n_kv_head = n_head), S shared experts."""
    mla = dict(q_lora_rank=config.q_lora_rank or 0, kv_lora_rank=config.kv_lora_rank,
               qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
               v_head_dim=config.v_head_dim)
    return _llama("refpar", config.n_layer, config.n_embd, config.n_head, config.n_head,
                  config.intermediate_size, config.vocab_size, config.n_positions, global_batch,
                  "refpar.config.ModelConfig", tied_embeddings=config.tie_embeddings,
                  moe_d_ff=config.moe_intermediate_size if moe else 0,
                  n_shared_experts=config.moe_shared_experts if moe else 0, **mla, **experts)


SPEC_OF = {"gpt2": _gpt2_spec, "llama": _llama_spec, "deepseek-v3": _deepseek_spec}  # ModelConfig.arch


def preset(name: str) -> ModelSpec:
    """The named model, or one sentence listing the names there are."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# `refpar plan --model-spec` keys (a contract): what each sets, and which are required.
MODEL_SPEC_KEYS = {"layers": "n_layer", "hidden": "d_model", "heads": "n_head", "vocab": "vocab_size",
                   "seq": "seq_len", "kv_heads": "n_kv_head", "ffn": "d_ff", "experts": "n_experts",
                   "topk": "top_k", "arch": None}
REQUIRED_SPEC_KEYS = ("layers", "hidden", "heads", "vocab", "seq")
ARCHS = ("gpt2", "llama")
BATCH_TOKENS = 4 * 2 ** 20  # a model without a published batch: about 4M tokens a step, as Llama 2


def parse_model_spec(text: str) -> ModelSpec:
    """`layers=70,hidden=14336,heads=112,vocab=250680,seq=2048[,kv_heads=K][,ffn=F]
    [,experts=E,topk=k][,arch=gpt2|llama]` as a ModelSpec, or one sentence saying what to change.

    arch=gpt2 (the default) is GPT-2's block: GELU MLP of width 4h, LayerNorm, biases, learned
    positions, tied head, dropout. arch=llama is Llama's: SwiGLU of width 8h/3 rounded up to a
    multiple of 256 (Llama's `multiple_of`), RMSNorm, no biases, rotary positions, untied head, no
    dropout. experts=E,topk=k makes every block's MLP E experts of width ffn, k per token. The
    global batch is about 4M tokens (a power of two sequences) unless --global-batch says otherwise.
    """
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--model-spec item {item.strip()!r} is not key=value; write e.g. "
                              f"layers=32,hidden=4096,heads=32,vocab=32000,seq=4096")
        if key not in MODEL_SPEC_KEYS:
            raise ConfigError(f"--model-spec has no key {key!r}; choose from {', '.join(MODEL_SPEC_KEYS)}")
        if key in fields:
            raise ConfigError(f"--model-spec gives {key} twice; give it once")
        fields[key] = value.strip()
    missing = [k for k in REQUIRED_SPEC_KEYS if k not in fields]
    if missing:
        raise ConfigError(f"--model-spec needs {', '.join(missing)} too (required: "
                          f"{', '.join(REQUIRED_SPEC_KEYS)})")
    arch = fields.pop("arch", "gpt2")
    if arch not in ARCHS:
        raise ConfigError(f"--model-spec arch={arch} is unknown; choose one of {', '.join(ARCHS)}")
    numbers = {}
    for key, value in fields.items():
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--model-spec {key}={value} must be a positive whole number")
        numbers[MODEL_SPEC_KEYS[key]] = int(value)
    if ("n_experts" in numbers) != ("top_k" in numbers):
        raise ConfigError("--model-spec experts and topk go together; give both or neither")
    h, seq = numbers["d_model"], numbers["seq_len"]
    batch = 2 ** max(0, round(math.log2(BATCH_TOKENS / seq)))
    if arch == "llama":
        numbers.setdefault("d_ff", 256 * -(-(8 * h // 3) // 256))
        spec = ModelSpec("custom", global_batch=batch, mlp="swiglu", norm="rmsnorm", bias=False,
                         tied_embeddings=False, learned_positions=False, dropout=False,
                         source="--model-spec", **numbers)
    else:
        spec = ModelSpec("custom", global_batch=batch, source="--model-spec", **numbers)
    return replace(spec, moe_d_ff=spec.d_ff) if spec.is_moe else spec
