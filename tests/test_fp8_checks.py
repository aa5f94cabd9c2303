"""Argument and content checks around fp8 weights: checkpoints refuse fp8 contents Trainium cannot use on save
and on load, fp8 is not a model's parameter dtype, and quantization's arguments (damping, block sizes, Gram
matrices, dtypes) are checked with errors that name them."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tiny_models
from hf_checkpoints import write_hf_checkpoint

from jax_neuronmm.compress import FP8_DTYPE, CheckpointError, dequantize_fp8, gptq_fp8, quantize_fp8
from jax_neuronmm.compress import checkpoint as checkpoint_module
from jax_neuronmm.compress.checkpoint import load_compressed, save_compressed
from jax_neuronmm.compress.prune import prune_neurons
from jax_neuronmm.models import Llama, load_checkpoint, load_compressed_checkpoint, load_gguf, load_hf
from jax_neuronmm.pipeline import compress_checkpoint, quantize_model

# --- item 5: fp8 contents of checkpoints ------------------------------------------------------------------------


def fp8_params(rng, value=None, scale_value=None):
    """{"proj": {"kernel": fp8 [40, 13], "kernel_scale": float32 [13]}, "norm": float32 [40]}; with `value`, the
    kernel's element (3, 4) set to it; with `scale_value`, the scale's element 5."""
    kernel, scale = (np.asarray(a) for a in quantize_fp8(rng.standard_normal((40, 13))))
    if value is not None:
        kernel = kernel.copy()
        kernel[3, 4] = value
    if scale_value is not None:
        scale = scale.copy()
        scale[5] = scale_value
    return {"proj": {"kernel": kernel, "kernel_scale": scale}, "norm": rng.standard_normal(40).astype(np.float32)}


@pytest.mark.parametrize("value", [np.nan, 256.0, -448.0])
def test_save_refuses_fp8_values_trainium_cannot_hold(tmp_path, rng, value):
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=r"'proj/kernel' holds 1 value\(s\) beyond ±240 or NaN.*quantize_fp8"):
        save_compressed(path, fp8_params(rng, value=value))
    assert not path.exists()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_save_refuses_non_finite_scales(tmp_path, rng, value):
    with pytest.raises(ValueError, match=r"'proj/kernel_scale' \(the scales of 'proj/kernel'\) holds 1 NaN or ±inf"):
        save_compressed(tmp_path / "w.safetensors", fp8_params(rng, scale_value=value))
    # A float32 tensor that is not an fp8 weight's scales may hold anything.
    save_compressed(tmp_path / "other.safetensors", {"x_scale": np.array([np.nan], np.float32)})


@pytest.mark.parametrize(
    "value,scale_value,message",
    [
        (448.0, None, r"'proj/kernel' holds 1 value\(s\) beyond ±240"),
        (np.nan, None, r"'proj/kernel' holds 1 value\(s\) beyond ±240 or NaN"),
        (None, np.nan, r"'proj/kernel_scale' \(the scales of 'proj/kernel'\) holds 1 NaN"),
    ],
)
def test_load_refuses_fp8_contents_whose_checksums_hold(tmp_path, rng, monkeypatch, value, scale_value, message):
    """A file whose bytes and checksums agree (as a tampered file with its sha256 recomputed does) but whose fp8
    values Trainium cannot use: written with the save check patched out, refused on load."""
    path = tmp_path / "w.safetensors"
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "fp8_content_problems", lambda paths, tensors: [])
        save_compressed(path, fp8_params(rng, value=value, scale_value=scale_value))
    with pytest.raises(CheckpointError, match=rf"checkpoint .*: fp8 tensors that Trainium cannot use: {message}"):
        load_compressed(path)
    good = tmp_path / "good.safetensors"
    save_compressed(good, fp8_params(rng))
    loaded, _ = load_compressed(good)
    assert loaded["proj"]["kernel"].dtype == FP8_DTYPE


# --- item 6: fp8 is not a parameter dtype -------------------------------------------------------------------------

FP8_MESSAGE = r"dtype=float8_e4m3fn: fp8 is a weight format .*pipeline.quantize_model\(model\)"


def test_loaders_refuse_fp8_and_int_parameter_dtypes(tmp_path, rng):
    directory = tmp_path / "hf"
    write_hf_checkpoint(rng, str(directory))
    # load_checkpoint hands an HF directory to load_hf.
    for loader, op in ((load_hf, "load_hf"), (load_compressed_checkpoint, "load_compressed_checkpoint")):
        for dtype in (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, "float8_e4m3fn"):
            with pytest.raises(TypeError, match=f"{op}: {FP8_MESSAGE}"):
                loader(str(directory), dtype=dtype)
    with pytest.raises(TypeError, match=f"load_hf: {FP8_MESSAGE}"):
        load_checkpoint(str(directory), dtype=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=f"load_gguf: {FP8_MESSAGE}"):
        load_gguf(str(tmp_path / "model.gguf"), dtype=jnp.float8_e4m3fn)  # refused before the file is opened
    with pytest.raises(TypeError, match="load_gguf: dtype=float8_e5m2: fp8 is a weight format"):
        load_gguf(str(tmp_path / "model.gguf"), dtype="float8_e5m2")
    with pytest.raises(TypeError, match=f"compress_checkpoint: {FP8_MESSAGE}"):
        compress_checkpoint(str(directory), str(tmp_path / "out"), dtype=jnp.float8_e4m3fn)
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="load_hf: dtype=int8: expected a float parameter dtype, one of float16"):
        load_hf(str(directory), dtype=jnp.int8)
    with pytest.raises(TypeError, match="Llama: dtype=int8: expected a float parameter dtype"):
        Llama(tiny_models.llama().config, dtype=jnp.int8)
    with pytest.raises(TypeError, match=f"Llama: {FP8_MESSAGE}"):
        Llama(tiny_models.llama().config, dtype=jnp.float8_e4m3fn)
    model = load_hf(str(directory), dtype=jnp.bfloat16)  # float dtypes load as before
    assert model.dtype == jnp.bfloat16


# --- item 7: quantization's arguments -----------------------------------------------------------------------------


def gram_of(rng, tokens, k):
    x = rng.standard_normal((tokens, k))
    return x.T @ x


def test_quantize_model_checks_damping():
    model = tiny_models.llama()
    ids = tiny_models.token_ids(2, 8, seed=1)
    for damping in (np.nan, -5, "0.1", np.inf, True):
        with pytest.raises(ValueError, match=r"quantize_model: damping=.*; expected a finite number >= 0"):
            quantize_model(model, calibration_ids=ids, damping=damping, progress=False)
    with pytest.raises(ValueError, match="quantize_model: damping=nan"):
        quantize_model(model, damping=float("nan"), progress=False)  # without calibration ids too


def test_gptq_fp8_checks_its_arguments(rng):
    w, gram = rng.standard_normal((30, 7)), gram_of(rng, 100, 30)
    for name, value in (("block", 0), ("block", 2.5), ("column_chunk", 0), ("column_chunk", True)):
        with pytest.raises(ValueError, match=rf"gptq_fp8: {name}={value!r}; expected a positive int"):
            gptq_fp8(w, gram, **{name: value})
    with pytest.raises(ValueError, match="gptq_fp8: damping=nan"):
        gptq_fp8(w, gram, damping=float("nan"))
    bad = gram.copy()
    bad[2, 5] = bad[5, 2] = np.nan
    with pytest.raises(ValueError, match=r"gptq_fp8: gram holds 2 NaN or ±inf value\(s\)"):
        gptq_fp8(w, bad)
    with pytest.raises(ValueError, match="gptq_fp8: gram with damping=0.01 is not positive definite"):
        gptq_fp8(w, -gram)
    skew = gram.copy()
    skew[0, 1] += 0.5 * np.abs(gram).max()
    with pytest.raises(ValueError, match="gptq_fp8: gram is not symmetric"):
        gptq_fp8(w, skew)
    values, scale = gptq_fp8(w, gram, block=7, column_chunk=3)  # ragged blocks and chunks still work
    assert values.shape == (30, 7) and np.all(np.abs(np.asarray(values, np.float32)) <= 240)


def test_prune_neurons_checks_its_gram(rng):
    down, gram = rng.standard_normal((12, 5)), gram_of(rng, 50, 12)
    bad = gram.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"prune_neurons: gram holds 1 NaN or ±inf value\(s\)"):
        prune_neurons(bad, down, 6)
    indefinite = gram - 2 * np.linalg.eigvalsh(gram).max() * np.outer(np.eye(12)[3], np.eye(12)[3])
    with pytest.raises(ValueError, match="prune_neurons: gram with damping=0.0001 is not positive definite"):
        prune_neurons(indefinite, down, 6)
    dead = gram.copy()
    dead[4], dead[:, 4] = 0.0, 0.0  # a neuron that never fires: singular, needs damping
    with pytest.raises(ValueError, match="prune_neurons: gram with damping=0 is not positive definite"):
        prune_neurons(dead, down, 6, damping=0.0)
    kept, rows = prune_neurons(dead, down, 6)
    assert len(kept) == 6 and 4 not in kept and rows.shape == (6, 5)


def test_quantize_fp8_and_dequantize_fp8_dtypes(rng):
    w = rng.standard_normal((20, 6))
    for dtype in (jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.float8_e4m3, jnp.int8):
        with pytest.raises(TypeError, match=r"quantize_fp8: w has dtype .*; expected float16, bfloat16, float32"):
            quantize_fp8(jnp.asarray(w).astype(dtype))
    values, scale = quantize_fp8(np.zeros((0, 32), np.float32))  # no rows: every column's scale is 1
    assert values.shape == (0, 32) and values.dtype == FP8_DTYPE
    np.testing.assert_array_equal(scale, np.ones(32, np.float32))
    values, scale = quantize_fp8(w)
    for dtype in (jnp.int32, np.int8, None, jnp.float8_e4m3fn):
        with pytest.raises(TypeError, match=r"dequantize_fp8: dtype=.*; expected one of float16, bfloat16"):
            dequantize_fp8(values, scale, dtype=dtype)
    want = np.asarray(values, np.float64) * np.asarray(scale, np.float64)
    got = dequantize_fp8(jnp.asarray(values).view(jnp.float8_e4m3), scale)  # the same bits under Trainium's name
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
