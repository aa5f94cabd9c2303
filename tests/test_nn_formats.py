"""The weight format as a value: one NNX class per layer shape (Linear, SVDLinear, SVDMLP) in every WeightFormat."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from nn_references import gated_mlp64

from jax_neuronmm.compress import quantize_fp8
from jax_neuronmm.nn.nnx import SVDMLP, Linear, QuantizedWeight, SVDLinear
from jax_neuronmm.weights import WeightFormat

FP8 = WeightFormat.FP8_E4M3


def dequantized(values, scale):
    return np.asarray(values, np.float64) * np.asarray(scale, np.float64)


def random_svd_linear(rng, k, n, rank, use_bias=True):
    bias = rng.standard_normal(n).astype(np.float32) if use_bias else None
    u = (rng.standard_normal((k, rank)) / np.sqrt(k)).astype(np.float32)
    v = (rng.standard_normal((rank, n)) / np.sqrt(rank) * np.logspace(-1, 1, n)).astype(np.float32)
    return SVDLinear.from_values(u, v, bias)


def test_the_format_follows_the_stored_values_and_keeps_checkpoint_names(rng):
    layer = random_svd_linear(rng, 100, 70, 13)
    assert layer.format is WeightFormat.FLOAT and not layer.format.scaled
    quantized = layer.quantized()
    assert quantized.format is FP8 and FP8.scaled and layer.format is WeightFormat.FLOAT  # the source unchanged
    assert set(nnx.state(layer)) == {"u", "v", "bias"}
    assert set(nnx.state(quantized)) == {"u", "v", "u_scale", "v_scale", "bias"}
    assert set(nnx.state(quantized, nnx.Param)) == {"bias"}  # fp8 values and scales are never trained
    assert isinstance(quantized.u, QuantizedWeight) and quantized.u[...].dtype == ml_dtypes.float8_e4m3fn
    assert WeightFormat(FP8.value) is FP8 and WeightFormat.of(ml_dtypes.float8_e4m3) is FP8


@pytest.mark.parametrize("tokens,k,n,rank", [((1,), 37, 100, 1), ((7,), 130, 200, 13), ((2, 5), 200, 1000, 130)])
def test_fp8_svd_linear_computes_its_dequantized_factors(rng, tokens, k, n, rank):
    layer = random_svd_linear(rng, k, n, rank)
    quantized = layer.quantized()
    x = rng.standard_normal(tokens + (k,)).astype(np.float32)
    u = dequantized(quantized.u[...], quantized.u_scale[...])
    v = dequantized(quantized.v[...], quantized.v_scale[...])
    want = (x.astype(np.float64) @ u) @ v + np.asarray(quantized.bias[...], np.float64)
    got = np.asarray(jax.jit(lambda m, x: m(x))(quantized, x), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Rounding to fp8 shows against the float layer, mildly.
    exact = np.asarray(layer(x), np.float64)
    assert 0 < np.abs(got - exact).max() <= 0.1 * np.abs(exact).max()


def test_one_mlp_class_serves_both_formats(rng):
    h, i, ranks = 37, 100, (5, 3, 7)
    projections = [
        random_svd_linear(rng, k, n, r, use_bias=False) for (k, n), r in zip(((h, i), (h, i), (i, h)), ranks)
    ]
    mlp = SVDMLP.from_projections(*projections, activation="gelu_tanh")
    quantized = mlp.quantized()
    assert type(quantized) is SVDMLP and quantized.format is FP8 and mlp.format is WeightFormat.FLOAT
    x = rng.standard_normal((7, h)).astype(np.float32)
    layers = (quantized.gate_proj, quantized.up_proj, quantized.down_proj)
    factors = [dequantized(f[...], s[...]) for p in layers for f, s in ((p.u, p.u_scale), (p.v, p.v_scale))]
    weights = [factors[0] @ factors[1], factors[2] @ factors[3], factors[4] @ factors[5]]
    want = gated_mlp64(x, *weights, "gelu_tanh")
    got = np.asarray(quantized(x), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(TypeError, match=r"gate_proj, up_proj, down_proj: got formats .*FP8_E4M3.*FLOAT"):
        SVDMLP.from_projections(layers[0], projections[1], projections[2])
    with pytest.raises(TypeError, match="SVDLinear.quantized: the layer is already FP8_E4M3"):
        layers[0].quantized()


def test_dense_linear_in_both_formats(rng):
    linear = nnx.Linear(100, 70, rngs=nnx.Rngs(0))
    linear.kernel.set_value(jnp.asarray(rng.standard_normal((100, 70)) / 10, jnp.float32))
    linear.bias.set_value(jnp.asarray(rng.standard_normal(70), jnp.float32))
    x = rng.standard_normal((3, 100)).astype(np.float32)
    same = Linear.from_linear(linear, WeightFormat.FLOAT)
    assert same.format is WeightFormat.FLOAT and set(nnx.state(same, nnx.Param)) == {"kernel", "bias"}
    np.testing.assert_allclose(np.asarray(same(x)), np.asarray(linear(x)), rtol=1e-6, atol=1e-6)
    fp8 = Linear.from_linear(linear)
    values, scale = quantize_fp8(linear.kernel[...])
    want = x.astype(np.float64) @ dequantized(values, scale) + np.asarray(linear.bias[...], np.float64)
    assert fp8.format is FP8 and set(nnx.state(fp8)) == {"kernel", "kernel_scale", "bias"}
    np.testing.assert_allclose(np.asarray(fp8(x), np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
