"""How close a compressed model stays to its dense original, beyond perplexity: next-token agreement under teacher
forcing, how long greedy continuations stay identical, and a LAMBADA-style cloze task built from any text.

Perplexity can look fine while generations drift; these measure the drift directly. Each takes models with the
CausalLM call (token ids [B, T] → logits [B, T, V]) and runs on JAX's default device.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jax_neuronmm.models.evaluation import Predictions, window_predictions
from jax_neuronmm.models.generation import generate


def top1_agreement(model_predictions: Predictions, reference: Predictions) -> float:
    """Fraction of positions where both predict the same next token."""
    return float(np.mean(model_predictions.top1 == reference.top1))


def greedy_continuations(model, prompts, max_new_tokens: int) -> np.ndarray:
    """Greedy continuations [B, max_new_tokens] of prompts [B, T] (models.generate, temperature 0, no end token)."""
    prompts = np.asarray(prompts)
    return np.asarray(generate(model, prompts, max_new_tokens))[:, prompts.shape[1] :]


def tokens_until_divergence(continuations, reference) -> np.ndarray:
    """Per row of two continuations [B, n]: how many tokens agree before the first that differs (n if none)."""
    continuations, reference = np.asarray(continuations), np.asarray(reference)
    if continuations.shape != reference.shape:
        raise ValueError(f"continuations: got shape {continuations.shape}, expected the reference's {reference.shape}")
    differs = continuations != reference
    return np.where(differs.any(axis=1), differs.argmax(axis=1), continuations.shape[1])


@dataclasses.dataclass(frozen=True)
class ClozeItem:
    """context [context_tokens] token ids, then the target word's token ids (the word with its leading space)."""

    context: np.ndarray
    target: np.ndarray
    word: str


# A sentence ends at . ! or ? (with closing quotes) followed by white space.
_SENTENCE_END = re.compile(r"[.!?][\"'”’]*\s")
_LAST_WORD = re.compile(r"([A-Za-z]{4,})[\"'”’]*[.!?][\"'”’]*$")


def cloze_items(
    text: str, encode: Callable[[str], Sequence[int]], count: int, context_tokens: int = 128
) -> list[ClozeItem]:
    """LAMBADA-style items from `text`: predict the last word of a sentence from what precedes it.

    A sentence qualifies when its last word has at least 4 letters, appears in the ~context_tokens of text before
    the sentence (so the context makes it guessable) but not earlier in the sentence itself, and the tokenizer's
    tokens of the text up to the word are a prefix of those up to the word's end (the word is whole tokens). Items
    are the first `count` qualifying sentences, in text order, each with exactly context_tokens tokens of context
    (earlier text is cut off); sentences with less context before them are skipped.
    """
    items = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        sentence_start, end = start, match.end()
        start = end
        sentence = text[sentence_start:end].strip()
        found = _LAST_WORD.search(sentence)
        if found is None:
            continue
        word = found.group(1)
        word_start = sentence_start + text[sentence_start:end].rfind(word)
        before_sentence = text[max(0, sentence_start - 6 * context_tokens) : sentence_start]
        in_sentence = text[sentence_start:word_start]
        if not re.search(rf"\b{word}\b", before_sentence) or re.search(rf"\b{word}\b", in_sentence):
            continue
        prefix = list(encode(text[:word_start].rstrip(" ")))
        full = list(encode(text[: word_start + len(word)]))
        if full[: len(prefix)] != prefix or len(full) == len(prefix) or len(prefix) < context_tokens:
            continue
        items.append(ClozeItem(np.asarray(prefix[-context_tokens:]), np.asarray(full[len(prefix) :]), word))
        if len(items) == count:
            break
    return items


def cloze_correct(model, items: Sequence[ClozeItem], bos_id: int | None) -> np.ndarray:
    """Per item, whether the model's argmax predicts every token of the target word given the context and the
    word's earlier tokens (teacher forcing); bos_id, when given, is put before each context."""
    correct = np.zeros(len(items), bool)
    for index, item in enumerate(items):  # windows of one width (targets of one length) share a compilation
        row = np.concatenate([[] if bos_id is None else [bos_id], item.context, item.target]).astype(np.int32)
        top1 = np.asarray(window_predictions(model, jnp.asarray(row[None]))[1])[0]
        correct[index] = bool(np.all(top1[-len(item.target) :] == item.target))
    return correct


@dataclasses.dataclass(frozen=True)
class RatioInterval:
    """Perplexity of a model over its reference's on the same windows, and a bootstrap interval of that ratio."""

    ratio: float
    low: float
    high: float
    windows: int


def perplexity_ratio_interval(
    model_predictions: Predictions,
    reference: Predictions,
    *,
    confidence: float = 0.95,
    samples: int = 2000,
    seed: int = 0,
) -> RatioInterval:
    """The perplexity ratio model / reference on the same windows, with a percentile bootstrap interval over windows:
    windows are drawn with replacement `samples` times (both models scored on the same draw, so the interval is of
    the paired difference), each draw's ratio exp(mean NLL(model) − mean NLL(reference)). Positions within a window
    are not independent, hence windows, not tokens, are resampled."""
    model_ll, reference_ll = np.asarray(model_predictions.log_likelihood), np.asarray(reference.log_likelihood)
    if model_ll.shape != reference_ll.shape or model_ll.ndim != 2:
        raise ValueError(
            f"model_predictions: log-likelihood shape {model_ll.shape}, expected the reference's {reference_ll.shape} "
            "(both [W, L-1] on the same windows)"
        )
    # Windows have one length, so the mean over windows of per-window means is the mean over tokens.
    return window_ratio_interval(
        window_nll(model_predictions),
        window_nll(reference),
        confidence=confidence,
        samples=samples,
        seed=seed,
    )


def window_nll(predictions: Predictions) -> np.ndarray:
    """Each window's mean next-token negative log-likelihood [W], float64: what a results file keeps per window."""
    return -np.mean(np.asarray(predictions.log_likelihood), axis=1, dtype=np.float64)


def window_ratio_interval(
    model_nll, reference_nll, *, confidence: float = 0.95, samples: int = 2000, seed: int = 0
) -> RatioInterval:
    """`perplexity_ratio_interval` from per-window mean negative log-likelihoods [W] of the model and its reference
    on the same W windows of one length (what a results file keeps so that intervals can be recomputed from it)."""
    model_nll, reference_nll = np.asarray(model_nll, np.float64), np.asarray(reference_nll, np.float64)
    if model_nll.shape != reference_nll.shape or model_nll.ndim != 1 or model_nll.size < 1:
        raise ValueError(
            f"model_nll: shape {model_nll.shape}, expected the reference's {reference_nll.shape} (both [W] per-window "
            "means on the same W >= 1 windows)"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: got {confidence!r}, expected 0 < confidence < 1")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: got {samples!r}, expected an int >= 1")
    excess = model_nll - reference_nll
    draws = np.random.default_rng(seed).integers(0, excess.size, size=(samples, excess.size))
    low, high = np.quantile(np.exp(excess[draws].mean(axis=1)), [(1 - confidence) / 2, (1 + confidence) / 2])
    return RatioInterval(float(np.exp(excess.mean())), float(low), float(high), int(excess.size))
