"""Typical wrong attempts at the course's exercises, each refused by its checker with a sentence that
teaches: what the answer got, what refpar measures, and which idea of the lesson it missed. One
process each (the answer is graded in this process, as `refpar lesson check N` does for them)."""

from __future__ import annotations

import pytest

from lessons import course as lessons
from lessons.checks import EXERCISES, check


def _wrong(n: int, tmp_path, old: str, new: str):
    """The reference solution of exercise n with `old` replaced by `new`: one typical mistake."""
    solution = (lessons.LESSONS / "solutions" / EXERCISES[n].file).read_text()
    assert solution.count(old) == 1, old
    path = tmp_path / EXERCISES[n].file
    path.write_text(solution.replace(old, new))
    return path


def _told(n: int, path, capsys) -> str:
    assert check(n, path) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"lesson {n}: not yet: "), out
    return out[len(f"lesson {n}: not yet: "):].strip()


# ------------------------------------------------------------------------------------- lesson 2
@pytest.mark.parametrize("old, new, told", [
    # the paper's equation 1 as printed: 2-byte activations, 1-byte masks
    ("return paper + square + rstd + tanh", "return B * T * C * (34 + 5 * heads * T // C)",
     "block_activation_bytes(B=8, T=16, C=32, heads=4, e=8) = 180,224; the ledger measures 919,552 for one "
     "block (float64); that is Korthikanti et al.'s sbh (34 + 5as/h), the paper's 2-byte count with 1-byte "
     "masks, not what refpar keeps"),
    # the paper's list, forgetting what refpar's GELU keeps
    ("return paper + square + rstd + tanh", "return paper + square + rstd",
     "block_activation_bytes(B=8, T=16, C=32, heads=4, e=8) = 788,480; the ledger measures 919,552 for one "
     "block (float64); you are short by exactly the GELU's tanh, one (B, T, 4C) array"),
    # one moment instead of AdamW's two
    ('"master": 0, "optimizer": 16 * psi', '"master": 0, "optimizer": 8 * psi',
     "optimizer for Ψ = 54,976 in float64: 439,808 (8 bytes per parameter), the ledger measures 879,616 (16 "
     "per parameter). AdamW keeps two moments per parameter"),
    # mixed precision without its master copy
    ('"master": 4 * psi, "optimizer": 8 * psi', '"master": 0, "optimizer": 8 * psi',
     "master for Ψ = 54,976 in bf16-mixed: 0 (0 bytes per parameter), the ledger measures 219,904 (4 per "
     "parameter). Which of the four needs a copy in another format when the weights are 16-bit?"),
], ids=["paper-at-2-bytes", "no-gelu-tanh", "one-moment", "no-master-copy"])
def test_lesson_2_wrong_memory_counts_are_told_the_missing_term(tmp_path, capsys, old, new, told):
    assert _told(2, _wrong(2, tmp_path, old, new), capsys) == told
