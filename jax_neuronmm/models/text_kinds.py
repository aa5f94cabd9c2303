"""Texts of several kinds for judging a compressed model on text no compression step saw.

A user calibrates on a few thousand tokens of their own text and then serves whatever arrives, so a compressed
model is measured on every kind here, and the headline is the worst. `TEXT_KINDS` names them: the held-out parts of
the two kinds the shipped calibration mix trains on (the novel's chapters 50-61, the held-out half of the Python
reference topics) and four kinds the shipped mix never holds (a software license, the Declaration of
Independence, the Constitution of the United States, CPython standard-library docstrings). The Declaration is one
text a model may recite (837 words, 3-4 windows); the Constitution is founding-era legal prose of the same register
long enough for 16 windows. Sources and licenses: jax_neuronmm/data/SOURCES.txt.
`text_windows` cuts any text into token windows; the compression pipeline's calibration text
(`jax_neuronmm.pipeline.calibration`) is cut the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Public-domain and free texts shipped with the package (jax_neuronmm/data/SOURCES.txt).
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
# Chapters 50-61 of the shipped novel: the chapters before them are the pipeline's calibration and training text.
EVALUATION_TEXT = os.path.join(DATA_DIR, "pride_and_prejudice_ch50-61.txt")
LICENSE_TEXT = os.path.join(DATA_DIR, "gpl-3.0.txt")
DECLARATION_TEXT = os.path.join(DATA_DIR, "declaration_of_independence.txt")
CONSTITUTION_TEXT = os.path.join(DATA_DIR, "us_constitution_1787.txt")
LIBRARY_DOCS_TEXT = os.path.join(DATA_DIR, "cpython_library_docstrings.txt")
# kind -> where its text comes from (a file, or the held-out half of the Python reference topics)
TEXT_KINDS = {
    "novel": EVALUATION_TEXT,
    "python reference": "pydoc_data.topics (held-out half)",
    "license": LICENSE_TEXT,
    "declaration": DECLARATION_TEXT,
    "constitution": CONSTITUTION_TEXT,
    "library docs": LIBRARY_DOCS_TEXT,
}


def technical_texts() -> tuple[str, str]:
    """(training, held-out) halves of the Python Language Reference topic texts CPython ships (pydoc_data.topics):
    the topics in key order, alternately to one and the other, so each holds every kind of topic and none of the
    other's text."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return "\n\n".join(topics[key] for key in keys[0::2]), "\n\n".join(topics[key] for key in keys[1::2])


def text_windows(tokenizer, text: str, count: int, seq_len: int, bos_id: int | None, *, name: str) -> np.ndarray:
    """The first `count` windows [count, seq_len] of `text`'s tokens: bos_id (when given: Gemma needs it at position
    0) then consecutive tokens. ValueError naming `name` when the text is too short."""
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids)
    span = seq_len - (bos_id is not None)
    if ids.size < count * span:
        raise ValueError(f"{name}: {ids.size} tokens, fewer than the {count} x {span} asked for")
    windows = ids[: count * span].reshape(count, span)
    return windows if bos_id is None else np.concatenate([np.full((count, 1), bos_id), windows], axis=1)


def kind_text(kind: str) -> str:
    """The text of `kind` (a key of TEXT_KINDS)."""
    if kind not in TEXT_KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {tuple(TEXT_KINDS)}")
    if kind == "python reference":
        return technical_texts()[1]
    return Path(TEXT_KINDS[kind]).read_text(encoding="utf-8").strip()


def kind_windows(tokenizer, kind: str, seq_len: int, bos_id: int | None, max_windows: int | None = None) -> np.ndarray:
    """As many whole windows [W, seq_len] of `kind`'s text as it holds (at most max_windows): bos_id (when given)
    then consecutive tokens (`text_windows`). ValueError naming the kind when it holds none."""
    span = seq_len - (bos_id is not None)
    tokens = len(tokenizer.encode(kind_text(kind), add_special_tokens=False).ids)
    count = tokens // span if max_windows is None else min(tokens // span, max_windows)
    if count < 1:
        raise ValueError(f"kind {kind!r}: {tokens} tokens, fewer than one window of {span}")
    return text_windows(tokenizer, kind_text(kind), count, seq_len, bos_id, name=f"kind {kind!r}")
