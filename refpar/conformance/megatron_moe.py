"""mpiexec -n 2 python -m refpar.conformance.megatron_moe

Megatron-Core 0.16.1's own MoELayer (TopKRouter, MoEAlltoAllTokenDispatcher, SequentialMLP experts,
SharedExpertMLP, from `get_moe_module_spec(use_te=False)`) at expert_model_parallel_size = 2 on two
CPU ranks (gloo), next to refpar's single-device MoE layer (refpar/model/moe.py with DeepSeek-V3's
spec, refpar.model.deepseek.MOE) set to Megatron's conventions: sigmoid scores, the expert bias
(aux-free balancing's, added for the choice only), 8 experts in 4 groups, tokens limited to 2 groups
ranked by `moe_group_score="megatron"` (a group's best floor(k/M) = 1 biased score), k = 3 gates
normalised and scaled by 2.5, one shared SwiGLU expert, no capacity, no auxiliary losses. Rank r
holds sequence r of the batch (as data parallelism gives it) and experts 4r..4r+3; the all-to-all
sends its tokens to the other rank's experts and back. Prints from rank 0 one JSON line: per rank,
whether Megatron's router picked other experts than refpar's (and than refpar under DeepSeek's group
score, which must differ), the largest relative differences of the gates, the output, the input's
gradient and every parameter gradient (the router's and the shared expert's summed over the ranks,
each expert's on the rank that holds it), once with Megatron's float32 sigmoid made float64 and once
as shipped (tests/frameworks/test_megatron_moe.py holds the bounds).

Patched to run on the CPU (`patched`; each one found by removing it and reading the error):
- `torch.cuda.current_device` returns "cpu": the router's expert bias and token counts and the
  all-to-all's output buffer are allocated on it (the CPU build raises "Torch not compiled with CUDA
  enabled").
- `torch.cuda.current_stream` gives a null stream, as does the dispatcher's class attribute
  `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream` (it makes one with `torch.cuda.Stream()` otherwise):
  the dispatcher copies its split sizes to the host on a side stream and waits on an event
  (`_maybe_dtoh_and_synchronize`); on the CPU the work is already in order (`torch.cuda.stream`
  itself accepts the null stream on a CPU build).
- token_dispatcher's `maybe_move_tensor_to_cpu` also converts a CPU tensor to numpy when asked
  (`as_numpy=True`): Megatron converts only CUDA tensors, so on the CPU the split sizes reach
  `all_to_all_single` as tensors, which it refuses (TypeError: incompatible function arguments); on a
  GPU they arrive as numpy arrays, as here.
- `moe_utils.te_general_gemm = None`: the router's gating GEMM tests this name, which moe_utils binds
  only when Transformer Engine imports (a NameError without it; None is what the test means).
- float64 only (`float64_sigmoid`): `Tensor.float` leaves a float64 tensor as it is (any in the
  layer, not only the one meant), so that `torch.sigmoid(logits.float())` in
  `topk_routing_with_score_function` runs in float64, as in tests/frameworks/test_megatron_router.py.
  Run as shipped too: every float32 cast's trace, bounded by the test as the sigmoid's.
Not needed here, though the GPT case patches it (megatron_cases.py): `CudaRNGStatesTracker.fork`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from refpar.comm.communicator import abort_on_error, world
from refpar.config import MODEL_PRESETS, ModelConfig
from refpar.conformance.dist import process_group
from refpar.model.deepseek import MOE
from refpar.model.moe import moe_backward, moe_forward

B, T = 2, 16  # one sequence per rank
E, K, G, M, S = 8, 3, 4, 2, 1  # experts, k, groups, group limit (floor(k/M) = 1, DeepSeek's 2), shared
C, H = 16, 12  # channels, a routed expert's SwiGLU width
SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor


def refpar_config(group_score: str = "megatron") -> ModelConfig:
    """deepseek-tiny's MoE at these shapes, no auxiliary losses (Megatron's set to "none")."""
    return replace(MODEL_PRESETS["deepseek-tiny"], n_embd=C, moe_experts=E, moe_top_k=K, moe_groups=G,
                   moe_group_limit=M, moe_group_score=group_score, moe_norm_topk_prob=True,
                   moe_routed_scaling_factor=SCALE, moe_shared_experts=S, moe_intermediate_size=H,
                   moe_seq_aux_weight=0.0, dtype="float64")


def inputs():
    """(params by refpar's name, the (E,) expert bias, x (B, T, C), dout (B, T, C)): the loss is
    sum(out * dout). The bias is float32-exact: Megatron keeps its expert bias in float32."""
    gen = np.random.default_rng(41)
    params = {name: gen.standard_normal(shape) * 0.3
              for name, shape in MOE.param_shapes(refpar_config(), 0).items()}
    bias = (gen.standard_normal(E) * 0.1).astype(np.float32).astype(np.float64)
    return params, bias, gen.standard_normal((B, T, C)), gen.standard_normal((B, T, C))


class NullStream:
    """A CUDA stream on the CPU: the work is already in order, so waits and events do nothing."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


@contextmanager
def patched(float64_sigmoid: bool):
    """The patches that let Megatron's MoE layer run on the CPU (the module docstring says why)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    stream, float_ = NullStream(), torch.Tensor.float

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else float_(self, *args, **kwargs)

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "current_stream", torch.cuda.current_stream),
             (torch.Tensor, "float", float_), (dispatcher, "cuda_dtoh_stream", dispatcher.cuda_dtoh_stream),
             (token_dispatcher, "maybe_move_tensor_to_cpu", token_dispatcher.maybe_move_tensor_to_cpu)]
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    if float64_sigmoid:
        torch.Tensor.float = keep_float64
    dispatcher.cuda_dtoh_stream = stream
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    bound = hasattr(moe_utils, "te_general_gemm")
    if not bound:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if not bound:
            del moe_utils.te_general_gemm


def megatron_layer(ep: int):
    """Megatron's MoELayer from the local spec (no Transformer Engine), float64 parameters, the
    router's logits in float64 (`moe_router_dtype="fp64"`)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=1, hidden_size=C, num_attention_heads=2, ffn_hidden_size=H, moe_ffn_hidden_size=H,
        num_moe_experts=E, moe_router_topk=K, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=G, moe_router_group_topk=M,
        moe_router_topk_scaling_factor=SCALE, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp64", moe_shared_expert_intermediate_size=S * H, moe_shared_expert_overlap=False,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float64, hidden_dropout=0.0,
        gradient_accumulation_fusion=False, moe_grouped_gemm=False, moe_permute_fusion=False)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    return MoELayer(config, spec.submodules)


def swiglu_names(rank: int, ep: int) -> dict[str, str]:
    """{Megatron's SwiGLU prefix: refpar's} on this rank: local expert i is expert rank * E/ep + i."""
    local = E // ep
    names = {f"experts.local_experts.{i}": MOE.expert_prefix(0, rank * local + i) for i in range(local)}
    return names | {"shared_experts": MOE.shared.format(layer=0)}


def load(net, params: dict, bias, rank: int, ep: int) -> None:
    """refpar's parameters into Megatron's layer: a SwiGLU's linear_fc1 is [gate; up] stacked (its
    GLU splits fc1's output in halves, silu on the first), linear_fc2 is down; the router (E, C) as
    stored; the expert bias into the router's buffer."""
    theirs = dict(net.named_parameters())
    with torch.no_grad():
        theirs["router.weight"].copy_(torch.from_numpy(params[MOE.router_name(0)]))  # (E, C)
        net.router.expert_bias.copy_(torch.from_numpy(bias))  # (E,)
        for prefix, mine in swiglu_names(rank, ep).items():
            theirs[f"{prefix}.linear_fc1.weight"].copy_(torch.from_numpy(np.concatenate(
                [params[f"{mine}.gate_proj.weight"], params[f"{mine}.up_proj.weight"]])))  # (2H, C)
            theirs[f"{prefix}.linear_fc2.weight"].copy_(torch.from_numpy(params[f"{mine}.down_proj.weight"]))


def megatron_grads(net, rank: int, ep: int) -> dict:
    """{refpar name: Megatron's gradient}: this rank's experts' own; the router's and the shared
    expert's summed over the ranks (each rank's holds its own tokens' share)."""
    import torch.distributed as dist

    theirs = {n: p.grad for n, p in net.named_parameters()}
    for name in ("router.weight", "shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"):
        dist.all_reduce(theirs[name])
    out = {MOE.router_name(0): theirs["router.weight"]}
    for prefix, mine in swiglu_names(rank, ep).items():
        gate, up = theirs[f"{prefix}.linear_fc1.weight"].chunk(2)  # (H, C) each
        out |= {f"{mine}.gate_proj.weight": gate, f"{mine}.up_proj.weight": up,
                f"{mine}.down_proj.weight": theirs[f"{prefix}.linear_fc2.weight"]}
    return {name: g.detach().numpy() for name, g in out.items()}


def rel(a, b) -> float:
    """max |a - b| / max |b|."""
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def chosen(routing, rank: int):
    """(T, E) gates of sequence `rank`, 0 where an expert is not chosen."""
    gates = np.zeros((B * T, E))  # (N, E)
    np.put_along_axis(gates, routing["experts"], routing["gates"], axis=1)
    return gates.reshape(B, T, E)[rank]  # (T, E)


def compare(comm, float64_sigmoid: bool) -> dict:
    """One forward and backward on both sides; this rank's differences."""
    params, bias, x, dout = inputs()
    r, ep = comm.rank, comm.size
    out, cache = moe_forward(x, params, 0, refpar_config(), MOE, bias=bias)  # (B, T, C): one device
    dx, grads = moe_backward(dout, cache)  # (B, T, C)
    _, other = moe_forward(x, params, 0, refpar_config("deepseek"), MOE, bias=bias)

    with patched(float64_sigmoid):
        net = megatron_layer(ep)
        load(net, params, bias, r, ep)
        routed = {}
        net.router.register_forward_hook(
            lambda mod, args, output: routed.update(probs=output[0], map=output[1]))  # (T, E) each
        xr = torch.from_numpy(x[r][:, None, :].copy()).requires_grad_()  # (T, 1, C): Megatron's [s, b, h]
        theirs, _ = net(xr)  # (T, 1, C)
        (theirs * torch.from_numpy(dout[r][:, None, :])).sum().backward()
        their_grads = megatron_grads(net, r, ep)
    their_map = routed["map"].numpy()  # (T, E) bool
    mine, deepseek = chosen(cache["routing"], r), chosen(other["routing"], r) > 0  # (T, E) each
    away = [e for e in range(E) if e // (E // ep) != r]
    return {"rank": r, "dtype": str(theirs.dtype), "sent_away": int(their_map[:, away].sum()),
            "experts_differ": int(np.sum(np.any(their_map != (mine > 0), axis=1))),
            "experts_differ_deepseek": int(np.sum(np.any(their_map != deepseek, axis=1))),
            "gates": rel(routed["probs"].detach().numpy(), mine),
            "out": rel(theirs.detach().numpy()[:, 0], out[r]), "dx": rel(xr.grad.numpy()[:, 0], dx[r]),
            "grads": {name: rel(g, grads[name]) for name, g in their_grads.items()}}


def main() -> None:
    with abort_on_error():
        comm = world()
        with process_group(comm):
            rows = {mode: comm.gather_object(compare(comm, mode == "float64-sigmoid"))
                    for mode in ("float64-sigmoid", "as-shipped")}
        if comm.rank == 0:
            print(json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
