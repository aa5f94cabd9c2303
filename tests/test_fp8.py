"""fp8 e4m3 weights with fp32 scales: the format (compress.quantize_fp8) and svd_matmul with scaled fp8 factors
on the XLA reference lowering, against float64 numpy on the dequantized weights."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads
from mlp_calls import svd_mlp_of_factors

import jax_neuronmm as jn
from jax_neuronmm.compress import FP8_DTYPE, FP8_MAX, dequantize_fp8, gptq_fp8, quantize_fp8


def wide_columns(rng, k, n, low=-3.0, high=3.0):
    """w [k, n] whose column magnitudes span 10**low .. 10**high (scales spanning orders of magnitude)."""
    return rng.standard_normal((k, n)) * np.logspace(low, high, n)[None, :] / np.sqrt(k)


def fp8_factors(rng, tokens, k, r, n, dtype=np.float32):
    """x, (uq, us), (vq, vs) and the dequantized u, v in float64; x·u·v stays O(1)."""
    x = rng.standard_normal(tokens + (k,)).astype(dtype)
    u = wide_columns(rng, k, r)
    v = wide_columns(rng, r, n) / np.logspace(-3.0, 3.0, r)[:, None]  # undo u's column spread
    (uq, us), (vq, vs) = quantize_fp8(u), quantize_fp8(v)
    u64 = np.asarray(uq, np.float64) * np.asarray(us, np.float64)[None, :]
    v64 = np.asarray(vq, np.float64) * np.asarray(vs, np.float64)[None, :]
    return x, (uq, us), (vq, vs), u64, v64


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)


# --- the format -----------------------------------------------------------------------------------------------


def test_quantize_fp8_rounds_to_nearest_within_240(rng):
    w = wide_columns(rng, 200, 130, -6, 4)
    w[:, 3] = 0.0  # an all-zero channel
    values, scale = quantize_fp8(w)
    assert values.dtype == FP8_DTYPE and values.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (130,)
    q = np.asarray(values, np.float64)
    assert np.abs(q).max() == FP8_MAX  # each channel's largest magnitude lands on ±240
    assert np.all(np.abs(q).max(axis=0)[np.arange(130) != 3] == FP8_MAX)
    assert scale[3] == 1.0 and np.all(q[:, 3] == 0)
    s = np.asarray(scale, np.float64)
    np.testing.assert_allclose(s, np.abs(w).max(axis=0).clip(min=1e-300) / FP8_MAX * (s != 1) + (s == 1), rtol=1e-6)
    # Round to nearest: e4m3 has 3 mantissa bits, so the error is at most half a step (2^-4 relative) above
    # the subnormal range (steps of 2^-9).
    exact = w / s[None, :]
    assert np.all(np.abs(exact - q) <= np.maximum(np.abs(q) * 2.0**-4, 2.0**-10) * (1 + 1e-6))
    # Bits are Trainium's e4m3 (IEEE-style, max 240): reinterpreting gives the same values.
    same = np.asarray(values).view(ml_dtypes.float8_e4m3).astype(np.float64)
    np.testing.assert_array_equal(same, q)


def test_quantize_fp8_row_channels_and_stacks(rng):
    w = rng.standard_normal((3, 40, 7)) * np.logspace(-2, 2, 40)[None, :, None]
    values, scale = quantize_fp8(w, axis=-2)  # one scale per row
    assert scale.shape == (3, 40)
    np.testing.assert_allclose(np.abs(np.asarray(values, np.float64)).max(axis=-1), FP8_MAX)
    back = np.asarray(dequantize_fp8(values, scale, axis=-2), np.float64)
    # Half a step of the top binade [128, 240] (steps of 16) is 8 / 240 of the channel maximum.
    assert np.all(np.abs(back - w) <= np.abs(w).max(axis=-1, keepdims=True) / 30 * (1 + 1e-6))


def test_quantize_fp8_errors():
    with pytest.raises(ValueError, match="quantize_fp8: w must have at least 2 dims"):
        quantize_fp8(np.ones(3))
    with pytest.raises(ValueError, match="quantize_fp8: axis=0"):
        quantize_fp8(np.ones((3, 4, 5)), axis=0)
    with pytest.raises(TypeError, match="quantize_fp8: w has dtype int32"):
        quantize_fp8(np.ones((3, 4), np.int32))
    with pytest.raises(ValueError, match=r"dequantize_fp8: scale has shape \(3,\); expected \(4,\)"):
        dequantize_fp8(np.ones((3, 4), FP8_DTYPE), np.ones(3, np.float32))


def test_gptq_lowers_the_output_error_in_the_same_format(rng):
    k, n, tokens = 300, 130, 3000
    x = rng.standard_normal((tokens, k)) @ (rng.standard_normal((k, k)) / np.sqrt(k)) + 0.3 * rng.standard_normal(
        (tokens, k)
    )
    x[:, 7] = 0.0  # an input that never varies: a singular Gram matrix
    w = wide_columns(rng, k, n, -2, 2)
    values, scale = gptq_fp8(w, x.T @ x, column_chunk=50)  # chunks of columns give the same result
    nearest, nearest_scale = quantize_fp8(w)
    assert values.dtype == FP8_DTYPE and values.shape == w.shape
    np.testing.assert_array_equal(scale, nearest_scale)
    assert np.abs(np.asarray(values, np.float64)).max() <= FP8_MAX
    np.testing.assert_array_equal(np.asarray(values, np.float32)[7], 0)

    def output_error(q):
        return np.linalg.norm(x @ (w - np.asarray(q, np.float64) * np.asarray(scale, np.float64))) / np.linalg.norm(
            x @ w
        )

    measured = output_error(values), output_error(nearest)
    assert measured[0] < 0.9 * measured[1], measured  # 0.020 vs 0.026 when written
    again, _ = gptq_fp8(w, x.T @ x)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(values, np.float32))
    with pytest.raises(ValueError, match=r"gptq_fp8: w has shape \(300, 130\) and gram \(3, 3\)"):
        gptq_fp8(w, np.eye(3))


# --- svd_matmul with fp8 factors, XLA lowering -------------------------------------------------------------

SHAPES = [  # (token dims, K, r, N)
    ((1,), 100, 1, 1000),
    ((7,), 200, 130, 1000),
    ((130,), 100, 130, 37),
    ((2, 3), 200, 1, 5),
    ((0,), 5, 3, 7),
]


def scaled(x, uq, us, vq, vs, **kwargs):
    return jn.svd_matmul(x, uq, vq, u_scale=us, v_scale=vs, **kwargs)


@pytest.mark.parametrize("tokens,k,r,n", SHAPES)
def test_float32_activations_match_float64(rng, tokens, k, r, n):
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, tokens, k, r, n)
    y = jax.jit(scaled)(x, uq, us, vq, vs)
    assert y.shape == tokens + (n,) and y.dtype == jnp.float32
    want = x.astype(np.float64) @ u64 @ v64
    if want.size:
        assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max(initial=0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tokens,k,r,n", SHAPES[:3])
def test_low_precision_activations_within_rounding(rng, dtype, tokens, k, r, n):
    """bf16 / fp16 x: the scaled rank-r intermediate and the output are rounded to x's dtype (as in the kernels)."""
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, tokens, k, r, n, dtype)
    y = jax.jit(scaled)(x, uq, us, vq, vs)
    assert y.dtype == dtype
    assert rel_err(y, np.asarray(x, np.float64) @ u64 @ v64) <= 1e-2


def test_reference_rounds_like_the_kernels(rng):
    """The XLA lowering = float32 sums, scaled, rounded to x's dtype at the intermediate and at the output."""
    x, (uq, us), (vq, vs), _, _ = fp8_factors(rng, (7,), 200, 130, 1000, ml_dtypes.bfloat16)
    f32 = [np.asarray(a, np.float32) for a in (x, uq, us, vq, vs)]
    xu = ((f32[0] @ f32[1]) * f32[2]).astype(ml_dtypes.bfloat16).astype(np.float32)
    want = ((xu @ f32[3]) * f32[4]).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.asarray(scaled(x, uq, us, vq, vs), np.float32)
    ulp = np.abs(want) * 2.0**-7
    assert np.all(np.abs(got - want) <= ulp + 1e-30)


def test_preferred_element_type(rng):
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, (9,), 100, 13, 17, ml_dtypes.bfloat16)
    y = scaled(x, uq, us, vq, vs, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    assert rel_err(y, np.asarray(x, np.float64) @ u64 @ v64) <= 1e-2


def test_gradients_in_x(rng, x64):
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, (7,), 100, 13, 30, np.float64)
    f = jax.jit(lambda x: scaled(x, uq, us, vq, vs))
    check_grads(f, (x,), order=2, modes=["fwd", "rev"])
    ct = rng.standard_normal((7, 30))
    (got,) = jax.vjp(f, x)[1](ct)
    np.testing.assert_allclose(got, ct @ v64.T @ u64.T, rtol=1e-6, atol=1e-9)


def test_gradients_in_x_float32(rng):
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, (3, 4), 200, 1, 50)
    ct = rng.standard_normal((3, 4, 50)).astype(np.float32)
    (got,) = jax.vjp(lambda x: scaled(x, uq, us, vq, vs), x)[1](ct)
    np.testing.assert_allclose(got, ct.astype(np.float64) @ v64.T @ u64.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argnum,name", [(1, "u"), (2, "u_scale"), (3, "v"), (4, "v_scale")])
def test_weights_are_not_differentiable(rng, argnum, name):
    args = (rng.standard_normal((3, 10)).astype(np.float32), *quantize_fp8(rng.standard_normal((10, 4))))
    args = args + quantize_fp8(rng.standard_normal((4, 6)))
    with pytest.raises(TypeError, match=f"svd_matmul: cannot differentiate with respect to {name}: fp8"):
        jax.jvp(
            lambda a: scaled(*args[:argnum], a, *args[argnum + 1 :]),
            (args[argnum],),
            (jnp.ones_like(args[argnum], dtype=jnp.float32 if argnum % 2 == 0 else args[argnum].dtype),),
        )


@pytest.mark.parametrize("batched", [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4), (1, 4)])
def test_vmap_over_each_argument(rng, batched):
    b = 3
    per = [fp8_factors(rng, (5,), 30, 4, 20) for _ in range(b)]
    stacked = [
        np.stack([p[0] for p in per]),
        np.stack([p[1][0] for p in per]),
        np.stack([p[1][1] for p in per]),
        np.stack([p[2][0] for p in per]),
        np.stack([p[2][1] for p in per]),
    ]
    first = [per[0][0], per[0][1][0], per[0][1][1], per[0][2][0], per[0][2][1]]
    args = [stacked[i] if i in batched else first[i] for i in range(5)]
    axes = [0 if i in batched else None for i in range(5)]
    y = jax.jit(jax.vmap(scaled, in_axes=axes))(*args)
    for j in range(b):
        x, uq, us, vq, vs = (a[j] if i in batched else a for i, a in enumerate(args))
        want = np.asarray(x, np.float64) @ (np.asarray(uq, np.float64) * np.asarray(us, np.float64))
        want = want @ (np.asarray(vq, np.float64) * np.asarray(vs, np.float64))
        np.testing.assert_allclose(np.asarray(y[j], np.float64), want, rtol=2e-5, atol=2e-5)


def test_vmap_then_grad(rng):
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, (4, 5), 30, 4, 20)
    g = jax.vmap(jax.grad(lambda x: scaled(x, uq, us, vq, vs).sum()))(x)
    np.testing.assert_allclose(g, np.broadcast_to((u64 @ v64).sum(1), x.shape), rtol=1e-4, atol=1e-5)


def test_export_round_trip(rng):
    x, (uq, us), (vq, vs), _, _ = fp8_factors(rng, (7,), 100, 13, 37, ml_dtypes.bfloat16)
    exported = jax.export.export(jax.jit(scaled))(x, uq, us, vq, vs)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(restored.call(x, uq, us, vq, vs), scaled(x, uq, us, vq, vs))


def test_errors(rng):
    x = rng.standard_normal((3, 10)).astype(np.float32)
    uq, us = quantize_fp8(rng.standard_normal((10, 4)))
    vq, vs = quantize_fp8(rng.standard_normal((4, 6)))
    with pytest.raises(TypeError, match="svd_matmul: u and v are float8_e4m3fn; v_scale .* must be given"):
        jn.svd_matmul(x, uq, vq, u_scale=us)
    with pytest.raises(TypeError, match="svd_matmul: u and v are float8_e4m3fn; u_scale and v_scale"):
        jn.svd_matmul(x, uq, vq)
    with pytest.raises(TypeError, match="fp8 factors come in pairs"):
        jn.svd_matmul(x, uq, np.asarray(vq, np.float32), u_scale=us, v_scale=vs)
    with pytest.raises(TypeError, match="u_scale and v_scale given with u=float32, v=float32; scales go with"):
        jn.svd_matmul(x, np.ones((10, 4), np.float32), np.ones((4, 6), np.float32), u_scale=us, v_scale=vs)
    with pytest.raises(ValueError, match=r"svd_matmul: v_scale has shape \(4,\); expected \(6,\)"):
        jn.svd_matmul(x, uq, vq, u_scale=us, v_scale=us)
    with pytest.raises(TypeError, match="svd_matmul: u_scale has dtype bfloat16; expected float32"):
        jn.svd_matmul(x, uq, vq, u_scale=us.astype(jnp.bfloat16), v_scale=vs)
    with pytest.raises(TypeError, match="svd_matmul: x has dtype int32"):
        jn.svd_matmul(x.astype(np.int32), uq, vq, u_scale=us, v_scale=vs)


def test_emulator_backend_equals_xla(rng):
    """The kernels on the emulator compute what the XLA lowering computes (float32 sums, the same roundings)."""
    x, (uq, us), (vq, vs), u64, v64 = fp8_factors(rng, (2, 65), 200, 130, 1000, ml_dtypes.bfloat16)
    f = jax.jit(scaled)
    want = np.asarray(f(x, uq, us, vq, vs), np.float32)
    with jn.use_backend("emulator"):
        got = np.asarray(f(x, uq, us, vq, vs), np.float32)
        grad = jax.grad(lambda x: scaled(x, uq, us, vq, vs).astype(jnp.float32).sum())(x)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6 * np.abs(want).max())
    assert rel_err(got, np.asarray(x, np.float64) @ u64 @ v64) <= 1e-2
    want_grad = np.broadcast_to((u64 @ v64).sum(axis=1), x.shape)
    assert rel_err(grad, want_grad) <= 1e-2


def test_emulator_backend_needs_2_byte_activations(rng):
    x, (uq, us), (vq, vs), _, _ = fp8_factors(rng, (3,), 20, 4, 6)
    with jn.use_backend("emulator"), pytest.raises(TypeError, match="svd_matmul: x has dtype float32; fp8 factors"):
        jax.jit(scaled)(x, uq, us, vq, vs)


# --- svd_mlp with fp8 factors ----------------------------------------------------------------------------------


def mlp_operands(rng, tokens, h, i, ranks, dtype=np.float32):
    """x, six fp8 factors, their six scales, and the dequantized factors in float64."""
    rg, ru, rd = ranks
    x = rng.standard_normal(tokens + (h,)).astype(dtype)
    weights = []
    for (k, r), n in zip(((h, rg), (h, ru), (i, rd)), (i, i, h)):
        # u's column magnitudes span four orders, undone in v's rows, v's own columns spread two.
        weights += [wide_columns(rng, k, r, -2, 2), wide_columns(rng, r, n, -1, 1) / np.logspace(-2, 2, r)[:, None]]
    quantized = [quantize_fp8(w) for w in weights]
    dequantized = [np.asarray(q, np.float64) * np.asarray(s, np.float64) for q, s in quantized]
    return x, [q for q, _ in quantized], [s for _, s in quantized], dequantized


def mlp_f64(x, d, activation):
    x = np.asarray(x, np.float64)
    gate, up = x @ d[0] @ d[1], x @ d[2] @ d[3]
    if activation == "silu":
        act = gate * 0.5 * (1 + np.tanh(gate / 2))  # silu, without overflow
    else:
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
    return (act * up) @ d[4] @ d[5]


def fp8_mlp(x, factors, scales, **kwargs):
    return svd_mlp_of_factors(x, *factors, *scales, **kwargs)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,h,i,ranks", [((1,), 100, 1000, (130, 1, 130)), ((7,), 200, 130, (1, 130, 1))])
def test_mlp_matches_float64(rng, activation, tokens, h, i, ranks):
    x, factors, scales, d = mlp_operands(rng, tokens, h, i, ranks)
    y = jax.jit(lambda x: fp8_mlp(x, factors, scales, activation=activation))(x)
    want = mlp_f64(x, d, activation)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [(1,), (7,), (130,)])
def test_mlp_emulator_backend_within_bf16_rounding(rng, activation, tokens):
    x, factors, scales, d = mlp_operands(rng, tokens, 200, 1000, (130, 1, 130), ml_dtypes.bfloat16)
    f = jax.jit(lambda x: fp8_mlp(x, factors, scales, activation=activation))
    want = mlp_f64(x, d, activation)
    xla = f(x)
    with jn.use_backend("emulator"):
        got = f(x)
    assert got.dtype == jnp.bfloat16
    assert rel_err(xla, want) <= 1e-2 and rel_err(got, want) <= 1e-2
    assert rel_err(got, np.asarray(xla, np.float64)) <= 1e-2


def test_mlp_gradient_in_x_and_vmap(rng, x64):
    x, factors, scales, d = mlp_operands(rng, (5,), 20, 30, (4, 3, 5), np.float64)
    f = lambda x: fp8_mlp(x, factors, scales)  # noqa: E731
    check_grads(f, (x,), order=1, modes=["fwd", "rev"])
    xs = rng.standard_normal((3, 5, 20))
    np.testing.assert_allclose(jax.vmap(f)(xs), np.stack([mlp_f64(a, d, "silu") for a in xs]), rtol=1e-9)
    stacked = [jnp.stack([s, 2 * s]) for s in scales]
    ys = jax.vmap(lambda *s: fp8_mlp(x, factors, s))(*stacked)
    np.testing.assert_allclose(ys[0], mlp_f64(x, d, "silu"), rtol=1e-9)
    doubled = [a * 2 for a in d]
    np.testing.assert_allclose(ys[1], mlp_f64(x, doubled, "silu"), rtol=1e-9)


def test_mlp_errors(rng):
    x, factors, scales, _ = mlp_operands(rng, (3,), 20, 30, (4, 3, 5))
    with pytest.raises(TypeError, match="svd_mlp: down.u and down.v are float8_e4m3fn; down.v_scale"):
        fp8_mlp(x, factors, scales[:5] + [None])
    with pytest.raises(TypeError, match="svd_mlp: either every factor pair is float8_e4m3fn with scales, or none"):
        floats = factors[:4] + [np.asarray(f, np.float32) for f in factors[4:]]
        fp8_mlp(x, floats, scales[:4] + [None, None])
    with pytest.raises(TypeError, match="svd_mlp: cannot differentiate with respect to gate.v_scale"):
        jax.grad(lambda s: fp8_mlp(x, factors, [scales[0], s, *scales[2:]]).sum())(scales[1])
