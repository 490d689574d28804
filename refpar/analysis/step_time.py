"""Communication bytes per rank by axis, alpha-beta times, pipeline time, step time and MFU.

Legend as in refpar/analysis/scale.py: t tensor, p pipeline, d data, c context, e expert
parallel sizes; b micro-batch size, s sequence, m micro-batches per step, v chunks per stage.

Ranks are laid out as refpar's DeviceMesh lays them (pp slowest, then dp, ep, cp, tp fastest,
as Megatron does), so an axis's group lies inside one node when its stride times its size is at
most the node's GPU count, and then runs over NVLink; otherwise over InfiniBand. A collective gets
`Efficiency.network` of its link's bandwidth (fitted: refpar/analysis/calibration.py).

A block's compute is efficiency.block_seconds; this module adds its communication, says which of
it is exposed (`Software`: what overlaps what), and composes the step: the heaviest pipeline
stage's micro-batches, the bubble, the transfers, the data-parallel reduction and the optimizer.

Collective costs: refpar.comm.cost's alpha-beta times (Thakur, Rabenseifner and Gropp 2005) for
the ring (pairwise for all-to-all) with the link's bandwidth and per-step latency, plus NCCL's
per-call latency; an all-reduce may take a double binary tree instead. Bytes per rank, S the full
buffer, n ranks: ring all-reduce 2 (n-1)/n S, all-gather and reduce-scatter (n-1)/n S, all-to-all
(n-1)/n S (the even-split forms of cost.py's exact per-rank counts). An all-reduce takes
whichever of ring and tree is faster. Every size argument may be a NumPy array (see scale.py).
"""

from __future__ import annotations

import numpy as np

from refpar.analysis.efficiency import (
    CALIBRATED,
    MODERN,
    Software,
    block_seconds,
    head_seconds,
    memory_seconds,
)
from refpar.analysis.flops import layer_params, model_flops
from refpar.analysis.hardware import Hardware
from refpar.analysis.presets import ModelSpec
from refpar.analysis.scale import PRECISIONS, Precision, middle_stage_params, stage_layers, stage_params
from refpar.comm import cost

AXES = ("pp", "dp", "ep", "cp", "tp")  # slowest- to fastest-varying (refpar.config.MESH_AXES)


def members_per_node(hw: Hardware, sizes: dict, group: tuple):
    """How many ranks of one group (the axes `group`, the others fixed) one node holds, under the
    mesh's layout: a node's gpus_per_node consecutive ranks cover the fastest axes first."""
    left, members = hw.gpus_per_node, 1
    for name in reversed(AXES):  # fastest first
        size = np.asarray(sizes.get(name, 1))
        covered = np.minimum(size, left)
        if name in group:
            members = members * covered
        left = np.maximum(1, left // size)
    return members


def link(hw: Hardware, sizes: dict, axis: str, group: tuple = ()):
    """(bandwidth, step latency) of a group: NVLink inside a node; across nodes, the adapters of
    the group's members in each node together.

    The group is the axis `axis`, or the axes `group` together (a data-parallel group spanning dp,
    ep and cp). A group with g members in each of its nodes runs as NCCL runs it on DGX nodes: g
    rings (channels), each leaving the node through a different member's adapter (NCCL binds a
    channel to the NIC nearest its GPU), so each adapter carries a g-th of a rank's traffic and
    NVLink the (g - 1)/g that stays inside: per-rank bandwidth min(g x adapter, g/(g - 1) x NVLink).
    With one member per node (tensor parallelism filling the node) that is one adapter.
    """
    group = group or (axis,)
    g = members_per_node(hw, sizes, group)
    n = 1
    for name in group:
        n = n * np.asarray(sizes.get(name, 1))
    inside = g >= n
    across = np.minimum(g * hw.ib_bandwidth, hw.nvlink_bandwidth * g / np.maximum(g - 1, 1))
    across = np.where(g > 1, across, hw.ib_bandwidth)
    return (np.where(inside, hw.nvlink_bandwidth, across),
            np.where(inside, hw.nvlink_latency, hw.ib_latency))


def collective_bytes(op: str, size, n):
    """Bytes one rank sends in a bandwidth-optimal `op` of a `size`-byte buffer over n ranks."""
    n = np.asarray(n)
    if op == "all_reduce":
        return 2 * (n - 1) / n * size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * size
    if op == "send":
        return size * np.ones_like(n)
    raise ValueError(f"unknown collective {op!r}")


def collective_time(op: str, size, n, bandwidth, latency, call_latency):
    """Alpha-beta time of one collective; all-reduce picks the faster of ring and tree."""
    return collective_choice(op, size, n, bandwidth, latency, call_latency)[0]


def _ring_time(op: str, size, n, bandwidth, latency):
    """refpar.comm.cost.alpha_beta_time for every entry. Its times are affine in the bytes, so it
    is called twice per distinct (link, ranks) and the line is applied to every message size:
    a search has tens of thousands of candidates but only a few groups and links."""
    size, n, bw, lat = np.broadcast_arrays(*(np.asarray(x, float) for x in (size, n, bandwidth, latency)))
    if size.size == 1:  # one plan: no line to share
        return np.asarray(cost.alpha_beta_time(op, "native", float(size.flat[0]), int(n.flat[0]),
                                               alpha=float(lat.flat[0]), bandwidth=float(bw.flat[0])),
                          float).reshape(size.shape)
    big = 1e12  # bytes: far enough from zero that the slope keeps its digits
    # One integer code per distinct (bandwidth, latency, ranks), each column coded on its own.
    columns = [np.unique(x.ravel(), return_inverse=True) for x in (bw, lat, n)]
    code = np.zeros(size.size, dtype=np.int64)
    for values, index in columns:
        code = code * len(values) + index
    codes, inverse = np.unique(code, return_inverse=True)
    t0, slope = np.empty(len(codes)), np.empty(len(codes))
    where = np.zeros(len(codes), dtype=np.int64)
    where[inverse] = np.arange(size.size)  # one entry of each code
    for j, i in enumerate(where):
        b, a, p = bw.flat[i], lat.flat[i], n.flat[i]
        t0[j] = cost.alpha_beta_time(op, "native", 0, int(p), alpha=a, bandwidth=b)
        slope[j] = (cost.alpha_beta_time(op, "native", big, int(p), alpha=a, bandwidth=b) - t0[j]) / big
    inverse = inverse.reshape(size.shape)
    return t0[inverse] + slope[inverse] * size


def collective_choice(op: str, size, n, bandwidth, latency, call_latency):
    """(seconds, algorithm) of one collective: the ring (pairwise for all-to-all) as
    refpar.comm.cost prices it, plus NCCL's per-call latency; an all-reduce takes NCCL's double
    binary tree (2 log2(n) latency steps, 2 S bytes: Sanders, Speck and Traeff 2009) where that is
    faster, and names it "tree"."""
    n = np.asarray(n)
    if op == "send":
        return call_latency + _ring_time("send", size, np.full(np.shape(n), 2), bandwidth, latency), "p2p"
    ring = call_latency + _ring_time(op, size, n, bandwidth, latency)
    if op != "all_reduce":
        return np.where(n > 1, ring, 0.0), "pairwise" if op == "all_to_all" else "ring"
    tree = call_latency + 2 * np.log2(np.maximum(n, 2)) * latency + 2 * size / bandwidth
    return np.where(n > 1, np.minimum(ring, tree), 0.0), np.where(tree < ring, "tree", "ring")


def stage_replicated(spec: ModelSpec) -> float:
    """Weights a block keeps whole on every tensor-parallel rank (norms, row-parallel biases,
    router), averaged over its dense and MoE blocks."""
    dense, moe = layer_params(spec, False), layer_params(spec, True)
    n_moe = spec.n_moe_layers
    return ((spec.n_layer - n_moe) * dense.replicated + n_moe * moe.replicated) / spec.n_layer


def pipeline_time(schedule: str, pp, m, F, B, W, p2p=0.0, chunks=1, overlap=False):
    """(work, bubble, exposed p2p) of one step on the busiest stage, in seconds.

    F, B, W: one micro-batch's forward, input-gradient and weight-gradient time on a whole stage
    (a chunk of an interleaved stage takes a v-th of each); p2p: one activation transfer.
    With p2p = 0 these are the makespans `simulate.simulate` gives for the builders' schedules:
    GPipe and 1F1B idle (p-1)(F+B+W) (Narayanan et al. 2021, eq. 1), interleaving divides that by
    v (Section 2.2.2), ZB-H1 idles (p-1)(F+B-W) (Qi et al. 2023, Section 3; the simulator's
    max(F, W) + B - W where W > F), ZB-H2 (p-1)(F+B-2W) in steady state but at least the (p-1) F
    it takes the first forward to reach the last stage (m >= 2p - 1). Transfers are priced as
    blocking, every micro-batch and chunk, both ways: an upper bound on the simulator's. With
    `overlap` (Megatron-Core's overlap_p2p_comm) a transfer runs behind the next chunk's compute,
    and only the 2 (p - 1) of the fill and the drain, where no compute waits to cover them, are.
    """
    if schedule == "interleaved-1f1b":
        bubble = (pp - 1) / chunks * (F + B + W)
    elif schedule == "zb-h1":
        bubble = (pp - 1) * (np.maximum(F, W) + B - W)
    elif schedule == "zb-h2":
        bubble = (pp - 1) * np.maximum(F, F + B - 2 * W)
    else:
        bubble = (pp - 1) * (F + B + W)
    exposed = 2 * (pp - 1) if overlap else 2 * (m * chunks + pp - 1)
    comm = np.where(pp > 1, exposed * p2p, 0.0)
    return m * (F + B + W), bubble, comm


def step_time(spec: ModelSpec, hw: Hardware, *, global_batch, micro_batch, seq, tp=1, pp=1, dp=1,
              cp=1, ep=1, zero=0, schedule="1f1b", chunks=1, recompute="none", sp=None,
              precision: Precision = PRECISIONS["bf16"], dtype="bfloat16", eff=CALIBRATED,
              software: Software = MODERN):
    """Predicted time of one optimizer step, split by cause, with bytes per rank per axis.

    The compute of a block is efficiency.block_seconds (GEMMs by shape, the attention core,
    memory-bound kernels) at the calibrated `eff`; collectives are alpha-beta times at
    eff.network of their link; `software` says what overlaps what. The step is the pipeline's
    (simulate.simulate's makespan, in closed form) on its heaviest stage, plus what the data
    parallel reduction and the optimizer add. refpar/analysis/calibration.py holds the whole model
    against published measured runs.

    Returns (times, bytes, calls): times has compute, bubble, tp, cp, ep, pp, dp, optimizer and
    total in seconds (communication entries are the exposed part), and under "stage" one
    micro-batch's F, B (input gradient), W (weight gradient) and p2p times on the heaviest stage;
    bytes is sent per rank per step by axis (the first stage's); calls names each collective
    ("tp.all_reduce", "dp.experts.reduce_scatter", ...) with (axis, op, message bytes, ranks,
    calls per step, seconds per call, algorithm).
    """
    tp, pp, dp, cp, ep, zero = (np.asarray(x) for x in (tp, pp, dp, cp, ep, zero))
    sp = tp > 1 if sp is None else np.asarray(sp)
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    m = global_batch / (dp * ep * micro_batch)
    e, h = precision.activation, spec.d_model
    cl = hw.call_latency

    def on_link(axis, group=None):  # (bandwidth NCCL reaches, step latency) of an axis's group
        bw, lat = link(hw, {**sizes, **(group or {})}, axis, tuple(group or ()))
        return bw * eff.network, lat

    # One block's compute per micro-batch, dense and MoE (efficiency.py).
    block_kw = dict(micro_batch=micro_batch, seq=seq, tp=tp, cp=cp, ep=ep, sp=sp, precision=precision,
                    dtype=dtype, eff=eff, software=software)
    blocks = {moe: block_seconds(spec, hw, moe=moe, **block_kw) for moe in (False, True)
              if moe in (False, spec.is_moe)}
    blocks.setdefault(True, blocks[False])  # a dense model has no MoE block to price

    # Tensor parallelism (Narayanan et al. 2021, Section 3.2), per micro-batch: per block two
    # all-reduces of the (b, s/c, h) activation forward (g) and two backward (f), two more when
    # full recomputation reruns the forward; the vocab-parallel embedding's all-reduce forward;
    # with the head, its input's all-reduce backward and the cross-entropy's three all-reduces of
    # (b, s/c) fp32 statistics (max, sum of exponentials, target logit). Sequence parallelism
    # (Korthikanti et al. 2022, Section 4.2.2) turns each all-reduce into a reduce-scatter and an
    # all-gather, and, as Megatron-LM does, re-gathers in backward the input each column-parallel
    # linear kept sharded (two per block, one for the head); once per step it all-reduces the
    # gradients of the weights applied to the sharded sequence (norms, row-parallel biases,
    # positions). refpar's tensor parallelism makes the same calls (analysis/intra_layer.py).
    # Bytes are the first stage's, with the head's terms where it is also the last.
    n_tok = micro_batch * seq / cp
    act = e * n_tok * h
    layers_per_stage = spec.n_layer / pp
    head_here = pp == 1
    bw, lat = on_link("tp")
    t_ar, tp_algo = collective_choice("all_reduce", act, tp, bw, lat, cl)
    t_ag = collective_time("all_gather", act, tp, bw, lat, cl)
    t_rs = collective_time("reduce_scatter", act, tp, bw, lat, cl)
    stats = max(e, 4) * n_tok
    t_stats, stats_algo = collective_choice("all_reduce", stats, tp, bw, lat, cl)
    redo = {"full": 2, "selective-op": 1}.get(recompute, 0)  # forward collectives run again per block
    # Calls per micro-batch, forward and backward: (all-reduces, all-gathers, reduce-scatters).
    ar_f = np.where(sp, 0, 2 * layers_per_stage + 1)
    ar_b = np.where(sp, 0, (2 + redo) * layers_per_stage + head_here)
    ag_f = np.where(sp, 2 * layers_per_stage + head_here, 0)
    rs_f = np.where(sp, 2 * layers_per_stage + 1, 0)
    ag_b = np.where(sp, (4 + redo) * layers_per_stage + 1 + head_here, 0)
    rs_b = np.where(sp, (2 + redo) * layers_per_stage + head_here, 0)
    n_stats = np.where(head_here, 3, 0)
    sp_grads = np.where(sp & (tp > 1), precision.grad * (layers_per_stage * stage_replicated(spec)
                        + (spec.seq_len * h if spec.learned_positions else 0)
                        + np.where(head_here, 2 * h if spec.norm == "layernorm" else h, 0)), 0)
    t_sp_grads, sp_algo = collective_choice("all_reduce", sp_grads, tp, bw, lat, cl)
    tp_bytes = (m * ((ar_f + ar_b) * collective_bytes("all_reduce", act, tp)
                     + (ag_f + ag_b + rs_f + rs_b) * collective_bytes("all_gather", act, tp)
                     + n_stats * collective_bytes("all_reduce", stats, tp))
                + collective_bytes("all_reduce", sp_grads, tp))
    calls = {
        "tp.all_reduce": ("tp", "all_reduce", act, tp, m * (ar_f + ar_b), t_ar, tp_algo),
        "tp.all_gather": ("tp", "all_gather", act, tp, m * (ag_f + ag_b), t_ag, "ring"),
        "tp.reduce_scatter": ("tp", "reduce_scatter", act, tp, m * (rs_f + rs_b), t_rs, "ring"),
        "tp.cross_entropy": ("tp", "all_reduce", stats, tp, m * n_stats, t_stats, stats_algo),
        "tp.sp_grads": ("tp", "all_reduce", sp_grads, tp, np.where(sp_grads > 0, 1, 0), t_sp_grads,
                        sp_algo),
    }
    # The same calls timed per block: forward, the backward's own, and the recomputed forward's.
    tp_block_f = np.where(sp, 2 * (t_ag + t_rs), 2 * t_ar)
    tp_block_b = np.where(sp, 4 * t_ag + 2 * t_rs, 2 * t_ar)
    tp_head_f = np.where(sp, t_ag, 0) + 3 * t_stats
    tp_head_b = np.where(sp, 2 * t_ag + t_rs, t_ar)
    tp_embed_f = np.where(sp, t_rs, t_ar)

    # Context parallelism. Ring attention (Liu et al. 2023; refpar's): K and V pass around the
    # ring, c - 1 hops forward; backward passes them c - 1 hops again and their gradients c hops,
    # home (analysis/intra_layer.py), behind the attention core. All-gather (Llama 3): K and V of
    # the whole sequence gathered before the core, their gradients reduce-scattered after it.
    bw, lat = on_link("cp")
    kv = 2 * e * n_tok * spec.kv_dim / np.minimum(tp, spec.n_kv_head)  # whole kv heads, replicated past nkv
    if spec.kv_lora_rank:  # MLA: the rank's heads' k (dn + dr) and v (dv), latent_attention.mla_cp_widths
        kv = e * n_tok * spec.n_head / tp * (spec.qk_head_size + spec.v_head_size)
    if software.cp == "ring":
        hop = collective_time("send", kv, cp, bw, lat, cl)
        hops_f = np.where(cp > 1, cp - 1, 0)
        hops_b = np.where(cp > 1, 2 * cp - 1, 0)
        core_f, core_b = blocks[False]["core_f"], blocks[False]["core_b"]
        cp_block_f = np.maximum(0, hops_f * hop - core_f)
        cp_block_b = np.maximum(0, hops_b * hop - core_b)
        cp_bytes = m * layers_per_stage * (hops_f + hops_b) * kv
        calls["cp.send"] = ("cp", "send", kv, cp, m * layers_per_stage * (hops_f + hops_b), hop, "ring")
    else:
        whole = kv * cp  # K and V of the whole sequence
        t_gather = collective_time("all_gather", whole, cp, bw, lat, cl)
        t_scatter = collective_time("reduce_scatter", whole, cp, bw, lat, cl)
        cp_block_f, cp_block_b = t_gather, t_scatter
        per_block = np.where(cp > 1, 1 + (recompute in ("full", "selective-op")), 0)
        cp_bytes = m * layers_per_stage * collective_bytes("all_gather", whole, cp) * (per_block + (cp > 1))
        calls["cp.all_gather"] = ("cp", "all_gather", whole, cp, m * layers_per_stage * per_block,
                                  t_gather, "ring")
        calls["cp.reduce_scatter"] = ("cp", "reduce_scatter", whole, cp,
                                      m * layers_per_stage * np.where(cp > 1, 1, 0), t_scatter, "ring")

    # Expert parallelism: dispatch and combine all-to-alls of the k copies of each token, forward
    # and backward (Lepikhin et al. 2021), per MoE block.
    bw, lat = on_link("ep")
    moe_per_stage = spec.n_moe_layers / pp
    a2a = e * n_tok * max(spec.top_k, 1) * h
    t_a2a, ep_algo = collective_choice("all_to_all", a2a, ep, bw, lat, cl)
    ep_redo = 2 if recompute in ("full", "selective-op") else 0
    ep_bytes = m * moe_per_stage * (4 + ep_redo) * collective_bytes(
        "all_to_all", a2a, ep)
    calls["ep.all_to_all"] = ("ep", "all_to_all", a2a, ep,
                              m * moe_per_stage * (4 + ep_redo), t_a2a, ep_algo)

    # A block forward and backward, by cause: its compute, and the communication on its critical
    # path. The forward's collectives always are. In the backward, where the software overlaps
    # them, the collectives whose result only the next GEMM's caller needs run behind the
    # weight-gradient GEMMs: without sequence parallelism both all-reduces of dX, with it the
    # re-gathers of the inputs and the reduce-scatters of dX; sequence parallelism's gathers of
    # the incoming gradient come before any backward GEMM can start. Recomputation reruns the
    # forward (full) or the attention core (selective) in the backward.
    tp_block_critical = np.where(sp, 2 * t_ag, 0.0)

    def block_parts(moe):
        t = blocks[moe]
        ep_calls = 2 * t_a2a if moe else 0.0
        forward = {"compute": t["gemm_f"] + t["core_f"] + t["memory_f"], "tp": tp_block_f,
                   "cp": cp_block_f, "ep": ep_calls}
        hideable = tp_block_b - tp_block_critical
        hidden = np.minimum(hideable, t["wgrad"]) if software.tp_overlap else 0.0
        # Under FlashAttention selective recomputation has nothing to make again: the kernel keeps
        # no scores, and its backward already recomputes them (priced in core_b).
        selective = 0.0 if software.attention == "flash" else t["core_f"]
        # Per-op checkpointing (torchtitan's "op") reruns the forward's memory-bound kernels and every
        # second GEMM (efficiency.op_checkpoint_gemms): o's collective again, K's gather under
        # all-gather context parallelism, a MoE block's dispatch and combine.
        per_op = {"compute": t["memory_f"] + t["op_gemm"], "tp": tp_block_f / 2,
                  "cp": cp_block_f if software.cp == "all_gather" else 0.0, "ep": ep_calls}
        rerun = {"none": dict.fromkeys(forward, 0.0), "selective": {**dict.fromkeys(forward, 0.0),
                 "compute": selective}, "full": forward, "selective-op": per_op}[recompute]
        backward = {"compute": t["gemm_b"] - t["wgrad"] + t["core_b"] + t["memory_b"] + rerun["compute"],
                    "tp": tp_block_b - hidden + rerun["tp"], "cp": cp_block_b + rerun["cp"],
                    "ep": ep_calls + rerun["ep"]}
        weights = {"compute": t["wgrad"] + t["accumulate"], "tp": 0.0, "cp": 0.0, "ep": 0.0}
        return forward, backward, weights

    head_f, head_b = head_seconds(spec, hw, micro_batch=micro_batch, seq=seq, tp=tp, cp=cp, dtype=dtype,
                                  eff=eff)
    zero_parts = {"compute": 0.0, "tp": 0.0, "cp": 0.0, "ep": 0.0}
    head = ({**zero_parts, "compute": head_f, "tp": tp_head_f},
            {**zero_parts, "compute": head_b, "tp": tp_head_b}, zero_parts)
    embed = ({**zero_parts, "tp": tp_embed_f}, zero_parts, zero_parts)
    dense, moe = block_parts(False), block_parts(True)

    def stage(n_blocks, n_moe_blocks, *extras):  # (F, B, W) of a stage, each by cause
        return tuple({k: (n_blocks - n_moe_blocks) * d[k] + n_moe_blocks * x[k]
                      + sum(extra[i][k] for extra in extras) for k in zero_parts}
                     for i, (d, x) in enumerate(zip(dense, moe, strict=True)))

    # Dense blocks come first, so the last stages hold the MoE ones; of the middle stages the one
    # with the most MoE blocks is priced. One stage is first and last at once.
    first_n, middle_n, last_n = stage_layers(spec.n_layer, pp)
    n_moe = spec.n_moe_layers
    lone = stage(first_n, np.minimum(n_moe, first_n), embed, head)
    first = stage(first_n, np.clip(n_moe - (spec.n_layer - first_n), 0, first_n), embed)
    middle = stage(middle_n, np.minimum(n_moe, middle_n))
    last = stage(last_n, np.minimum(n_moe, last_n), head)
    first = tuple({k: np.where(pp == 1, a[k], b[k]) for k in zero_parts}
                  for a, b in zip(lone, first, strict=True))

    def total(parts):
        return sum(sum(part.values()) for part in parts)

    heavy_first = (total(first) >= total(middle)) & (total(first) >= total(last))
    heavy_last = ~heavy_first & (total(last) >= total(middle))
    heavy = tuple({k: np.where(heavy_first, a[k], np.where(heavy_last, c[k], b[k])) for k in zero_parts}
                  for a, b, c in zip(first, middle, last, strict=True))
    t_f, t_b, t_w = (sum(part.values()) for part in heavy)

    # Pipeline: one activation forward and one gradient backward per micro-batch and chunk;
    # sequence parallelism sends the t-th part, as does Megatron-LM's scatter/gather without it
    # (Narayanan et al. 2021, Section 4.1: send a t-th over InfiniBand, all-gather it over
    # NVLink on arrival). Bytes are the first stage's: stage s lives on rank s mod p, so rank 0
    # sends 2v - 1 copies per micro-batch (no gradient leaves the first stage), and with a tied
    # head it all-reduces the embedding's gradient with the last stage (Megatron's embedding
    # group; refpar's engine counts the same).
    bw, lat = on_link("pp")
    split_send = sp | (software.scatter_gather & (tp > 1))
    p2p_size = e * n_tok * h / np.where(split_send, tp, 1)
    send = np.where(pp > 1, collective_time("send", p2p_size, 2, bw, lat, cl), 0)
    sends = np.where(pp > 1, m * (2 * chunks - 1), 0)
    p2p = send
    if software.scatter_gather:  # each of the 2v - 1 arrivals is all-gathered over the tp group
        gather_bw, gather_lat = on_link("tp")
        regather = collective_time("all_gather", act, tp, gather_bw, gather_lat, cl)
        gathers = np.where((pp > 1) & ~sp & (tp > 1), sends, 0)
        p2p = p2p + np.where(gathers > 0, regather, 0)
        tp_bytes = tp_bytes + gathers * collective_bytes("all_gather", act, tp)
        calls["tp.p2p_gather"] = ("tp", "all_gather", act, tp, gathers, regather, "ring")
    tied = np.where((pp > 1) & spec.tied_embeddings, spec.vocab_size * h / tp * precision.grad, 0)
    t_tied, tied_algo = collective_choice("all_reduce", tied, np.where(tied > 0, 2, 1), bw, lat, cl)
    pp_bytes = sends * p2p_size + collective_bytes("all_reduce", tied, 2)
    calls["pp.send"] = ("pp", "send", p2p_size, pp, sends, send, "p2p")
    calls["pp.all_reduce"] = ("pp", "all_reduce", tied, 2, np.where(tied > 0, 1, 0), t_tied, tied_algo)
    work, bubble, pipe_comm = pipeline_time(schedule, pp, m, t_f, t_b, t_w, p2p, chunks,
                                            overlap=software.p2p_overlap)

    # Data parallelism over the replicas of each weight of the heaviest stage (scale.py): stages 0
    # and 1 reduce the gradients once, stage 2 reduce-scatters each micro-batch's gradients during
    # its backward, stage 3 also gathers the weights before forward and backward (Rajbhandari et
    # al. 2020, Section 7). Overlapped (DDP buckets, Li et al. 2020; FSDP prefetching), only what
    # outlasts the backward it hides behind is exposed; otherwise all of it follows the backward.
    # The stage holding the most weights: first, last or a middle one (DeepSeek-V3's middle stages
    # hold the most experts, its first the dense blocks).
    (fs, fe), (ls, le) = stage_params(spec, tp, pp, ep)
    ms, me = middle_stage_params(spec, tp, pp, ep)
    first_heavier = fs + fe >= ls + le
    shared, expert = np.where(first_heavier, fs, ls), np.where(first_heavier, fe, le)
    middle_heavier = ms + me > shared + expert
    shared, expert = np.where(middle_heavier, ms, shared), np.where(middle_heavier, me, expert)
    t_back = t_b + t_w
    dp_time, dp_bytes = 0.0, 0.0
    groups = (("dp", shared, {"dp": dp, "ep": ep, "cp": cp}), ("dp.experts", expert, {"dp": dp, "cp": cp}))
    for name, params, group_sizes in groups:
        n = group_sizes["dp"] * group_sizes["cp"] * group_sizes.get("ep", 1)
        # The group spans the slowest of its axes: its link is that axis's.
        bw, lat = on_link("dp", group_sizes)
        g, w = params * (4 if software.fp32_grad_reduce else precision.grad), params * precision.param
        t_ar, ar_algo = collective_choice("all_reduce", g, n, bw, lat, cl)
        t_rs = collective_time("reduce_scatter", g, n, bw, lat, cl)
        t_ag = collective_time("all_gather", w, n, bw, lat, cl)
        once = np.where(zero == 0, t_ar, t_rs + t_ag)
        if software.dp_overlap:
            z0 = np.maximum(0, once - t_back)
            z2 = m * np.maximum(0, t_rs - t_back) + t_ag
            z3 = m * np.maximum(0, 2 * t_ag + t_rs - (t_f + t_back))
        else:
            z0, z2, z3 = once, m * t_rs + t_ag, m * (2 * t_ag + t_rs)
        dp_time = dp_time + np.where(params > 0, np.select([zero <= 1, zero == 2], [z0, z2], z3), 0)
        dp_bytes = dp_bytes + np.select(
            [zero == 0, zero == 1, zero == 2],
            [collective_bytes("all_reduce", g, n),
             collective_bytes("reduce_scatter", g, n) + collective_bytes("all_gather", w, n),
             m * collective_bytes("reduce_scatter", g, n) + collective_bytes("all_gather", w, n)],
            m * (collective_bytes("reduce_scatter", g, n) + 2 * collective_bytes("all_gather", w, n)))
        calls[f"{name}.all_reduce"] = ("dp", "all_reduce", g, n, np.where(zero == 0, 1, 0), t_ar, ar_algo)
        calls[f"{name}.reduce_scatter"] = ("dp", "reduce_scatter", g, n,
                                           np.select([zero == 0, zero == 1], [0, 1], m), t_rs, "ring")
        calls[f"{name}.all_gather"] = ("dp", "all_gather", w, n,
                                       np.select([zero == 0, zero <= 2], [0, 1], 2 * m), t_ag, "ring")

    # The optimizer step is memory-bound, for the rank's shard: zero the gradient buffer and read it
    # for the global norm that clipping needs (PyTorch's and Megatron-LM's clip_grad_norm), then
    # Adam reads it with the master weights and both moments and writes those three, and the
    # weights are cast from the master copy.
    local = shared / np.where(zero >= 1, dp * ep * cp, 1) + expert / np.where(zero >= 1, dp * cp, 1)
    grad = precision.grad_accum or precision.grad
    touched = local * (3 * grad + 2 * (precision.master + precision.optimizer) + precision.master
                       + precision.param)
    optimizer = memory_seconds(hw, touched, eff)

    # The heaviest stage's pipeline work by cause (its share of the bubble is "bubble").
    by_cause = {k: m * sum(part[k] for part in heavy) for k in zero_parts}
    times = {
        "compute": by_cause["compute"],
        "bubble": bubble,
        "tp": by_cause["tp"] + t_sp_grads,
        "cp": by_cause["cp"],
        "ep": by_cause["ep"],
        "pp": pipe_comm + t_tied,
        "dp": dp_time,
        "optimizer": optimizer,
    }
    times["total"] = work + pipe_comm + t_tied + t_sp_grads + bubble + dp_time + optimizer
    # One micro-batch on one stage, for simulate.simulate (analysis/timeline.py), and one dense
    # block's forward and whole backward with their exposed communication.
    times["stage"] = {"F": t_f, "B": t_b, "W": t_w, "p2p": p2p}
    times["block"] = {"F": sum(dense[0].values()), "B": sum(dense[1].values()) + sum(dense[2].values())}
    comm_bytes = {"tp": tp_bytes, "cp": cp_bytes, "ep": ep_bytes, "pp": pp_bytes, "dp": dp_bytes}
    return times, comm_bytes, calls


def throughput(spec: ModelSpec, hw: Hardware, step_seconds, *, global_batch, seq, gpus,
               dtype="bfloat16"):
    """(MFU, tokens/s): model FLOPs without recomputation over peak (Chowdhery et al. 2022, App. B)."""
    mfu = model_flops(spec, global_batch, seq) / (step_seconds * gpus * hw.flops(dtype))
    return mfu, global_batch * seq / step_seconds
