"""The model family a page shows, picked by the user: GPT-2 or Llama (refpar.viz.expected.FAMILIES)."""

import streamlit as st

from refpar.viz.expected import FAMILIES


def family_picker(where=st) -> str:
    """A radio of the families (the key "family", so that the choice follows the user from page to
    page); returns the chosen family's preset name."""
    label = where.radio("model family", tuple(FAMILIES), horizontal=True, key="family",
                        help="GPT-2: refpar's tiny GPT-2 (4 heads). Llama: llama-tiny, RMSNorm, RoPE, "
                             "SwiGLU and 4 query heads over 2 kv heads (grouped-query attention)")
    return FAMILIES[label]
