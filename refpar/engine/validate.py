"""Every check of how a run composes the strategies on its mesh (refpar.config.Plan): `validate`.

    plan = Plan(schedule="1f1b", microbatches=4, zero=1, sp=True)
    validate(model, train, {"pp": 2, "dp": 2, "tp": 2, "cp": 1, "ep": 1}, plan)

`validate` makes no communication, so every rank raises the same ConfigError, one sentence saying
what to change, before the first message.
"""

from __future__ import annotations

from refpar.config import RECOMPUTE, ConfigError, ModelConfig, Plan, TrainConfig
from refpar.holdings import names, stage_layers, tied_embedding
from refpar.parallel.context_parallel import check_cp
from refpar.parallel.expert_parallel import check_expert_parallel
from refpar.parallel.pieces import family
from refpar.parallel.sequence_parallel import check_sp, check_sp_cp
from refpar.parallel.tensor_parallel import check_tp
from refpar.schedules import stage_map
from refpar.schedules.builders import BUILDERS, build, model_parts, of_plan
from refpar.schedules.simulate import validate as validate_schedule


def validate(model: ModelConfig, train: TrainConfig, sizes: dict, plan: Plan) -> None:
    """Every check of a run on a mesh of `sizes` (every axis), with no communication."""
    p, d, e, c, t = (sizes.get(a, 1) for a in ("pp", "dp", "ep", "cp", "tp"))
    train.check_model(model)
    _check_family(model, sizes)
    check_expert_parallel(model, e)
    check_tp(model, t)
    if plan.sp:
        check_sp(model, train.seq_len, t)  # "give the mesh tp=2 or more", seq_len >= tp
    if plan.cp_algo is not None and c < 2:
        raise ConfigError("--cp-algo chooses how cp ranks share attention; give the mesh cp=2 or more")
    if c > 1:
        check_cp(model, train.seq_len, c, plan.cp_algo or "ring", t)
        if plan.sp:  # every cp rank's tokens split over tp
            check_sp_cp(model, train.seq_len, t, c, plan.cp_algo or "ring")
    if (plan.schedule is not None or plan.chunks is not None or plan.schedule_csv is not None) and p == 1:
        raise ConfigError("--schedule, --schedule-csv and --chunks need a pipeline; add pp=2 or more to "
                          "--mesh")
    if plan.schedule is not None and plan.schedule_csv is not None:
        raise ConfigError("--schedule KIND and --schedule-csv FILE each give the schedule; drop one")
    if plan.schedule_csv is None and plan.kind in BUILDERS:  # "pp x chunks stages need as many blocks"
        stage_layers(model.n_layer, model_parts(plan.kind, p, plan.chunks), 0)
    if plan.recompute not in RECOMPUTE:
        raise ConfigError(f"unknown --recompute {plan.recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    _check_batch(model, train, d, e, plan.microbatches)
    _check_data_parallel(model, d * e * c if model.moe_experts else d * c, plan)
    _check_schedule(model, p, plan)  # last: building costs p x m x v; its own sentences


def _check_family(model: ModelConfig, sizes: dict) -> None:
    """What the engine runs each family with (the pieces table): every strategy, except that
    refpar/parallel/expert_tensor_parallel.py splits GPT-2's and DeepSeek-V3's experts only, and
    multi-token prediction trains on one device only."""
    fam = family(model)
    split = [f"{axis}={sizes[axis]}" for axis in ("tp", "cp") if sizes.get(axis, 1) > 1]
    if split and not fam.splits_attention:
        raise ConfigError(f"{names(model).title}'s attention runs whole on each rank so far, not split over "
                          f"{split[0]} (dp, ZeRO, FSDP, pp and ep run it); drop {split[0]} from --mesh")
    _check_mlp_widths(model, sizes)
    if model.moe_experts and sizes.get("tp", 1) > 1 and not fam.experts_over_tp:
        raise ConfigError(f"Mixtral's experts run over ep, dp, cp and pp, not split over tp={sizes['tp']} "
                          "(expert tensor parallelism is GPT-2's and DeepSeek-V3's so far); drop tp from "
                          "--mesh")
    if model.num_nextn_predict_layers:
        raise ConfigError("multi-token prediction trains in refpar.model.loss_and_grads only so far, not on "
                          "the engine's pieces; set num_nextn_predict_layers=0")


def _check_mlp_widths(model: ModelConfig, sizes: dict) -> None:
    """A SwiGLU width (Llama's and DeepSeek-V3's intermediate_size, DeepSeek-V3's experts'
    moe_intermediate_size) splits over tp by columns, so each rank needs one (GPT-2's 4C has more
    columns than n_head, which check_tp already holds to tp)."""
    t = sizes.get("tp", 1)
    widths = [("intermediate_size", model.intermediate_size)]
    if model.moe_experts:
        widths.append(("moe_intermediate_size", model.moe_intermediate_size))
    for name, width in widths:
        if width is None:
            continue
        if width < t:
            raise ConfigError(f"tp={t} splits {name}={width} into fewer columns than ranks; use "
                              f"tp <= {width}")


def _check_schedule(model: ModelConfig, p: int, plan: Plan) -> None:
    """The schedule builds, or its CSV reads and runs (`simulate.validate` names the first action
    that cannot), on p ranks with the plan's microbatches and enough blocks for its stages."""
    if plan.schedule_csv is None:
        lay = stage_map(build(plan.kind, p, plan.microbatches, plan.chunks))
    else:
        lay = _check_csv(model, p, plan)
    if lay.copies == 2 and model.moe_experts:
        # a rank's two copies route different microbatches through different blocks, which the
        # MoE report's per-microbatch routing of the rank's blocks does not describe
        raise ConfigError("a schedule with two copies of the model (dualpipe) sends each microbatch "
                          "through one copy only; train a MoE model with dualpipev or another schedule")


def _check_csv(model: ModelConfig, p: int, plan: Plan):
    """A schedule read from torch's CSV: a row per pp rank, the plan's microbatches, a block for each
    stage, and every action able to run; returns its schedules.StageMap."""
    if plan.chunks is not None:
        raise ConfigError("--chunks sets the stages per rank of a built schedule, and a --schedule-csv "
                          "file places its own; drop --chunks")
    schedule = of_plan(plan, p)
    if len(schedule) != p:
        raise ConfigError(f"the --schedule-csv file has {len(schedule)} ranks but the mesh has pp={p}; "
                          f"give --mesh pp={len(schedule)} or a schedule of {p} rows")
    lay = validate_schedule(schedule)
    if lay.n_microbatches != plan.microbatches:
        raise ConfigError(f"the --schedule-csv file runs {lay.n_microbatches} microbatches; give "
                          f"--microbatches {lay.n_microbatches}")
    stage_layers(model.n_layer, lay.stages_per_copy, 0)
    ends = {lay.stage_rank[0], lay.stage_rank[lay.stages_per_copy - 1]}
    # the tied embedding's gradient is summed over ranks 0 and p-1
    if lay.tied_apart and tied_embedding(model) and ends != {0, p - 1}:
        raise ConfigError(f"the --schedule-csv file puts the first and the last stage, which share the "
                          f"tied embedding, on ranks {sorted(ends)}; put them on ranks 0 and {p - 1}, "
                          "or both on one rank")
    P = lay.stages_per_copy
    if lay.copies == 2 and any(lay.stage_rank[P + k] != p - 1 - lay.stage_rank[k] for k in range(P)):
        raise ConfigError("the --schedule-csv file holds two copies of the model; put each stage of the "
                          "second copy on the mirror rank p-1-r of the same part's rank r in the first, "
                          "as dualpipe does")
    return lay


def _check_batch(model: ModelConfig, train: TrainConfig, d: int, e: int, m: int) -> None:
    """Dense models split each data-parallel rank's rows into m microbatches; MoE models route each
    of m equal slices of the batch on its own, cut over the dp x ep data ranks (engine/train.py)."""
    B = train.batch_size
    if m < 1:
        raise ConfigError(f"--microbatches {m} must be at least 1")
    if not model.moe_experts:
        if B // d < m:
            raise ConfigError(f"--batch-size {B} over dp={d} leaves fewer sequences per data-parallel "
                              f"rank than --microbatches {m}; use --batch-size {d * m} or more, or "
                              f"fewer microbatches")
        return
    n = d * e
    if B < n:
        raise ConfigError(f"batch_size={B} is smaller than dp x ep = {n}; use --batch-size {n} or more so "
                          f"every rank has a sequence")
    if B % m:
        raise ConfigError(f"--microbatches {m} does not divide --batch-size {B}; MoE microbatches are "
                          f"equal slices of the batch, so choose a divisor of {B}")
    if B // m < n:
        raise ConfigError(f"--batch-size {B} in {m} microbatches leaves {B // m} sequences per "
                          f"microbatch for dp x ep = {n} ranks; use --batch-size {n * m} or more, or "
                          f"fewer microbatches")


def _check_data_parallel(model: ModelConfig, replicas: int, plan: Plan) -> None:
    """ZeRO and FSDP shard over a unit's replicas; the DP and FSDP options belong to theirs."""
    if plan.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {plan.zero} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3")
    if plan.fsdp and plan.zero not in (0, 3):
        raise ConfigError(f"--fsdp and --zero {plan.zero} are two ways to shard; give one of them")
    if plan.overlap and plan.stage:
        raise ConfigError("--overlap applies to plain DP's gradient buckets; drop it or use --zero 0")
    if (plan.prefetch or not plan.reshard_after_forward) and not plan.fsdp:
        raise ConfigError("--prefetch and --no-reshard-after-forward are FSDP options; add --fsdp or "
                          "drop them")
    if plan.bucket_elems < 1:
        raise ConfigError(f"the bucket must hold at least one element, got {plan.bucket_elems}; "
                          "give --bucket-kb a larger size")
    if plan.stage and replicas < 2:
        flag = "--fsdp" if plan.fsdp else f"--zero {plan.zero}"
        if model.moe_experts:
            raise ConfigError(f"{flag} shards each stage's weights over its dp x ep x cp ranks; give the "
                              f"mesh dp=2, ep=2 or cp=2 or more")
        raise ConfigError(f"{flag} shards over the dp (and cp) ranks; give the mesh dp=2 or more")
