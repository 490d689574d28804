"""Lesson 2: what one training step holds, measured by the memory ledger and written as formulas.

    python lessons/scripts/02_memory.py [--batch B] [--seq-len T]

One process trains the tiny GPT-2 for one AdamW step (float64, then bf16-mixed). The memory ledger
(refpar/memory.py) counts every array the process allocates, by category; its peaks are printed
next to the formulas of the lesson: the model states in bytes per parameter (8 + 8 + 16 in float64,
the ZeRO paper's 2 + 2 + 12 in mixed precision), and the activations kept for the backward,
block by block (refpar/analysis/activations.py: Korthikanti et al. 2022's terms, as refpar keeps them).
"""

import argparse
from dataclasses import replace

from refpar.analysis.activations import (
    PAPER,
    Keep,
    embed_bytes,
    head_bytes,
    korthikanti_layer_bytes,
    layer_bytes,
)
from refpar.analysis.intra_layer import rank_shape
from refpar.analysis.memory import unit_sizes
from refpar.comm.communicator import world
from refpar.config import Plan, TrainConfig, model_preset
from refpar.engine import parallelize, train
from refpar.mesh import DeviceMesh

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=16)
args = parser.parse_args()

comm = world()
cfg = TrainConfig(steps=1, batch_size=args.batch, seq_len=args.seq_len)
STATES = ("params", "grads", "master", "optimizer")


def one_step(dtype: str):
    model = model_preset("tiny", dtype=dtype)
    par = parallelize(model, cfg, DeviceMesh(comm, {"dp": 1}), Plan())
    train(par)
    return model, par.ledger


model, ledger = one_step("float64")
psi = sum(unit_sizes(model).values())
L, C, a, B, T = model.n_layer, model.n_embd, model.n_head, cfg.batch_size, cfg.seq_len
print(f"GPT-2 tiny: {L} blocks, C = {C} channels, {a} heads, Ψ = {psi:,} parameters; batch B = {B} "
      f"x T = {T} tokens; one AdamW step on one process")
print("model states after the step, measured by the ledger | bytes per parameter x Ψ")
per_param = {"params": 8, "grads": 8, "master": 0, "optimizer": 16}
for c in STATES:
    print(f"  {c:<10} {ledger.current[c]:>10,} | {per_param[c]:>2} x Ψ = {per_param[c] * psi:>10,}")
held = sum(ledger.current[c] for c in STATES)
print(f"  {'total':<10} {held:>10,} | 32 x Ψ = {32 * psi:>10,}   (float64: 8 + 8 + 16, no master copy)")
psi_block = unit_sizes(model)["h.0"]
print(f"grads peak {ledger.peak['grads']:,} = the accumulator {ledger.current['grads']:,} + one block's "
      f"gradients in flight, {psi_block:,} parameters x 8 = {8 * psi_block:,}")

r = rank_shape(model, cfg, {"dp": 1}, {"dp": 0}, sp=False, cp_algo=None)
one_block = layer_bytes(model, r)
embed, head = embed_bytes(model, r), head_bytes(model, r)
print(f"activations peak {ledger.peak['activations']:,} = {L} blocks x {one_block:,} + embedding {embed:,} "
      f"+ head {head:,} = {L * one_block + embed + head:,}")
paper = layer_bytes(model, replace(r, e=2), keep=PAPER)
print(f"  one block at the paper's 2 bytes and 1-byte masks: {paper:,} = sbh (34 + 5as/h) = "
      f"{korthikanti_layer_bytes(T, B, C, a):,.0f}")
# refpar's block, term by term: the paper's list at 8 bytes, then what refpar keeps beyond it
steps = [layer_bytes(model, r, keep=k) for k in (PAPER, Keep(None, False, False), Keep(None, True, False))]
steps.append(one_block)
print(f"  one block in float64: {one_block:,} = the paper's list at 8 bytes {steps[0]:,} + dropout masks "
      f"kept as 8-byte scales {steps[1] - steps[0]:,} + LayerNorm's 1/std {steps[2] - steps[1]:,} + the "
      f"GELU's tanh {steps[3] - steps[2]:,}")

model, ledger = one_step("bfloat16")
print("bf16-mixed, the same step: model states measured | the ZeRO paper's bytes per parameter x Ψ")
per_param = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
for c in STATES:
    print(f"  {c:<10} {ledger.current[c]:>10,} | {per_param[c]:>2} x Ψ = {per_param[c] * psi:>10,}")
held = sum(ledger.current[c] for c in STATES)
print(f"  {'total':<10} {held:>10,} | 16 x Ψ = {16 * psi:>10,}   (2 + 2 + 12: K = 12 for Adam)")
r16 = rank_shape(model, cfg, {"dp": 1}, {"dp": 0}, sp=False, cp_algo=None)
print(f"activations peak {ledger.peak['activations']:,} = {L} x {layer_bytes(model, r16):,} + "
      f"{embed_bytes(model, r16):,} + {head_bytes(model, r16):,}")
