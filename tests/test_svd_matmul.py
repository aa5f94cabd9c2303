"""svd_matmul primitive on the XLA reference lowering: numerics, AD, vmap, transforms, errors."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_neuronmm as jn


def factors(rng, tokens, k, r, n, dtype=np.float32):
    """Fresh random x, u, v scaled so products stay O(1)."""
    x = rng.standard_normal(tokens + (k,))
    u = rng.standard_normal((k, r)) / np.sqrt(k)
    v = rng.standard_normal((r, n)) / np.sqrt(r)
    return [a.astype(dtype) for a in (x, u, v)]


def ref64(x, u, v):
    x, u, v = (np.asarray(a, np.float64) for a in (x, u, v))
    return (x @ u) @ v


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)


SHAPES = [  # (token dims, K, r, N)
    ((0,), 5, 3, 7),
    ((1,), 1, 1, 1),
    ((7,), 37, 1, 513),
    ((2, 3), 129, 13, 37),
    ((130,), 100, 130, 1000),
    ((), 200, 5, 3),
]


@pytest.mark.parametrize("tokens,k,r,n", SHAPES)
def test_float32_matches_float64(rng, tokens, k, r, n):
    x, u, v = factors(rng, tokens, k, r, n)
    y = jax.jit(jn.svd_matmul)(x, u, v)
    assert y.shape == tokens + (n,) and y.dtype == jnp.float32
    want = ref64(x, u, v)
    if want.size:
        assert np.abs(want).max() > 0.1  # the check below is not vacuous
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tokens,k,r,n", SHAPES[2:5])
def test_low_precision_error_bound(rng, dtype, tokens, k, r, n):
    """Documented bound: relative Frobenius error ≤ 1e-2 against float64 on the same (rounded) inputs.

    Inputs are exact in the low-precision dtype; error comes from rounding the
    rank-r intermediate and the output (≈ 2 ulp of 2^-8 for bf16, 2^-11 for fp16).
    """
    x, u, v = factors(rng, tokens, k, r, n, dtype)
    y = jax.jit(jn.svd_matmul)(x, u, v)
    assert y.dtype == dtype
    assert rel_err(y, ref64(x, u, v)) <= 1e-2


def test_preferred_element_type_sets_result_dtype(rng):
    x, u, v = factors(rng, (9,), 33, 4, 17, ml_dtypes.bfloat16)
    y = jn.svd_matmul(x, u, v, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    assert rel_err(y, ref64(x, u, v)) <= 1e-2


def test_precision_highest_matches_float64(rng):
    x, u, v = factors(rng, (5,), 64, 8, 16)
    y = jn.svd_matmul(x, u, v, precision="highest")
    np.testing.assert_allclose(y, ref64(x, u, v), rtol=1e-5, atol=1e-5)


def test_jaxpr_has_one_svd_matmul(rng):
    x, u, v = factors(rng, (4,), 16, 2, 8)
    jaxpr = jax.make_jaxpr(jax.jit(lambda *a: jn.svd_matmul(*a) * 2.0))(x, u, v)
    inner = jaxpr.eqns[0].params["jaxpr"].jaxpr
    assert [e.primitive.name for e in inner.eqns].count("svd_matmul") == 1


@pytest.mark.parametrize("tokens,k,r,n", [((3,), 5, 2, 4), ((2, 3), 7, 1, 1), ((1,), 1, 3, 6)])
def test_check_grads_second_order(rng, x64, tokens, k, r, n):
    x, u, v = factors(rng, tokens, k, r, n, np.float64)
    check_grads(jn.svd_matmul, (x, u, v), order=2, modes=["fwd", "rev"])


def test_grad_values_match_closed_form(rng, x64):
    x, u, v = factors(rng, (6,), 9, 3, 5, np.float64)
    w = rng.standard_normal((6, 5))
    gx, gu, gv = jax.grad(lambda *a: jnp.sum(jn.svd_matmul(*a) * w), argnums=(0, 1, 2))(x, u, v)
    np.testing.assert_allclose(gx, w @ v.T @ u.T, rtol=1e-12)
    np.testing.assert_allclose(gu, x.T @ (w @ v.T), rtol=1e-12)
    np.testing.assert_allclose(gv, (x @ u).T @ w, rtol=1e-12)


def test_transpose_wrt_x_is_an_svd_matmul(rng):
    x, u, v = factors(rng, (4,), 8, 2, 6)
    vjp_fn = jax.vjp(lambda x: jn.svd_matmul(x, u, v), x)[1]
    jaxpr = jax.make_jaxpr(vjp_fn)(np.ones((4, 6), np.float32))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("svd_matmul") == 1 and "dot_general" not in names


def _moved(a, axis, size, rng, dtype):
    """Stack `size` fresh copies of a's shape along `axis`."""
    stacked = rng.standard_normal((size,) + a.shape).astype(dtype) / np.sqrt(max(a.shape[0], 1))
    return np.moveaxis(stacked, 0, axis)


@pytest.mark.parametrize("axes", [c for c in itertools.product([None, 0, 1], repeat=3) if c != (None,) * 3])
def test_vmap_every_argument_combination(rng, axes):
    size = 3
    base = factors(rng, (4,), 6, 2, 5)
    args = [a if ax is None else _moved(a, ax, size, rng, np.float32) for a, ax in zip(base, axes)]
    got = jax.vmap(jn.svd_matmul, in_axes=axes)(*args)
    for i in range(size):
        sliced = [a if ax is None else np.take(a, i, axis=ax) for a, ax in zip(args, axes)]
        np.testing.assert_allclose(got[i], ref64(*sliced), rtol=1e-5, atol=1e-5)


def test_nested_vmap_over_weights_and_grad(rng, x64):
    """Experts × layers of stacked factors, then grads through both vmaps."""
    x = rng.standard_normal((2, 3, 4, 6))
    u = rng.standard_normal((2, 3, 6, 2))
    v = rng.standard_normal((2, 3, 2, 5))
    f = jax.vmap(jax.vmap(jn.svd_matmul))
    np.testing.assert_allclose(f(x, u, v), np.einsum("abtk,abkr,abrn->abtn", x, u, v), rtol=1e-12)
    check_grads(f, (x, u, v), order=1, modes=["fwd", "rev"])


def test_scan_over_stacked_layers_with_remat_and_grad(rng, x64):
    layers, k, r = 4, 8, 3
    x = rng.standard_normal((5, k))
    us = rng.standard_normal((layers, k, r)) / np.sqrt(k)
    vs = rng.standard_normal((layers, r, k)) / np.sqrt(r)

    def model(x, us, vs):
        step = jax.checkpoint(lambda h, w: (jnp.tanh(jn.svd_matmul(h, *w)), None))
        return jax.lax.scan(step, x, (us, vs))[0].sum()

    def model_np(x):
        h = x
        for layer in range(layers):
            h = np.tanh(h @ us[layer] @ vs[layer])
        return h.sum()

    np.testing.assert_allclose(jax.jit(model)(x, us, vs), model_np(x), rtol=1e-12)
    check_grads(model, (x, us, vs), order=1, modes=["rev"])


def test_export_round_trip(rng):
    x, u, v = factors(rng, (3, 4), 10, 2, 7)
    exported = jax.export.export(jax.jit(jn.svd_matmul))(x, u, v)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(x, u, v), ref64(x, u, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shapes,dtypes,exc,words",
    [
        (((3, 5), (4, 2), (2, 6)), None, ValueError, ["u", "(4, 2)", "= 5"]),
        (((3, 5), (5, 2), (3, 6)), None, ValueError, ["v", "(3, 6)", "rank r", "= 2"]),
        (((3, 5), (5, 2, 1), (2, 6)), None, ValueError, ["u must be 2-D", "(5, 2, 1)"]),
        (((3, 5), (5, 2), (6,)), None, ValueError, ["v must be 2-D"]),
        (((), (5, 2), (2, 6)), None, ValueError, ["x", "scalar"]),
        (((3, 5), (5, 2), (2, 6)), (np.int32, np.int32, np.int32), TypeError, ["x has dtype int32"]),
        (((3, 5), (5, 2), (2, 6)), (np.float32, np.complex64, np.float32), TypeError, ["u has dtype complex64"]),
        (((3, 5), (5, 2), (2, 6)), (np.float32, np.float32, np.float16), TypeError, ["share one dtype", "v=float16"]),
    ],
)
def test_bad_input_names_the_argument(shapes, dtypes, exc, words):
    dtypes = dtypes or (np.float32,) * 3
    args = [np.ones(s, d) for s, d in zip(shapes, dtypes)]
    with pytest.raises(exc) as info:
        jn.svd_matmul(*args)
    for word in words:
        assert word in str(info.value)


def test_bad_preferred_element_type():
    with pytest.raises(TypeError, match="preferred_element_type=int32"):
        jn.svd_matmul(
            np.ones((2, 3), np.float32),
            np.ones((3, 1), np.float32),
            np.ones((1, 2), np.float32),
            preferred_element_type=np.int32,
        )


def test_float64_result_without_x64_is_refused():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="preferred_element_type=float64 needs 64-bit mode"):
        jn.svd_matmul(x, np.ones((3, 1), np.float32), np.ones((1, 2), np.float32), preferred_element_type=np.float64)


def test_precision_reaches_every_gradient_product(rng):
    x, u, v = factors(rng, (4,), 8, 2, 6)
    grads = jax.grad(lambda *a: jn.svd_matmul(*a, precision="highest").sum(), argnums=(0, 1, 2))
    jaxpr = jax.make_jaxpr(grads)(x, u, v)

    found = [e.params["precision"] for e in jaxpr.eqns if e.primitive.name in ("dot_general", "svd_matmul")]
    assert len(found) >= 3
    highest = jax.lax.Precision.HIGHEST
    assert all(p in (highest, (highest, highest)) for p in found), found
