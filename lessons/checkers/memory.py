"""Lesson 2's checker: the model states and one block's activations, against the closed forms that
tests/test_memory*.py hold to refpar's memory ledger (refpar/analysis/memory.py, activations.py)."""

from __future__ import annotations

from dataclasses import replace

from lessons.checkers.common import Wrong
from refpar.analysis.activations import PAPER, Keep, core_bytes, layer_bytes
from refpar.analysis.intra_layer import rank_shape
from refpar.analysis.memory import Options, model_state_bytes, precision_options, unit_sizes
from refpar.config import TrainConfig, model_preset

STATES = ("params", "grads", "master", "optimizer")
# (B, T, C, heads, dtype): the lesson's run, then shapes where no two terms are the same size
SHAPES = ((8, 16, 32, 4, "float64"), (3, 10, 48, 6, "bfloat16"), (2, 33, 64, 8, "float32"))


def _states(mod) -> None:
    for model in (model_preset("tiny"), model_preset("tiny", n_layer=2, n_embd=48, vocab_size=101)):
        psi = sum(unit_sizes(model).values())
        for name, dtype in (("float64", "float64"), ("bf16-mixed", "bfloat16")):
            want = model_state_bytes(model, 1, 0, Options(strategy="dp", **precision_options(dtype)))
            got = mod.model_state_bytes(psi, name)
            if not isinstance(got, dict) or set(got) != set(STATES):
                raise Wrong("model_state_bytes must return a dict with the keys params, grads, master and "
                            f"optimizer; it returned {got!r}")
            for c in STATES:
                if got[c] != want[c]:
                    per = got[c] / psi if psi else 0
                    raise Wrong(f"{c} for Ψ = {psi:,} in {name}: {got[c]:,} ({per:g} bytes per parameter), "
                                f"the ledger measures {want[c]:,} ({want[c] // psi} per parameter)"
                                + (". AdamW keeps two moments per parameter" if c == "optimizer" else "")
                                + (". Which of the four needs a copy in another format when the weights "
                                   "are 16-bit?" if c == "master" else ""))


def _explain(got: int, want: int, counted: dict[str, int], missing: dict[str, int]) -> str:
    """What a wrong count is, in the lesson's words: a known formula, or the right one less a term."""
    for name, size in counted.items():
        if got == size:
            return f"; that is {name}, not what refpar keeps"
    for name, size in missing.items():
        if want - got == size:
            return f"; you are short by exactly {name}"
    if got > want:
        return f"; you count {got - want:,} bytes more: is a term counted twice, or at e bytes where it is 1?"
    return f"; you are short by {want - got:,}: which term of the lesson's list is missing?"


def _activations(mod) -> None:
    for B, T, C, heads, dtype in SHAPES:
        model = model_preset("tiny", n_embd=C, n_head=heads, dtype=dtype, n_positions=64)
        r = rank_shape(model, TrainConfig(batch_size=B, seq_len=T), {"dp": 1}, {"dp": 0}, sp=False,
                       cp_algo=None)
        want = layer_bytes(model, r)
        got = mod.block_activation_bytes(B, T, C, heads, r.e)
        if got == want:
            continue
        e = r.e
        counted = {  # formulas a learner may write, each named as the lesson names it
            "Korthikanti et al.'s sbh (34 + 5as/h), the paper's 2-byte count with 1-byte masks":
                layer_bytes(model, replace(r, e=2), keep=PAPER),
            "the paper's list at e bytes with 1-byte masks": layer_bytes(model, r, keep=PAPER),
        }
        missing = {  # terms a count usually leaves out
            "the GELU's tanh, one (B, T, 4C) array": B * T * 4 * C * e,
            "the two LayerNorms' 1/std, one value per token each": 2 * B * T * e,
            "the attention's T x T squares (softmax output, its mask, the dropout's output)":
                core_bytes(model, r),
            "the dropout masks at e bytes instead of 1":
                want - layer_bytes(model, r, keep=Keep(1, True, True)),
        }
        raise Wrong(f"block_activation_bytes(B={B}, T={T}, C={C}, heads={heads}, e={e}) = {got:,}; the "
                    f"ledger measures {want:,} for one block ({dtype})"
                    + _explain(got, want, counted, missing))


def check_02(mod, comm) -> str:
    _states(mod)
    _activations(mod)
    return ("model_state_bytes and block_activation_bytes equal what refpar's ledger measures, in float64 "
            "and bf16-mixed, for three block shapes")
