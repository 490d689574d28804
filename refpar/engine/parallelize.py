"""`parallelize`: the strategies applied to a model (GPT-2 or Llama: engine/validate.py says what
each runs) on a mesh, in one fixed order, for every mesh.

    par = parallelize(model, train, mesh, Plan(microbatches=4, zero=1))
    run = train(par)                                                   # refpar/engine/train.py

The order (torchtitan's parallelize_llama, picotron's train.py), each step reading only the ones
before it:

 1. layout      which tokens and weights of a block this rank computes: tensor parallelism's heads
                and vocabulary rows (tp), sequence parallelism's residual shard (sp), context
                parallelism's positions with ring or Ulysses attention (cp) (`layout_for`); the
                trivial layout without any of them (the model's layers, bit for bit)
 2. MoE layer   expert parallelism over ep (its routing over the mesh's `data` group) and expert
                tensor parallelism over tp, in the MoE blocks; each microbatch's token runs
 3. pipeline    the schedule as data, the stages this pp rank runs (one Stage class), what their
                blocks keep for the backward and rerun in it (--recompute; the attention core
                under "selective" wraps the layout's)
 4. parameters  drawn whole on the host, sliced by pp (the stages'), ep (this rank's experts) and
                tp (tensor_parallel's slices), moved to the run's backend; or, with
                TrainConfig.init_from, only those slices read from the weights file (refpar/weights.py)
 5. data        each unit's replica group (dp x cp; a MoE model's dense weights dp x ep x cp)
    parallel    keeps its model states by plain DP (bucketed all-reduce), ZeRO-1/2/3 or FSDP,
                bound once to what a step needs of the other strategies (model_states.Composition)
 6. optimizer   the state that strategy holds (whole, or this rank's shards); fp16's loss scaler;
                clipping by the global norm: what this rank counts, the axes its sums go over
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from refpar import backend
from refpar.config import ModelConfig, Plan, TrainConfig
from refpar.holdings import (
    held_expert,
    keeps_lowp,
    microbatch_samples,
    sequence_parallel_param_names,
    stage_names,
    tied_embedding,
    tp_param_slices,
)
from refpar.memory import MemoryLedger
from refpar.model import init_params, param_shapes
from refpar.parallel.clipping import clip_for
from refpar.parallel.context_parallel import cp_layout, cp_positions
from refpar.parallel.data_parallel import DataParallel
from refpar.parallel.expert_parallel import ExpertParallelMoE
from refpar.parallel.expert_tensor_parallel import TensorParallelExpertMoE
from refpar.parallel.fsdp import FSDP
from refpar.parallel.model_states import Composition
from refpar.parallel.pieces import tp_layout
from refpar.parallel.pipeline.executor import PipelineExecutor
from refpar.parallel.pipeline.stage import Stage
from refpar.parallel.recompute import Recompute, SelectiveAttention
from refpar.parallel.routing_runs import routing_runs, token_runs
from refpar.parallel.sequence_parallel import sp_cp_layout, sp_layout
from refpar.parallel.tensor_parallel import shard_params_tp
from refpar.parallel.units import Units
from refpar.parallel.zero import Zero1, Zero2, Zero3
from refpar.schedules import stage_map
from refpar.schedules.builders import of_plan


@dataclass
class Parallel:
    """The model parallelized on one rank of `mesh`: what `train` runs."""

    model: ModelConfig
    train: TrainConfig
    mesh: object
    plan: Plan
    lay: object  # tensor_parallel.Layout: the pieces' (refpar/parallel/pieces.py)
    states: object  # model_states.ModelStates: DataParallel, Zero1, Zero2, Zero3 or FSDP
    executor: PipelineExecutor
    ledger: MemoryLedger
    samples: list[tuple[int, ...]]  # this rank's sample ids of each microbatch
    moe: object = None  # the MoE blocks' layer
    routings: dict = field(default_factory=dict)  # sample ids of a microbatch -> layer -> routing

    @property
    def data(self):
        """The ranks that see different tokens (their losses and routing add up): dp x cp, and ep too
        in a MoE model, of this stage and tp coordinate."""
        return self.mesh.axis("data" if self.model.moe_experts else "dp_cp")

    @property
    def tp_slices(self) -> dict:
        """Which slice of each global parameter this rank's tp shards are (holdings.tp_param_slices)."""
        return tp_param_slices(self.model, self.mesh.sizes["tp"], self.mesh.coords["tp"])

    @property
    def clip(self):
        """clipping.GlobalNormClip with --clip-grad-norm (else None), bound in the model states."""
        return self.states.clip

    @property
    def copies(self):
        """DualPipe: the mirror rank's group summing the two copies' gradients (else None)."""
        return self.states.copies


def differing_groups(model: ModelConfig, mesh, plan: Plan) -> list:
    """The groups whose ranks hold different gradients, where an fp16 overflow is agreed: tp shards,
    pipeline stages, and each unit's shard under ZeRO (else a MoE model's experts)."""
    replicas = mesh.axis("data" if model.moe_experts else "dp_cp")
    return [g for g in (mesh.tp, mesh.pp, replicas if plan.stage > 0 else mesh.ep) if g.size > 1]


def layout_for(model: ModelConfig, seq_len: int, mesh, sp: bool = False, cp_algo: str | None = None):
    """The tensor_parallel.Layout of this rank's tokens and weights on `mesh` (its tp and cp axes):
    the trivial one (pieces.tp_layout without a tp group) where nothing is split."""
    t, c = mesh.sizes["tp"], mesh.sizes["cp"]
    tp, cp = (mesh.tp if t > 1 else None), (mesh.cp if c > 1 else None)
    if cp is not None and sp:  # sp inside each cp rank's tokens
        return sp_cp_layout(model, seq_len, cp, cp_algo or "ring", mesh.tp)
    if cp is not None:  # each cp rank runs its zig-zag (ring) or contiguous (ulysses) tokens
        return cp_layout(model, seq_len, cp, cp_algo or "ring", tp)
    if sp:
        return sp_layout(model, seq_len, mesh.tp)
    return tp_layout(model, seq_len, tp)


def held_params(model: ModelConfig, mesh, names: set[str], seed: int, init_from: str | None = None) -> dict:
    """This rank's parameters: of the initialisation drawn whole, its stages' `names` (pp), its ep
    rank's experts (ep), its tp slices (tp), in the family's order, on the run's backend. With
    `init_from` (an HF folder or .safetensors file) the same slices are read from it, and nothing else."""
    ep, q = mesh.sizes["ep"], mesh.coords["ep"]
    if init_from is not None:
        from refpar.weights import read_params

        held = [n for n in param_shapes(model) if n in names and held_expert(model, n, ep, q)]
        slices = tp_param_slices(model, mesh.sizes["tp"], mesh.coords["tp"])
        return backend.current().from_host(read_params(init_from, model, held, slices))
    full = init_params(model, seed)
    kept = {n: full[n] for n in full if n in names and held_expert(model, n, ep, q)}
    return backend.current().from_host(shard_params_tp(kept, model, mesh.sizes["tp"], mesh.coords["tp"]))


def parallelize(model: ModelConfig, train: TrainConfig, mesh, plan: Plan) -> Parallel:
    """The model on this rank of `mesh` as `plan` says (module docstring), once `validate`
    (refpar/engine/validate.py) has passed them, as `refpar train` checks them before any message."""
    sizes, coords, m = mesh.sizes, mesh.coords, plan.microbatches
    ledger = MemoryLedger()
    # 1. layout
    lay = layout_for(model, train.seq_len, mesh, plan.sp, plan.cp_algo)
    # 2. MoE layer
    samples = [tuple(microbatch_samples(model, train.batch_size, m, sizes, coords, j)) for j in range(m)]
    moe, runs = None, {}
    if model.moe_experts:
        data, c = mesh.axis("data"), sizes["cp"]
        sequences = mesh.cp if c > 1 else None  # the sequence-wise loss sums its counts over them
        moe = (TensorParallelExpertMoE(data, mesh.ep, model, lay, plan.sp, weight=1 / m, cp=c,
                                       sequences=sequences)
               if sizes["tp"] > 1 else ExpertParallelMoE(data, mesh.ep, model, weight=1 / m, cp=c,
                                                         sequences=sequences))
        held = [cp_positions(train.seq_len, c, r, plan.cp_algo) for r in range(c)]  # (Ta,) each
        n_data = sizes["dp"] * sizes["ep"]
        for j in range(m):  # every member's token runs, for the routing's global order
            rows = [microbatch_samples(model, train.batch_size, m, sizes, {"dp": d // sizes["ep"],
                                                                           "ep": d % sizes["ep"]}, j)
                    for d in range(n_data)]
            every = [token_runs(rows[g // c], held[g % c], train.seq_len) for g in range(data.size)]
            runs[samples[j]] = routing_runs(every, data.rank)
    # 3. pipeline
    schedule = of_plan(plan, sizes["pp"])
    pipe = stage_map(schedule)
    stages = pipe.stages_of(coords["pp"])
    # 4. parameters
    params = held_params(model, mesh, {n for s in stages for n in stage_names(model, pipe, s)}, train.seed,
                         train.init_from)
    # 5. data parallelism over each unit's replica group
    dense = mesh.axis("data") if model.moe_experts else mesh.axis("dp_cp")
    held = {s: [n for n in stage_names(model, pipe, s) if n in params] for s in stages}
    units = Units(held, {n: p.shape for n, p in params.items()},
                  lambda expert: mesh.axis("dp_cp") if expert else dense,
                  {s: len(pipe.microbatches(s)) for s in stages}, tied_embedding(model))
    # the partial sums between pipeline ranks: the tied wte's two ends where two ranks hold them,
    # DualPipe's two copies of every part; the sequence-sharded region's over tp
    copies = mesh.axis("mirror") if pipe.copies == 2 else None
    sp_names = [n for n in sequence_parallel_param_names(model) if n in params] if plan.sp else []
    composition = Composition(
        embedding=mesh.axis("embedding") if pipe.tied_apart and tied_embedding(model) else None,
        tp=mesh.tp, sp_names=sp_names, copies=copies, differ=differing_groups(model, mesh, plan),
        clip=clip_for(model, train, mesh, plan, stages, dense, copies), moe=moe)
    # 6. optimizer state: created by the strategy, which knows what it keeps
    lowp = keeps_lowp(model, mesh.sizes)
    if plan.fsdp:
        states = FSDP(units, model, train, ledger, params, composition, plan.prefetch,
                      plan.reshard_after_forward, both_ends=pipe.n_stages == 1, lowp=lowp)
    elif plan.zero:
        states = (Zero1, Zero2, Zero3)[plan.zero - 1](units, model, train, ledger, params, composition, lowp)
    else:
        states = DataParallel(units, model, train, ledger, params, composition, plan.bucket_elems,
                              plan.overlap, lowp)
    routings: dict = {}
    # recomputation: what a block keeps and reruns (refpar/parallel/recompute.py)
    recompute = (None if plan.recompute == "none" else
                 Recompute(plan.recompute, ledger, states.buffers(), mesh.world.tracer))
    if recompute is not None and recompute.mode == "selective":
        lay = replace(lay, attention=SelectiveAttention(lay.attention, recompute))

    def make_stage(s: int, pipe) -> Stage:
        return Stage(model, pipe.stages_per_copy, pipe.part(s), units.of_stage[s], states, lay, moe, runs,
                     routings, mesh.axis("kv"), recompute)

    tokens = len(lay.resid_pos)
    like = next(iter(params.values()))
    executor = PipelineExecutor(schedule, model, mesh.pp, make_stage, tokens, like, states.buffers(), ledger)
    return Parallel(model, train, mesh, plan, lay, states, executor, ledger, samples, moe, routings)

