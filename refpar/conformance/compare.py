"""Differences between refpar's arrays and another framework's, one number per tensor."""

from __future__ import annotations

import numpy as np


def rel_diff(got, want) -> float:
    """max |got - want| / max |want|: a relative difference that a zero entry cannot blow up."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} against {want.shape}")
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / max(scale, np.finfo(np.float64).tiny) if got.size else 0.0


def worst(got: dict, want: dict) -> tuple[float, str]:
    """(largest rel_diff, its tensor's name) over the names of `want`."""
    diffs = {name: rel_diff(got[name], want[name]) for name in want}
    name = max(diffs, key=diffs.get)
    return diffs[name], name


def step_row(loss_refpar: float, loss_torch: float, grads: tuple[float, str],
             params: tuple[float, str]) -> dict:
    return {"loss_refpar": loss_refpar, "loss_torch": loss_torch,
            "loss": abs(loss_torch - loss_refpar) / abs(loss_refpar),
            "grads": grads[0], "grad_worst": grads[1], "params": params[0], "param_worst": params[1]}


def merge_ranks(rows_per_rank: list[list[dict]]) -> list[dict]:
    """Per step, the worst rank's differences (every rank compares its own shards)."""
    out = []
    for rows in zip(*rows_per_rank, strict=True):
        row = dict(rows[0])
        for key, name in (("grads", "grad_worst"), ("params", "param_worst"), ("loss", None)):
            top = max(rows, key=lambda r, k=key: r[k])
            row[key] = top[key]
            if name:
                row[name] = top[name]
        out.append(row)
    return out
