"""Token windows of the text the package ships for calibration and distillation, and of held-out text.

Whitened SVD keeps the directions its calibration activations use, so the calibration text decides what a compressed
model still does well: calibrated on the novel alone, Gemma 3 270M's MLPs at keep 0.8 (whitened + sequential) keep
1.74x dense perplexity on held-out chapters of the novel but 10.6x on Python's language reference; on windows of both
kinds in turn, 1.92x and 2.11x (benchmarks/results/accuracy_report.md). `training_windows` gives that mix: windows of
the public-domain novel in jax_neuronmm/data/ (chapters 1-12, then 13-49) alternating with windows of half of the
Python Language Reference topic texts that CPython ships (`pydoc_data.topics`); `technical_texts` also returns the
other half, never trained on, for evaluation. Distillation gains from text it has not seen: on 480 windows instead of
160, Gemma 3 270M's MLPs at keep 0.8 end nearer the dense model on both held-out texts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jax_neuronmm.models.compression import CALIBRATION_TEXT, TRAINING_TEXT


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


def interleaved(*parts: np.ndarray) -> np.ndarray:
    """Windows [sum of counts, T] taking one from each part in turn (so any leading slice mixes the texts)."""
    return np.stack([window for group in zip(*parts) for window in group])


def training_windows(tokenizer, count: int, seq_len: int = 256, bos_id: int | None = None) -> np.ndarray:
    """`count` (even) windows [count, seq_len] for calibration and distillation: one of the shipped novel (chapters
    1-12, then 13-49), one of the training half of the Python reference, in turn; the first k of them are the
    calibration windows of a pipeline that distills on all of them. With Gemma 3's tokenizer and 256-token windows
    the reference half holds 241 windows, so count is at most 482."""
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
