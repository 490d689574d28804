"""Megatron sequence parallelism on the `tp` axis (Korthikanti et al. 2022 §4.2.2).

    mpiexec -n 2 python -m refpar train --mesh tp=2 --sp --check

Legend: B batch, T sequence, C channels, t tp size, Tl = the tokens shard_range(T, t, rank).

Under plain TP the LayerNorms and dropouts between the regions run on the whole (B, T, C) on every
rank. Sequence parallelism shards them along the sequence instead, and replaces the conjugate pair:

    f = gather_from_sp          all-gather forward      | reduce-scatter backward
    g = reduce_scatter_to_sp    reduce-scatter forward  | all-gather backward

An all-reduce is a reduce-scatter followed by an all-gather, so the four pairs per block move the
bytes of TP's four all-reduces. As in Megatron-LM, the column-parallel linear keeps only its
sequence shard for backward and gathers it again there (tag ":regather"): two more all-gathers per
block, which is what lets Korthikanti's eq. 4 divide every activation by t.

Parameters applied in the sharded region (LayerNorms, the row-parallel biases, wpe) see only this
rank's tokens, so their gradients are summed over tp once per step.

With context parallelism (`sp_cp_layout`) the same pair runs on each cp rank's tokens: the
all-gather and reduce-scatter span the Ta tokens of this cp rank, not the whole sequence.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
from array_api_compat import array_namespace

from refpar.config import ConfigError, ModelConfig
from refpar.parallel.context_parallel import cp_layout, cp_positions
from refpar.parallel.pieces import tp_layout
from refpar.parallel.tensor_parallel import Layout, RegionPair, check_tp
from refpar.sharding import shard_range, shard_sizes


def _all_gather_seq(x, tp, tag, seq_len):
    """(B, Tl, C) -> (B, T, C). Collectives work on axis 0, so the sequence goes first."""
    xp = array_namespace(x)
    seq_first = xp.permute_dims(x, (1, 0, 2))  # (Tl, B, C)
    return xp.permute_dims(tp.all_gather(seq_first, tag=tag, counts=shard_sizes(seq_len, tp.size)), (1, 0, 2))


def _reduce_scatter_seq(x, tp, tag):
    """(B, T, C) -> (B, Tl, C), summed over tp; rank r keeps positions shard_range(T, t, r)."""
    xp = array_namespace(x)
    return xp.permute_dims(tp.reduce_scatter(xp.permute_dims(x, (1, 0, 2)), tag=tag), (1, 0, 2))


def gather_from_sp(x, tp, tag, seq_len):
    """f forward: the region needs the whole sequence."""
    return _all_gather_seq(x, tp, tag, seq_len)


def gather_from_sp_backward(dx, tp, tag, seq_len):
    """f backward: each rank's partial gradient of the whole sequence, summed and split back."""
    return _reduce_scatter_seq(dx, tp, tag)


def reduce_scatter_to_sp(x, tp, tag, seq_len):
    """g forward: sum the partial outputs and keep this rank's part of the sequence."""
    return _reduce_scatter_seq(x, tp, tag)


def reduce_scatter_to_sp_backward(dx, tp, tag, seq_len):
    """g backward: the region's output gradient is needed over the whole sequence."""
    return _all_gather_seq(dx, tp, tag, seq_len)


def sp_pair(seq_len: int) -> RegionPair:
    """The pair for sequences of seq_len tokens (the all-gathers are told every rank's length)."""
    return RegionPair(*(partial(fn, seq_len=seq_len) for fn in (
        gather_from_sp, gather_from_sp_backward, reduce_scatter_to_sp, reduce_scatter_to_sp_backward)))


def check_sp(config: ModelConfig, seq_len: int, tp: int) -> None:
    check_tp(config, tp)
    if tp < 2:
        raise ConfigError("--sp shards along the sequence over tp ranks; give the mesh tp=2 or more")
    if seq_len < tp:
        raise ConfigError(f"seq_len={seq_len} is shorter than tp={tp}; use --seq-len {tp} or more")


def sp_layout(config: ModelConfig, seq_len: int, tp_comm) -> Layout:
    """Regions see the whole sequence; the residual stream holds shard_range(T, t, rank)."""
    check_sp(config, seq_len, tp_comm.size)
    return replace(tp_layout(config, seq_len, tp_comm), pair=sp_pair(seq_len),
                   resid_pos=np.arange(*shard_range(seq_len, tp_comm.size, tp_comm.rank)))


def check_sp_cp(config: ModelConfig, seq_len: int, tp: int, cp: int, algo: str) -> None:
    """Every cp rank's tokens must split over the tp ranks."""
    check_sp(config, seq_len, tp)

    def fewest(T):
        return min(len(cp_positions(T, cp, r, algo)) for r in range(cp))

    if fewest(seq_len) < tp:
        need = next(T for T in range(seq_len, seq_len + 2 * cp * tp + 1) if fewest(T) >= tp)
        raise ConfigError(f"a cp rank holds {fewest(seq_len)} of the {seq_len} tokens, fewer than tp={tp} "
                          f"to shard them over with --sp; use --seq-len {need} or more")


def sp_cp_layout(config: ModelConfig, seq_len: int, cp_comm, algo: str, tp_comm) -> Layout:
    """sp inside cp, as Megatron-LM combines them: cp gives this rank its tokens (zig-zag under ring
    attention, contiguous under Ulysses) and attention over the whole sequence; inside those Ta
    tokens the regions see all of them and the residual stream only shard_range(Ta, t, rank)."""
    check_sp_cp(config, seq_len, tp_comm.size, cp_comm.size, algo)
    lay = cp_layout(config, seq_len, cp_comm, algo, tp_comm)
    Ta, t, r = len(lay.region_pos), tp_comm.size, tp_comm.rank
    return replace(lay, pair=sp_pair(Ta), resid_pos=lay.region_pos[slice(*shard_range(Ta, t, r))])


