"""compress_model: full rank reproduces the dense model, error falls as keep grows, whitening, emulator run."""

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import gemma3 as _gemma3
from tiny_models import llama as _llama
from tiny_models import logits as _logits
from tiny_models import token_ids as _ids

import jax_neuronmm
from jax_neuronmm.compress import svd
from jax_neuronmm.models import GatedMLP, Gemma, GemmaConfig, Llama, LlamaConfig, from_preset, generate
from jax_neuronmm.models.layers import activation_fn, attention_mask
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline import Recipe, compress_model
from jax_neuronmm.pipeline.compression import RankRoundingWarning


@pytest.mark.parametrize("make_model", [_llama, _gemma3], ids=["llama", "gemma3"])
def test_full_rank_reproduces_dense_logits(make_model):
    model = make_model()
    ids = _ids(2, 9, seed=1)
    dense = np.asarray(_logits(model, ids), np.float64)
    compressed = compress_model(model, Recipe(rank="full", include=("mlp", "attention")))
    assert all(isinstance(layer.mlp, SVDMLP) for layer in compressed.layers)
    assert all(isinstance(layer.self_attn.q_proj, SVDLinear) for layer in compressed.layers)
    assert isinstance(model.layers[0].mlp, GatedMLP), "the input model must stay dense"
    np.testing.assert_allclose(np.asarray(_logits(compressed, ids), np.float64), dense, atol=2e-4, rtol=0)


def test_error_falls_as_keep_grows():
    model = _llama()
    ids = _ids(2, 12, seed=2)
    dense = np.asarray(_logits(model, ids), np.float64)
    errors = []
    for keep in (0.25, 0.6, 1.0):
        compressed = compress_model(model, Recipe(keep=keep, block=8))
        errors.append(np.abs(np.asarray(_logits(compressed, ids), np.float64) - dense).max())
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 10 * errors[-1] or errors[0] > 1e-2, errors


def test_keep_sets_block_aligned_ranks():
    model = _llama()
    compressed = compress_model(model, Recipe(keep=0.5, block=8))
    mlp = compressed.layers[0].mlp
    for proj, (k, n) in ((mlp.gate_proj, (96, 200)), (mlp.down_proj, (200, 96))):
        expected = jax_neuronmm.compress.block_aligned_rank(k, n, 0.5, 8)
        assert proj.u.shape == (k, expected) and proj.v.shape == (expected, n)


def test_whitened_beats_plain_svd_on_calibration_data():
    model = _llama(seed=3)
    # Calibrate on a skewed token distribution so the activations are far from isotropic.
    calib = jnp.asarray(np.random.default_rng(4).integers(0, 48, size=(6, 40)))
    dense = np.asarray(_logits(model, calib), np.float64)
    plain = compress_model(model, Recipe(keep=0.4, block=8))
    whitened = compress_model(model, Recipe(keep=0.4, method="whitened", block=8), calibration_ids=calib)
    plain_error = np.abs(np.asarray(_logits(plain, calib)) - dense).mean()
    whitened_error = np.abs(np.asarray(_logits(whitened, calib)) - dense).mean()
    assert whitened_error < plain_error, (whitened_error, plain_error)


@pytest.mark.parametrize("steps", [(), ("sequential",)])
def test_too_few_calibration_tokens_warn_once_saying_how_many_the_width_needs(steps, caplog):
    # 30 tokens for Gram matrices 96 (hidden) and 200 (intermediate) wide: every projection input is damped. This
    # used to warn once per projection per layer.
    model = _llama(seed=5)
    calib = _ids(1, 30, seed=6)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        compress_model(
            model, Recipe(keep=0.5, method="whitened", steps=steps, block=8), calibration_ids=calib, progress=False
        )
    damped = [w for w in caught if issubclass(w.category, svd.WhiteningDampedWarning)]
    assert len(damped) == 1, [str(w.message) for w in damped]
    message = str(damped[0].message)
    assert "K up to 200, from 30 tokens" in message
    assert "it needs at least 200 calibration tokens" in message, message
    assert sum("Gram" in record.getMessage() for record in caplog.records) == 1


def test_steps_given_as_one_string_is_named():
    with pytest.raises(TypeError, match=r"steps: got the string 'sequential', expected a sequence of step names"):
        compress_model(_llama(), Recipe(keep=0.5, method="whitened", steps="sequential"), calibration_ids=_ids(1, 8, 0))


def test_bad_arguments():
    model = _llama()
    with pytest.raises(ValueError, match="method"):
        compress_model(model, Recipe(method="qr"))
    with pytest.raises(ValueError, match="include"):
        compress_model(model, Recipe(include=("embedding",)))
    with pytest.raises(ValueError, match="calibration_ids"):
        compress_model(model, Recipe(method="whitened"))
    with pytest.raises(ValueError, match="keep"):
        compress_model(model, Recipe(keep=1.5))
    with pytest.raises(TypeError, match="compressed already"):
        compress_model(compress_model(model, Recipe(keep=0.5)))
    # A rank no projection can have: named before any factoring (it used to fail inside truncated_svd).
    smallest = min(model.config.hidden_size, model.config.intermediate_size)
    with pytest.raises(ValueError, match=f"rank: got 100000, expected at most {smallest}: layers/0/mlp/"):
        compress_model(model, Recipe(rank=100000))


def test_emulator_backend_generates_the_same_tokens():
    config = LlamaConfig.preset("tiny", vocab_size=101, hidden_size=64, intermediate_size=136, num_layers=1)
    model = compress_model(Llama(config, rngs=nnx.Rngs(5)), Recipe(keep=0.8, block=8))
    prompt = np.random.default_rng(6).integers(0, 101, size=(1, 5))
    expected = np.asarray(generate(model, prompt, 3))
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        got = np.asarray(generate(model, prompt, 3))
    np.testing.assert_array_equal(got, expected)
    assert len(prof.runs) >= 3 and prof.latency_us["trn1"] > 0


def _gemma3_mixed_layers():
    """Six layers, two attention structures (sliding window and full): shapes no other test compiles."""
    types = ("sliding_attention",) * 4 + ("full_attention", "sliding_attention")
    config = GemmaConfig.preset(
        "gemma3-tiny", vocab_size=211, hidden_size=72, intermediate_size=152, num_layers=6, layer_types=types
    )
    return Gemma(config, rngs=nnx.Rngs(3))


def test_calibration_pass_compiles_once_per_layer_structure(caplog):
    model = _gemma3_mixed_layers()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        compress_model(
            model,
            Recipe(keep=0.5, include=("mlp", "attention"), method="whitened", block=8),
            calibration_ids=_ids(3, 61, seed=4),
            progress=False,
        )
    compiles = [
        record
        for record in caplog.records
        if "_tapped_forward" in record.getMessage() and "Compiling" in record.getMessage()
    ]
    # Six layers, one pass each, two structures (sliding / full attention): two compilations, not six.
    assert len(compiles) == 2, [record.getMessage()[:120] for record in compiles]


def test_whitened_mlp_factors_match_a_numpy_reference():
    """Layer 0's MLP factors equal whitened_svd on the float64 numpy reference of its inputs (the normed hidden
    state, and act(x·gate)·(x·up) for down_proj), which the compiled calibration pass records."""
    model = _gemma3_mixed_layers()
    batch, tokens = 4, 41  # 164 tokens: more than the 152 features of down_proj's input, so XᵀX is definite
    ids = _ids(batch, tokens, seed=5)
    layer = model.layers[0]
    x = model.embed(jnp.asarray(ids, jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(tokens), (batch, tokens))
    mask = attention_mask(positions, positions, jnp.ones((batch, tokens), bool), layer.self_attn.spec.sliding_window)
    h = x + layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(x), positions, mask, None, None)[0])
    mlp_in = np.asarray(layer.pre_feedforward_layernorm(h), np.float64).reshape(-1, 72)
    gate, up, down = (
        np.asarray(getattr(layer.mlp, name).kernel[...], np.float64) for name in ("gate_proj", "up_proj", "down_proj")
    )
    hidden = np.asarray(activation_fn(layer.mlp.activation)(jnp.asarray(mlp_in @ gate, jnp.float32)), np.float64) * (
        mlp_in @ up
    )
    rank = 24
    compressed = compress_model(model, Recipe(rank=rank, method="whitened"), calibration_ids=ids, progress=False)
    mlp = compressed.layers[0].mlp
    for kernel, inputs, factored in ((gate, mlp_in, mlp.gate_proj), (down, hidden, mlp.down_proj)):
        ref_u, ref_v = svd.whitened_svd(kernel, inputs, rank)
        got = inputs @ np.asarray(factored.u[...], np.float64) @ np.asarray(factored.v[...], np.float64)
        want = inputs @ ref_u @ ref_v
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)


def test_compress_model_warns_when_block_rounding_moves_the_kept_fraction():
    # hidden 64, MLP 256: budget 64*256*keep/320 = 46.1 at keep 0.9; block 32 rounds it to 32 (0.625 kept).
    model = from_preset("gemma3", "tiny", num_layers=1, vocab_size=300, hidden_size=64, intermediate_size=256)
    with pytest.warns(RankRoundingWarning, match=r"keep=0.9: ranks rounded to multiples of block=32 keep 0.625"):
        compress_model(model, Recipe(keep=0.9, method="svd", block=32), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RankRoundingWarning)
        compress_model(model, Recipe(keep=0.9, method="svd", block=8), progress=False)  # rank 48: 0.9375 kept
        compress_model(model, Recipe(rank=32, method="svd"), progress=False)  # an explicit rank is what was asked
