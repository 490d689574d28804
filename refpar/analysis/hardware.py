"""Accelerator presets: peak FLOP/s per dtype, memory, and the two links of a DGX-style node.

Units are SI: FLOP/s, bytes, bytes/s per direction, seconds. Memory is the datasheet's decimal
figure (80 GB = 80e9 bytes); the CUDA context and the allocator take some of the slightly larger
physical amount, so the decimal figure serves as the usable budget.

Every GPU of a node reaches the others over NVLink through NVSwitch, and owns one InfiniBand
adapter for traffic between nodes (DGX A100/H100/H200 user guides: eight compute NICs per eight
GPUs); a collective whose group spans nodes leaves each node through the adapters of the group's
members there (step_time.link). `refpar plan --hardware-spec` describes hardware of one's own
(`parse_hardware_spec`).

What the accelerator reaches in practice is measured, not read off the datasheet: `matmul_flops` is
the Maximum Achievable Matmul FLOPS (MAMF) of a brute-force search over GEMM shapes, mean of 100
iterations after 50 warm-up ones (S. Bekman, Machine Learning Engineering, "Maximum Achievable Matmul
FLOPS comparison table", github.com/stas00/ml-engineering, compute/accelerator/README.md), and
`flash_fraction` is the fraction of the dense peak FlashAttention-2 reaches (Dao 2023, arXiv:2307.08691,
abstract: "50-73% of the theoretical maximum FLOPs/s on A100"; Shah et al. 2024, FlashAttention-3,
arXiv:2407.08608, abstract: "FlashAttention-2 achieving only 35% utilization on the H100 GPU").
`sm_count` (the GPU's streaming multiprocessors) sets how many GEMM tiles run at once (analysis/
efficiency.py).

Latencies are the per-step ring latencies of NCCL's own cost model (src/graph/tuning.cc, `hwLat`,
Ring/Simple: 5.7 us over NVLink, 6.6 us over the network) and its per-call base latency
(`baseLat`, Ring/Simple: 8.4 us), as in NCCL 2.x releases whose tables have these entries (they
change between releases). Simple is the protocol NCCL picks for the large messages of training
(gradients, activations).
"""

from __future__ import annotations

from dataclasses import dataclass

from refpar.config import ConfigError

TERA = 1e12
GIGA = 1e9

# NCCL src/graph/tuning.cc (see the module docstring).
NVLINK_STEP_LATENCY = 5.7e-6
NET_STEP_LATENCY = 6.6e-6
CALL_LATENCY = 8.4e-6


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense (no 2:4 sparsity) tensor-core peak per dtype
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int
    nvlink_bandwidth: float  # bytes/s per GPU per direction
    ib_bandwidth: float  # bytes/s per GPU per direction
    sm_count: int
    matmul_flops: dict[str, float]  # measured MAMF per dtype; bfloat16 at least
    flash_fraction: float  # of the dense peak, reached by FlashAttention-2
    nvlink_latency: float = NVLINK_STEP_LATENCY
    ib_latency: float = NET_STEP_LATENCY
    call_latency: float = CALL_LATENCY
    source: str = ""

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"{self.name} has no {dtype} peak listed; choose one of "
                              f"{', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def matmul_rate(self, dtype: str) -> float:
        """The measured maximum achievable matmul FLOP/s; for a dtype nobody measured, the peak
        scaled by the bfloat16 measurement's fraction of its peak."""
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        return self.flops(dtype) * self.matmul_flops["bfloat16"] / self.peak_flops["bfloat16"]


# H100 and H200 SXM, dense (no 2:4 sparsity): the datasheets' comment beside the H100 below
HOPPER_FLOPS = {"float64": 67 * TERA, "float32": 67 * TERA, "tf32": 494.5 * TERA, "bfloat16": 989.5 * TERA,
                "float16": 989.5 * TERA, "fp8": 1979 * TERA}

HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in [
        # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM 80GB column: FP64 Tensor Core 19.5,
        # FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s dense; 80 GB HBM2e at 2,039 GB/s; NVLink
        # 600 GB/s (both directions together, so 300 GB/s each way). DGX A100 user guide: eight
        # ConnectX-6 HDR InfiniBand adapters at 200 Gb/s = 25 GB/s per GPU each way.
        Hardware(
            "a100",
            peak_flops={"float64": 19.5 * TERA, "float32": 19.5 * TERA, "tf32": 156 * TERA,
                        "bfloat16": 312 * TERA, "float16": 312 * TERA},
            memory_bytes=80 * GIGA, hbm_bandwidth=2039 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=300 * GIGA, ib_bandwidth=25 * GIGA,
            # NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs. MAMF: 271.2 TFLOP/s bf16
            # (torch 2.6.0+cu126, best shape 1024x10240x5120).
            sm_count=108, matmul_flops={"bfloat16": 271.2 * TERA, "float16": 271.2 * TERA},
            flash_fraction=0.50,
            source="NVIDIA A100 datasheet (SXM 80GB); DGX A100 user guide; MAMF table (Bekman)",
        ),
        # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP64 Tensor Core 67, FP32 67,
        # TF32 494.5, BF16/FP16 989.5, FP8 1,979 TFLOP/s dense (the datasheet's headline figures
        # are twice these, with sparsity); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (450 each way).
        # DGX H100 user guide: eight ConnectX-7 NDR adapters at 400 Gb/s = 50 GB/s per GPU each way.
        Hardware(
            "h100",
            peak_flops=HOPPER_FLOPS,
            memory_bytes=80 * GIGA, hbm_bandwidth=3350 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=450 * GIGA, ib_bandwidth=50 * GIGA,
            # NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs on the SXM5 part. MAMF:
            # 794.5 TFLOP/s bf16 (torch 2.7.0+cu126), 1402.6 fp8.
            sm_count=132, matmul_flops={"bfloat16": 794.5 * TERA, "float16": 794.5 * TERA,
                                        "fp8": 1402.6 * TERA},
            flash_fraction=0.35,
            source="NVIDIA H100 datasheet (SXM); DGX H100 user guide; MAMF table (Bekman)",
        ),
        Hardware(
            # the H100's die for export, NVLink cut to 400 GB/s both ways; DeepSeek-V3's nodes have
            # 8 GPUs and one 400 Gb/s InfiniBand NIC per GPU (DeepSeek-AI 2024, V3 report §3.1)
            "h800",
            peak_flops=HOPPER_FLOPS,
            memory_bytes=80 * GIGA, hbm_bandwidth=3350 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=200 * GIGA, ib_bandwidth=50 * GIGA,
            sm_count=132, matmul_flops={"bfloat16": 794.5 * TERA, "float16": 794.5 * TERA,
                                        "fp8": 1402.6 * TERA},
            flash_fraction=0.35,
            source="NVIDIA H800 (SXM): H100 compute and memory, NVLink 400 GB/s; DeepSeek-V3 report "
                   "§3.1; MAMF as measured on the H100 (Bekman)",
        ),
        # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: the H100 SXM's compute, 141 GB
        # HBM3e at 4.8 TB/s, NVLink 900 GB/s. DGX H200: eight ConnectX-7 at 400 Gb/s per GPU.
        Hardware(
            "h200",
            peak_flops=HOPPER_FLOPS,
            memory_bytes=141 * GIGA, hbm_bandwidth=4800 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=450 * GIGA, ib_bandwidth=50 * GIGA,
            # The H100's 132 SMs; the MAMF table lists bf16 for the H100 with "H200 is the same", and
            # 1453.4 TFLOP/s fp8 for the H200 itself.
            sm_count=132, matmul_flops={"bfloat16": 794.5 * TERA, "float16": 794.5 * TERA,
                                        "fp8": 1453.4 * TERA},
            flash_fraction=0.35,
            source="NVIDIA H200 datasheet (SXM); DGX H200 user guide; MAMF table (Bekman)",
        ),
        # The A100 SXM 40GB column of the same datasheet: the 80GB part's compute and NVLink, 40 GB of
        # HBM2 at 1,555 GB/s; DGX A100 (40GB) has the same eight 200 Gb/s adapters. The chip is the
        # 80GB part's, so its measured MAMF is taken for this one (not measured here).
        Hardware(
            "a100-40gb",
            peak_flops={"float64": 19.5 * TERA, "float32": 19.5 * TERA, "tf32": 156 * TERA,
                        "bfloat16": 312 * TERA, "float16": 312 * TERA},
            memory_bytes=40 * GIGA, hbm_bandwidth=1555 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=300 * GIGA, ib_bandwidth=25 * GIGA,
            sm_count=108, matmul_flops={"bfloat16": 271.2 * TERA, "float16": 271.2 * TERA},
            flash_fraction=0.50,
            source="NVIDIA A100 datasheet (SXM 40GB); DGX A100 user guide; MAMF as measured on the "
                   "A100 80GB (Bekman)",
        ),
        # HGX B200 at 1,000 W, dense: FP64 40, TF32 1,100, BF16/FP16 2,250, FP8 4,500 TFLOP/s; DGX B200:
        # 1,440 GB of HBM3e at 64 TB/s for eight GPUs (180 GB, 8 TB/s each), NVLink 5 at 1.8 TB/s per
        # GPU (900 GB/s each way), eight ConnectX-7 at 400 Gb/s (50 GB/s per GPU). Its MAMF and
        # FlashAttention's fraction are not measured here: the H100's measured fractions of its peak
        # (794.5 / 989.5 of the bf16 peak; 0.35) are taken, so its plans are the H100's scaled, not
        # measured. 148 SMs (two dies of 74).
        Hardware(
            "b200",
            peak_flops={"float64": 40 * TERA, "float32": 80 * TERA, "tf32": 1100 * TERA,
                        "bfloat16": 2250 * TERA, "float16": 2250 * TERA, "fp8": 4500 * TERA},
            memory_bytes=180 * GIGA, hbm_bandwidth=8000 * GIGA, gpus_per_node=8,
            nvlink_bandwidth=900 * GIGA, ib_bandwidth=50 * GIGA,
            sm_count=148, matmul_flops={"bfloat16": 2250 * TERA * 794.5 / 989.5},
            flash_fraction=0.35,
            source="HGX B200 specifications (1,000 W), DGX B200 specifications; MAMF and flash "
                   "fraction scaled from the H100's measured ones",
        ),
    ]
}

# `refpar plan --hardware-spec` keys (a contract): (Hardware field, unit it is given in).
HARDWARE_SPEC_KEYS = {"memory": ("memory_bytes", GIGA), "flops": ("peak_flops", TERA),
                      "hbm": ("hbm_bandwidth", GIGA), "nvlink": ("nvlink_bandwidth", GIGA),
                      "ib": ("ib_bandwidth", GIGA), "gpus_per_node": ("gpus_per_node", 1),
                      "mamf": ("matmul_flops", TERA), "flash": ("flash_fraction", 1), "sms": ("sm_count", 1)}
REQUIRED_HARDWARE_KEYS = ("memory", "flops", "hbm", "nvlink", "ib", "gpus_per_node")


def parse_hardware_spec(text: str) -> Hardware:
    """`memory=GB,flops=TFLOP/s,hbm=GB/s,nvlink=GB/s,ib=GB/s,gpus_per_node=N[,mamf=TFLOP/s]
    [,flash=F][,sms=N]` as a Hardware named "custom", or one sentence saying what to change.

    flops is the dense bf16 (and fp16) tensor-core peak; nvlink the bandwidth each GPU has to the
    others of its node each way, ib its own network adapter's each way. What a user rarely knows
    has the H100's measured values: mamf (the matmul rate reached, default 794.5 / 989.5 of flops),
    flash (FlashAttention's fraction of the peak, 0.35) and sms (132)."""
    fields: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--hardware-spec item {item.strip()!r} is not key=value; write e.g. "
                              f"memory=80,flops=989.5,hbm=3350,nvlink=450,ib=50,gpus_per_node=8")
        if key not in HARDWARE_SPEC_KEYS:
            raise ConfigError(f"--hardware-spec has no key {key!r}; choose from "
                              f"{', '.join(HARDWARE_SPEC_KEYS)}")
        if key in fields:
            raise ConfigError(f"--hardware-spec gives {key} twice; give it once")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not number > 0 or number == float("inf"):
            raise ConfigError(f"--hardware-spec {key}={value} must be a positive number")
        if key in ("gpus_per_node", "sms") and number != int(number):
            raise ConfigError(f"--hardware-spec {key}={value} must be a whole number")
        if key == "flash" and number > 1:
            raise ConfigError(f"--hardware-spec flash={value} is a fraction of the peak: give it in (0, 1]")
        fields[key] = number
    missing = [k for k in REQUIRED_HARDWARE_KEYS if k not in fields]
    if missing:
        raise ConfigError(f"--hardware-spec needs {', '.join(missing)} too (required: "
                          f"{', '.join(REQUIRED_HARDWARE_KEYS)})")
    peak = fields["flops"] * TERA
    mamf = fields.get("mamf", fields["flops"] * 794.5 / 989.5) * TERA
    if mamf > peak:
        raise ConfigError(f"--hardware-spec mamf={mamf / TERA:g} is above flops={fields['flops']:g}; the "
                          f"rate matmuls reach cannot exceed the peak")
    return Hardware("custom", peak_flops={"bfloat16": peak, "float16": peak},
                    memory_bytes=fields["memory"] * GIGA, hbm_bandwidth=fields["hbm"] * GIGA,
                    gpus_per_node=int(fields["gpus_per_node"]), nvlink_bandwidth=fields["nvlink"] * GIGA,
                    ib_bandwidth=fields["ib"] * GIGA, sm_count=int(fields.get("sms", 132)),
                    matmul_flops={"bfloat16": mamf, "float16": mamf},
                    flash_fraction=fields.get("flash", 0.35), source="--hardware-spec")


def hardware(name: str) -> Hardware:
    """The named accelerator, or one sentence listing the names there are."""
    if name not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}")
    return HARDWARE[name]
