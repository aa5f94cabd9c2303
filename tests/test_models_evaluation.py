"""models.perplexity against a float64 numpy reference on ragged windows, an exact uniform-model case, batching,
and bad arguments named."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig, perplexity
from jax_neuronmm.pipeline import Recipe, compress_model

VOCAB = 101


def _random(cls, config, seed):
    """Every parameter random; norm weights around their identity (1 for Llama, 0 for Gemma's 1 + w)."""
    model = cls(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.standard_normal(param.shape)
        if "norm" in "/".join(map(str, path)):
            value = (0.0 if cls is Gemma else 1.0) + 0.3 * noise
        else:
            value = 0.2 * noise  # logits well away from uniform
        param.set_value(jnp.asarray(value, jnp.float32))
    return model


def _models():
    llama = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_layers=2)
    gemma = GemmaConfig.preset("gemma3-tiny", vocab_size=VOCAB, hidden_size=48, intermediate_size=72)
    return {"llama": _random(Llama, llama, 1), "gemma3": _random(Gemma, gemma, 2)}


MODELS = _models()


def _reference(model, windows) -> float:
    """exp(mean NLL), every window scored on its own; log-softmax and the mean in float64."""
    nll = []
    for window in windows:
        logits = np.asarray(model(jnp.asarray(window[None, :-1])), np.float64)[0]
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll.extend(-logp[np.arange(len(window) - 1), window[1:]])
    return math.exp(np.mean(nll))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(1, 2), (3, 7), (5, 13)])
def test_matches_float64_reference(name, shape):
    model = MODELS[name]
    windows = np.random.default_rng(sum(shape)).integers(0, VOCAB, size=shape)
    want = _reference(model, windows)
    assert want > 1.5 and abs(want - VOCAB) > 5  # far from the trivial values
    for batch_size in (1, 2, 8):
        np.testing.assert_allclose(perplexity(model, windows, batch_size=batch_size), want, rtol=2e-5)
    if shape[0] == 1:
        np.testing.assert_allclose(perplexity(model, windows[0]), want, rtol=2e-5)  # [L] is one window


def test_windows_are_scored_independently():
    model = MODELS["llama"]
    windows = np.random.default_rng(4).integers(0, VOCAB, size=(2, 9))
    a, b = (perplexity(model, w) for w in windows)
    np.testing.assert_allclose(perplexity(model, windows), math.sqrt(a * b), rtol=2e-5)  # equal counts: geometric mean


def test_uniform_model_has_perplexity_vocab():
    # Zero embeddings (tied head): every logit is 0, so each prediction has probability exactly 1 / vocab.
    model = nnx.clone(MODELS["llama"])
    model.embed_tokens.embedding.set_value(jnp.zeros_like(model.embed_tokens.embedding[...]))
    windows = np.random.default_rng(5).integers(0, VOCAB, size=(2, 6))
    np.testing.assert_allclose(perplexity(model, windows), VOCAB, rtol=1e-5)


def test_compressed_model():
    model = MODELS["llama"]
    windows = np.random.default_rng(6).integers(0, VOCAB, size=(2, 10))
    compressed = compress_model(model, Recipe(rank=8, method="svd"), progress=False)
    np.testing.assert_allclose(perplexity(compressed, windows), _reference(compressed, windows), rtol=2e-5)


@pytest.mark.parametrize(
    "ids, kwargs, error, match",
    [
        (np.zeros((2, 1), np.int32), {}, ValueError, r"perplexity: ids: got shape \(2, 1\), expected \[W, L\]"),
        (np.zeros((0, 5), np.int32), {}, ValueError, r"perplexity: ids: got shape \(0, 5\)"),
        (np.zeros((1, 2, 3), np.int32), {}, ValueError, r"perplexity: ids: got shape \(1, 2, 3\)"),
        (np.zeros((1, 4), np.float32), {}, ValueError, r"perplexity: ids: got dtype float32, expected integer"),
        (np.array([[1, VOCAB]]), {}, ValueError, rf"perplexity: ids: token id {VOCAB} is outside"),
        ([[1, 2, 3], [4, 5]], {}, ValueError, r"perplexity: ids: windows of different lengths"),
        (np.zeros((1, 4), np.int32), {"batch_size": 0}, ValueError, r"perplexity: batch_size: got 0"),
        (np.zeros((1, 4), np.int32), {"batch_size": 2.0}, TypeError, r"perplexity: batch_size: got 2\.0"),
    ],
)
def test_bad_arguments_are_named(ids, kwargs, error, match):
    with pytest.raises(error, match=match):
        perplexity(MODELS["llama"], ids, **kwargs)
    with pytest.raises(TypeError, match="perplexity: model: got str"):
        perplexity("llama", np.zeros((1, 4), np.int32))
