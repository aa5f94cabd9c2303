"""Quality metrics against brute-force float64 references on small random models."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_neuronmm.models import from_preset
from jax_neuronmm.models.evaluation import predictions
from jax_neuronmm.models.quality import (
    ClozeItem,
    cloze_correct,
    cloze_items,
    greedy_continuations,
    tokens_until_divergence,
    top1_agreement,
)
from jax_neuronmm.pipeline import Recipe
from jax_neuronmm.pipeline.compression import compress_model


@pytest.fixture(scope="module")
def pair():
    dense = from_preset("llama", "tiny", num_layers=2, vocab_size=97)
    return dense, compress_model(dense, Recipe(keep=0.3, method="svd", block=4), progress=False)


def _logits64(model, ids):
    return np.asarray(model(jnp.asarray(ids)), np.float64)


def test_predictions_match_float64_log_softmax(pair):
    dense, _ = pair
    windows = np.random.default_rng(0).integers(0, 97, (3, 13))
    logits = _logits64(dense, windows[:, :-1])
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_p, windows[:, 1:, None], -1)[..., 0]
    got = predictions(dense, windows)
    np.testing.assert_allclose(got.log_likelihood, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.top1, logits.argmax(-1))
    np.testing.assert_allclose(got.perplexity, np.exp(-expected.mean()), rtol=1e-5)


def test_top1_agreement_counts_equal_argmaxes(pair):
    dense, small = pair
    windows = np.random.default_rng(1).integers(0, 97, (4, 17))
    expected = np.mean(_logits64(dense, windows[:, :-1]).argmax(-1) == _logits64(small, windows[:, :-1]).argmax(-1))
    assert 0 < expected < 1  # the compressed model disagrees somewhere, and agrees somewhere
    assert top1_agreement(predictions(small, windows), predictions(dense, windows)) == pytest.approx(expected)


def test_greedy_continuations_match_a_cache_free_loop(pair):
    dense, small = pair
    prompts = np.random.default_rng(2).integers(0, 97, (3, 5))
    for model in pair:
        ids = prompts.copy()
        for _ in range(4):  # greedy by full forward passes: no KV cache, no decode-step primitive
            ids = np.concatenate([ids, _logits64(model, ids)[:, -1].argmax(-1)[:, None]], axis=1)
        np.testing.assert_array_equal(greedy_continuations(model, prompts, 4), ids[:, 5:])


def test_tokens_until_divergence():
    reference = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    other = np.array([[1, 2, 9, 4], [0, 6, 7, 8], [1, 1, 1, 1]])
    np.testing.assert_array_equal(tokens_until_divergence(other, reference), [2, 0, 4])
    with pytest.raises(ValueError, match=r"continuations: got shape \(3, 3\), expected the reference's \(3, 4\)"):
        tokens_until_divergence(other[:, :3], reference)


def test_cloze_items_take_sentences_whose_last_word_the_context_names():
    filler = " ".join(f"w{i}" for i in range(40))
    text = (
        f"{filler} The garden was green. She walked along the path. "
        "Then she saw the garden. Nobody mentioned it. Later they found a garden and a house."
        " It was near the house. "
    )
    vocabulary = {}

    def encode(s):
        pieces = [piece for piece in s.replace(" ", "\0 ").split("\0") if piece]
        return [vocabulary.setdefault(piece, len(vocabulary)) for piece in pieces]

    items = cloze_items(text, encode, count=5, context_tokens=20)
    # Out: "green" and "path" (not named before), "it" (too short), the first "house" (not named before). In:
    # "garden" and the last "house", each named before its sentence.
    assert [item.word for item in items] == ["garden", "house"]
    for item in items:
        assert len(item.context) == 20 and list(item.target) == encode(" " + item.word)[-1:]
    assert cloze_items(text, encode, count=1, context_tokens=20)[0].word == "garden"
    assert cloze_items(text, encode, count=5, context_tokens=500) == []  # not enough context before any sentence


def test_cloze_correct_matches_float64_argmax(pair):
    dense, _ = pair
    rng = np.random.default_rng(3)
    items = [ClozeItem(rng.integers(0, 97, 9), rng.integers(0, 97, n), "w") for n in (1, 2, 1, 3)]
    # One item the model surely gets right: its target is the model's own greedy continuation.
    context = rng.integers(0, 97, 9)
    items.append(ClozeItem(context, greedy_continuations(dense, np.concatenate([[1], context])[None], 2)[0], "w"))
    expected = []
    for item in items:
        row = np.concatenate([[1], item.context, item.target])
        top1 = _logits64(dense, row[None, :-1])[0].argmax(-1)
        expected.append(bool(np.all(top1[-len(item.target) :] == item.target)))
    np.testing.assert_array_equal(cloze_correct(dense, items, bos_id=1), expected)
    assert expected[-1]


def test_decode_weight_bytes_count_every_projection_and_the_head(pair):
    from flax import nnx

    from jax_neuronmm.models.decode import decode_weight_bytes

    for model in pair:
        # Brute force over the parameter tree: every projection's kernel or factors, and the head, which for the
        # tiny Llama preset is the tied embedding (read whole by the head); norms are left out.
        assert model.lm_head is None
        leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
        expected = sum(
            value.get_value().size
            for path, value in leaves
            if (path[-1] in ("kernel", "u", "v") and "layers" in path) or path[0] == "embed_tokens"
        )
        assert decode_weight_bytes(model) == 2 * expected
        assert decode_weight_bytes(model, bytes_per_weight=1) == expected
    dense, small = pair
    assert decode_weight_bytes(small) < decode_weight_bytes(dense)
