"""The shipped calibration / distillation windows and the technical text's training and held-out halves."""

import types

import numpy as np
import pytest

from jax_neuronmm.models import text_kinds
from jax_neuronmm.pipeline import calibration
from jax_neuronmm.pipeline.calibration import CALIBRATION_TEXT, TRAINING_TEXT


class CharTokenizer:
    """One id per character (its code point): windows can be checked against the text itself."""

    def encode(self, text, add_special_tokens=False):
        return types.SimpleNamespace(ids=[ord(c) for c in text])


def test_technical_halves_alternate_the_topics():
    from pydoc_data.topics import topics

    training, held_out = text_kinds.technical_texts()
    keys = sorted(topics)
    assert training == "\n\n".join(topics[key] for key in keys[0::2])
    assert held_out == "\n\n".join(topics[key] for key in keys[1::2])
    total = len(training) + len(held_out)
    assert 0.3 * total < len(held_out) < 0.7 * total  # both halves are substantial texts


def test_text_windows_are_consecutive_tokens_after_bos():
    text = "".join(chr(65 + i % 26) for i in range(1000))
    windows = text_kinds.text_windows(CharTokenizer(), text, 3, 17, 7, name="t")
    assert windows.shape == (3, 17) and np.all(windows[:, 0] == 7)
    np.testing.assert_array_equal(windows[:, 1:].reshape(-1), [ord(c) for c in text[: 3 * 16]])
    plain = text_kinds.text_windows(CharTokenizer(), text, 2, 10, None, name="t")
    np.testing.assert_array_equal(plain.reshape(-1), [ord(c) for c in text[:20]])
    with pytest.raises(ValueError, match=r"short text: 5 tokens, fewer than the 1 x 9 asked for"):
        text_kinds.text_windows(CharTokenizer(), "abcde", 1, 10, 0, name="short text")


def test_training_windows_alternate_the_novel_and_the_reference():
    windows = calibration.training_windows(CharTokenizer(), 4, 12, bos_id=1)
    novel = open(CALIBRATION_TEXT, encoding="utf-8").read()
    reference = text_kinds.technical_texts()[0]
    assert windows.shape == (4, 12) and np.all(windows[:, 0] == 1)
    decoded = ["".join(map(chr, row[1:])) for row in windows]
    assert decoded[0] == novel[:11] and decoded[2] == novel[11:22]
    assert decoded[1] == reference[:11] and decoded[3] == reference[11:22]
    with pytest.raises(ValueError, match="count: got 3, expected an even number >= 2"):
        calibration.training_windows(CharTokenizer(), 3)


def test_training_windows_continue_the_novel_into_chapters_13_to_49():
    def read(path):
        with open(path, encoding="utf-8") as f:
            return f.read()

    first, more = read(CALIBRATION_TEXT), read(TRAINING_TEXT)
    assert first.rstrip().endswith("Colonel Forster was going to be married.") and more.startswith("Chapter 13\n")
    span = 1000  # characters a window (after bos): 103 novel windows run past chapter 12's 101,849 characters
    count = 2 * (len(first) // span + 2)
    windows = calibration.training_windows(CharTokenizer(), count, span + 1, bos_id=1)
    novel = "".join("".join(map(chr, row[1:])) for row in windows[0::2])
    assert novel == (first.rstrip("\n") + "\n\n" + more)[: len(novel)] and len(novel) > len(first) + span
