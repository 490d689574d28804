"""torch.distributed.pipelining schedules against refpar's, on pp = world.

Each torch schedule runs next to the refpar schedule that splits the model into the same stages
(stage s holds blocks shard_range(L, S, s); the embeddings on stage 0, ln_f and the tied head on
stage S-1). Loop placement (stage = chunk * p + rank) is shared by GPipe, 1F1B, Interleaved1F1B,
LoopedBFS and InterleavedZeroBubble; ZBVZeroBubble and DualPipeV place stages in a V (rank r
holds r and 2p-1-r), which no refpar schedule does, so they are compared by parameter name with
refpar's interleaved 1F1B of 2 chunks: the numbers of a schedule do not depend on where a stage
runs, only on the order of the microbatch sums (float64 rounding).

Conventions: refpar normalises every token by the global count B*T and sums the microbatches;
torch's schedules divide the gradients by the number of microbatches after backward
(`scale_grads=True`) to pair with a per-microbatch mean loss. Both give the global mean when the
microbatches are equal; here the torch side takes refpar's ("global": loss_fn = token sum / (B*T),
scale_grads=False), and "mean" takes torch's default.

The tied wte sits on the first and the last stage; as in Megatron (and refpar's model states)
its two gradients are summed after the backward, so both copies take the same update.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipe
from torch import nn

from refpar.config import ModelConfig, Plan, TrainConfig
from refpar.conformance.cases import adamw, held_grads, run_steps
from refpar.conformance.compare import step_row, worst
from refpar.conformance.torch_model import Block, to_gpt2_layout, to_torch_layout
from refpar.model.gpt import init_params
from refpar.schedules.builders import build
from refpar.sharding import shard_range
from refpar.trainer import corpus_for

# torch schedule -> (refpar schedule for its numbers, chunks per rank, placement, refpar schedule
# whose per-rank action order is the same idea, or None)
SCHEDULES = {
    "GPipe": ("gpipe", 1, "loop", "gpipe"),
    "1F1B": ("1f1b", 1, "loop", "1f1b"),
    "Interleaved1F1B": ("interleaved-1f1b", 2, "loop", "interleaved-1f1b"),
    "LoopedBFS": ("interleaved-1f1b", 2, "loop", None),
    "InterleavedZeroBubble": ("interleaved-1f1b", 2, "loop", None),
    "ZBVZeroBubble": ("interleaved-1f1b", 2, "v", None),
    "DualPipeV": ("interleaved-1f1b", 2, "v", None),
}


class StageModule(nn.Module):
    """Blocks `layers` of GPT-2, with the embeddings if first and ln_f and the tied head if last."""

    def __init__(self, config, layers: range, first: bool, last: bool):
        super().__init__()
        C, eps = config.n_embd, config.layer_norm_eps
        self.first, self.last = first, last
        if first or last:
            self.wte = nn.Embedding(config.vocab_size, C)
        if first:
            self.wpe = nn.Embedding(config.n_positions, C)
        self.h = nn.ModuleDict({str(i): Block(C, config.head_size, eps) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(C, eps=eps)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))  # (B, T, C)
        for block in self.h.values():
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t() if self.last else x  # (B, T, V) or (B, T, C)


def stage_indices(placement: str, p: int, v: int, rank: int) -> list[int]:
    if placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [chunk * p + rank for chunk in range(v)]


def torch_order(schedule) -> dict[int, list[str]]:
    """Per rank, the computation actions of a torch schedule as refpar writes them ("1F0"); a
    backward-input action (I) is refpar's B, a full backward (B) too."""
    out = {}
    for rank, actions in schedule.pipeline_order.items():
        row = []
        for a in actions:
            # DualPipeV's overlapped forward+backward is one action holding both as sub-actions
            for sub in () if a is None else (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    row.append(f"{sub.stage_index}{'B' if kind == 'I' else kind}{sub.microbatch_index}")
        out[rank] = row
    return out


def refpar_order(kind: str, p: int, m: int, v: int) -> dict[int, list[str]]:
    return {r: [str(a) for a in row if a is not None] for r, row in build(kind, p, m, v).items()}


def pipelining(comm, name: str, dtype: str = "float64", convention: str = "global",
               microbatches: int = 4) -> tuple[list[dict], dict]:
    """Runs torch schedule `name` and its refpar counterpart on a batch of 2 sequences per
    microbatch; rows are computed on rank 0 from every rank's tensors (other ranks return zero
    rows). Also returns the action orders of both.

    Equal microbatches, because a torch PipelineStage infers its receive buffers from the first
    microbatch: with 5 sequences in 4 microbatches (2, 1, 1, 1) the job was seen to hang in gloo."""
    kind, v, placement, same_idea = SCHEDULES[name]
    p, r, m = comm.size, comm.rank, microbatches
    S = p * v
    model = ModelConfig(n_layer=S, dropout=0.0, dtype=dtype)
    train = TrainConfig(steps=3, batch_size=2 * m, seq_len=8)
    B, T = train.batch_size, train.seq_len
    full = init_params(model, train.seed)

    tdtype = getattr(torch, dtype)
    modules, stages = [], []
    for s in stage_indices(placement, p, v, r):
        mod = StageModule(model, range(*shard_range(model.n_layer, S, s)), s == 0, s == S - 1).to(tdtype)
        with torch.no_grad():
            for n, w in mod.named_parameters():
                w.copy_(torch.from_numpy(np.ascontiguousarray(to_torch_layout(n, full[n]))))
        modules.append(mod)
        stages.append(pipe.PipelineStage(mod, s, S, torch.device("cpu")))

    def loss_fn(logits, targets):
        ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         reduction="sum")
        return ce / (B * T) if convention == "global" else ce / targets.numel()

    cls = getattr(pipe, f"Schedule{name}")
    scale = convention == "mean"
    sched = (cls(stages[0], m, loss_fn=loss_fn, scale_grads=scale) if v == 1
             else cls(stages, m, loss_fn=loss_fn, scale_grads=scale))
    opt = adamw(nn.ModuleList(modules), train)
    corpus = corpus_for(model, train)

    def each(par, step, loss):
        grads, ours = held_grads(par), par.states.full_params()
        tokens, targets = corpus.batch(step, range(B), T)
        opt.zero_grad()
        losses = []
        has_first = any(st.is_first for st in stages)
        has_last = any(st.is_last for st in stages)
        kwargs = {"target": torch.from_numpy(targets), "losses": losses} if has_last else {}
        sched.step(*([torch.from_numpy(tokens)] if has_first else []), **kwargs)
        tied = [mod.wte.weight for mod in modules if hasattr(mod, "wte")]
        total = torch.zeros(model.vocab_size, model.n_embd, dtype=tdtype)
        for w in tied:
            total += w.grad
        dist.all_reduce(total)  # the tied embedding's two gradients, summed (see module doc)
        for w in tied:
            w.grad.copy_(total)
        opt.step()
        here = float(sum(x.detach() for x in losses)) if has_last else 0.0
        torch_loss = torch.tensor([here], dtype=torch.float64)
        dist.all_reduce(torch_loss)
        if convention == "mean":
            torch_loss /= m

        mine_g = {n: to_gpt2_layout(n, w.grad.numpy()) for mod in modules for n, w in mod.named_parameters()}
        mine_p = {n: to_gpt2_layout(n, w.detach().numpy()) for mod in modules
                  for n, w in mod.named_parameters()}
        every = comm.gather_object((mine_g, mine_p, grads, ours))
        if r != 0:
            return step_row(1.0, 1.0, (0.0, ""), (0.0, ""))
        merged = [{k: v for part in every for k, v in part[i].items()} for i in range(4)]
        return step_row(loss, float(torch_loss[0]), worst(merged[0], merged[2]), worst(merged[1], merged[3]))

    rows = run_steps(model, train, comm, {"pp": p, "dp": 1, "ep": 1, "cp": 1, "tp": 1},
                     Plan(schedule=kind, microbatches=m, chunks=v), each)
    orders = {"torch": torch_order(sched), "refpar": refpar_order(same_idea, p, m, v) if same_idea else None}
    return rows, orders
