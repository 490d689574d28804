"""`refpar verify [--quick] [--precision P]`: every strategy and their combinations, each a real MPI
job, against the single-device run of the same precision and the closed forms.

    refpar verify --quick
    refpar verify --precision bf16-mixed
    refpar verify --clip-grad-norm 0.05 --lr-schedule cosine --warmup-steps 2

Each row launches `mpiexec -n N python -m refpar train ... --check --json` as a subprocess with a
timeout and reads its JSON summary: the largest relative difference from one device, whether the
traced bytes per rank, axis and op equal the closed forms, and whether the peak memory per rank
and category equals them ("-" where the run models none). Exit status 1 if any row fails.
--clip-grad-norm, --lr-schedule, --warmup-steps and --min-lr go to every run; with clipping a float64 run is
judged on its global gradient norms too. --data (with --tokenizer, --vocab-size) trains every run on real
text instead of the Markov corpus: `refpar verify --quick --data docs/`.

What "agrees with one device" means depends on the precision (`tolerance`): float64 runs match
loss and parameters to 1e-10; float32, bf16-mixed and fp16-mixed runs compare losses only, within
a bound set by that format's rounding (parallel runs sum in another order and round partial sums
where one device rounds once; AdamW turns a sign flip of a tiny gradient into a full lr step of one
parameter, so parameters are not compared elementwise). Mixture-of-Experts rows get a wider 16-bit
bound, since routing is discrete: a token at the capacity edge may change expert once the
parameters differ in the last bit. tests/test_mixed_precision_strategies.py explains the bounds per
strategy and records the differences measured. Rows the configuration refuses in a precision
are skipped with its reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HELP = "Run every strategy and combination on MPI ranks; table of differences, bytes and memory."
TOLERANCE = 1e-10  # float64, after several AdamW steps (DESIGN.md, "Numerics")
# Relative loss difference allowed per precision (module docstring): float32's unit roundoff is
# 6e-8, bf16's 3.9e-3, fp16's 4.9e-4. fp32: a loss after a few steps carries the roundings of ~10
# ops per block, each summed in another order on the ranks, amplified by the steps: tens of u, so
# 1e-5 (~170 u) holds on any BLAS kernel (tests/test_intra_layer.py measures about 1e-7). The
# 16-bit bounds are u/2 (bf16) and about 2u (fp16), tests/test_mixed_precision_strategies.py says why.
LOSS_TOLERANCES = {"fp64": TOLERANCE, "fp32": 1e-5, "bf16-mixed": 2e-3, "fp16-mixed": 1e-3}
MOE_LOSS_TOLERANCES = {"bf16-mixed": 5e-3, "fp16-mixed": 2e-3}  # routing can flip once parameters differ

# Top-2 routing with a capacity that drops tokens, on two of the four blocks.
MOE = ("--moe-experts", "4", "--moe-topk", "2", "--capacity-factor", "0.9", "--moe-layers", "1,3")
# (config name, ranks, refpar train arguments). Meshes need their product of ranks.
MATRIX: list[tuple[str, int, tuple[str, ...]]] = [
    ("dp", 2, ("--mesh", "dp=2")),
    ("zero-1", 2, ("--mesh", "dp=2", "--zero", "1")),
    ("zero-2", 2, ("--mesh", "dp=2", "--zero", "2", "--microbatches", "2")),
    ("zero-3", 2, ("--mesh", "dp=2", "--zero", "3")),
    ("fsdp", 2, ("--mesh", "dp=2", "--fsdp")),
    ("tp", 2, ("--mesh", "tp=2")),
    ("tp+sp", 2, ("--mesh", "tp=2", "--sp")),
    ("cp ring", 2, ("--mesh", "cp=2")),
    ("cp ulysses", 2, ("--mesh", "cp=2", "--cp-algo", "ulysses")),
    ("pp 1f1b", 2, ("--mesh", "pp=2", "--microbatches", "4")),
    ("pp zb-h1", 2, ("--mesh", "pp=2", "--schedule", "zb-h1", "--microbatches", "4")),
    ("ep", 2, ("--mesh", "ep=2", *MOE)),
    ("dp x tp", 4, ("--mesh", "dp=2,tp=2")),
    ("dp x cp", 4, ("--mesh", "dp=2,cp=2")),
    ("dp x ep", 4, ("--mesh", "dp=2,ep=2", *MOE)),
    ("pp x ep", 4, ("--mesh", "pp=2,ep=2", "--microbatches", "2", *MOE)),
    ("ep x cp ring", 4, ("--mesh", "ep=2,cp=2", "--microbatches", "2", *MOE)),
    ("ep x tp", 4, ("--mesh", "ep=2,tp=2", *MOE)),
    ("zero-1 x dp x ep", 4, ("--mesh", "dp=2,ep=2", "--zero", "1", *MOE)),
    ("fsdp x pp x ep", 4, ("--mesh", "pp=2,ep=2", "--fsdp", "--microbatches", "2", *MOE)),
    ("zero-2 x ep x cp", 4, ("--mesh", "ep=2,cp=2", "--zero", "2", "--microbatches", "2", *MOE)),
    ("dp x pp", 4, ("--mesh", "dp=2,pp=2", "--microbatches", "2")),
    ("interleaved x tp", 4, ("--mesh", "tp=2,pp=2", "--schedule", "interleaved-1f1b",
                             "--microbatches", "4")),
    ("dp x tp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--microbatches", "4")),
    ("zero-1 x tp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--zero", "1", "--microbatches", "2")),
    ("zero-3 x tp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--zero", "3", "--microbatches", "2")),
    ("zero-1 x tp+sp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--zero", "1", "--sp",
                                "--microbatches", "2")),
    ("tp x cp x pp", 8, ("--mesh", "pp=2,cp=2,tp=2", "--microbatches", "2")),
    ("dp x ep x pp 1f1b", 8, ("--mesh", "pp=2,dp=2,ep=2", "--schedule", "1f1b", "--microbatches", "2",
                              *MOE)),
    ("ep x ulysses x pp", 8, ("--mesh", "pp=2,ep=2,cp=2", "--cp-algo", "ulysses", "--microbatches", "2",
                              *MOE)),
    ("ep x tp+sp x pp", 8, ("--mesh", "pp=2,ep=2,tp=2", "--sp", "--microbatches", "2", *MOE)),
    ("ep x cp x tp", 8, ("--mesh", "ep=2,cp=2,tp=2", "--microbatches", "2", *MOE)),
    ("zero-1 x ep x tp+sp", 4, ("--mesh", "ep=2,tp=2", "--sp", "--zero", "1", "--microbatches", "2", *MOE)),
    ("fsdp x moe pp x cp x tp", 8, ("--mesh", "pp=2,cp=2,tp=2", "--fsdp", "--microbatches", "2", *MOE)),
    ("moe pp x cp x tp+sp", 8, ("--mesh", "pp=2,cp=2,tp=2", "--cp-algo", "ulysses", "--sp",
                                "--microbatches", "2", *MOE)),
    ("zero-1 x ulysses x pp", 8, ("--mesh", "dp=2,cp=2,pp=2", "--zero", "1", "--cp-algo", "ulysses",
                                  "--microbatches", "2")),
    # ZeRO over dp x cp, ZeRO-2 with tp and pp, sp with ZeRO-2/3, sp inside cp, FSDP in stages
    ("zero-3 x cp x pp", 8, ("--mesh", "dp=2,cp=2,pp=2", "--zero", "3", "--microbatches", "2")),
    ("zero-2 x tp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--zero", "2", "--microbatches", "2")),
    ("zero-2 x interleaved", 4, ("--mesh", "dp=2,pp=2", "--zero", "2", "--schedule", "interleaved-1f1b",
                                 "--microbatches", "4")),
    ("zero-3 x tp+sp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--zero", "3", "--sp", "--microbatches", "2")),
    ("tp+sp x cp x pp", 8, ("--mesh", "cp=2,tp=2,pp=2", "--sp", "--microbatches", "2")),
    ("fsdp x tp x pp", 8, ("--mesh", "dp=2,tp=2,pp=2", "--fsdp", "--microbatches", "2")),
    ("zero-3 x tp+sp x cp", 4, ("--mesh", "cp=2,tp=2", "--sp", "--zero", "3", "--cp-algo", "ulysses",
                                "--microbatches", "2")),
    # the V-shaped and bidirectional schedules: two stages per rank, an overlapped F&B, two copies
    ("pp zbv", 2, ("--mesh", "pp=2", "--schedule", "zbv", "--microbatches", "4")),
    ("zero-1 x v-half", 4, ("--mesh", "dp=2,pp=2", "--zero", "1", "--schedule", "v-half",
                            "--microbatches", "4")),
    ("tp x v-min", 4, ("--mesh", "tp=2,pp=2", "--schedule", "v-min", "--microbatches", "4")),
    ("pp dualpipev", 2, ("--mesh", "pp=2", "--schedule", "dualpipev", "--microbatches", "4")),
    ("zero-3 x dualpipe", 4, ("--mesh", "dp=2,pp=2", "--zero", "3", "--schedule", "dualpipe",
                              "--microbatches", "4")),
    # One mixed-precision row in every matrix (its own precision whatever --precision says).
    ("tp+sp bf16", 2, ("--mesh", "tp=2", "--sp", "--precision", "bf16-mixed")),
    # Llama (llama-tiny: 4 query heads over 2 kv heads): tp=4 replicates each kv head on 2 ranks
    ("llama tp=4 gqa", 4, ("--model", "llama-tiny", "--mesh", "tp=4")),
    ("llama zero-3", 2, ("--model", "llama-tiny", "--mesh", "dp=2", "--zero", "3")),
    ("llama dp x tp x pp", 8, ("--model", "llama-tiny", "--mesh", "dp=2,tp=2,pp=2", "--microbatches", "4")),
    ("llama fsdp x interleaved", 4, ("--model", "llama-tiny", "--mesh", "dp=2,pp=2", "--fsdp",
                                     "--schedule", "interleaved-1f1b", "--microbatches", "4")),
    ("llama dp x tp+sp x pp", 8, ("--model", "llama-tiny", "--mesh", "dp=2,tp=2,pp=2", "--sp",
                                  "--microbatches", "4")),
    # RoPE by global position: zig-zag chunks under ring; Ulysses splits the 2 kv heads over cp
    ("llama cp ring", 2, ("--model", "llama-tiny", "--mesh", "cp=2")),
    ("llama cp ulysses", 2, ("--model", "llama-tiny", "--mesh", "cp=2", "--cp-algo", "ulysses")),
    # Mixtral's experts: HF's MixtralSparseMoeBlock routing (softmax, top-2, renormalised, dropless)
    ("llama dp x ep mixtral", 4, ("--model", "llama-tiny", "--mesh", "dp=2,ep=2", "--moe-experts", "4",
                                  "--moe-topk", "2", "--dropless", "--microbatches", "2")),
    ("llama tp+sp bf16", 2, ("--model", "llama-tiny", "--mesh", "tp=2", "--sp", "--precision", "bf16-mixed")),
    # DeepSeek-V3 (deepseek-tiny: latent attention, a dense block, then 8 fine-grained experts and a
    # shared one): heads over tp, the latents gathered under sp, routed experts' columns over tp,
    # positions over cp with RoPE by global position, k and v at their own widths
    ("deepseek dp x ep zero-3", 4, ("--model", "deepseek-tiny", "--mesh", "dp=2,ep=2", "--zero", "3")),
    ("deepseek tp", 2, ("--model", "deepseek-tiny", "--mesh", "tp=2")),
    ("deepseek tp+sp", 2, ("--model", "deepseek-tiny", "--mesh", "tp=2", "--sp", "--microbatches", "2")),
    ("deepseek ep x tp+sp", 4, ("--model", "deepseek-tiny", "--mesh", "tp=2,ep=2", "--sp", "--zero", "1",
                                "--microbatches", "2")),
    ("deepseek cp ring", 2, ("--model", "deepseek-tiny", "--mesh", "cp=2")),
    ("deepseek ulysses x tp+sp", 4, ("--model", "deepseek-tiny", "--mesh", "cp=2,tp=2", "--sp", "--cp-algo",
                                     "ulysses", "--microbatches", "2")),
    ("deepseek dp x tp x pp", 8, ("--model", "deepseek-tiny", "--mesh", "dp=2,tp=2,pp=2", "--zero", "1",
                                  "--microbatches", "2")),
]
# About 10 runs that touch every building block once: `make test` runs these.
QUICK = ("zero-3", "tp+sp", "dp x cp", "dp x ep", "pp zb-h1", "interleaved x tp", "zero-1 x tp+sp x pp",
         "zero-3 x tp x pp", "tp x cp x pp", "zero-3 x tp+sp x cp", "tp+sp bf16")


def add_arguments(parser) -> None:
    from refpar.config import LR_SCHEDULES

    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} runs: {', '.join(QUICK)}")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per run (default 3)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    parser.add_argument("--only", default=None, help="comma-separated config names to run")
    parser.add_argument("--backend", default="numpy", choices=("numpy", "torch", "cupy"),
                        help="array library of the runs (default numpy); the reference stays NumPy")
    parser.add_argument("--device", default=None, help="torch: cpu (default) or cuda")
    parser.add_argument("--precision", default="fp64", choices=tuple(LOSS_TOLERANCES),
                        help="precision of every run and of its single-device reference (default "
                             "fp64); tolerances per precision in the table's footnote")
    parser.add_argument("--clip-grad-norm", type=float, default=0.0, metavar="X",
                        help="every run clips its gradients to global norm X (default 0: none)")
    parser.add_argument("--lr-schedule", default="constant", choices=LR_SCHEDULES,
                        help="every run's learning-rate schedule (default constant)")
    parser.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                        help="every run's warmup steps (default 0)")
    parser.add_argument("--min-lr", type=float, default=0.0, metavar="X",
                        help="where every run's decaying schedule ends (default 0)")
    parser.add_argument("--data", metavar="PATH", default=None,
                        help="every run trains on this text or these token files (refpar train --data) "
                             "instead of the Markov corpus")
    parser.add_argument("--tokenizer", default=None, metavar="KIND",
                        help="with --data: every run's tokenizer (refpar train --tokenizer)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="with --data: the BPE's or the token files' vocabulary")


def _rows(rows, key) -> dict | None:
    if rows is None:
        return None
    out = {}
    for r in rows:
        value = tuple(r[k] for k in r if k not in key)
        if any(value):
            out[tuple(r[k] for k in key)] = value
    return out


def refused(precision: str, moe: bool) -> str | None:
    """The configuration's sentence when it refuses this precision for this kind of run (a
    precision not built for experts yet), else None: such rows are skipped, not failed."""
    from refpar.config import ConfigError, TrainConfig, model_preset
    from refpar.precision import PRECISIONS

    try:
        TrainConfig().check_model(model_preset("tiny", dtype=PRECISIONS[precision],
                                               moe_experts=4 if moe else 0))
    except ConfigError as err:
        return str(err).split(";")[0]
    return None


def tolerance(precision: str, moe: bool) -> float:
    """The relative difference from one device a run of `precision` may show (module docstring)."""
    return (MOE_LOSS_TOLERANCES if moe else LOSS_TOLERANCES).get(precision, LOSS_TOLERANCES[precision])


def judge(summary: dict) -> dict:
    """max diff, bytes ok and memory ok of one run's JSON summary (None: not modelled). float64 runs
    are judged on loss and parameters, the others on the loss (module docstring). Memory is
    compared in the categories the run's closed forms give."""
    exact = summary.get("precision", "fp64") == "fp64"
    diffs = [summary.get("max_loss_rel_diff")] + ([summary.get("max_param_rel_diff"),
                                                   summary.get("max_grad_norm_rel_diff")] if exact else [])
    diff = max(d for d in diffs if d is not None) if any(d is not None for d in diffs) else None
    comm_key, mem_key = ("rank", "axis", "op"), ("rank", "category")
    expected_comm = _rows(summary.get("expected_comm_bytes"), comm_key)
    expected_mem = _rows(summary.get("expected_memory_peak_bytes"), mem_key)
    return {"max_diff": diff,
            "bytes_ok": None if expected_comm is None
            else _rows(summary["comm_bytes"], comm_key) == expected_comm,
            "memory_ok": None if expected_mem is None
            else all(_rows(summary["memory_peak_bytes"], mem_key).get(k) == v
                     for k, v in expected_mem.items())}


def launch(ranks: int, args: tuple[str, ...], steps: int, timeout: float,
           backend: tuple[str, ...] = ()) -> tuple[dict | str, float]:
    """One run as `mpiexec` from this Python's environment; (summary, seconds), or (one sentence
    saying how it failed, seconds). `backend`: further `refpar train` arguments (the backend, the
    precision)."""
    from refpar import interrupt
    from refpar.jobs import RankWatch, how_it_ended

    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "refpar", "train", *args,
           "--steps", str(steps), "--check", "--json", *backend]
    watch = RankWatch()  # which rank died, if one does
    env = dict(os.environ, OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]), **watch.env())
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    interrupt.adopt(proc)  # Ctrl-C or SIGTERM to verify ends this job too (refpar/interrupt.py)
    watch.follow(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return (f"timed out after {timeout:.0f} s (a hang? REFPAR_COLLECTIVE_TIMEOUT=30 makes each "
                "waiting rank say what it waits for)"), time.perf_counter() - start
    finally:
        watch.close()
    seconds = time.perf_counter() - start
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return how_it_ended(proc.returncode, stdout + stderr, watch, steps), seconds
    return json.loads(lines[-1]), seconds


def data_flags(args) -> tuple[str, ...]:
    """--data and its options for every run, after the corpus was opened and checked here: a path or
    tokenizer that cannot serve is one sentence before any job starts."""
    if args.data is None:
        if args.tokenizer is not None or args.vocab_size is not None:
            from refpar.config import ConfigError

            raise ConfigError("--tokenizer and --vocab-size tokenize text; add --data PATH or drop them")
        return ()
    from refpar.data import open_data

    open_data(args.data, args.tokenizer, args.vocab_size).check_fits(8, 16)  # the runs' batch of 8 x 16
    flags = ("--data", str(Path(args.data).resolve()))  # the runs start in the repository
    if args.tokenizer is not None:  # a tokenizer.json's path resolved too; bytes, bpe and gpt2 are kinds
        kind = args.tokenizer in ("bytes", "bpe", "gpt2")
        flags += ("--tokenizer", args.tokenizer if kind else str(Path(args.tokenizer).resolve()))
    return flags + (("--vocab-size", str(args.vocab_size)) if args.vocab_size is not None else ())


def run(args) -> int:
    from refpar import backend, interrupt
    from refpar.config import ConfigError

    if not 0 < args.timeout < math.inf:  # nan too: every run would time out at once, or never
        raise ConfigError(f"--timeout {args.timeout:g} must be a positive finite number of seconds; give "
                          "e.g. --timeout 300")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1; give e.g. --steps 3")
    backend.get(args.backend, args.device)  # a backend that cannot run here: one sentence, no jobs
    chosen = ("--backend", args.backend) + (("--device", args.device) if args.device else ())
    chosen += ("--clip-grad-norm", str(args.clip_grad_norm), "--lr-schedule", args.lr_schedule,
               "--warmup-steps", str(args.warmup_steps), "--min-lr", str(args.min_lr))
    chosen += data_flags(args)
    names = [n for n, _, _ in MATRIX]
    wanted = QUICK if args.quick else tuple(names)
    if args.only:
        wanted = tuple(args.only.split(","))
        unknown = [w for w in wanted if w not in names]
        if unknown:
            from refpar.config import ConfigError

            raise ConfigError(f"unknown config {unknown[0]!r}; choose among: {', '.join(names)}")
    clipping = args.clip_grad_norm > 0  # a column of the steps each run clipped
    print(f"{'config':<24} {'ranks':>5} {'max diff':>9} {'bytes':>6} {'memory':>6} {'time':>7}"
          + (f" {'clipped':>7}" if clipping else "") + "  result", flush=True)
    failed, skipped, used = 0, 0, set()
    order = [name for name, _, _ in MATRIX if name in wanted]
    for name, ranks, cli in MATRIX:
        if name not in wanted:
            continue
        interrupt.at(order.index(name), len(order), "run")  # what Ctrl-C's line says
        precision = cli[cli.index("--precision") + 1] if "--precision" in cli else args.precision
        moe = "--moe-experts" in cli or "deepseek-tiny" in cli  # its preset has experts
        why = refused(precision, moe)
        if why is not None:
            skipped += 1
            print(f"{name:<24} {ranks:>5} {'':>23} {'':>7}  skip ({why})", flush=True)
            continue
        used.add(precision)
        extra = () if "--precision" in cli or precision == "fp64" else ("--precision", precision)
        summary, seconds = launch(ranks, cli, args.steps, args.timeout, chosen + extra)
        if isinstance(summary, str):
            failed += 1
            print(f"{name:<24} {ranks:>5} {'':>23} {seconds:>6.1f}s  FAIL {summary}", flush=True)
            continue
        j = judge(summary)

        def mark(ok):
            return "-" if ok is None else ("ok" if ok else "WRONG")

        good = (j["max_diff"] is not None and j["max_diff"] <= tolerance(precision, moe)
                and j["bytes_ok"] is not False and j["memory_ok"] is not False)
        failed += not good
        diff = "-" if j["max_diff"] is None else f"{j['max_diff']:.1e}"
        clipped = ""
        if clipping:
            from refpar.model.optim import clipped_steps

            norms = [n for n in summary["grad_norms"] or () if n is not None]
            fraction = f"{clipped_steps(norms, args.clip_grad_norm)}/{len(summary['losses'])}"
            clipped = f" {fraction:>7}"
        print(f"{name:<24} {ranks:>5} {diff:>9} {mark(j['bytes_ok']):>6} {mark(j['memory_ok']):>6} "
              f"{seconds:>6.1f}s{clipped}  {'pass' if good else 'FAIL'}", flush=True)
    ran = len(wanted) - skipped
    exact = "loss, parameters and gradient norms" if args.clip_grad_norm else "loss and parameters"
    bounds = "; ".join(f"{p}: {exact if p == 'fp64' else 'loss'} <= "
                       f"{LOSS_TOLERANCES[p]:g}" + (f" ({MOE_LOSS_TOLERANCES[p]:g} with experts)"
                                                    if p in MOE_LOSS_TOLERANCES else "")
                       for p in LOSS_TOLERANCES if p in used)
    print(f"{failed} of {ran} failed" if failed else f"all {ran} passed", flush=True)
    print(f"max diff: relative difference from one device of the same precision after {args.steps} "
          f"AdamW steps; {bounds}", flush=True)
    return 1 if failed else 0
