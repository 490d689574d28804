"""`refpar lesson check 14`: lesson 14's checker, a step's GEMM FLOPs with and without recomputation."""

from __future__ import annotations

from lessons.checkers.common import Wrong


def check_14(mod, comm) -> str:
    from refpar.analysis.flops import step_flops
    from refpar.analysis.presets import from_model_config
    from refpar.config import RECOMPUTE, model_preset

    why = {"none": "count each product of the docstring's list once in the forward and twice in the "
                   "backward; is the attention core's s x s square in, and the head?",
           "selective": "what runs again is each block's attention core, nothing else",
           "full": "what runs again is each block's whole forward, not the head's"}
    for (B, s), model in (((8, 16), model_preset("tiny")), ((8, 256), model_preset("small")),
                          ((2, 1024), model_preset("tiny", n_layer=12, n_embd=768, n_head=12,
                                                   vocab_size=50257, n_positions=1024))):
        L, h, V = model.n_layer, model.n_embd, model.vocab_size
        for mode in RECOMPUTE:  # none first: its terms are in the other two
            want = int(step_flops(from_model_config(model), B, s, mode))
            got = mod.step_flops(B, s, L, h, V, mode)
            if got != want:
                others = [m for m in RECOMPUTE if m != mode and
                          got == int(step_flops(from_model_config(model), B, s, m))]
                like = f", the count for {others[0]!r}" if others else ""
                raise Wrong(f"step_flops(B={B}, s={s}, L={L}, h={h}, V={V}, {mode!r}) = {got}{like}; "
                            f"refpar's ranks run {want} together ({got / want:.4f} of it): {why[mode]}")
    return "step_flops counts what refpar's GEMMs run, with and without recomputation, for three GPT-2 sizes"
