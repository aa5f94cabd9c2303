"""svd_mlp primitive on the XLA reference lowering: numerics, AD, vmap, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from mlp_calls import svd_mlp_of_factors

import jax_neuronmm as jn


def mlp_factors(rng, tokens, hidden, inter, ranks, dtype=np.float32):
    rg, ru, rd = ranks
    shapes = [(hidden, rg), (rg, inter), (hidden, ru), (ru, inter), (inter, rd), (rd, hidden)]
    x = rng.standard_normal(tokens + (hidden,))
    weights = [rng.standard_normal(s) / np.sqrt(s[0]) for s in shapes]
    return [a.astype(dtype) for a in [x] + weights]


def gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def mlp64(x, gu, gv, uu, uv, du, dv, activation="silu"):
    x, gu, gv, uu, uv, du, dv = (np.asarray(a, np.float64) for a in (x, gu, gv, uu, uv, du, dv))
    gate = x @ gu @ gv
    act = gate / (1 + np.exp(-gate)) if activation == "silu" else gelu_tanh(gate)
    return (act * (x @ uu @ uv)) @ du @ dv


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    "tokens,hidden,inter,ranks",
    [
        ((1,), 37, 100, (1, 3, 2)),
        ((7,), 129, 200, (13, 13, 9)),
        ((2, 65), 100, 300, (130, 64, 100)),
        ((0,), 8, 16, (2, 2, 2)),
    ],
)
def test_float32_matches_float64(rng, activation, tokens, hidden, inter, ranks):
    args = mlp_factors(rng, tokens, hidden, inter, ranks)
    y = jax.jit(svd_mlp_of_factors, static_argnames="activation")(*args, activation=activation)
    assert y.shape == tokens + (hidden,)
    want = mlp64(*args, activation=activation)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5)


def test_bf16_error_bound(rng):
    args = mlp_factors(rng, (33,), 64, 160, (16, 16, 24), jnp.bfloat16)
    y = svd_mlp_of_factors(*args)
    want = mlp64(*args)
    assert y.dtype == jnp.bfloat16
    assert np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want) <= 2e-2


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_check_grads_second_order(rng, x64, activation):
    args = mlp_factors(rng, (3,), 5, 7, (2, 3, 2), np.float64)
    check_grads(lambda *a: svd_mlp_of_factors(*a, activation=activation), args, order=2, modes=["fwd", "rev"])


def test_reverse_mode_runs_through_svd_matmul(rng):
    args = mlp_factors(rng, (4,), 8, 12, (2, 2, 2))
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: svd_mlp_of_factors(*a).sum(), argnums=tuple(range(7))))(*args)
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("svd_matmul") >= 4 and "svd_mlp" not in names


@pytest.mark.parametrize("batched", [(0,), (1, 6), (0, 1, 2, 3, 4, 5, 6), (2, 3)])
def test_vmap(rng, batched):
    size = 2
    base = mlp_factors(rng, (3,), 6, 10, (2, 3, 2))
    axes = [0 if i in batched else None for i in range(7)]
    args = [
        np.stack([a] + [rng.standard_normal(a.shape).astype(a.dtype) / 3 for _ in range(size - 1)]) if ax == 0 else a
        for a, ax in zip(base, axes)
    ]
    got = jax.vmap(svd_mlp_of_factors, in_axes=axes)(*args)
    for i in range(size):
        sliced = [a[i] if ax == 0 else a for a, ax in zip(args, axes)]
        np.testing.assert_allclose(got[i], mlp64(*sliced), rtol=2e-5, atol=2e-5)


def test_jaxpr_has_one_svd_mlp(rng):
    args = mlp_factors(rng, (4,), 8, 12, (2, 2, 2))
    jaxpr = jax.make_jaxpr(svd_mlp_of_factors)(*args)
    assert [e.primitive.name for e in jaxpr.eqns] == ["svd_mlp"]


@pytest.mark.parametrize(
    "index,shape,words",
    [
        (1, (9, 2), ["gate.u", "(9, 2)", "x.shape[-1] (H)"]),
        (4, (2, 11), ["up.v", "(2, 11)", "gate.v.shape[1]"]),
        (5, (11, 2), ["down.u", "intermediate size I"]),
        (6, (5, 8), ["down.v", "down.u.shape[1]"]),
    ],
)
def test_bad_shapes_name_the_argument(rng, index, shape, words):
    args = mlp_factors(rng, (4,), 8, 12, (2, 2, 2))
    args[index] = np.ones(shape, np.float32)
    with pytest.raises(ValueError) as info:
        svd_mlp_of_factors(*args)
    for word in words:
        assert word in str(info.value)


def test_bad_activation_and_dtypes(rng):
    args = mlp_factors(rng, (4,), 8, 12, (2, 2, 2))
    with pytest.raises(ValueError, match="activation='relu'"):
        svd_mlp_of_factors(*args, activation="relu")
    args[3] = args[3].astype(np.float16)
    with pytest.raises(TypeError, match=r"up\.u=float16"):
        svd_mlp_of_factors(*args)


def test_weights_that_are_not_factored_name_the_projection(rng):
    x, gu, gv, uu, uv, du, dv = mlp_factors(rng, (4,), 8, 12, (2, 2, 2))
    gate, down = jn.Factored(gu, gv), jn.Factored(du, dv)
    with pytest.raises(TypeError, match=r"svd_mlp: up: got tuple, expected a Factored\(u, v\)"):
        jn.svd_mlp(x, gate, (uu, uv), down)
    with pytest.raises(TypeError, match=r"svd_mlp: down\.v missing"):
        jn.svd_mlp(x, gate, jn.Factored(uu, uv), jn.Factored(du))


def test_factored_weights_are_pytrees_under_jit_and_vmap(rng):
    """Factored weights pass through jit and vmap as pytrees: vmap over a stack of down projections."""
    x, gu, gv, uu, uv, du, dv = mlp_factors(rng, (5,), 9, 14, (3, 2, 4))
    stacked_u = np.stack([du, rng.standard_normal(du.shape).astype(np.float32) / 4])
    down = jn.Factored(stacked_u, dv)
    gate, up = jn.Factored(gu, gv), jn.Factored(uu, uv)
    got = jax.jit(jax.vmap(jn.svd_mlp, in_axes=(None, None, None, jn.Factored(0, None))))(x, gate, up, down)
    for i in range(2):
        want = mlp64(x, gu, gv, uu, uv, stacked_u[i], dv)
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-5)
