"""The dense model's own samples as distillation text: prompts, generation, cache, mixing, step scaling, and the
step kept chosen on generated windows no step trains on."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jax_neuronmm.models import from_preset, generate
from jax_neuronmm.pipeline import Recipe, pruning, self_distillation
from jax_neuronmm.pipeline.compression import compress_model
from jax_neuronmm.pipeline.distill import DistillOptions, distill_factors
from jax_neuronmm.pipeline.self_distillation import (
    SelfTextOptions,
    generated_windows,
    mixed_windows,
    prompts,
    scaled_options,
)

VOCAB, BOS = 300, 7


@pytest.fixture(scope="module")
def tiny():
    model = from_preset("llama", "tiny", num_layers=2, vocab_size=VOCAB)
    rng = np.random.default_rng(11)
    user = rng.integers(0, VOCAB, (10, 21))
    user[:, 0] = BOS  # the windows share a beginning-of-sequence token
    return model, user


def _options(tmp_path, **overrides):
    fields = dict(windows=7, from_start=0.3, prompt_tokens=5, batch=3, holdout=2, calibration_windows=2, seed=4)
    fields["cache_dir"] = str(tmp_path)
    return SelfTextOptions(**{**fields, **overrides})


def test_prompts_start_from_bos_or_cut_from_the_user_text(tiny, tmp_path):
    _, user = tiny
    options = _options(tmp_path)
    start, text = prompts(user, options)
    assert start.shape == (2, 1) and np.all(start == BOS)  # round(7 * 0.3) from the shared first token
    assert text.shape == (5, 6) and np.all(text[:, 0] == BOS)
    for row in text[:, 1:]:  # each prompt is 5 consecutive tokens of some window (after its first token)
        assert any(np.array_equal(row, window[o : o + 5]) for window in user for o in range(1, user.shape[1] - 4)), row
    # Windows without a shared first token: every sample continues a prompt of the text, none starts from BOS.
    mixed_first = user.copy()
    mixed_first[0, 0] = BOS + 1
    start, text = prompts(mixed_first, options)
    assert start.shape == (0, 1) and text.shape == (7, 5)
    # ... unless a start token is given: then the start rows begin with it, the text prompts are plain text.
    start, text = prompts(mixed_first, _options(tmp_path, start_id=3))
    assert start.shape == (2, 1) and np.all(start == 3) and text.shape == (5, 5)


def test_generated_windows_are_the_seeded_samples_and_are_cached(tiny, tmp_path, monkeypatch):
    model, user = tiny
    options = _options(tmp_path)
    windows = generated_windows(model, user, options, progress=False)
    assert windows.shape == (7, 21) and windows.dtype == np.int32
    assert np.all((windows >= 0) & (windows < VOCAB))
    start, text = prompts(user, options)
    np.testing.assert_array_equal(windows[:2, :1], start)
    np.testing.assert_array_equal(windows[2:, :6], text)
    # The first batch of text prompts is models.generate's sample with the documented seed.
    expected = np.asarray(
        generate(model, text[:3], 21 - 6, temperature=1.0, top_p=0.95, seed=4 * 1_000_003 + 1 * 10_007 + 0)
    )
    np.testing.assert_array_equal(windows[2:5], expected)
    cached = [f for f in os.listdir(tmp_path) if f.endswith(".npy")]
    assert len(cached) == 1

    # Same model and settings: read from the cache (generate is not called again).
    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(self_distillation, "generate", no_generation)
    np.testing.assert_array_equal(generated_windows(model, user, options, progress=False), windows)
    monkeypatch.undo()

    # Another seed: other samples, another cache file; the same seed again in a fresh cache: the same samples.
    other = generated_windows(model, user, _options(tmp_path, seed=5), progress=False)
    assert not np.array_equal(other, windows)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".npy")]) == 2
    fresh = generated_windows(model, user, _options(tmp_path / "fresh"), progress=False)
    np.testing.assert_array_equal(fresh, windows)


def test_a_corrupt_cache_file_is_not_used(tiny, tmp_path):
    model, user = tiny
    options = _options(tmp_path)
    windows = generated_windows(model, user, options, progress=False)
    (path,) = [tmp_path / f for f in os.listdir(tmp_path) if f.endswith(".npy")]
    np.save(path, np.full((7, 21), VOCAB + 3, np.int32))  # ids outside the vocabulary
    np.testing.assert_array_equal(generated_windows(model, user, options, progress=False), windows)
    path.write_bytes(b"not an npy file")
    np.testing.assert_array_equal(generated_windows(model, user, options, progress=False), windows)


def test_the_cache_key_follows_the_weights(tiny, tmp_path):
    model, user = tiny
    changed = from_preset("llama", "tiny", num_layers=2, vocab_size=VOCAB, seed=1)
    generated_windows(model, user, _options(tmp_path), progress=False)
    generated_windows(changed, user, _options(tmp_path), progress=False)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".npy")]) == 2


def test_mixed_windows_hold_out_only_generated_ones():
    rng = np.random.default_rng(3)
    user, generated = rng.integers(0, 50, (5, 9)), rng.integers(50, 100, (11, 9))
    mixed = mixed_windows(user, generated, holdout=3)
    assert mixed.shape == (16, 9)
    np.testing.assert_array_equal(mixed[-3:], generated[-3:])
    # Every user window and every trained generated window once, each kind in its order, spread through the mix.
    train = mixed[:-3]
    np.testing.assert_array_equal(train[train[:, 0] < 50], user)
    np.testing.assert_array_equal(train[train[:, 0] >= 50], generated[:8])
    assert (train[:8, 0] < 50).sum() >= 2
    with pytest.raises(ValueError, match="holdout"):
        mixed_windows(user, generated, holdout=11)
    with pytest.raises(ValueError, match="generated"):
        mixed_windows(user, generated[:, :5], holdout=2)


@pytest.mark.parametrize(
    "windows,steps,rate", [(16, 40, 2e-3 * (16 / 480) ** 0.5), (100, 200, 2e-3 * (100 / 480) ** 0.5)]
)
def test_scaled_options_take_at_most_two_epochs_at_a_smaller_step(windows, steps, rate):
    options = scaled_options(windows, holdout=6)
    assert options.steps == steps and options.holdout == 6
    np.testing.assert_allclose(options.learning_rate, rate)
    np.testing.assert_allclose(options.pruned_learning_rate, 5e-4 * (windows / 480) ** 0.5)
    big = scaled_options(2000, holdout=4)
    assert big.steps == DistillOptions().steps and big.learning_rate == DistillOptions().learning_rate


def _kl64(student_model, teacher_model, ids):
    student = np.asarray(student_model(jnp.asarray(ids)), np.float64)
    teacher = np.asarray(teacher_model(jnp.asarray(ids)), np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(teacher), log_softmax(student)
    return float(np.mean(np.sum(np.exp(p) * (p - q), -1)))


def test_the_step_kept_is_the_best_on_held_out_generated_windows(tiny, tmp_path):
    model, user = tiny
    generated = generated_windows(model, user, _options(tmp_path, windows=9, holdout=3), progress=False)
    ids = mixed_windows(user, generated, holdout=3)
    held = generated[-3:]

    def fresh():
        return compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)

    compressed, seen = fresh(), []
    options = DistillOptions(
        steps=12, batch=2, learning_rate=3e-3, relative=False, warmup=0, eval_every=4, holdout=3, vocab_top_k=0
    )
    distill_factors(
        compressed, model, ids, options, progress=False, on_step=lambda done, m: seen.append(_kl64(m, model, held))
    )
    # Every position and the whole vocabulary: the held-out loss is the full KL on the generated held-out windows.
    best = min([_kl64(fresh(), model, held)] + [seen[i - 1] for i in (4, 8, 12)])
    np.testing.assert_allclose(_kl64(compressed, model, held), best, rtol=1e-3)


def test_compress_model_generates_training_text_by_default(tiny, tmp_path, monkeypatch):
    model, user = tiny
    calls = []
    real = self_distillation.generated_windows

    def recorded(dense, ids, options, **kwargs):
        calls.append((ids.shape, options))
        return real(dense, ids, dataclasses.replace(options, cache_dir=str(tmp_path)), **kwargs)

    monkeypatch.setattr(self_distillation, "generated_windows", recorded)
    pruned_on = []
    real_prune = pruning.prune_mlps
    monkeypatch.setattr(
        pruning, "prune_mlps", lambda m, ids, *a, **k: pruned_on.append(ids) or real_prune(m, ids, *a, **k)
    )
    compress_model(model, Recipe(keep=0.8), calibration_ids=user, progress=False)
    assert len(calls) == 1 and calls[0][0] == user.shape and calls[0][1] == SelfTextOptions()
    # The layer-wise steps calibrate on the user's windows and the first 32 generated ones (all trained on).
    generated = real(model, user, dataclasses.replace(SelfTextOptions(), cache_dir=str(tmp_path)), progress=False)
    np.testing.assert_array_equal(pruned_on[0], np.concatenate([user, generated[:32]]))
    # Off on request, and off by default when the user passes their own corpus.
    compress_model(model, Recipe(keep=0.8, self_text=False), calibration_ids=user, progress=False)
    compress_model(model, Recipe(keep=0.8), calibration_ids=user, distill_ids=user, progress=False)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="self_text"):
        compress_model(model, Recipe(keep=0.8, steps=("fisher",), self_text=True), calibration_ids=user, progress=False)
    with pytest.raises(TypeError, match="self_text"):
        compress_model(model, Recipe(keep=0.8, self_text="yes"), calibration_ids=user, progress=False)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("windows", 0, "windows"),
        ("holdout", 20, "holdout"),
        ("calibration_windows", 17, "calibration_windows"),
        ("top_p", 0.0, "top_p"),
        ("from_start", 1.5, "from_start"),
    ],
)
def test_self_text_options_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        SelfTextOptions(**{"windows": 20, "holdout": 4, "calibration_windows": 8, field: value})


def test_the_default_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_NEURONMM_CACHE", str(tmp_path / "mine"))
    assert self_distillation.default_cache_dir() == str(tmp_path / "mine" / "generated")
    monkeypatch.delenv("JAX_NEURONMM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert self_distillation.default_cache_dir() == str(tmp_path / "xdg" / "jax_neuronmm" / "generated")


def test_the_cache_key_does_not_depend_on_the_ids_integer_type(tiny, tmp_path, monkeypatch):
    model, user = tiny
    user = user.copy()
    user[:, 0] = np.arange(user.shape[0])  # no shared first token: the prompts are the ids' own integer type
    windows = generated_windows(model, user.astype(np.int64), _options(tmp_path), progress=False)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(self_distillation, "generate", no_generation)
    np.testing.assert_array_equal(generated_windows(model, user.astype(np.int32), _options(tmp_path)), windows)
