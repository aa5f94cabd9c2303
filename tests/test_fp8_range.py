"""fp8 values Trainium cannot hold, and fp8 under its own name.

Trainium's float8_e4m3 holds ±240 at most; float8_e4m3fn (the storage) holds up to ±448, and its values beyond ±240
have bits the device reads as inf / NaN. Where values are known at call time (eager calls, constructors) the APIs
refuse them with a ValueError naming the array; under jit, where they are not, every backend reads them as the
device does, NaN (`shapes.fp8_read`), so the XLA lowering and the emulator's kernels give the same NaN outputs.
NaN or ±inf scales are refused alike. Arrays in float8_e4m3 (NKI's and Trainium's name of the format) are taken
as the same bits as float8_e4m3fn.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from decode_operands import GEMMA3_8, WEIGHT_INDEX, fp8_operands
from mlp_calls import svd_mlp_of_factors
from test_decode_step_fp8 import _causal_mask, _jax_operands

import jax_neuronmm as jn
from jax_neuronmm.compress import FP8_DTYPE, quantize_fp8
from jax_neuronmm.nn.fp8 import fp8_dense
from jax_neuronmm.nn.nnx import Linear, SVDLinear
from nki_kernels.decode import Factored, Quantized

BF16 = ml_dtypes.bfloat16
BEYOND = "beyond ±240 or NaN"


def ocp_fp8(w):
    """The OCP e4m3fn recipe: scale = max|w| / 448 per column, so values reach ±448 (beyond Trainium's ±240)."""
    scale = (np.abs(w).max(axis=0) / 448.0).astype(np.float32)
    return jnp.asarray((w / scale).astype(FP8_DTYPE)), jnp.asarray(scale)


def factors(rng, k=70, r=13, n=37):
    (uq, us), (vq, vs) = quantize_fp8(rng.standard_normal((k, r))), quantize_fp8(rng.standard_normal((r, n)))
    return uq, us, vq, vs


def with_value(values, index, value):
    """values (fp8) with one element set to `value` (float8_e4m3fn: 256, 448, NaN are all representable)."""
    return jnp.asarray(values).at[index].set(jnp.asarray(value, FP8_DTYPE))


def as_trainium(values):
    return jax.lax.bitcast_convert_type(values, jnp.float8_e4m3)


# --- item 4: values beyond ±240 where they are known ------------------------------------------------------------


def test_svd_matmul_refuses_the_ocp_recipe_and_256(rng):
    x = rng.standard_normal((7, 70)).astype(np.float32)
    u, v = rng.standard_normal((70, 13)), rng.standard_normal((13, 37))
    (uq, us), (vq, vs) = ocp_fp8(u), ocp_fp8(v)
    with pytest.raises(ValueError, match=rf"svd_matmul: u holds \d+ fp8 value\(s\) {BEYOND} .*max\|w\| / 240"):
        jn.svd_matmul(x, uq, vq, u_scale=us, v_scale=vs)
    uq, us, vq, vs = factors(rng)
    for value in (256.0, -448.0, np.nan):
        with pytest.raises(ValueError, match=rf"svd_matmul: v holds 1 fp8 value\(s\) {BEYOND}"):
            jn.svd_matmul(x, uq, with_value(vq, (4, 30), value), u_scale=us, v_scale=vs)
    for value in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match=r"svd_matmul: u_scale holds 1 non-finite value\(s\)"):
            jn.svd_matmul(x, uq, vq, u_scale=us.at[3].set(value), v_scale=vs)
    # Closed-over constants are known while the caller is traced: refused there too.
    bad_scale = vs.at[0].set(np.nan)
    with pytest.raises(ValueError, match="svd_matmul: v_scale holds 1 non-finite"):
        jax.jit(lambda x: jn.svd_matmul(x, uq, vq, u_scale=us, v_scale=bad_scale))(x)
    y = jn.svd_matmul(x, uq, with_value(vq, (4, 30), 240.0), u_scale=us, v_scale=vs)  # ±240 itself is fine
    assert np.all(np.isfinite(y))


def test_svd_mlp_and_the_nnx_modules_name_the_bad_array(rng):
    x = rng.standard_normal((3, 20)).astype(np.float32)
    weights = [quantize_fp8(rng.standard_normal(shape)) for shape in ((20, 4), (4, 30), (20, 5), (5, 30), (30, 3))]
    weights.append(quantize_fp8(rng.standard_normal((3, 20))))
    gate, up, down = (jn.Factored(u, v, us, vs) for (u, us), (v, vs) in zip(weights[::2], weights[1::2]))
    bad_down = dataclasses.replace(down, v=with_value(down.v, (1, 2), 300.0))
    with pytest.raises(ValueError, match=rf"svd_mlp: down\.v holds 1 fp8 value\(s\) {BEYOND}"):
        jn.svd_mlp(x, gate, up, bad_down)
    bad_up = dataclasses.replace(up, v_scale=up.v_scale.at[0].set(np.inf))
    with pytest.raises(ValueError, match=r"svd_mlp: up\.v_scale holds 1 non-finite"):
        jn.svd_mlp(x, gate, bad_up, down)

    ocp_values, ocp_scale = ocp_fp8(rng.standard_normal((20, 6)))
    with pytest.raises(ValueError, match=rf"^Linear: kernel holds \d+ fp8 value\(s\) {BEYOND}"):
        Linear(ocp_values, kernel_scale=ocp_scale)
    kernel, scale = quantize_fp8(rng.standard_normal((20, 6)))
    with pytest.raises(ValueError, match="^Linear: kernel_scale holds 1 non-finite"):
        Linear(kernel, kernel_scale=scale.at[0].set(np.nan))
    uq, us, vq, vs = factors(rng)
    with pytest.raises(ValueError, match=rf"^SVDLinear: u holds 1 fp8 value\(s\) {BEYOND}"):
        SVDLinear.from_values(with_value(uq, (0, 0), 256.0), vq, u_scale=us, v_scale=vs)
    with pytest.raises(ValueError, match="^SVDLinear: v_scale holds 1 non-finite"):
        SVDLinear.from_values(uq, vq, u_scale=us, v_scale=vs.at[5].set(-np.inf))
    with pytest.raises(TypeError, match=r"^SVDLinear: u_scale: got None, expected float32 \[\d+\]"):
        SVDLinear.from_values(uq, vq, v_scale=vs)
    with pytest.raises(TypeError, match="^Linear: kernel_scale given with float32 kernel; scales go with fp8"):
        Linear(np.ones((3, 2), np.float32), kernel_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=rf"fp8_dense: kernel holds 1 fp8 value\(s\) {BEYOND}"):
        fp8_dense(x, with_value(kernel, (0, 0), 256.0), scale)


# --- item 4: traced values beyond ±240 read as NaN on both backends --------------------------------------------


def test_traced_values_beyond_240_are_nan_on_xla_and_the_emulator(rng):
    """One value of v at 256 (column 30) or 448 (column 5): those output columns are NaN on both backends, the
    others finite and equal to bf16 precision; the OCP recipe (every column reaches 448) makes every output NaN on
    both, where XLA used to return finite numbers and the emulator NaN."""
    x = rng.standard_normal((7, 70)).astype(BF16)
    uq, us, vq, vs = factors(rng)
    vq = with_value(with_value(vq, (4, 30), 256.0), (0, 5), -448.0)
    f = jax.jit(lambda x, u, v: jn.svd_matmul(x, u, v, u_scale=us, v_scale=vs))
    ocp_u, ocp_us = ocp_fp8(rng.standard_normal((70, 13)))
    ocp_v, ocp_vs = quantize_fp8(rng.standard_normal((13, 37)))
    results = {}
    for backend in ("xla", "emulator"):
        with jn.use_backend(backend):
            results[backend] = np.asarray(f(x, uq, vq), np.float32)
            ocp = np.asarray(jax.jit(lambda x, u: jn.svd_matmul(x, u, ocp_v, u_scale=ocp_us, v_scale=ocp_vs))(x, ocp_u))
        assert np.all(np.isnan(ocp)), backend
    nan_columns = np.zeros(37, bool)
    nan_columns[[5, 30]] = True
    for got in results.values():
        np.testing.assert_array_equal(np.isnan(got), np.broadcast_to(nan_columns, got.shape))
    finite = results["xla"][:, ~nan_columns]
    np.testing.assert_allclose(
        results["emulator"][:, ~nan_columns], finite, rtol=2**-6, atol=2**-6 * np.abs(finite).max()
    )


def test_traced_values_beyond_240_in_svd_mlp_and_fp8_dense_are_nan(rng):
    x = rng.standard_normal((5, 20)).astype(BF16)
    weights = [quantize_fp8(rng.standard_normal(shape)) for shape in ((20, 4), (4, 30), (20, 5), (5, 30), (30, 3))]
    weights.append(quantize_fp8(rng.standard_normal((3, 20))))
    values, scales = [w for w, _ in weights], [s for _, s in weights]
    values[5] = with_value(values[5], (1, 7), 448.0)  # down_v: output column 7
    f = jax.jit(lambda x, *v: svd_mlp_of_factors(x, *v, *scales))
    for backend in ("xla", "emulator"):
        with jn.use_backend(backend):
            y = np.asarray(f(x, *values), np.float32)
        np.testing.assert_array_equal(np.isnan(y), np.arange(20)[None, :].repeat(5, 0) == 7)
    kernel, scale = quantize_fp8(rng.standard_normal((20, 6)))
    y = jax.jit(fp8_dense)(x, with_value(kernel, (3, 2), 256.0), scale)
    np.testing.assert_array_equal(np.isnan(np.asarray(y, np.float32)), np.arange(6)[None, :].repeat(5, 0) == 2)


# --- item 4: decode_step's fp8 weights ------------------------------------------------------------------------

SPEC = GEMMA3_8.replace(vocab=40, head_rank=23, final_logit_softcap=None)
SLOTS = 8


@pytest.fixture(scope="module")
def decode_ops():
    rng = np.random.default_rng(50)
    operands = fp8_operands(rng, SPEC, 4, 1, SLOTS, 0)  # 4 rows: _causal_mask's
    operands[15] = _causal_mask(SPEC, 0)
    return _jax_operands(operands, SPEC)


def replaced(ops, name, value):
    return [value if i == WEIGHT_INDEX[name] else op for i, op in enumerate(ops)]


def test_decode_step_refuses_fp8_beyond_240_and_bad_scales(decode_ops):
    step = functools.partial(jn.decode_step, spec=SPEC)
    head, k = decode_ops[WEIGHT_INDEX["head"]], decode_ops[WEIGHT_INDEX["k"]]
    bad_head = Factored(head.u, with_value(head.v, (2, 11), 256.0), head.u_scale, head.v_scale)
    with pytest.raises(ValueError, match=rf"decode_step: head.v holds 1 fp8 value\(s\) {BEYOND}"):
        step(*replaced(decode_ops, "head", bad_head))
    with pytest.raises(ValueError, match=rf"decode_step: k.w holds 1 fp8 value\(s\) {BEYOND}"):
        step(*replaced(decode_ops, "k", Quantized(with_value(k.w, (1, 3, 4), np.nan), k.scale)))
    with pytest.raises(ValueError, match=r"decode_step: k.scale holds 1 non-finite value\(s\)"):
        step(*replaced(decode_ops, "k", Quantized(k.w, k.scale.at[0, 9].set(np.inf))))


def test_decode_step_traced_values_beyond_240_are_nan_on_xla_and_the_emulator(decode_ops):
    """One value of the head's v at 448 (vocabulary entry 11): that logit is NaN on both backends, the others
    finite and close; the caches (written before the head) stay finite."""
    head = decode_ops[WEIGHT_INDEX["head"]]
    ops = replaced(decode_ops, "head", Factored(head.u, with_value(head.v, (2, 11), 448.0), head.u_scale, head.v_scale))
    step = jax.jit(functools.partial(jn.decode_step, spec=SPEC))
    logits = {}
    for backend in ("xla", "emulator"):
        with jn.use_backend(backend):
            logits[backend], k_cache, _ = step(*ops)
        assert np.all(np.isfinite(np.asarray(k_cache, np.float32)))
        np.testing.assert_array_equal(np.isnan(logits[backend]), np.broadcast_to(np.arange(40) == 11, (4, 1, 40)))
    keep = np.arange(40) != 11
    want = np.asarray(logits["xla"])[..., keep]
    np.testing.assert_allclose(np.asarray(logits["emulator"])[..., keep], want, atol=2e-2 * np.abs(want).max())


# --- item 8: float8_e4m3, the format's own name ---------------------------------------------------------------


def test_float8_e4m3_factors_are_the_same_bits(rng):
    x = rng.standard_normal((7, 70)).astype(BF16)
    uq, us, vq, vs = factors(rng)
    f = jax.jit(lambda x, u, v: jn.svd_matmul(x, u, v, u_scale=us, v_scale=vs))
    for backend in ("xla", "emulator"):
        with jn.use_backend(backend):
            want = np.asarray(f(x, uq, vq), np.float32)
            for u, v in ((as_trainium(uq), as_trainium(vq)), (uq, as_trainium(vq))):
                np.testing.assert_array_equal(np.asarray(f(x, u, v), np.float32), want)
                np.testing.assert_array_equal(np.asarray(jn.svd_matmul(x, u, v, u_scale=us, v_scale=vs)), want)
    layer = SVDLinear.from_values(as_trainium(uq), np.asarray(as_trainium(vq)), u_scale=us, v_scale=vs)
    np.testing.assert_array_equal(np.asarray(layer(x), np.float32), want)
    kernel, scale = quantize_fp8(rng.standard_normal((70, 6)))
    dense = Linear(as_trainium(kernel), kernel_scale=scale)
    assert dense.kernel[...].dtype == FP8_DTYPE
    np.testing.assert_array_equal(np.asarray(dense(x)), np.asarray(Linear(kernel, kernel_scale=scale)(x)))
    # float8_e4m3's inf (the bits of e4m3fn's 256) is not a weight value.
    with pytest.raises(ValueError, match=rf"svd_matmul: u holds 1 fp8 value\(s\) {BEYOND}"):
        jn.svd_matmul(x, as_trainium(uq).at[0, 0].set(jnp.inf), vq, u_scale=us, v_scale=vs)
    with pytest.raises(TypeError, match="scales go with fp8 factors only .*float8_e4m3fn, or float8_e4m3"):
        jn.svd_matmul(x, uq.astype(jnp.float8_e5m2), vq.astype(jnp.float8_e5m2), u_scale=us, v_scale=vs)


def test_float8_e4m3_in_svd_mlp_and_decode_step(rng, decode_ops):
    x = rng.standard_normal((5, 20)).astype(BF16)
    weights = [quantize_fp8(rng.standard_normal(shape)) for shape in ((20, 4), (4, 30), (20, 5), (5, 30), (30, 3))]
    weights.append(quantize_fp8(rng.standard_normal((3, 20))))
    scales = [s for _, s in weights]
    want = svd_mlp_of_factors(x, *(w for w, _ in weights), *scales)
    got = svd_mlp_of_factors(x, *(as_trainium(w) for w, _ in weights), *scales)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    k = decode_ops[WEIGHT_INDEX["k"]]
    step = jax.jit(functools.partial(jn.decode_step, spec=SPEC))
    want = step(*decode_ops)
    got = step(*replaced(decode_ops, "k", Quantized(as_trainium(k.w), k.scale)))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
