"""Token windows of the text the package ships for calibration and distillation.

Whitened SVD keeps the directions its calibration activations use, so the calibration text decides what a compressed
model still does well: calibrated on one kind of text, a model keeps that kind and loses others. `training_windows`
therefore mixes two kinds: windows of the public-domain novel in jax_neuronmm/data/ (chapters 1-12, then 13-49)
alternating with windows of half of the Python Language Reference topic texts that CPython ships
(`models.text_kinds.technical_texts`, whose other half is held out for evaluation). Distillation gains from text it
has not seen, so it takes more windows of the same mix than calibration needs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jax_neuronmm.models.text_kinds import DATA_DIR, technical_texts, text_windows

CALIBRATION_TEXT = os.path.join(DATA_DIR, "pride_and_prejudice_ch01-12.txt")
# More of the novel for distillation: chapters 13-49, after the calibration text.
TRAINING_TEXT = os.path.join(DATA_DIR, "pride_and_prejudice_ch13-49.txt")


def interleaved(*parts: np.ndarray) -> np.ndarray:
    """Windows [sum of counts, T] taking one from each part in turn (so any leading slice mixes the texts)."""
    return np.stack([window for group in zip(*parts) for window in group])


def training_windows(tokenizer, count: int, seq_len: int = 256, bos_id: int | None = None) -> np.ndarray:
    """`count` (even) windows [count, seq_len] for calibration and distillation: one of the shipped novel (chapters
    1-12, then 13-49), one of the training half of the Python reference, in turn; the first k of them are the
    calibration windows of a pipeline that distills on all of them. The reference half bounds count (ValueError
    naming the text that is too short)."""
    if count < 2 or count % 2:
        raise ValueError(f"count: got {count!r}, expected an even number >= 2 (one window of each text in turn)")
    parts = (Path(path).read_text(encoding="utf-8").rstrip("\n") for path in (CALIBRATION_TEXT, TRAINING_TEXT))
    novel = "\n\n".join(parts)
    half = count // 2
    return interleaved(
        text_windows(tokenizer, novel, half, seq_len, bos_id, name="the shipped novel"),
        text_windows(
            tokenizer, technical_texts()[0], half, seq_len, bos_id, name="the Python reference's training half"
        ),
    )
