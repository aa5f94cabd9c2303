"""Linen SVDDense / SVDMLP: dense equivalence at full rank, params, jit/grad, conversion, rank sweep, errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from nn_references import gated_mlp64, rel_err

from jax_neuronmm.compress import compress_params, truncated_svd
from jax_neuronmm.nn import SVDDense
from jax_neuronmm.nn.linen import SVDMLP


def dense_params(rng, k, n, use_bias=True):
    params = {"kernel": jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)}
    if use_bias:
        params["bias"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
    return params


def test_init_param_structure_and_forward(rng):
    layer = SVDDense(70, 13)
    x = rng.standard_normal((2, 7, 100)).astype(np.float32)
    variables = layer.init(jax.random.key(int(rng.integers(1 << 30))), x)
    shapes = jax.tree.map(jnp.shape, variables)
    assert shapes == {"params": {"u": (100, 13), "v": (13, 70), "bias": (70,)}}
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), variables)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    want = (x.astype(np.float64) @ p64["u"]) @ p64["v"] + p64["bias"]
    assert rel_err(layer.apply(params, x), want) < 1e-5
    no_bias = jax.eval_shape(SVDDense(70, 13, use_bias=False).init, jax.random.key(0), x)
    assert set(no_bias["params"]) == {"u", "v"}


@pytest.mark.parametrize("k, n, use_bias", [(100, 70, True), (130, 200, False)])
def test_full_rank_params_from_dense_equal_dense(rng, k, n, use_bias):
    dense = dense_params(rng, k, n, use_bias)
    params = SVDDense.params_from_dense(dense, rank=min(k, n))
    x = rng.standard_normal((7, k)).astype(np.float32)
    got = SVDDense(n, min(k, n), use_bias=use_bias).apply({"params": params}, x)
    assert rel_err(got, nn.Dense(n, use_bias=use_bias).apply({"params": dense}, x)) < 1e-5
    want = x.astype(np.float64) @ np.asarray(dense["kernel"], np.float64)
    if use_bias:
        want += np.asarray(dense["bias"], np.float64)
    assert rel_err(got, want) < 1e-5


def test_jit_and_grad_through_svd_dense(rng):
    params = SVDDense.params_from_dense(dense_params(rng, 40, 30), rank=9)
    layer = SVDDense(30, 9)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    np.testing.assert_allclose(
        jax.jit(layer.apply)({"params": params}, x), layer.apply({"params": params}, x), rtol=1e-6, atol=1e-6
    )
    assert "svd_matmul" in str(jax.make_jaxpr(layer.apply)({"params": params}, x))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2)))(params)
    u, v, b = (np.asarray(params[name], np.float64) for name in ("u", "v", "bias"))
    x64 = x.astype(np.float64)
    dy = 2 * ((x64 @ u) @ v + b)
    np.testing.assert_allclose(grads["bias"], dy.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["v"], (x64 @ u).T @ dy, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["u"], x64.T @ (dy @ v.T), rtol=1e-4, atol=1e-4)


def test_dtype_and_param_dtype(rng):
    x = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    layer = SVDDense(16, 8, dtype=jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    assert variables["params"]["u"].dtype == jnp.float32
    params = SVDDense.params_from_dense(dense_params(rng, 32, 16), rank=8)
    assert layer.apply({"params": params}, x).dtype == jnp.bfloat16


def test_params_from_dense_keep_whitened_and_error_shrinks(rng):
    dense = dense_params(rng, 96, 120)
    x = rng.standard_normal((50, 96)).astype(np.float32)
    exact = nn.Dense(120).apply({"params": dense}, x)
    errors = []
    for rank in (2, 10, 40, 96):
        params = SVDDense.params_from_dense(dense, rank=rank)
        errors.append(rel_err(SVDDense(120, rank).apply({"params": params}, x), exact))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert SVDDense.params_from_dense(dense, keep=0.5, block=16)["u"].shape == (96, 32)
    mixing = np.linalg.qr(rng.standard_normal((96, 96)))[0] * np.logspace(0, -2, 96)
    calibration = rng.standard_normal((400, 96)) @ mixing.T
    held_out = (rng.standard_normal((300, 96)) @ mixing.T).astype(np.float32)
    exact = nn.Dense(120).apply({"params": dense}, held_out)
    whitened = SVDDense.params_from_dense(dense, rank=10, method="whitened", calibration=calibration)
    plain = SVDDense.params_from_dense(dense, rank=10)
    layer = SVDDense(120, 10)
    assert rel_err(layer.apply({"params": whitened}, held_out), exact) < rel_err(
        layer.apply({"params": plain}, held_out), exact
    )


class DenseGatedMLP(nn.Module):
    """Reference Linen gated MLP with Llama projection names."""

    intermediate: int

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.intermediate, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(self.intermediate, use_bias=False, name="up_proj")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_svd_mlp_full_rank_equals_dense(rng, activation):
    hidden, intermediate = 40, 72
    dense = {
        "gate_proj": dense_params(rng, hidden, intermediate, False),
        "up_proj": dense_params(rng, hidden, intermediate, False),
        "down_proj": dense_params(rng, intermediate, hidden, False),
    }
    params = SVDMLP.params_from_dense(dense, activation=activation, rank=hidden)
    mlp = SVDMLP(intermediate, hidden, activation=activation)
    x = rng.standard_normal((3, 5, hidden)).astype(np.float32)
    shapes = jax.tree.map(jnp.shape, jax.eval_shape(mlp.init, jax.random.key(0), x))
    assert shapes == jax.tree.map(jnp.shape, {"params": params})
    want = gated_mlp64(
        x, dense["gate_proj"]["kernel"], dense["up_proj"]["kernel"], dense["down_proj"]["kernel"], activation
    )
    assert rel_err(jax.jit(mlp.apply)({"params": params}, x), want) < 1e-5
    assert "svd_mlp" in str(jax.make_jaxpr(mlp.apply)({"params": params}, x))
    grads = jax.grad(lambda p: jnp.sum(jax.jit(mlp.apply)({"params": p}, x) ** 2))(params)
    assert np.all(np.isfinite(grads["down_proj"]["v"])) and float(jnp.abs(grads["gate_proj"]["u"]).max()) > 0


def test_compressed_linen_mlp_error_shrinks_with_rank(rng):
    hidden, intermediate = 32, 64
    x = rng.standard_normal((20, hidden)).astype(np.float32)
    variables = DenseGatedMLP(intermediate).init(jax.random.key(int(rng.integers(1 << 30))), x)
    exact = DenseGatedMLP(intermediate).apply(variables, x)
    errors = []
    for rank in (2, 8, 16, 32):
        compressed, _ = compress_params(variables, rank=rank, include=r"_proj/", progress=False)
        errors.append(rel_err(SVDMLP(intermediate, rank).apply(compressed, x), exact))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5
    mixing = np.linalg.qr(rng.standard_normal((hidden, hidden)))[0] * np.logspace(0, -2, hidden)
    calibration = rng.standard_normal((400, hidden)) @ mixing.T
    held_out = (rng.standard_normal((200, hidden)) @ mixing.T).astype(np.float32)
    exact = DenseGatedMLP(intermediate).apply(variables, held_out)
    whitened = SVDMLP.params_from_dense(variables["params"], rank=8, method="whitened", calibration=calibration)
    plain = SVDMLP.params_from_dense(variables["params"], rank=8)
    mlp = SVDMLP(intermediate, 8)
    assert rel_err(mlp.apply({"params": whitened}, held_out), exact) < rel_err(
        mlp.apply({"params": plain}, held_out), exact
    )
    u_gate, _ = truncated_svd(np.asarray(variables["params"]["gate_proj"]["kernel"]), 8)
    np.testing.assert_array_equal(plain["gate_proj"]["u"], u_gate)


def test_bad_arguments(rng):
    x = jnp.ones((2, 10))
    with pytest.raises(ValueError, match="rank"):
        SVDDense(20, 0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="rank"):
        SVDDense(20, 11).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="kernel"):
        SVDDense.params_from_dense({"weight": np.ones((3, 3))}, rank=1)
    dense = dense_params(rng, 10, 20)
    with pytest.raises(ValueError, match="exactly one of rank= or keep="):
        SVDDense.params_from_dense(dense)
    with pytest.raises(ValueError, match=r"activations must have shape \[n, 10\]"):
        SVDDense.params_from_dense(dense, rank=3, method="whitened", calibration=np.ones((50, 20)))
    with pytest.raises(ValueError, match="activation"):
        SVDMLP(20, 3, activation="relu").init(jax.random.key(0), x)
    mlp_dense = {"gate_proj": dense, "up_proj": dense, "down_proj": dense_params(rng, 20, 10)}
    with pytest.raises(ValueError, match="bias-free"):
        SVDMLP.params_from_dense(mlp_dense, rank=3)
    with pytest.raises(ValueError, match=r"missing \['down_proj'\]"):
        SVDMLP.params_from_dense({"gate_proj": dense, "up_proj": dense}, rank=3)
    with pytest.raises(ValueError, match="triple"):
        SVDMLP.params_from_dense(
            {name: dense_params(rng, 10, 10, False) for name in ("gate_proj", "up_proj", "down_proj")}, rank=(1, 2)
        )


def test_check_grads_float64(rng, x64):
    layer = SVDDense(30, 7, param_dtype=jnp.float64)
    params = {"u": rng.standard_normal((20, 7)), "v": rng.standard_normal((7, 30)), "bias": rng.standard_normal(30)}
    x = rng.standard_normal((3, 20))
    check_grads(lambda inputs, p: layer.apply({"params": p}, inputs), (x, params), order=1, modes=("fwd", "rev"))
    mlp = SVDMLP(24, (5, 6, 7), param_dtype=jnp.float64)
    mlp_params = jax.tree.map(
        lambda a: rng.standard_normal(a.shape) / np.sqrt(a.shape[0]),
        jax.eval_shape(mlp.init, jax.random.key(0), x)["params"],
    )
    check_grads(lambda inputs, p: mlp.apply({"params": p}, inputs), (x, mlp_params), order=1, modes=("fwd", "rev"))
