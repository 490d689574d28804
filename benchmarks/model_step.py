"""One training step (forward, backward, AdamW) of a GPT-2 preset in float32 (`small` by default,
`gpt2` = GPT-2 small, 124M): refpar's NumPy model against the same model in PyTorch eager on the
CPU, same threads, same batch.

    python benchmarks/model_step.py [--model gpt2] [--threads 2] [--batch-size 8] [--seq-len 256]

Prints the median (and minimum) step time of each and the ratio refpar / torch (lower is better;
1.0 = parity). With --profile, a table of each part of the step instead: the embedding, every
block's forward and backward, the head (ln_f, tied logits, cross-entropy) and the optimizer, the
median over the timed steps. refpar's parts are timed around the calls `loss_and_grads` makes, one
after the other as it makes them; torch's by hooks on each block (forward pre-hook and hook,
backward pre-hook and hook), so a torch block's backward is the autograd time from the gradient
of its output to the gradient of its input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="BLAS/torch threads (default: all cores)")
    parser.add_argument("--model", default="small", help="GPT-2 preset: small or gpt2 (default small)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps after two warm-up steps")
    parser.add_argument("--profile", action="store_true", help="time each block's forward and backward")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, steadier on a shared machine (use with --threads 1)")
    return parser.parse_args()


ARGS = parse_args()
# Before NumPy loads: OpenBLAS reads its thread count once, at import.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

from refpar.allocator import keep_freed_memory  # noqa: E402
from refpar.config import TrainConfig, model_preset  # noqa: E402
from refpar.model.data import MarkovCorpus  # noqa: E402
from refpar.model.gpt import (  # noqa: E402
    add_embedding_grads,
    block_backward,
    block_forward,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
    init_params,
    loss_and_grads,
)
from refpar.model.optim import optimizer_init, optimizer_step  # noqa: E402


def median_time(step, repeats):
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append(clock() - start)
    return float(np.median(times)), float(np.min(times))


def refpar_step_time(config, train, tokens, targets):
    state = {"params": init_params(config, train.seed)}
    state["opt"] = optimizer_init(state["params"], train)

    def step():
        _, grads = loss_and_grads(state["params"], tokens, targets, config, seed=train.seed)
        state["params"], state["opt"] = optimizer_step(state["params"], grads, state["opt"], train,
                                                       lr=train.lr)

    return median_time(step, ARGS.repeats)


def clock():
    return (time.perf_counter if ARGS.clock == "wall" else time.process_time)()


def refpar_profile(config, train, tokens, targets) -> dict:
    """{part: median seconds}: `loss_and_grads`'s calls (no dropout), then the optimizer step."""
    params = init_params(config, train.seed)
    opt = optimizer_init(params, train)
    B, T = tokens.shape
    runs = []
    for _ in range(2 + ARGS.repeats):
        t = {}
        start = clock()
        x, c_embed = embed_forward(tokens, params)  # (B, T, C)
        t["embedding forward"] = clock() - start
        caches = []
        for layer in range(config.n_layer):
            start = clock()
            x, c = block_forward(x, params, layer, config)  # (B, T, C)
            t[f"block {layer} forward"] = clock() - start
            caches.append(c)
        start = clock()
        _, c_head = head_forward(x, params, targets, config, B * T)
        dx, grads = head_backward(c_head)  # (B, T, C)
        t["head forward + backward"] = clock() - start
        for layer in reversed(range(config.n_layer)):
            start = clock()
            dx, g = block_backward(dx, caches[layer])  # (B, T, C)
            t[f"block {layer} backward"] = clock() - start
            grads.update(g)
        start = clock()
        add_embedding_grads(grads, embed_backward(dx, c_embed))
        t["embedding backward"] = clock() - start
        start = clock()
        params, opt = optimizer_step(params, {n: grads[n] for n in params}, opt, train, lr=train.lr)
        t["optimizer (AdamW)"] = clock() - start
        runs.append(t)
    return {part: float(np.median([r[part] for r in runs[2:]])) for part in runs[0]}


def torch_model(config, train):
    """(nanoGPT's GPT-2 in torch, its AdamW with refpar's decay groups)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.set_num_threads(ARGS.threads)
    C, nh, p = config.n_embd, config.n_head, config.dropout

    class Block(nn.Module):  # nanoGPT's block (Karpathy), GPT-2 exactly
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p if self.training else 0.0, is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + F.dropout(self.attn_proj(y), p, self.training)
            m = self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
            return x + F.dropout(m, p, self.training)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, C)
            self.wpe = nn.Embedding(config.n_positions, C)
            self.h = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = F.dropout(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])), p, self.training)
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT().float()
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps)
    return model, opt


def torch_profile(config, train, tokens, targets) -> dict:
    """{part: median seconds}: each block's forward and backward by module hooks, the rest as
    what the step's other spans leave."""
    import torch

    model, opt = torch_model(config, train)
    idx, tgt = torch.from_numpy(tokens), torch.from_numpy(targets)
    marks: dict = {}
    for layer, block in enumerate(model.h):
        block.register_forward_pre_hook(lambda *_, i=layer: marks.__setitem__(("f0", i), clock()))
        block.register_forward_hook(lambda *_, i=layer: marks.__setitem__(("f1", i), clock()))
        block.register_full_backward_pre_hook(lambda *_, i=layer: marks.__setitem__(("b0", i), clock()))
        block.register_full_backward_hook(lambda *_, i=layer: marks.__setitem__(("b1", i), clock()))
    L = config.n_layer
    runs = []
    for _ in range(2 + ARGS.repeats):
        opt.zero_grad(set_to_none=True)
        start = clock()
        model(idx, tgt).backward()
        backward_end = clock()
        opt.step()
        t = {"embedding forward": marks[("f0", 0)] - start}
        t.update({f"block {i} forward": marks[("f1", i)] - marks[("f0", i)] for i in range(L)})
        t["head forward + backward"] = marks[("b0", L - 1)] - marks[("f1", L - 1)]  # ln_f, logits, loss
        t.update({f"block {i} backward": marks[("b1", i)] - marks[("b0", i)] for i in reversed(range(L))})
        t["embedding backward"] = backward_end - marks[("b1", 0)]
        t["optimizer (AdamW)"] = clock() - backward_end
        runs.append(t)
    return {part: float(np.median([r[part] for r in runs[2:]])) for part in runs[0]}


def print_profile(config, train, tokens, targets) -> None:
    ours = refpar_profile(config, train, tokens, targets)
    try:
        theirs = torch_profile(config, train, tokens, targets)
    except ImportError:
        theirs = {}
    print("| part | refpar ms | torch ms | refpar / torch |\n|---|---|---|---|")
    for part, t in ours.items():
        other = theirs.get(part)
        versus = f"| {other * 1e3:.2f} | {t / other:.2f} |" if other else "| - | - |"
        print(f"| {part} | {t * 1e3:.2f} {versus}", flush=True)
    if theirs:
        print(f"| sum | {sum(ours.values()) * 1e3:.2f} | {sum(theirs.values()) * 1e3:.2f} "
              f"| {sum(ours.values()) / sum(theirs.values()):.2f} |", flush=True)


def torch_step_time(config, train, tokens, targets):
    import torch

    model, opt = torch_model(config, train)
    idx, tgt = torch.from_numpy(tokens), torch.from_numpy(targets)

    def step():
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        opt.step()

    return median_time(step, ARGS.repeats)


def main() -> int:
    # As refpar's training runs (refpar/allocator.py), for both models, which take their arrays from
    # the same malloc: a step reuses the pages the one before freed instead of faulting them in again.
    keep_freed_memory()
    overrides = {} if ARGS.dropout is None else {"dropout": ARGS.dropout}
    config = model_preset(ARGS.model, dtype="float32", **overrides)
    train = TrainConfig(batch_size=ARGS.batch_size, seq_len=ARGS.seq_len)
    train.check_model(config)
    corpus = MarkovCorpus(config.vocab_size, train.seed)
    tokens, targets = corpus.batch(0, range(train.batch_size), train.seq_len)  # (B, T) each
    print(f"{ARGS.model} preset: {config.n_layer} layers, C={config.n_embd}, V={config.vocab_size}, float32, "
          f"dropout {config.dropout}; batch {train.batch_size} x {train.seq_len}; {ARGS.threads} threads; "
          f"{ARGS.clock} clock",
          flush=True)
    if ARGS.profile:
        print_profile(config, train, tokens, targets)
        return 0
    # The minimum too: on a shared machine it is the least disturbed of the timed steps.
    ours = refpar_step_time(config, train, tokens, targets)
    print(f"refpar (NumPy):       {ours[0] * 1e3:8.1f} ms per step (min {ours[1] * 1e3:.1f})", flush=True)
    try:
        theirs = torch_step_time(config, train, tokens, targets)
    except ImportError:
        print("torch is not installed: pip install 'refpar[torch]' for the comparison", flush=True)
        return 0
    print(f"PyTorch eager (CPU):  {theirs[0] * 1e3:8.1f} ms per step (min {theirs[1] * 1e3:.1f})", flush=True)
    print(f"ratio refpar / torch: {ours[0] / theirs[0]:8.2f}x (of the minima {ours[1] / theirs[1]:.2f}x)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
