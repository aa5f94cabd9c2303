"""Texts of several kinds for judging a compressed model on text no compression step saw.

A user calibrates on a few thousand tokens of their own text and then serves whatever arrives, so a compressed
model is measured on every kind here, and the headline is the worst. `TEXT_KINDS` names them: the held-out parts of
the two kinds the shipped calibration mix trains on (the novel's chapters 50-61, the held-out half of the Python
reference topics) and three kinds the shipped mix never holds (a software license, the Declaration of
Independence, CPython standard-library docstrings). Sources and licenses: jax_neuronmm/data/SOURCES.txt.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jax_neuronmm.models.calibration import technical_texts, text_windows
from jax_neuronmm.models.compression import EVALUATION_TEXT

_DATA = Path(EVALUATION_TEXT).parent
LICENSE_TEXT = os.path.join(_DATA, "gpl-3.0.txt")
DECLARATION_TEXT = os.path.join(_DATA, "declaration_of_independence.txt")
LIBRARY_DOCS_TEXT = os.path.join(_DATA, "cpython_library_docstrings.txt")
# kind -> where its text comes from (a file, or the held-out half of the Python reference topics)
TEXT_KINDS = {
    "novel": EVALUATION_TEXT,
    "python reference": "pydoc_data.topics (held-out half)",
    "license": LICENSE_TEXT,
    "declaration": DECLARATION_TEXT,
    "library docs": LIBRARY_DOCS_TEXT,
}


def kind_text(kind: str) -> str:
    """The text of `kind` (a key of TEXT_KINDS)."""
    if kind not in TEXT_KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {tuple(TEXT_KINDS)}")
    if kind == "python reference":
        return technical_texts()[1]
    return Path(TEXT_KINDS[kind]).read_text(encoding="utf-8").strip()


def kind_windows(tokenizer, kind: str, seq_len: int, bos_id: int | None, max_windows: int | None = None) -> np.ndarray:
    """As many whole windows [W, seq_len] of `kind`'s text as it holds (at most max_windows): bos_id (when given)
    then consecutive tokens (`calibration.text_windows`). ValueError naming the kind when it holds none."""
    span = seq_len - (bos_id is not None)
    tokens = len(tokenizer.encode(kind_text(kind), add_special_tokens=False).ids)
    count = tokens // span if max_windows is None else min(tokens // span, max_windows)
    if count < 1:
        raise ValueError(f"kind {kind!r}: {tokens} tokens, fewer than one window of {span}")
    return text_windows(tokenizer, kind_text(kind), count, seq_len, bos_id, name=f"kind {kind!r}")
