"""`refpar train`: train GPT-2 or Llama (--model) on the synthetic Markov corpus or a text (--data), on
any mesh, and print the loss next to its floor or the text's unigram entropy (and, with --check, next
to the single device's).

    refpar train --model tiny --steps 200
    refpar train --model tiny --steps 5 --json     # last line: the JSON summary (refpar/engine/report.py)
    mpiexec -n 8 refpar train --mesh dp=2,tp=2,pp=2 --zero 1 --microbatches 4 --check

Every mesh takes one path: the options become a `Plan` (refpar/config.py), checked on every rank
before any communication (refpar/engine/validate.py), and refpar/engine/run.py trains and reports.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

HELP = "Train GPT-2 or Llama on any mesh; print the loss next to the best loss possible."


class PresetDefault(str):
    """--model's default, told apart from a --model the user gave (which --init-from checks)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from refpar.config import FINETUNE_RECIPE, MODEL_PRESETS, RECIPES, TrainConfig, describe_preset

    d = TrainConfig()
    parser.add_argument("--model", default=PresetDefault("tiny"), help=(
        f"model preset (default tiny): {describe_preset('tiny')}, the tests' model, 55K parameters; "
        f"{describe_preset('small')}, the benchmarks' model, 3.7M parameters, not GPT-2 small; "
        f"{describe_preset('gpt2')}, Hugging Face's GPT-2 small, 124M parameters; "
        f"{', '.join(name for name in MODEL_PRESETS if name not in ('tiny', 'small', 'gpt2'))}"))
    parser.add_argument("--init-from", metavar="PATH", default=None,
                        help="start from Hugging Face weights: a GPT2LMHeadModel or LlamaForCausalLM folder "
                             "(config.json + model.safetensors; it gives the model's shape) or a "
                             ".safetensors file with --model (refpar/weights.py); each rank reads its slices")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"global batch, sequences per step (default {d.batch_size})")
    parser.add_argument("--seq-len", type=int, default=d.seq_len,
                        help=f"tokens per sequence (default {d.seq_len})")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: the preset's recipe, refpar/config.py RECIPES: "
                             + ", ".join(f"{name} {r.lr:g}" for name, r in RECIPES.items())
                             + f"; {FINETUNE_RECIPE.lr:g} with --init-from)")
    parser.add_argument("--optimizer", default=d.optimizer, help="adamw or sgd (default adamw)")
    add_schedule_arguments(parser)
    parser.add_argument("--dtype", default=None, help="float64 or float32 (default: the preset's)")
    add_precision_arguments(parser)
    parser.add_argument("--seed", type=int, default=d.seed,
                        help=f"seeds weights, data and dropout (default {d.seed})")
    parser.add_argument("--dropout", type=float, default=None,
                        help="dropout probability (default: the preset's)")
    parser.add_argument("--mesh", default=None, help="parallel layout, e.g. dp=2,tp=2 (default: one device)")
    parser.add_argument("--backend", default="numpy", choices=("numpy", "torch", "cupy"),
                        help="array library every rank of a --mesh run computes with (default numpy; "
                             "refpar/backend.py); the single-device reference is always NumPy")
    parser.add_argument("--device", default=None,
                        help="torch: cpu (default) or cuda; cupy: cuda (each rank takes its local GPU)")
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary last")
    parser.add_argument("--save", metavar="DIR", default=None,
                        help="write sharded checkpoints to DIR/step-N (after the last step, and "
                             "every --save-every steps)")
    parser.add_argument("--save-every", metavar="N", type=int, default=None,
                        help="with --save: also save every N steps")
    parser.add_argument("--resume", metavar="DIR", default=None,
                        help="continue from a checkpoint (DIR/step-N, or DIR: its newest complete "
                             "step), whatever mesh wrote it; --steps counts from the start")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --save DIR (its step directories), --trace and --log hold "
                             "already (default: refuse them, unless --resume continues the run in DIR)")
    # Flags every strategy reads; add_strategy_arguments and add_moe_arguments add the strategies'.
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step (gradient accumulation; pipeline microbatches)")
    parser.add_argument("--check", action="store_true",
                        help="also run the single-device reference and compare")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="write communication events as a Chrome trace (open in Perfetto) and "
                             "PATH.jsonl")
    add_report_arguments(parser)
    add_strategy_arguments(parser)
    add_moe_arguments(parser)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """What the run trains on (refpar/data; docs/data.md): the Markov corpus unless --data is given."""
    add = parser.add_argument
    add("--data", metavar="PATH", default=None,
        help="train on real text: a UTF-8 text file, a folder of them, or a folder with nanoGPT's "
             "train.bin and val.bin (default: the synthetic Markov corpus, whose best loss is known)")
    add("--tokenizer", default=None, metavar="KIND",
        help="with --data text: bytes (256 tokens, the default), bpe (a byte-level BPE of --vocab-size "
             "tokens trained on the corpus, saved beside --save), gpt2 (tiktoken's, where its file is "
             "present) or the path of a tokenizer.json")
    add("--vocab-size", type=int, default=None, metavar="N",
        help="with --data: the BPE's vocabulary, or the vocabulary of nanoGPT token files")
    add("--eval-every", type=int, default=0, metavar="N",
        help="the validation loss on held-out windows every N steps and after the last (default 0: never)")


def data_configs(args, overrides: dict) -> dict:
    """TrainConfig's data fields; with --data the model's vocabulary becomes the corpus's (in
    `overrides`), after the corpus was opened and checked on every rank before any communication."""
    fields = {"data": args.data, "tokenizer": args.tokenizer, "tokenizer_vocab": args.vocab_size,
              "eval_every": args.eval_every}
    if args.data is not None:
        from refpar.data import open_data

        corpus = open_data(args.data, args.tokenizer, args.vocab_size, args.seed)
        corpus.check_fits(args.batch_size, args.seq_len)
        overrides.setdefault("vocab_size", corpus.vocab_size)
    return fields


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """What a run reports as it goes (refpar/engine/runlog.py)."""
    add = parser.add_argument
    add("--log-every", type=int, default=None, metavar="N",
        help="a step row every N steps, with elapsed time, ETA and MFU (default: about a dozen rows, and "
             "one at least every minute)")
    add("--log", default=None, metavar="PATH",
        help="write one JSON line per step as it ends: loss, val_loss, lr, grad_norm, tokens/s, MFU, times")
    add("--tensorboard", default=None, metavar="DIR",
        help="write TensorBoard event files to DIR (needs tensorboardX: pip install refpar[tensorboard])")


def check_report_args(args) -> None:
    """--log-every, --log and --tensorboard, refused before the run in one sentence."""
    import importlib.util

    from refpar.config import ConfigError, check_output_path

    if args.log_every is not None and args.log_every < 1:
        raise ConfigError(f"--log-every {args.log_every} must be at least 1; give e.g. --log-every 10")
    if args.log is not None:
        appends = getattr(args, "resume", None) is not None  # a resumed run goes on with its log
        check_output_path("--log", args.log, overwrite=getattr(args, "overwrite", False) or appends)
    if args.tensorboard is not None:
        check_output_path("--tensorboard", args.tensorboard, directory=True)
        if importlib.util.find_spec("tensorboardX") is None:
            raise ConfigError("--tensorboard writes through tensorboardX, which is not installed here; "
                              "pip install 'refpar[tensorboard]' (tensorboardX==2.6.5) or drop --tensorboard")


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """Clipping, the learning-rate schedule and the weight-decay rule (refpar/model/optim.py)."""
    from refpar.config import LR_SCHEDULES

    add = parser.add_argument
    add("--clip-grad-norm", type=float, default=0.0, metavar="X",
        help="clip the gradients to global L2 norm X, as torch's clip_grad_norm_ (default 0: no clipping)")
    add("--lr-schedule", default=None, choices=LR_SCHEDULES,
        help="learning rate over the steps: constant, or cosine, linear, wsd decay to --min-lr "
             "(Megatron-LM's and nanoGPT's definitions; default: the preset's recipe)")
    add("--warmup-steps", type=int, default=None, metavar="N",
        help="steps of linear warmup to --lr (default: the recipe's, at most a tenth of --steps)")
    add("--min-lr", type=float, default=None, metavar="X",
        help="the learning rate a decaying schedule ends at, on the last step (default: the recipe's "
             "fraction of --lr, 0 for a constant schedule)")
    add("--wsd-decay-steps", type=int, default=None, metavar="N",
        help="wsd: steps of its final decay (default: a fifth of the steps after the warmup)")
    add("--decay-all", action="store_true",
        help="weight decay on every tensor (default: matrices and embeddings, not biases or norm gains)")


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategies' options beyond the mesh: data parallelism, tp/sp/cp and the pipeline."""
    from refpar.config import RECOMPUTE
    from refpar.schedules.builders import BUILDERS

    add = parser.add_argument
    add("--zero", type=int, default=0, choices=(0, 1, 2, 3),
        help="ZeRO stage over each unit's replicas: 0 plain DP, 1 optimizer, 2 +gradients, 3 +parameters")
    add("--fsdp", action="store_true", help="FSDP over each unit's replicas (ZeRO-3 by units)")
    add("--prefetch", action="store_true", help="FSDP: gather the next block one piece early")
    add("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
        help="FSDP: keep each block gathered from its forward to its backward")
    add("--overlap", action="store_true",
        help="DP: all-reduce each bucket as ring rounds interleaved with the rest of the backward")
    add("--bucket-kb", type=float, default=None,
        help="DP: gradient all-reduce bucket size in KiB (default: one bucket)")
    add("--sp", action="store_true", help="TP: Megatron sequence parallelism over the tp axis")
    add("--recompute", default="none", choices=RECOMPUTE,
        help="activations rebuilt in the backward: selective (the attention core) or full (each block "
             "from its input); default none")
    add("--cp-algo", default=None, choices=("ring", "ulysses"),
        help="how cp ranks share attention: ring (zig-zag ring attention, default) or ulysses")
    add("--schedule", default=None, help=f"pipeline schedule: {', '.join(BUILDERS)} (default 1f1b)")
    add("--schedule-csv", metavar="FILE", default=None,
        help="a pipeline schedule of one's own in torch.distributed.pipelining's CSV (refpar schedule "
             "KIND --csv writes one)")
    add("--chunks", type=int, default=None,
        help="model chunks per pipeline rank for interleaved-1f1b (default 2)")
    add("--n-layer", type=int, default=None,
        help="blocks of the model, replacing the preset's (each pipeline stage needs at least one)")


# The options that shape the experts, with their defaults: without --moe-experts none applies.
MOE_DEFAULTS = {"moe_topk": 1, "moe_layers": None, "capacity_factor": 1.25, "dropless": False,
                "aux_loss_weight": 0.01, "z_loss_weight": 0.001, "moe_shared_experts": 0,
                "moe_gate": "softmax", "moe_balance": "aux", "moe_bias_rate": 0.001, "moe_seq_aux": 0.0,
                "moe_groups": 1, "moe_group_limit": None, "moe_drop_policy": "position",
                "moe_group_score": "deepseek", "moe_norm_topk_prob": True, "moe_routed_scaling_factor": 1.0}


MAX_CAPACITY_FACTOR = 1e6


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    from refpar.config import MOE_BALANCES, MOE_DROP_POLICIES, MOE_GATES, MOE_GROUP_SCORES

    d = MOE_DEFAULTS
    group = parser.add_argument_group("Mixture of Experts (refpar/model/moe.py)")
    group.add_argument("--moe-experts", type=int, default=0,
                       help="experts per MoE block; 0 keeps GPT-2's MLP (default 0)")
    group.add_argument("--moe-topk", type=int, default=d["moe_topk"],
                       help="experts per token: 1 Switch, 2 Mixtral")
    group.add_argument("--moe-layers", default=d["moe_layers"],
                       help="blocks with experts, e.g. 1,3 (default: every block)")
    drop = group.add_mutually_exclusive_group()
    drop.add_argument("--capacity-factor", type=float, default=d["capacity_factor"],
                      help="capacity = ceil(tokens * k * factor / experts) per expert (default 1.25)")
    drop.add_argument("--dropless", action="store_true", help="no capacity: never drop a token")
    group.add_argument("--aux-loss-weight", type=float, default=d["aux_loss_weight"],
                       help="alpha of the Switch load-balancing loss (default 0.01)")
    group.add_argument("--z-loss-weight", type=float, default=d["z_loss_weight"],
                       help="beta of the router z-loss (default 0.001)")
    group.add_argument("--moe-shared-experts", type=int, default=d["moe_shared_experts"],
                       help="experts every token passes through, DeepSeekMoE's (default 0)")
    group.add_argument("--moe-gate", choices=MOE_GATES, default=d["moe_gate"],
                       help="router scores: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3)")
    group.add_argument("--moe-balance", choices=MOE_BALANCES, default=d["moe_balance"],
                       help="aux: Switch's loss; aux-free: DeepSeek-V3's expert bias; none")
    group.add_argument("--moe-bias-rate", type=float, default=d["moe_bias_rate"],
                       help="gamma of the aux-free bias update (default 0.001)")
    group.add_argument("--moe-seq-aux", type=float, default=d["moe_seq_aux"],
                       help="alpha of DeepSeek-V3's sequence-wise balance loss (default 0)")
    group.add_argument("--moe-groups", type=int, default=d["moe_groups"],
                       help="groups of consecutive experts for --moe-group-limit (default 1)")
    group.add_argument("--moe-group-limit", type=int, default=d["moe_group_limit"],
                       help="a token's experts lie in at most M groups (DeepSeek-V3's node limit)")
    group.add_argument("--moe-drop-policy", choices=MOE_DROP_POLICIES, default=d["moe_drop_policy"],
                       help="past the capacity drop the last queued (position) or least probable (probs)")
    group.add_argument("--moe-group-score", choices=MOE_GROUP_SCORES, default=d["moe_group_score"],
                       help="a group's score for --moe-group-limit: its best 2 scores (deepseek, as "
                            "Hugging Face) or best floor(k/M) (megatron, as Megatron-Core)")
    group.add_argument("--moe-norm-topk-prob", action=argparse.BooleanOptionalAction,
                       default=d["moe_norm_topk_prob"],
                       help="divide the k chosen scores by their sum (default on; HF's norm_topk_prob)")
    group.add_argument("--moe-routed-scaling-factor", type=float, default=d["moe_routed_scaling_factor"],
                       help="multiply the gates by this (DeepSeek-V3: 2.5; default 1.0)")


def model_overrides(args) -> dict:
    """ModelConfig fields from the MoE options (empty without --moe-experts)."""
    from refpar.config import ConfigError

    if not args.moe_experts:
        given = [name for name, default in MOE_DEFAULTS.items() if getattr(args, name, default) != default]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} shapes the experts of a Mixture of Experts; add --moe-experts E "
                              f"or drop {flag}")
        return {}
    if args.moe_bias_rate != MOE_DEFAULTS["moe_bias_rate"] and args.moe_balance != "aux-free":
        raise ConfigError("--moe-bias-rate sets aux-free balancing's bias step; add --moe-balance aux-free "
                          "or drop --moe-bias-rate")
    if args.capacity_factor > MAX_CAPACITY_FACTOR:  # capacity = ceil(tokens * k * factor / E): past E / k
        # every token fits already, and 1e308 overflowed to an infinite capacity (issue 43)
        every = args.moe_experts / max(args.moe_topk, 1)
        raise ConfigError(f"--capacity-factor {args.capacity_factor:g} is past any use (from E / k = "
                          f"{every:g} on no token is dropped); give at most {MAX_CAPACITY_FACTOR:g}, or "
                          "--dropless")
    layers = None
    if args.moe_layers is not None:
        try:
            layers = tuple(int(i) for i in args.moe_layers.split(",") if i.strip())
        except ValueError:
            raise ConfigError(f"--moe-layers {args.moe_layers!r} needs block numbers like 1,3") from None
    return {"moe_experts": args.moe_experts, "moe_top_k": args.moe_topk, "moe_layers": layers,
            "moe_capacity_factor": args.capacity_factor, "moe_dropless": args.dropless,
            "moe_aux_loss_weight": args.aux_loss_weight, "moe_z_loss_weight": args.z_loss_weight,
            "moe_shared_experts": args.moe_shared_experts, "moe_gate": args.moe_gate,
            "moe_balance": args.moe_balance, "moe_bias_rate": args.moe_bias_rate,
            "moe_seq_aux_weight": args.moe_seq_aux, "moe_groups": args.moe_groups,
            "moe_group_limit": args.moe_group_limit, "moe_drop_policy": args.moe_drop_policy,
            "moe_group_score": args.moe_group_score, "moe_norm_topk_prob": args.moe_norm_topk_prob,
            "moe_routed_scaling_factor": args.moe_routed_scaling_factor}


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """--precision and the mixed-precision options (refpar/precision.py)."""
    from refpar.precision import PRECISIONS

    parser.add_argument("--precision", default=None, choices=tuple(PRECISIONS),
                        help="fp64, fp32, or bf16/fp16 weights and activations with fp32 master "
                             "weights (default: the preset's dtype; --dtype is the fp64/fp32 alias)")
    parser.add_argument("--fp32-grads", action="store_true",
                        help="mixed precision: accumulate gradients in fp32 (20 bytes per parameter)")
    parser.add_argument("--loss-scale", type=float, default=None,
                        help="fp16-mixed: the initial dynamic loss scale (default 65536)")
    parser.add_argument("--loss-scale-window", type=int, default=None,
                        help="fp16-mixed: good steps in a row before the loss scale doubles (default 1000)")


def precision_dtype(args) -> str | None:
    """ModelConfig.dtype from --precision or its alias --dtype (None: the preset's)."""
    from refpar.config import ConfigError
    from refpar.precision import PRECISIONS

    precision = getattr(args, "precision", None)
    if precision is not None and args.dtype is not None:
        raise ConfigError(f"--dtype and --precision both set the precision; give only --precision "
                          f"{precision}")
    return PRECISIONS[precision] if precision is not None else args.dtype


def configs(args):
    """(ModelConfig, TrainConfig, mesh sizes) from the parsed arguments; ConfigError on any mistake."""
    from refpar.config import (
        MODEL_PRESETS,
        ConfigError,
        ParallelConfig,
        TrainConfig,
        model_preset,
        parse_mesh,
    )

    sizes = ParallelConfig(parse_mesh(args.mesh) if args.mesh is not None else {}).sizes
    preset_experts = args.model in MODEL_PRESETS and MODEL_PRESETS[args.model].moe_experts  # deepseek-tiny's
    if sizes["ep"] > 1 and not args.moe_experts and getattr(args, "init_from", None) is None \
            and not preset_experts:
        raise ConfigError(f"ep={sizes['ep']} spreads experts over ranks; add --moe-experts E with "
                          f"E >= {sizes['ep']}")
    schedule = optimizer_schedule(args)
    for flag, value, example in (("--steps", args.steps, 5), ("--batch-size", args.batch_size, 8),
                                 ("--seq-len", args.seq_len, 16), ("--lr", schedule["lr"], 0.01)):
        if not 0 < value < math.inf:  # nan too; named by its flag here, by its field in TrainConfig
            raise ConfigError(f"{flag} {value} must be positive; give e.g. {flag} {example}")
    overrides = {k: v for k, v in (("dtype", precision_dtype(args)), ("dropout", args.dropout),
                                   ("n_layer", args.n_layer)) if v is not None}
    data = data_configs(args, overrides)
    if getattr(args, "init_from", None) is not None:  # the shape from the weights (refpar/weights.py)
        from refpar.weights import read_hf_config

        preset = None if isinstance(args.model, PresetDefault) else args.model
        model = read_hf_config(args.init_from, preset, dtype=precision_dtype(args), dropout=args.dropout,
                               n_layer=args.n_layer, moe=model_overrides(args))
        if sizes["ep"] > 1 and not model.moe_experts:
            raise ConfigError(f"ep={sizes['ep']} spreads experts over ranks, but {args.init_from} is a dense "
                              "model; drop ep from --mesh")
        if overrides.get("vocab_size", 0) > model.vocab_size:  # --data's tokenizer
            raise ConfigError(f"the --data tokenizer has {overrides['vocab_size']} tokens but the model of "
                              f"{args.init_from} embeds {model.vocab_size}; give the model's own tokenizer "
                              "(--tokenizer its tokenizer.json) or one of fewer tokens")
    else:
        model = model_preset(args.model, **overrides, **model_overrides(args))
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                        optimizer=args.optimizer, seed=args.seed, **schedule,
                        fp32_grads=getattr(args, "fp32_grads", False),
                        loss_scale=getattr(args, "loss_scale", None),
                        loss_scale_window=getattr(args, "loss_scale_window", None),
                        clip_grad_norm=args.clip_grad_norm, wsd_decay_steps=args.wsd_decay_steps,
                        decay_all=args.decay_all, init_from=getattr(args, "init_from", None), **data)
    train.check_model(model)
    return model, train, sizes


def recipe_of(args):
    """The preset's optimizer recipe (refpar/config.py RECIPES), or fine-tuning's for --init-from; an
    unknown preset's is TrainConfig's lr (model_preset refuses the name itself)."""
    from refpar.config import FINETUNE_RECIPE, RECIPES, Recipe, TrainConfig

    if getattr(args, "init_from", None):
        return FINETUNE_RECIPE
    return RECIPES.get(args.model) or Recipe(TrainConfig().lr)


def optimizer_schedule(args) -> dict:
    """lr, lr_schedule, warmup_steps and min_lr: each flag given, else the checkpoint's when resuming
    (a recipe's warmup follows --steps, which a resumed run may extend), else the recipe's."""
    saved = resumed_schedule(args.resume) if getattr(args, "resume", None) else None
    if saved is not None and all(getattr(args, k) is None for k in ("lr", "lr_schedule", "warmup_steps",
                                                                      "min_lr")):
        return saved
    recipe = recipe_of(args)
    lr = recipe.lr if args.lr is None else args.lr
    schedule = recipe.schedule if args.lr_schedule is None else args.lr_schedule
    warmup = recipe.warmup_for(args.steps) if args.warmup_steps is None else args.warmup_steps
    if args.min_lr is not None:
        min_lr = args.min_lr
    else:  # the recipe's floor, relative to the peak actually used
        min_lr = lr * recipe.min_lr_ratio if schedule != "constant" else 0.0
    return {"lr": lr, "lr_schedule": schedule, "warmup_steps": warmup, "min_lr": min_lr}


def resumed_schedule(path: str) -> dict | None:
    """The learning-rate settings the checkpoint `path` was trained with, read from its manifest alone
    (None where there is none to read: opening the checkpoint later says why in one sentence)."""
    from refpar import checkpoint
    from refpar.reading import load_json, read_bounded

    try:
        folder = checkpoint.find(path)
        text = checkpoint.decided_manifest(folder) or read_bounded(
            folder / checkpoint.MANIFEST, "checkpoint manifest", checkpoint.MANIFEST_LIMIT,
            checkpoint.CheckpointError)
        train = load_json(text, folder, "checkpoint manifest", checkpoint.CheckpointError)["train"]
        return {k: train[k] for k in ("lr", "lr_schedule", "warmup_steps", "min_lr")}
    except (checkpoint.CheckpointError, KeyError, TypeError):
        return None


def plan_of(args, sizes: dict[str, int], model):
    """The Plan the options ask for (refpar/engine/validate.py checks it with the configs)."""
    from refpar.config import ConfigError
    from refpar.engine import Plan
    from refpar.precision import dtype_of

    if args.fsdp and args.zero:
        raise ConfigError(f"--fsdp and --zero {args.zero} are two ways to shard; give one of them")
    if args.bucket_kb is not None and (args.zero or args.fsdp):
        raise ConfigError("--bucket-kb sizes plain DP's all-reduce buckets; drop it or use --zero 0")
    if args.bucket_kb is not None and not 0 < args.bucket_kb <= 1 << 40:  # nan and 1e308 too (1 PiB)
        raise ConfigError(f"--bucket-kb {args.bucket_kb:g} must be a positive size in KiB of at most 2^40; "
                          "give e.g. --bucket-kb 64")
    bucket = 1 << 62
    if args.bucket_kb is not None:  # a bucket holds gradients
        bucket = int(args.bucket_kb * 1024 // (4 if args.fp32_grads else dtype_of(model.dtype).itemsize))
    csv = None
    if args.schedule_csv is not None:
        from refpar.reading import read_bounded
        from refpar.schedules.formats import MAX_CSV_CHARS

        path = Path(args.schedule_csv)
        if not path.exists():
            raise ConfigError(f"--schedule-csv {path}: no such file; give the path of a schedule CSV "
                              "(refpar schedule KIND --csv writes one)")
        try:  # a regular file of bounded size (a FIFO would wait forever)
            csv = read_bounded(path, "--schedule-csv", MAX_CSV_CHARS * 4, ConfigError).decode()
        except UnicodeDecodeError:
            raise ConfigError(f"--schedule-csv {path} is not text; give a schedule CSV (refpar schedule "
                              "KIND --csv writes one)") from None
    return Plan(schedule=args.schedule, schedule_csv=csv, microbatches=args.microbatches, chunks=args.chunks,
                sp=args.sp,
                cp_algo=args.cp_algo, zero=args.zero, fsdp=args.fsdp, prefetch=args.prefetch,
                reshard_after_forward=args.reshard_after_forward, bucket_elems=bucket, overlap=args.overlap,
                recompute=args.recompute)


def run(args) -> int:
    from refpar import backend, save_lock
    from refpar.engine import validate
    from refpar.engine.run import run_job

    model, train, sizes = configs(args)
    check_checkpoint_args(sizes, args)
    check_precision_args(sizes, args)
    check_report_args(args)
    if args.trace is not None:
        from refpar.config import check_output_path

        check_output_path("--trace", args.trace, overwrite=args.overwrite)
        check_output_path("--trace", trace_lines(args.trace), overwrite=args.overwrite)
    plan = plan_of(args, sizes, model)
    validate(model, train, sizes, plan)  # on every rank, before any communication
    train, lock = decide_checkpoints(args, train)  # rank 0 decides, every rank is told
    try:
        backend.use(args.backend, args.device)  # before any array exists: the run draws through it
        return run_job(model, train, sizes, plan, args)
    finally:
        if lock is not None:
            save_lock.release(Path(lock))


def trace_lines(trace: str) -> str:
    """--trace PATH's second file, every message of the run as JSON lines: PATH.jsonl, as the help says."""
    return f"{trace}.jsonl"


def decide_checkpoints(args, train):
    """What every rank must agree on about --resume and --save, decided on rank 0 and sent to the
    others (refpar/agreement.py), after every check a rank makes alone: the step a resume loads
    (args.resume becomes its directory) and, for --save DIR, its lock (refpar/save_lock.py: another
    job writing DIR is refused) and whether DIR may be written (a run already in it is refused unless
    --overwrite, which removes its steps, or --resume continues it). Returns (the TrainConfig, with
    the learning-rate settings of the step decided on, the lock's path on rank 0 or None)."""
    import dataclasses

    from refpar import checkpoint
    from refpar.agreement import decided

    if args.resume is None and args.save is None:
        return train, None
    comm = None
    from refpar.cli import under_launcher

    if under_launcher():
        from refpar.comm.communicator import world

        comm = world()
    if args.resume is not None:
        args.resume = checkpoint.decide_resume(args.resume, comm)
        saved = resumed_schedule(args.resume)
        if saved is not None and all(getattr(args, k) is None for k in ("lr", "lr_schedule", "warmup_steps",
                                                                          "min_lr")):
            train = dataclasses.replace(train, **saved)  # the decided step's, whatever a rank read before
    if args.save is None:
        return train, None
    lock = decided(comm, lambda: claim_save(args.save, args.resume, args.overwrite))
    return train, lock if comm is None or comm.rank == 0 else None


def claim_save(save: str, resume: str | None, overwrite: bool) -> str:
    """Rank 0: takes --save DIR's lock and refuses a DIR that holds another run, unless `overwrite`
    (its step directories are removed) or `resume` is a step in DIR (the run goes on there)."""
    from refpar import checkpoint, interrupt, save_lock
    from refpar.config import ConfigError
    from refpar.reading import shown

    root = Path(save)
    continuing = resume is not None and Path(resume).resolve().parent == root.resolve()
    lock = save_lock.take(root)
    steps = sorted(p for p in root.glob(f"{checkpoint.STEP_PREFIX}*") if p.is_dir())
    if steps and not continuing:
        if not overwrite:
            save_lock.release(lock)
            names = ", ".join(p.name for p in steps[-3:])
            raise ConfigError(f"--save {shown(save)} already holds a run ({names}); continue it with "
                              f"--resume {shown(save)}, pass --overwrite to replace it, or give another "
                              "--save DIR")
        for step in steps:  # the old run's steps, which a later --resume would mix with this run's
            with interrupt.file_operation():
                interrupt.remove(step)
    return str(lock)


def check_checkpoint_args(sizes: dict[str, int], args) -> None:
    """--save and --resume exist for every mesh (refpar/checkpoint.py)."""
    from refpar.config import ConfigError, check_output_path

    if args.save_every is not None and (args.save is None or args.save_every < 1):
        raise ConfigError("--save-every N needs --save DIR and N >= 1")
    if args.save is not None:
        check_output_path("--save", args.save, directory=True)
    if args.resume == "":
        raise ConfigError("--resume needs a directory written by --save")
    if args.resume is not None:
        from refpar.reading import check_path_length

        check_path_length("--resume", args.resume, ConfigError)
    if (args.save or args.resume) and getattr(args, "moe_balance", "aux") == "aux-free":
        raise ConfigError("a checkpoint does not hold aux-free balancing's expert biases, so a resumed "
                          "run would route differently; drop --save/--resume or use --moe-balance aux")
    if (args.save or args.resume) and getattr(args, "backend", "numpy") != "numpy":
        raise ConfigError(f"--save and --resume read and write NumPy arrays; drop them or --backend "
                          f"{args.backend}")


def check_precision_args(sizes: dict[str, int], args) -> None:
    """Mixed precision runs on every mesh, on NumPy and on torch."""
    from refpar.config import ConfigError
    from refpar.precision import PRECISIONS, is_16bit

    precision = getattr(args, "precision", None)
    if precision is None or not is_16bit(PRECISIONS[precision]):
        return
    if getattr(args, "backend", "numpy") == "cupy":
        raise ConfigError(f"--precision {precision} runs on --backend numpy or torch, not on CuPy "
                          f"(which has no bfloat16); drop --backend cupy")
