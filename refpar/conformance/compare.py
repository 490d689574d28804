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


WORST = {"grads": "grad_worst", "params": "param_worst"}  # the torch cases' names of the worst tensor


def worst_key(key: str) -> str:
    """The row's key naming the tensor where difference `key` is largest."""
    return WORST.get(key, f"{key}_worst")


def diff_keys(row: dict) -> list[str]:
    """The differences a row holds: the loss and each compared quantity named with its worst tensor
    (grads and params; the DeepSpeed cases' m and v; ...)."""
    return ["loss"] + [k for k in row if worst_key(k) in row]


def merge_ranks(rows_per_rank: list[list[dict]]) -> list[dict]:
    """Per step, the worst rank's differences (every rank compares its own shards)."""
    out = []
    for rows in zip(*rows_per_rank, strict=True):
        row = dict(rows[0])
        for key in diff_keys(row):
            name = None if key == "loss" else worst_key(key)
            top = max(rows, key=lambda r, k=key: r[k])
            row[key] = top[key]
            if name:
                row[name] = top[name]
        out.append(row)
    return out
