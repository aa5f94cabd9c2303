"""distill_fp8 on a small model: training through the rounding lowers the fp8 model's KL from the dense model below
round-to-nearest's, only the targeted kernels change, and bad input is named."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.models import from_preset
from jax_neuronmm.nn.nnx import Linear
from jax_neuronmm.pipeline import DistillOptions, Recipe, SelfTextOptions, compress_model, distill_fp8, quantize_model
from jax_neuronmm.weights import WeightFormat

VOCAB = 300


@pytest.fixture(scope="module")
def tiny():
    model = from_preset("llama", "tiny", num_layers=2, vocab_size=VOCAB)
    return model, np.random.default_rng(3).integers(0, VOCAB, (20, 29))


def _kl64(student_model, teacher_model, ids):
    """Mean next-token KL (float64) from the teacher's distribution to the student's at every position."""

    def log_softmax(model):
        logits = np.asarray(model(jnp.asarray(ids)), np.float64)
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    teacher, student = log_softmax(teacher_model), log_softmax(student_model)
    return float(np.mean(np.sum(np.exp(teacher) * (teacher - student), axis=-1)))


def test_training_through_the_rounding_beats_rounding_to_nearest(tiny):
    model, ids = tiny
    kernel_before = np.array(model.layers[0].mlp.up_proj.kernel[...])
    options = DistillOptions(steps=60, batch=4, learning_rate=1e-3, warmup=5, vocab_top_k=0, holdout=0)
    trained = distill_fp8(model, ids, options=options, self_text=False, progress=False)
    nearest = quantize_model(model, targets=("attention", "mlp"), progress=False)
    before, after = _kl64(nearest, model, ids[:8]), _kl64(trained, model, ids[:8])
    assert after < 0.5 * before, (before, after)  # measured: 5.4e-5 to 8.3e-6
    for layer in trained.layers:  # every targeted projection is stored in fp8
        for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
            assert isinstance(module, Linear) and module.format is WeightFormat.FP8_E4M3
    assert trained.lm_head is None  # the tied head stays the embedding
    np.testing.assert_array_equal(trained.embed_tokens.embedding[...], model.embed_tokens.embedding[...])
    np.testing.assert_array_equal(model.layers[0].mlp.up_proj.kernel[...], kernel_before)  # the input is unchanged


def test_only_the_targeted_kernels_train(tiny):
    model, ids = tiny
    options = DistillOptions(steps=6, batch=2, learning_rate=1e-3, warmup=1, vocab_top_k=0, holdout=0)
    trained = distill_fp8(model, ids, targets="mlp", options=options, self_text=False, progress=False)
    for got, dense in zip(trained.layers, model.layers, strict=True):
        assert isinstance(got.self_attn.q_proj, nnx.Linear)  # attention untouched and not rounded
        np.testing.assert_array_equal(got.self_attn.q_proj.kernel[...], dense.self_attn.q_proj.kernel[...])
        np.testing.assert_array_equal(got.input_layernorm.weight[...], dense.input_layernorm.weight[...])
        assert got.mlp.up_proj.format is WeightFormat.FP8_E4M3
    # Training moved the MLP kernels off their round-to-nearest values.
    nearest = quantize_model(model, targets="mlp", progress=False)
    moved = [
        not np.array_equal(np.asarray(a.mlp.up_proj.kernel[...]), np.asarray(b.mlp.up_proj.kernel[...]))
        for a, b in zip(trained.layers, nearest.layers, strict=True)
    ]
    assert any(moved)


def test_generated_text_joins_the_training_windows(tiny, tmp_path):
    model, ids = tiny
    self_text = SelfTextOptions(windows=5, prompt_tokens=4, batch=5, holdout=2, calibration_windows=1, seed=1)
    self_text = SelfTextOptions(**{**self_text.__dict__, "cache_dir": str(tmp_path)})
    options = DistillOptions(steps=4, batch=2, learning_rate=1e-3, warmup=1, vocab_top_k=0)
    trained = distill_fp8(model, ids[:6], options=options, self_text=self_text, progress=False)
    assert trained.layers[1].self_attn.v_proj.format is WeightFormat.FP8_E4M3
    assert len([f for f in tmp_path.iterdir() if f.suffix == ".npy"]) == 1  # the samples were generated and cached


def test_bad_input_is_named(tiny):
    model, ids = tiny
    with pytest.raises(ValueError, match=r"distill_fp8: targets=\('head',\)"):
        distill_fp8(model, ids, targets="head")
    with pytest.raises(ValueError, match="distill_fp8: distill_ids has shape"):
        distill_fp8(model, ids.astype(np.float32))
    with pytest.raises(ValueError, match="distill_ids"):
        distill_fp8(model, ids + VOCAB)
    with pytest.raises(TypeError, match="self_text"):
        distill_fp8(model, ids, self_text="yes")
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    with pytest.raises(TypeError, match="distill_fp8: layer 0 mlp.gate_proj is a"):
        distill_fp8(compressed, ids)
    with pytest.raises(TypeError, match="expected a CausalLM"):
        distill_fp8(model.layers[0], ids)
