"""`refpar lesson check 13`: lesson 13's checker, bf16-mixed model states under ZeRO, against the ledger's
closed forms."""

from __future__ import annotations

from lessons.checkers.common import Wrong


def check_13(mod, comm) -> str:
    from refpar.analysis.memory import Options, model_state_bytes, precision_options, unit_sizes
    from refpar.config import model_preset

    for model in (model_preset("tiny"), model_preset("tiny", n_layer=2, n_embd=48, vocab_size=101)):
        sizes = unit_sizes(model)
        for fp32_grads in (False, True):
            fields = precision_options("bfloat16", fp32_grads)
            for stage in (0, 1, 2, 3):
                opts = Options(strategy="dp" if stage == 0 else f"zero{stage}", **fields)
                for n in (1, 2, 3, 4, 7):
                    for rank in range(n):
                        want = model_state_bytes(model, n, rank, opts)
                        got = mod.model_state_bytes(dict(sizes), n, rank, stage, fp32_grads)
                        if not isinstance(got, dict) or set(got) != set(want):
                            raise Wrong("model_state_bytes must return a dict with the keys params, "
                                        "grads, master and optimizer")
                        for category, value in want.items():
                            if got[category] != value:
                                raise Wrong(
                                    f"{category} on rank {rank} of n={n}, ZeRO-{stage}"
                                    f"{' with fp32_grads' if fp32_grads else ''}, units {sizes}: "
                                    f"{got[category]}, the ledger measures {value}. Bytes per "
                                    "element: params 2, grads 2 (4 with fp32_grads, and DP/ZeRO-1 "
                                    "then keep the bf16 gradient too), master 4, optimizer 8; a "
                                    "sharded category holds this rank's part of every unit")
    return ("model_state_bytes equals the bytes refpar's ledger measures for DP and ZeRO-1/2/3 in "
            "bf16-mixed, uneven shards and fp32 gradients included")
