"""NNX SVDLinear / SVDMLP: dense equivalence at full rank, params, jit/grad, conversion, rank sweep, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nn_references import gated_mlp64, rel_err

from jax_neuronmm.compress import compress_params, whitened_svd
from jax_neuronmm.nn import SVDLinear
from jax_neuronmm.nn.nnx import SVDMLP


def random_linear(rng, k, n, use_bias=True):
    """An nnx.Linear with random kernel and bias (built without per-shape random-init compiles)."""
    linear = nnx.eval_shape(lambda: nnx.Linear(k, n, use_bias=use_bias, rngs=nnx.Rngs(0)))
    linear.kernel.set_value(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32))
    if use_bias:
        linear.bias.set_value(jnp.asarray(rng.standard_normal(n), jnp.float32))
    return linear


def random_module(rng, build):
    """build() with every Param set from rng (no eager random-init compiles; init itself is tested once)."""
    module = nnx.eval_shape(build)
    for _, param in nnx.iter_graph(module):
        if isinstance(param, nnx.Param):
            param.set_value(jnp.asarray(rng.standard_normal(param.shape) / np.sqrt(param.shape[0]), param.dtype))
    return module


def test_init_param_structure_and_forward(rng):
    layer = SVDLinear(100, 70, 13, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    state = nnx.state(layer, nnx.Param)
    assert set(state) == {"u", "v", "bias"}
    assert layer.u.shape == (100, 13) and layer.v.shape == (13, 70) and layer.bias.shape == (70,)
    assert layer.u.dtype == jnp.float32
    # LeCun-normal factors keep roughly unit output variance for unit inputs.
    assert 0.3 < float(jnp.std(layer.u[...]) * np.sqrt(100)) < 3
    layer.bias.set_value(jnp.asarray(rng.standard_normal(70), jnp.float32))
    x = rng.standard_normal((2, 7, 100)).astype(np.float32)
    want = (x.astype(np.float64) @ np.asarray(layer.u[...], np.float64)) @ np.asarray(layer.v[...], np.float64)
    want += np.asarray(layer.bias[...], np.float64)
    assert layer(x).shape == (2, 7, 70)
    assert rel_err(layer(x), want) < 1e-5
    no_bias = nnx.eval_shape(lambda: SVDLinear(100, 70, 13, use_bias=False, rngs=nnx.Rngs(0)))
    assert no_bias.bias is None and set(nnx.state(no_bias, nnx.Param)) == {"u", "v"}


@pytest.mark.parametrize("k, n, use_bias", [(100, 70, True), (130, 200, False)])
def test_full_rank_from_linear_equals_dense(rng, k, n, use_bias):
    linear = random_linear(rng, k, n, use_bias)
    layer = SVDLinear.from_linear(linear, rank=min(k, n))
    assert layer.rank == min(k, n) and (layer.bias is None) == (not use_bias)
    x = rng.standard_normal((7, k)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(linear.kernel[...], np.float64)
    if use_bias:
        want += np.asarray(linear.bias[...], np.float64)
    assert rel_err(layer(x), want) < 1e-5
    assert rel_err(layer(x), linear(x)) < 1e-5


def test_jit_and_grad_through_svd_linear(rng):
    layer = SVDLinear.from_linear(random_linear(rng, 40, 30), rank=9)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    jitted = nnx.jit(lambda module, inputs: module(inputs))
    np.testing.assert_allclose(jitted(layer, x), layer(x), rtol=1e-6, atol=1e-6)

    def loss(module, inputs):
        return jnp.sum(module(inputs) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer, x)
    u, v, b = (np.asarray(p[...], np.float64) for p in (layer.u, layer.v, layer.bias))
    x64 = x.astype(np.float64)
    dy = 2 * ((x64 @ u) @ v + b)
    np.testing.assert_allclose(grads["bias"][...], dy.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["v"][...], (x64 @ u).T @ dy, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["u"][...], x64.T @ (dy @ v.T), rtol=1e-4, atol=1e-4)
    # Gradient with respect to the inputs too.
    dx = jax.grad(lambda inputs: jnp.sum(layer(inputs) ** 2))(jnp.asarray(x))
    np.testing.assert_allclose(dx, dy @ v.T @ u.T, rtol=1e-4, atol=1e-4)


def test_jitted_module_reaches_the_primitive(rng):
    layer = random_module(rng, lambda: SVDLinear(16, 24, 4, rngs=nnx.Rngs(0)))
    jaxpr = jax.make_jaxpr(lambda inputs: layer(inputs))(jnp.ones((3, 16)))
    assert "svd_matmul" in str(jaxpr)
    mlp = random_module(rng, lambda: SVDMLP(16, 24, 4, rngs=nnx.Rngs(0)))
    assert "svd_mlp" in str(jax.make_jaxpr(lambda inputs: mlp(inputs))(jnp.ones((3, 16))))


def test_dtype_and_param_dtype(rng):
    layer = random_module(
        rng, lambda: SVDLinear(32, 16, 8, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    assert layer.u.dtype == jnp.float32
    assert layer(jnp.ones((2, 32), jnp.float32)).dtype == jnp.bfloat16
    half = random_module(rng, lambda: SVDLinear(32, 16, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert half.v.dtype == jnp.bfloat16 and half(jnp.ones((2, 32), jnp.float32)).dtype == jnp.float32


def test_from_linear_keep_and_error_shrinks_with_rank(rng):
    linear = random_linear(rng, 96, 120)
    x = rng.standard_normal((50, 96)).astype(np.float32)
    exact = linear(x)
    errors = [rel_err(SVDLinear.from_linear(linear, rank=rank)(x), exact) for rank in (2, 10, 40, 96)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5
    assert SVDLinear.from_linear(linear, keep=0.5, block=16).rank == 32  # 96·120·0.5/216 = 26.7 = 1.67 blocks → 2


def test_from_linear_whitened(rng):
    linear = random_linear(rng, 48, 40, use_bias=False)
    mixing = np.linalg.qr(rng.standard_normal((48, 48)))[0] * np.logspace(0, -2, 48)
    calibration = rng.standard_normal((300, 48)) @ mixing.T
    held_out = (rng.standard_normal((300, 48)) @ mixing.T).astype(np.float32)
    whitened = SVDLinear.from_linear(linear, rank=8, method="whitened", calibration=calibration)
    u, _ = whitened_svd(np.asarray(linear.kernel[...]), calibration, 8)
    np.testing.assert_allclose(whitened.u[...], u, rtol=1e-6)
    plain = SVDLinear.from_linear(linear, rank=8)
    assert rel_err(whitened(held_out), linear(held_out)) < rel_err(plain(held_out), linear(held_out))


def test_compress_params_state_loads_into_svd_model(rng):
    class Dense(nnx.Module):
        def __init__(self, linear):
            self.mlp = linear

    class Factored(nnx.Module):
        def __init__(self):
            self.mlp = SVDLinear(30, 20, 6, rngs=nnx.Rngs(0))

    linear = random_linear(rng, 30, 20)
    compressed, _ = compress_params(nnx.state(Dense(linear)), rank=6, progress=False)
    model = random_module(rng, Factored)
    assert jax.tree.structure(compressed) == jax.tree.structure(nnx.state(model))
    nnx.update(model, compressed)
    x = rng.standard_normal((4, 30)).astype(np.float32)
    np.testing.assert_allclose(model.mlp(x), SVDLinear.from_linear(linear, rank=6)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_svd_mlp_full_rank_equals_dense_gated_mlp(rng, activation):
    hidden, intermediate = 40, 72
    gate, up = random_linear(rng, hidden, intermediate, False), random_linear(rng, hidden, intermediate, False)
    down = random_linear(rng, intermediate, hidden, False)
    mlp = SVDMLP.from_linears(gate, up, down, activation=activation, rank=hidden)
    assert set(nnx.state(mlp, nnx.Param)) == {"gate_proj", "up_proj", "down_proj"}
    assert mlp.down_proj.u.shape == (intermediate, hidden)
    x = rng.standard_normal((3, 5, hidden)).astype(np.float32)
    want = gated_mlp64(x, gate.kernel[...], up.kernel[...], down.kernel[...], activation)
    assert rel_err(mlp(x), want) < 1e-5
    grads = nnx.grad(lambda module: jnp.sum(nnx.jit(lambda m, inputs: m(inputs))(module, x) ** 2))(mlp)
    assert grads["gate_proj"]["u"].shape == (hidden, hidden) and np.all(np.isfinite(grads["down_proj"]["v"][...]))
    assert float(jnp.abs(grads["up_proj"]["v"][...]).max()) > 0


def test_svd_mlp_error_shrinks_with_rank_and_whitened_helps(rng):
    hidden, intermediate = 32, 64
    gate, up = random_linear(rng, hidden, intermediate, False), random_linear(rng, hidden, intermediate, False)
    down = random_linear(rng, intermediate, hidden, False)
    mixing = np.linalg.qr(rng.standard_normal((hidden, hidden)))[0] * np.logspace(0, -2, hidden)
    calibration = rng.standard_normal((400, hidden)) @ mixing.T
    x = (rng.standard_normal((200, hidden)) @ mixing.T).astype(np.float32)
    want = gated_mlp64(x, gate.kernel[...], up.kernel[...], down.kernel[...], "silu")
    errors = [rel_err(SVDMLP.from_linears(gate, up, down, rank=rank)(x), want) for rank in (2, 8, 16, 32)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    whitened = SVDMLP.from_linears(gate, up, down, rank=8, method="whitened", calibration=calibration)
    assert rel_err(whitened(x), want) < errors[1]
    ranks = SVDMLP.from_linears(gate, up, down, rank=(4, 5, 6))
    assert (ranks.gate_proj.rank, ranks.up_proj.rank, ranks.down_proj.rank) == (4, 5, 6)


def test_bad_arguments(rng):
    with pytest.raises(ValueError, match="rank"):
        SVDLinear(10, 20, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank"):
        SVDLinear(10, 20, 11, rngs=nnx.Rngs(0))
    linear = random_linear(rng, 10, 20)
    with pytest.raises(ValueError, match="exactly one of rank= or keep="):
        SVDLinear.from_linear(linear)
    with pytest.raises(ValueError, match="keep"):
        SVDLinear.from_linear(linear, keep=2.0)
    with pytest.raises(ValueError, match="calibration"):
        SVDLinear.from_linear(linear, rank=3, method="whitened")
    with pytest.raises(ValueError, match=r"activations must have shape \[n, 10\]"):
        SVDLinear.from_linear(linear, rank=3, method="whitened", calibration=np.ones((50, 20)))
    with pytest.raises(ValueError, match="method"):
        SVDLinear.from_linear(linear, rank=3, method="qr")
    with pytest.raises(ValueError, match="activation"):
        nnx.eval_shape(lambda: SVDMLP(10, 20, 3, activation="relu", rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="has a bias"):
        SVDMLP.from_linears(linear, linear, random_linear(rng, 20, 10), rank=3)
    linear.kernel.set_value(linear.kernel[...].at[0, 0].set(jnp.inf))
    with pytest.raises(ValueError, match="NaN or Inf"):
        SVDLinear.from_linear(linear, rank=3)


@pytest.mark.parametrize(
    "build",
    [
        lambda: nnx.Conv(3, 2, kernel_size=(3, 3), rngs=nnx.Rngs(0)),
        lambda: nnx.LinearGeneral((4, 5), 6, axis=(-2, -1), rngs=nnx.Rngs(0)),
        lambda: None,
    ],
    ids=["Conv", "LinearGeneral", "None"],
)
def test_from_linear_rejects_what_is_not_a_linear(build):
    # Conv used to give a layer with u of shape (3, 3, 3, 2); LinearGeneral and None failed far away.
    with pytest.raises(TypeError, match=r"linear: got (Conv|LinearGeneral|NoneType), expected an nnx.Linear"):
        SVDLinear.from_linear(build(), rank=2)


def test_from_linears_rejects_mismatched_projections(rng):
    gate, up, down = (
        random_linear(rng, 40, 70, False),
        random_linear(rng, 40, 70, False),
        random_linear(rng, 70, 40, False),
    )
    with pytest.raises(
        ValueError, match=r"gate_proj, up_proj, down_proj: got \(in, out\) features .*'up_proj': \(40, 50\)"
    ):
        SVDMLP.from_linears(gate, random_linear(rng, 40, 50, False), down, rank=4)
    with pytest.raises(ValueError, match=r"'down_proj': \(60, 40\)"):
        SVDMLP.from_linears(gate, up, random_linear(rng, 60, 40, False), rank=4)
    with pytest.raises(TypeError, match="down_proj: got NoneType, expected Linear"):
        SVDMLP.from_linears(gate, up, None, rank=4)
    with pytest.raises(ValueError, match="activation must be one of"):
        SVDMLP.from_linears(gate, up, down, rank=4, activation="relu6")
    # from_projections assembles SVDLinear layers as they are, with the same checks.
    layers = [SVDLinear.from_linear(linear, rank=4) for linear in (gate, up, down)]
    mlp = SVDMLP.from_projections(*layers, activation="silu")
    assert mlp.gate_proj is layers[0] and (mlp.down_proj.in_features, mlp.down_proj.out_features) == (70, 40)
    with pytest.raises(TypeError, match="gate_proj: got Linear, expected SVDLinear"):
        SVDMLP.from_projections(gate, *layers[1:])
    with pytest.raises(ValueError, match="up_proj"):
        SVDMLP.from_projections(layers[0], SVDLinear.from_linear(random_linear(rng, 40, 50, False), rank=4), layers[2])


def test_from_factors_keeps_the_given_factors_and_the_bias(rng):
    linear = random_linear(rng, 37, 53)
    linear.param_dtype = jnp.bfloat16
    u, v = rng.standard_normal((37, 11)), rng.standard_normal((11, 53))  # float64, cast to the param dtype
    layer = SVDLinear.from_factors(linear, u, v)
    assert layer.u.dtype == layer.v.dtype == jnp.bfloat16 and layer.rank == 11
    np.testing.assert_array_equal(
        np.asarray(layer.u[...], np.float64), np.asarray(jnp.asarray(u, jnp.bfloat16), np.float64)
    )
    np.testing.assert_array_equal(np.asarray(layer.bias[...]), np.asarray(linear.bias[...]))
    x = rng.standard_normal((5, 37)).astype(np.float32)
    expected = x.astype(np.float64) @ np.asarray(layer.u[...], np.float64) @ np.asarray(
        layer.v[...], np.float64
    ) + np.asarray(linear.bias[...], np.float64)
    assert rel_err(layer(jnp.asarray(x)), expected) < 2e-2
    with pytest.raises(
        ValueError, match=r"u, v: got shapes \(37, 11\) and \(12, 53\), expected \[37, r\] and \[r, 53\]"
    ):
        SVDLinear.from_factors(linear, u, rng.standard_normal((12, 53)))
    with pytest.raises(ValueError, match=r"u, v: got shapes \(36, 11\)"):
        SVDLinear.from_factors(linear, rng.standard_normal((36, 11)), v)
