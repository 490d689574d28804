"""What multi-head latent attention moves over tp and cp (refpar/parallel/mla_tensor_parallel.py,
context_parallel.py): the calls of a DeepSeek-V3 stage's blocks, which closed_forms.rank_calls adds up
per axis and op.

    mpiexec -n 2 python -m refpar train --model deepseek-tiny --mesh tp=2 --sp --check

Legend: B this rank's rows, Ta the region's tokens, t tp size, C channels, rq q_lora_rank (C
without a query latent: q_proj enters the norm's output), rkv kv_lora_rank, dr qk_rope_head_dim.

A DeepSeek-V3 block's MLP moves what Llama's does (intra_layer._tp_calls' "h.i.mlp." calls) and
its attention leaves through o_proj's g as Llama's does, but enters the tensor-parallel region at
its latents, not at the hidden state. Per block, in place of the attention's one (B, Ta, C) entry:

    plain tp   backward: three all-reduces, of (B, Ta, rq), (B, Ta, rkv) and (B, Ta, dr)
    sp         forward: three all-gathers of those widths; backward: their reduce-scatters and the
               up-projections' two regathers, of (B, Ta, rq) and (B, Ta, rkv)

The down-projections and their norms run on the sequence shard under sp, so their gradients join
the sequence-parallel region's one all-reduce per step (holdings.sequence_parallel_param_names,
which closed_forms.data_parallel_bytes reads).

Under cp the block's keys and values travel as GPT-2's do (intra_layer's _ring_calls and
_ulysses_calls) at their own widths (`mla_cp_widths`): k dn + dr and v dv per head.
"""

from __future__ import annotations

from refpar.analysis.intra_layer import Call, RankShape
from refpar.comm import cost
from refpar.config import ModelConfig
from refpar.sharding import shard_sizes


def mla_entries(model: ModelConfig) -> list[tuple[str, int]]:
    """(tag, width) of what enters a block's attention region, in the order its forward enters them."""
    q = ("q_proj", model.n_embd) if model.q_lora_rank is None else ("q_b_proj", model.q_lora_rank)
    return [q, ("kv_b_proj", model.kv_lora_rank), ("k_rope", model.qk_rope_head_dim)]


def mla_tp_calls(model: ModelConfig, calls: list[Call], s: RankShape, sp: bool, tp_rank: int) -> list[Call]:
    """`calls` (intra_layer._tp_calls of the stage's blocks, GPT-2's tags) with each block's attention
    entry (its "attn.c_attn" calls) replaced by latent attention's entries, in place."""
    t, e = s.t, s.e

    def ar(tag, width):
        b = cost.all_reduce_bytes(s.B * s.Ta * width, t, tp_rank, e)
        return Call("tp", "all_reduce", tag, b.sent, b.recv)

    def ag(tag, width):
        b = cost.all_gather_bytes(shard_sizes(s.Ta, t), tp_rank, e, s.B * width)
        return Call("tp", "all_gather", tag, b.sent, b.recv)

    def rs(tag, width):
        b = cost.reduce_scatter_bytes(s.Ta, t, tp_rank, e, s.B * width)
        return Call("tp", "reduce_scatter", tag, b.sent, b.recv)

    entries = mla_entries(model)
    out = []  # GPT-2's entry ("c_attn": fwd under sp, regather, bwd) leaves; MLA's come in its place
    for call in calls:
        block, _, rest = call.tag.partition(".attn.c_attn:")
        if not rest:
            out.append(call)
        elif rest == "fwd":  # sp: the latents gathered
            out += [ag(f"{block}.attn.{name}:fwd", w) for name, w in entries]
        elif rest == "bwd" and not sp:  # f's backward, once per latent
            out += [ar(f"{block}.attn.{name}:bwd", w) for name, w in reversed(entries)]
        elif rest == "bwd":  # the reduce-scatters, and the up-projections' regathers before theirs
            k_rope, kv_b, q = reversed(entries)
            out += [rs(f"{block}.attn.k_rope:bwd", k_rope[1])]
            out += [c for name, w in (kv_b, q) for c in (ag(f"{block}.attn.{name}:regather", w),
                                                       rs(f"{block}.attn.{name}:bwd", w))]
    return out


def mla_cp_widths(model: ModelConfig, s: RankShape, ring: bool) -> tuple:
    """What context parallelism moves per row and token of a DeepSeek-V3 block, as the argument
    intra_layer's _ring_calls or _ulysses_calls takes (empty for the other families): the ring's
    K/V block, this tp rank's heads of k (dn + dr) and v (dv) side by side; Ulysses' q, k and v
    widths (the output's v's). Every head carries its copy of the shared RoPE key."""
    dq, dv = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    return (s.nh * (dq + dv),) if ring else ((dq, dq, dv),)
