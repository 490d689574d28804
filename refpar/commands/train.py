"""`refpar train`: train GPT-2 on the synthetic Markov corpus and print the loss next to its floor.

    refpar train --model tiny --steps 200
    refpar train --model tiny --steps 5 --json     # last line: the JSON summary (refpar.report)
"""

from __future__ import annotations

import argparse

from refpar.commands import train_moe

HELP = "Train GPT-2 on a synthetic Markov corpus; print the loss next to the best loss possible."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from refpar.config import TrainConfig

    d = TrainConfig()
    parser.add_argument("--model", default="tiny", help="model preset: tiny or small (default tiny)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"global batch, sequences per step (default {d.batch_size})")
    parser.add_argument("--seq-len", type=int, default=d.seq_len,
                        help=f"tokens per sequence (default {d.seq_len})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    parser.add_argument("--optimizer", default=d.optimizer, help="adamw or sgd (default adamw)")
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
    # Flags every strategy reads; each runner adds only its own after these.
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step (gradient accumulation; pipeline microbatches)")
    parser.add_argument("--check", action="store_true",
                        help="also run the single-device reference and compare")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="write communication events as a Chrome trace (open in Perfetto) and, "
                             "for engine runs, PATH.jsonl")
    from refpar.parallel import dp_runner, intra_layer_runner
    from refpar.parallel.pipeline import runner as pipeline_runner

    dp_runner.add_arguments(parser)
    intra_layer_runner.add_arguments(parser)
    pipeline_runner.add_arguments(parser)
    train_moe.add_arguments(parser)


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
    from refpar.config import ConfigError, ParallelConfig, TrainConfig, model_preset, parse_mesh

    sizes = ParallelConfig(parse_mesh(args.mesh) if args.mesh is not None else {}).sizes
    if sizes["ep"] > 1 and not args.moe_experts:
        raise ConfigError(f"ep={sizes['ep']} spreads experts over ranks; add --moe-experts E with "
                          f"E >= {sizes['ep']}")
    for axis, size in sizes.items():
        if size > 1:
            raise ConfigError(f"mesh axis {axis}={size} is not implemented yet; run without --mesh "
                              f"(or with {axis}=1) for the single-device reference")
    overrides = {k: v for k, v in (("dtype", precision_dtype(args)), ("dropout", args.dropout),
                                   ("n_layer", args.n_layer)) if v is not None}
    model = model_preset(args.model, **overrides, **train_moe.model_overrides(args))
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                        optimizer=args.optimizer, seed=args.seed,
                        fp32_grads=getattr(args, "fp32_grads", False),
                        loss_scale=getattr(args, "loss_scale", None),
                        loss_scale_window=getattr(args, "loss_scale_window", None))
    train.check_model(model)
    return model, train, sizes


def run(args) -> int:
    from refpar.config import ParallelConfig, parse_mesh
    from refpar.parallel import dp_runner, intra_layer_runner
    from refpar.parallel.pipeline import runner as pipeline_runner

    sizes = ParallelConfig(parse_mesh(args.mesh) if args.mesh is not None else {}).sizes
    check_checkpoint_args(sizes, args)
    check_precision_args(sizes, args)
    from refpar import backend

    backend.use(args.backend, args.device)  # before any array exists: the runners draw through it
    if args.moe_experts:  # MoE on one device or over dp x ep: refpar/commands/train_moe.py
        model, train, _ = configs(argparse.Namespace(**{**vars(args), "mesh": None}))
        return train_moe.run_cli(model, train, sizes, args)
    from refpar.commands import train_engine

    if train_engine.wants_engine(sizes, args):  # the N-D engine, refpar/engine.py (wants_engine says when)
        model, train, _ = configs(argparse.Namespace(**{**vars(args), "mesh": None}))
        return train_engine.run_cli(model, train, sizes, args)
    if pipeline_runner.wants_pipeline(sizes, args):  # pp > 1 (with dp): refpar/parallel/pipeline/runner.py
        model, train, _ = configs(argparse.Namespace(**{**vars(args), "mesh": None}))
        return pipeline_runner.run_cli(model, train, sizes, args)
    if intra_layer_runner.wants_intra_layer(sizes, args):  # TP, SP, CP (with dp): intra_layer_runner.py
        model, train, _ = configs(argparse.Namespace(**{**vars(args), "mesh": None}))
        return intra_layer_runner.run_cli(model, train, sizes, args)
    if dp_runner.wants_data_parallel(sizes, args):  # DP, ZeRO and FSDP: refpar/parallel/dp_runner.py
        model, train, _ = configs(argparse.Namespace(**{**vars(args), "mesh": None}))
        return dp_runner.run_cli(model, train, sizes, args)
    from refpar.cli import launcher_rank
    from refpar.model import param_shapes
    from refpar.report import loss_scaling_summary, run_summary, summary_line
    from refpar.trainer import corpus_for, train_single_device

    model, train, sizes = configs(args)
    if args.backend != "numpy":
        from refpar.config import ConfigError

        raise ConfigError(f"--backend {args.backend} runs the parallel strategies (give --mesh); the "
                          "single-device run is the NumPy reference every check compares with")
    speak = launcher_rank() == 0
    n_params = sum(_numel(shape) for shape in param_shapes(model).values())
    floor = corpus_for(model, train).entropy_rate()
    tokens_per_step = train.batch_size * train.seq_len
    # About a dozen table rows whatever the length of the run, plus the first and the last step.
    every = max(1, train.steps // 12)

    def say(text: str) -> None:
        if speak:
            print(text, flush=True)

    say(f"{'Llama' if model.arch == 'llama' else 'GPT-2'} {args.model}: {model.n_layer} layers, "
        f"{model.n_embd} channels, {model.n_head} heads, "
        f"{n_params:,} parameters, {precision_label(model.dtype)}, dropout {model.dropout}, 1 device")
    say(f"data: Markov chain over {model.vocab_size} tokens, batch {train.batch_size} x {train.seq_len} "
        f"tokens; loss floor (entropy rate) {floor:.4f}")
    scaled = model.dtype == "float16"  # fp16-mixed: show the loss scale and the skipped steps
    say(f"{'step':>6} {'loss':>9} {'floor':>9} {'tokens/s':>10}"
        + (f" {'loss scale':>11} {'skipped':>8}" if scaled else ""))

    shown: list[int] = []

    def row(r) -> None:
        if not shown or (r.step + 1) % every == 0 or r.step == train.steps - 1 or r.skipped:
            say(f"{r.step + 1:>6} {r.loss:>9.4f} {floor:>9.4f} {tokens_per_step / r.time_s:>10,.0f}"
                + (f" {r.loss_scale:>11g} {r.skipped_total:>8}" if scaled else ""))
            shown.append(r.step)

    result = train_single_device(model, train, on_step=row, save=args.save,
                                 save_every=args.save_every, resume=args.resume)
    # The mean of the last ten steps, since one batch's loss is noisy.
    tail = result.losses[-10:]
    first, last = result.losses[0], sum(tail) / len(tail)
    gap = first - floor
    progress = f", {100 * (first - last) / gap:.0f}% of the way to the floor" if gap > 0 else ""
    say(f"loss {first:.4f} at step {result.first_step + 1}, {last:.4f} over the last {len(tail)} "
        f"steps{progress}; {result.step_time_s * 1e3:.1f} ms per step")
    if args.json:
        summary = run_summary(model, train, result.losses, mesh=sizes, world_size=1,
                              step_time_s=result.step_time_s, loss_floor=floor,
                              loss_scaling=loss_scaling_summary(result.loss_scales,
                                                                result.skipped_steps))
        say(summary_line(summary))
    return 0


def check_checkpoint_args(sizes: dict[str, int], args) -> None:
    """--save and --resume exist for one device, the dp/ZeRO/FSDP, tp/sp/cp, pipeline and MoE
    runners and the N-D engine (refpar/checkpoint.py)."""
    from refpar.config import ConfigError

    if args.save_every is not None and (args.save is None or args.save_every < 1):
        raise ConfigError("--save-every N needs --save DIR and N >= 1")
    if (args.save or args.resume) and getattr(args, "backend", "numpy") != "numpy":
        raise ConfigError(f"--save and --resume read and write NumPy arrays; drop them or --backend "
                          f"{args.backend}")


def precision_label(dtype: str) -> str:
    """"float64", or for mixed runs e.g. "bf16-mixed (bfloat16 weights and activations, fp32 master
    weights)", for the header line of a run."""
    from refpar.precision import is_16bit, precision_of

    if not is_16bit(dtype):
        return dtype
    return f"{precision_of(dtype)} ({dtype} weights and activations, fp32 master weights)"


def check_precision_args(sizes: dict[str, int], args) -> None:
    """Mixed precision runs on every mesh and backend NumPy."""
    from refpar.config import ConfigError
    from refpar.precision import PRECISIONS, is_16bit

    precision = getattr(args, "precision", None)
    if precision is None or not is_16bit(PRECISIONS[precision]):
        return
    if getattr(args, "backend", "numpy") != "numpy":
        raise ConfigError(f"--precision {precision} runs on the NumPy backend (its 16-bit arrays are "
                          f"NumPy's and ml_dtypes'); drop --backend {args.backend}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
