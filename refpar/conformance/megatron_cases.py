"""Megatron-Core's GPTModel at TP=N (with and without sequence parallelism) next to refpar's
`--mesh tp=N [--sp]`, per optimizer step, on the same MPI ranks through gloo.

    mpiexec -n 2 python -m refpar.conformance megatron-tp megatron-tp-sp

refpar's GPT-2 weights go into a GPTModel built from `get_gpt_layer_local_spec()` (Megatron-Core's
own modules, no Transformer Engine): learned absolute positions, GPT-2's tanh GELU
(`openai_gelu`), LayerNorm, biases, tied embeddings, dropout 0; the layout conversion is
megatron_layout.py (its fused-QKV row order is the classic pitfall). Megatron's own training path
runs: its DistributedDataParallel wrapper (gradient buffers), `finalize_model_grads` (which
all-reduces the sequence-parallel LayerNorm gradients over tp) and `get_megatron_optimizer`, which
gives its FP32Optimizer around torch's AdamW (neither Transformer Engine's nor Apex's FusedAdam is
installed; its fallback), `clip_grad=0.0` (Megatron's default is 1.0, as DeepSpeed's).

The DistributedOptimizer (`use_distributed_optimizer=True`, Megatron's ZeRO-1) does not run on
CPU: it accepts only torch.cuda.{Half,BFloat16,Float}Tensor parameters (distrib_optimizer.py,
`_build_model_and_main_param_groups`, a TypeError for anything else, float64 included) and its base
class allocates its overflow buffers with device='cuda' (optimizer.py, MixedPrecisionOptimizer).
Patching those type checks would test the patch, not Megatron, so it is left out.

Each rank compares, element by element by their GPT-2 indices: its gradient partitions (Megatron's
main_grad) against refpar's tp slices of the same tensor, and its updated parameter partitions.

Bounds (the loss is Megatron's own: vocab_parallel_cross_entropy computes in float32, `.float()`
on the logits): the loss agrees to float32's rounding of a log-sum-exp (~1e-7 relative), and so
do the gradients, which all flow back from the float32 softmax - target (dlogits rounded to
float32: relative 2^-24 per entry, summed through float64 matmuls). The parameters after AdamW
agree to lr x (relative gradient error) per step except where a true gradient is 0 (the key third
of attn.c_attn.bias: a bias added to every key shifts a softmax row by a constant), where the
float32 noise itself is stepped by +-lr.

Patches to run on CPU (`patched`, `cuda_tensors_on_cpu`): `torch.cuda.current_device` returns
"cpu" (gradient buffers, sequence-parallel gathers and the embedding's all-reduce allocate on it);
`CudaRNGStatesTracker.fork` is a null context (the tracker forks a CUDA RNG around dropout, here
0); the local spec's LayerNorm without Apex, `WrappedTorchNorm`, refuses sequence parallelism (it
would not mark its parameters `sequence_parallel`, so their partial gradients would never be summed
over tp), so it is built as torch's LayerNorm with that mark, as Apex's FusedLayerNorm sets it (the
same arithmetic); two optimizer tensors Megatron makes with device='cuda' are made on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from refpar.config import Plan
from refpar.conformance import megatron_layout as layout
from refpar.conformance.cases import configs, held_grads, run_steps
from refpar.conformance.compare import worst_key
from refpar.holdings import tp_param_slices
from refpar.model.gpt import init_params, param_shapes
from refpar.trainer import corpus_for


@contextmanager
def cuda_tensors_on_cpu():
    """While Megatron's optimizer is built and steps: FP32Optimizer.__init__ makes its loss scale
    (1.0, unused without fp16) with `torch.tensor(..., device='cuda')` (optimizer.py), and every
    step's gradient norm (computed for its log even with clip_grad 0) a flag with
    `torch.zeros(1, device='cuda')` (clip_grads.py); both made on the CPU instead."""
    saved = {name: getattr(torch, name) for name in ("tensor", "zeros")}

    def on_cpu(make):
        def made(*args, device=None, **kwargs):
            return make(*args, device="cpu" if device == "cuda" else device, **kwargs)
        return made

    for name, make in saved.items():
        setattr(torch, name, on_cpu(make))
    try:
        yield
    finally:
        for name, make in saved.items():
            setattr(torch, name, make)


@contextmanager
def cross_entropy_in_input_dtype():
    """The diagnostic "-ce64" cases only: Megatron's vocab_parallel_cross_entropy computes in
    float32 (`VocabParallelCrossEntropy.calculate_logits_max` casts the logits with `.float()`);
    kept in the logits' dtype here, so that a float64 run shows what else differs (nothing)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    cast = VocabParallelCrossEntropy.calculate_logits_max

    def logits_max(vocab_parallel_logits):
        return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]

    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(logits_max)
    try:
        yield
    finally:
        VocabParallelCrossEntropy.calculate_logits_max = cast


@contextmanager
def patched():
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    def layer_norm(cls, config, hidden_size, eps=1e-5, **unused):
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():  # as FusedLayerNorm marks them: finalize_model_grads sums these
            p.sequence_parallel = config.sequence_parallel
        return norm

    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (mrandom.CudaRNGStatesTracker, "fork", mrandom.CudaRNGStatesTracker.fork),
             (torch_norm.WrappedTorchNorm, "__new__", torch_norm.WrappedTorchNorm.__new__)]
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: nullcontext()
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(layer_norm)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def transformer_config(model, tp: int, sp: bool, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    return TransformerConfig(
        num_layers=model.n_layer, hidden_size=model.n_embd, num_attention_heads=model.n_head,
        ffn_hidden_size=4 * model.n_embd, tensor_model_parallel_size=tp, sequence_parallel=sp,
        use_cpu_initialization=True, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_epsilon=model.layer_norm_eps, activation_func=openai_gelu, add_bias_linear=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, normalization="LayerNorm")


def build(model, params: dict, tp: int, rank: int, sp: bool, dtype, qkv: str = "megatron"):
    """Megatron's GPTModel holding this rank's partitions of refpar's GPT-2 `params`. `qkv`
    "gpt2" plants the bug: c_attn copied in GPT-2's [q | k | v] order (megatron_layout.py)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    net = GPTModel(config=transformer_config(model, tp, sp, dtype),
                   transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=model.vocab_size,
                   max_sequence_length=model.n_positions, position_embedding_type="learned_absolute",
                   share_embeddings_and_output_weights=True, parallel_output=True)
    net = net.to(dtype)  # the local LayerNorm ignores params_dtype
    C, hs = model.n_embd, model.head_size
    theirs = dict(net.named_parameters())
    with torch.no_grad():
        for name, mname in layout.names(model.n_layer).items():
            whole = layout.to_megatron(name, params[name], C, hs)
            if qkv == "gpt2" and ".attn.c_attn." in name:
                whole = params[name].T if params[name].ndim == 2 else params[name]
            theirs[mname].copy_(torch.from_numpy(np.ascontiguousarray(layout.shard(mname, whole, tp, rank))))
    return net


def gpt2_indices(model, tp: int, rank: int) -> dict:
    """{GPT-2 name: (Megatron's flat GPT-2 indices of this rank's partition, refpar's of its slice)}:
    which element of the whole GPT-2 tensor each local element is, on each side."""
    C, hs = model.n_embd, model.head_size
    slices, out = tp_param_slices(model, tp, rank), {}
    for name, mname in layout.names(model.n_layer).items():
        shape = param_shapes(model)[name]
        ids = np.arange(int(np.prod(shape))).reshape(shape)
        theirs = layout.shard(mname, layout.to_megatron(name, ids, C, hs), tp, rank)
        ours = np.take(ids, slices[name][1], axis=slices[name][0]) if name in slices else ids
        out[name] = (theirs.ravel(), ours.ravel())
    return out


def element_diff(theirs: dict, ours: dict, index: dict) -> tuple[float, str]:
    """(largest max |Megatron - refpar| / max |refpar| over each tensor's local elements, matched by
    GPT-2 index, its name); both sides must hold the same elements."""
    best, name_of = 0.0, ""
    for name, (ti, oi) in index.items():
        if not np.array_equal(np.sort(ti), np.sort(oi)):
            raise AssertionError(f"{name}: Megatron's partition and refpar's slice hold other elements")
        t = np.asarray(theirs[name], np.float64).ravel()[np.argsort(ti)]
        o = np.asarray(ours[name], np.float64).ravel()[np.argsort(oi)]
        d = float(np.max(np.abs(t - o))) / max(float(np.max(np.abs(o))), np.finfo(np.float64).tiny)
        if d > best or not name_of:
            best, name_of = d, name
    return best, name_of


def setup(model, params, tp: int, rank: int, sp: bool, dtype, train, qkv: str = "megatron"):
    """(the DDP-wrapped model, Megatron's optimizer, its scheduler): Megatron's own training objects."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    net = build(model, params, tp, rank, sp, dtype, qkv)
    ddp = DistributedDataParallel(config=net.config, module=net, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=False, overlap_grad_reduce=False, grad_reduce_in_fp32=False))
    config = OptimizerConfig(
        optimizer="adam", lr=train.lr, weight_decay=train.weight_decay, adam_beta1=train.beta1,
        adam_beta2=train.beta2, adam_eps=train.eps, clip_grad=0.0, use_distributed_optimizer=False,
        params_dtype=dtype, bf16=False, fp16=False)
    with cuda_tensors_on_cpu():
        # Without config_overrides get_megatron_optimizer decays every parameter, LayerNorms and
        # biases too; Megatron-LM's training passes the standard ones (no decay for biases and
        # 1-D parameters), which is refpar's rule (matrices only).
        opt = get_megatron_optimizer(config, [ddp], config_overrides=get_standard_config_overrides(config))
    # The decay multipliers (wd_mult 0 for biases and LayerNorms) reach the parameter groups only
    # through the scheduler, as in Megatron-LM's training: a constant lr and decay here.
    schedule = OptimizerParamScheduler(
        opt, init_lr=train.lr, max_lr=train.lr, min_lr=train.lr, lr_warmup_steps=0,
        lr_decay_steps=train.steps, lr_decay_style="constant", start_wd=train.weight_decay,
        end_wd=train.weight_decay, wd_incr_steps=train.steps, wd_incr_style="constant")
    return ddp, opt, schedule


def forward_backward(ddp, opt, tokens, targets):
    """Megatron's per-token float32 losses -> their mean over B*T (refpar's normalisation)."""
    from megatron.core.distributed import finalize_model_grads

    B, T = tokens.shape
    positions = torch.arange(T).expand(B, T)
    causal = torch.ones(1, 1, T, T, dtype=torch.bool).triu(1)  # True: masked
    ddp.zero_grad_buffer()  # both, as Megatron-LM's train_step: the optimizer points param.grad at
    opt.zero_grad()  # main_grad, and autograd would add into it before the hook adds again
    per_token = ddp(torch.from_numpy(tokens), positions, causal, labels=torch.from_numpy(targets))  # (B, T)
    loss = per_token.sum() / (B * T)
    loss.backward()
    finalize_model_grads([ddp])
    return float(loss.detach())


def local(net, model, key: str) -> dict:
    """{GPT-2 name: this rank's partition of the parameter (key "param") or of its main_grad}."""
    theirs = dict(net.named_parameters())
    return {name: (theirs[m].main_grad if key == "grad" else theirs[m]).detach().numpy().copy()
            for name, m in layout.names(model.n_layer).items()}


def tp_case(comm, dtype: str = "float64", batch_size: int = 8, sp: bool = False,
            ce64: bool = False) -> list[dict]:
    model, train_cfg = configs(dtype, batch_size=batch_size)
    N, r, B, T = comm.size, comm.rank, train_cfg.batch_size, train_cfg.seq_len
    full = init_params(model, train_cfg.seed)
    index = gpt2_indices(model, N, r)
    corpus = corpus_for(model, train_cfg)
    with patched(), cross_entropy_in_input_dtype() if ce64 else nullcontext():
        ddp, opt, schedule = setup(model, full, N, r, sp, getattr(torch, dtype), train_cfg)

        def each(par, step, loss):
            tokens, targets = corpus.batch(step, range(B), T)
            theirs_loss = forward_backward(ddp, opt, tokens, targets)
            grads = local(ddp.module, model, "grad")
            with cuda_tensors_on_cpu():
                opt.step()
            schedule.step(increment=1)
            row = {"loss_refpar": loss, "loss_torch": theirs_loss,
                   "loss": abs(theirs_loss - loss) / abs(loss)}
            row["grads"], row[worst_key("grads")] = element_diff(grads, held_grads(par), index)
            row["params"], row[worst_key("params")] = element_diff(local(ddp.module, model, "param"),
                                                                 par.states.full_params(), index)
            return row

        sizes = {"tp": N, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
        return run_steps(model, train_cfg, comm, sizes, Plan(sp=sp), each)
