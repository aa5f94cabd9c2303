"""Emulator behaviour pinned to statements of AWS's `nki` 0.6 API docs (aws-neuron-sdk nki/api/nki/*).

Each documented rule has a violating kernel (the error names the instruction and this file's line) and a
conforming one checked against float64 numpy; each documented semantic is checked on random inputs.
"""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl

_raises = hardware_error_check(__file__)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


# -- nc_matmul ---------------------------------------------------------------------------------------


@nki.jit
def _tiled_matmul(lhs_t, rhs, tile_position, tile_size):
    a, b = nl.load(lhs_t), nl.load(rhs)
    acc = nl.ndarray((lhs_t.shape[1], rhs.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, a, b, tile_position=tile_position, tile_size=tile_size)
    result = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc)
    out = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


def test_matmul_tiling_mode():
    lhs_t, rhs = rand((40, 24)), rand((40, 70), seed=1)
    expected = _f64(lhs_t).T @ _f64(rhs)
    np.testing.assert_allclose(_tiled_matmul(lhs_t, rhs, (64, 0), (64, 128)), expected, rtol=1e-5, atol=1e-4)
    assert "both must be set" in _raises("nc_matmul", _tiled_matmul, lhs_t, rhs, (), (64, 128))
    assert "multiple" in _raises("nc_matmul", _tiled_matmul, lhs_t, rhs, (32, 0), (64, 128))
    # quarter tiles exist from NeuronCore-v3 on
    np.testing.assert_allclose(
        _tiled_matmul(rand((30, 20)), rand((30, 9), seed=2), (32, 96), (32, 32)),
        _f64(rand((30, 20))).T @ _f64(rand((30, 9), seed=2)),
        rtol=1e-5,
        atol=1e-4,
    )
    with emulator.use_target("trn1"):
        assert "unsupported on trn1" in _raises(
            "nc_matmul", _tiled_matmul, rand((30, 20)), rand((30, 9), seed=2), (32, 0), (32, 128)
        )
    # the stationary must fit the chosen tile
    assert "exceeds 64" in _raises("nc_matmul", _tiled_matmul, rand((100, 8)), rand((100, 9)), (0, 0), (64, 128))


@nki.jit
def _double_row_matmul(lhs_t, rhs, dtype):
    """lhs_t [K, 2, M], rhs [K, 2, N] in fp8 -> [M, N] with the contraction over K and the pair axis."""
    a = nl.ndarray(lhs_t.shape, dtype, buffer=nl.sbuf)
    b = nl.ndarray(rhs.shape, dtype, buffer=nl.sbuf)
    nisa.dma_copy(a, lhs_t)
    nisa.dma_copy(b, rhs)
    acc = nl.ndarray((lhs_t.shape[2], rhs.shape[2]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, a, b, perf_mode=nisa.matmul_perf_mode.double_row)
    result = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc)
    out = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


def test_matmul_double_row_perf_mode():
    lhs_t, rhs = rand((50, 2, 7)), rand((50, 2, 33), seed=1)
    fp8 = ml_dtypes.float8_e4m3
    ref = np.einsum("kjm,kjn->mn", _f64(lhs_t.astype(fp8)), _f64(rhs.astype(fp8)))
    np.testing.assert_allclose(_double_row_matmul(lhs_t, rhs, nl.float8_e4m3), ref, rtol=1e-5, atol=1e-4)
    assert "float8" in _raises("nc_matmul", _double_row_matmul, lhs_t, rhs, nl.bfloat16)
    with emulator.use_target("trn1"):
        assert "NeuronCore-v2" in _raises("nc_matmul", _double_row_matmul, lhs_t, rhs, nl.float8_e4m3)


@nki.jit
def _transpose_through_pe(x, use_matmul):
    """x [P, F] (bf16) -> x.T via the Tensor Engine: nc_transpose, or nc_matmul with an identity moving."""
    t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    tt = nl.ndarray((x.shape[1], x.shape[0]), nl.bfloat16, buffer=nl.psum)
    if use_matmul:
        eye = nl.ndarray((x.shape[0], x.shape[0]), nl.bfloat16, buffer=nl.sbuf)
        nisa.iota(eye, [[1, x.shape[0]]], offset=0, channel_multiplier=-1)  # column - partition
        nisa.tensor_scalar(eye, eye, nl.equal, 0.0)
        nisa.nc_matmul(tt, t, eye, is_transpose=True)
    else:
        nisa.nc_transpose(tt, t)
    result = nl.ndarray(tt.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, tt)
    out = nl.ndarray(tt.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


@pytest.mark.parametrize("use_matmul", [True, False])
def test_pe_transpose_nan_handling_per_target(use_matmul):
    x = rand((12, 5))
    x[3, 1] = np.nan
    expected = _f64(x.astype(ml_dtypes.bfloat16)).T
    got = _transpose_through_pe(x, use_matmul)  # trn2: bit-accurate, the NaN is moved like any value
    np.testing.assert_array_equal(got, expected)
    with emulator.use_target("trn1"):  # NeuronCore-v2: a real matmul, NaN * 0 spoils its whole output row
        got = _transpose_through_pe(x, use_matmul)
    assert np.isnan(got[1]).all()
    np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(expected, 1, axis=0))


# -- engines and targets -----------------------------------------------------------------------------


@nki.jit
def _copy_on(x, engine):
    t = nl.load(x)
    c = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(c, t, engine=engine)
    out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
    nl.store(out, c)
    return out


def test_tensor_copy_scalar_engine_not_on_trn1():
    x = rand((9, 13))
    np.testing.assert_array_equal(_copy_on(x, nisa.engine.scalar), x.astype(ml_dtypes.bfloat16))
    with emulator.use_target("trn1"):
        assert "nl.copy" in _raises("tensor_copy", _copy_on, x, nisa.engine.scalar)
        np.testing.assert_array_equal(_copy_on(x, nisa.engine.vector), x.astype(ml_dtypes.bfloat16))


@nki.jit
def _activation_bias(x, bias_vector):
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    if bias_vector:
        b = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(b, 0.5)
        nisa.activation(y, nl.exp, t, bias=b, scale=2.0)
    else:
        nisa.activation(y, nl.exp, t, bias=0.5, scale=2.0)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, y)
    return out


def test_activation_scalar_bias_needs_trn2():
    x = rand((7, 11))
    expected = np.exp(2.0 * _f64(x) + 0.5)
    np.testing.assert_allclose(_activation_bias(x, False), expected, rtol=1e-5)
    with emulator.use_target("trn1"):
        assert "[7, 1] vector" in _raises("activation", _activation_bias, x, False)
        np.testing.assert_allclose(_activation_bias(x, True), expected, rtol=1e-5)


@nki.jit
def _dma_with(x, priority, dge, engine):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x, priority=priority, dge_mode=dge, engine=engine)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, t)
    return out


def test_dma_copy_options():
    x = rand((6, 10))
    np.testing.assert_array_equal(_dma_with(x, None, nisa.dge_mode.hwdge, nisa.engine.sync), x)
    assert "only valid with dge_mode=hwdge" in _raises(
        "dma_copy", _dma_with, x, None, nisa.dge_mode.unknown, nisa.engine.sync
    )
    assert "engine.sync or" in _raises("dma_copy", _dma_with, x, None, nisa.dge_mode.hwdge, nisa.engine.vector)
    assert "NeuronCore-v4" in _raises("dma_copy", _dma_with, x, 1, nisa.dge_mode.unknown, nisa.engine.unknown)
    with emulator.use_target("trn1"):
        assert "NeuronCore-v3" in _raises("dma_copy", _dma_with, x, None, nisa.dge_mode.hwdge, nisa.engine.unknown)


@nki.jit
def _dma_transpose_with(x, dge):
    t = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(t, x, dge_mode=dge)
    out = nl.ndarray(t.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, t)
    return out


def test_dma_transpose_dge_modes():
    x = rand((16, 40)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_dma_transpose_with(x, nisa.dge_mode.hwdge), x.T)
    assert "src.shape[0] == 16" in _raises("dma_transpose", _dma_transpose_with, x[:12], nisa.dge_mode.hwdge)
    assert "2-byte" in _raises("dma_transpose", _dma_transpose_with, x.astype(np.float32), nisa.dge_mode.hwdge)
    assert "not valid here" in _raises("dma_transpose", _dma_transpose_with, x, nisa.dge_mode.swdge)
    np.testing.assert_array_equal(_dma_transpose_with(x[:12], nisa.dge_mode.unknown), x[:12].T)


# -- vector-engine semantics -------------------------------------------------------------------------


@nki.jit
def _scalar_ops(x, op0, operand0, reverse0, op1, operand1, reverse1, engine, dtype):
    t = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    y = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(
        y, t, op0, operand0, reverse0=reverse0, op1=op1, operand1=operand1, reverse1=reverse1, engine=engine
    )
    out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
    nl.store(out, y)
    return out


def test_tensor_scalar_order_unary_and_bitvec():
    x = rand((10, 17))
    u = nisa.engine.unknown
    np.testing.assert_allclose(
        _scalar_ops(x, nl.subtract, 3.0, True, nl.divide, 2.0, True, u, nl.float32), 2.0 / (3.0 - _f64(x)), rtol=1e-5
    )
    np.testing.assert_allclose(
        _scalar_ops(x, nl.abs, None, False, nl.multiply, -2.0, False, u, nl.float32), -2.0 * np.abs(_f64(x)), rtol=1e-6
    )
    assert "unary" in _raises("tensor_scalar", _scalar_ops, x, nl.abs, 1.0, False, None, None, False, u, nl.float32)
    ints = np.random.default_rng(3).integers(-(2**30), 2**30, (10, 17)).astype(np.int32)
    np.testing.assert_array_equal(
        _scalar_ops(ints, nl.bitwise_and, 0x0F0F0F0F, False, nl.left_shift, 2, False, u, nl.int32),
        (ints & 0x0F0F0F0F) << 2,
    )
    assert "bitvec or both arithmetic" in _raises(
        "tensor_scalar", _scalar_ops, ints, nl.bitwise_and, 3, False, nl.add, 1.0, False, u, nl.int32
    )
    assert "integer dtype" in _raises(
        "tensor_scalar", _scalar_ops, x, nl.bitwise_and, 3, False, None, None, False, u, nl.float32
    )
    assert "Vector Engine only" in _raises(
        "tensor_scalar", _scalar_ops, ints, nl.bitwise_or, 3, False, None, None, False, nisa.engine.gpsimd, nl.int32
    )
    s = nisa.engine.scalar
    np.testing.assert_allclose(
        _scalar_ops(x, nl.multiply, 3.0, False, nl.add, 1.0, False, s, nl.float32), 3.0 * _f64(x) + 1.0, rtol=1e-6
    )
    assert "multiply/add" in _raises(
        "tensor_scalar", _scalar_ops, x, nl.subtract, 3.0, False, None, None, False, s, nl.float32
    )


@nki.jit
def _int_tensor_tensor(a, b, op, engine):
    x, y = nl.load(a), nl.load(b)
    z = nl.ndarray(a.shape, nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(z, x, y, op, engine=engine)
    out = nl.ndarray(a.shape, nl.int32, buffer=nl.shared_hbm)
    nl.store(out, z)
    return out


def test_tensor_tensor_int32_is_exact_on_gpsimd():
    rng = np.random.default_rng(4)
    a = rng.integers(2**24, 2**30, (8, 9)).astype(np.int32)
    b = rng.integers(1, 2**20, (8, 9)).astype(np.int32) | 1
    np.testing.assert_array_equal(
        _int_tensor_tensor(a, b, nl.add, nisa.engine.unknown), (a.astype(np.int64) + b).astype(np.int32)
    )
    via_fp32 = _int_tensor_tensor(a, b, nl.add, nisa.engine.vector)  # float32 math rounds large ints
    np.testing.assert_array_equal(via_fp32, (a.astype(np.float32) + b.astype(np.float32)).astype(np.int32))
    assert not np.array_equal(via_fp32, a + b)
    np.testing.assert_array_equal(_int_tensor_tensor(a, b, nl.bitwise_xor, nisa.engine.unknown), a ^ b)
    f = rand((8, 9))
    assert "integer dtype" in _raises("tensor_tensor", _int_tensor_tensor, f, f, nl.bitwise_xor, nisa.engine.unknown)


@nki.jit
def _reduce(x, op, axis, negate, keepdims, dtype):
    t = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    kept = (
        tuple(1 if d in axis else n for d, n in enumerate(x.shape))
        if keepdims
        else tuple(n for d, n in enumerate(x.shape) if d not in axis)
    )
    r = nl.ndarray(kept, dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(r, op, t, axis, negate=negate, keepdims=keepdims)
    out = nl.ndarray(kept, dtype, buffer=nl.shared_hbm)
    nl.store(out, r)
    return out


def test_tensor_reduce_bitvec_negate_keepdims():
    x = rand((6, 4, 9))
    np.testing.assert_allclose(
        _reduce(x, nl.maximum, (2,), True, True, nl.float32), -_f64(x).max(axis=2, keepdims=True), rtol=1e-6
    )
    np.testing.assert_allclose(
        _reduce(x[:, :, :1], nl.add, (1, 2), False, True, nl.float32),
        _f64(x[:, :, :1]).sum(axis=(1, 2), keepdims=True),
        rtol=1e-5,
        atol=1e-6,
    )
    ints = np.random.default_rng(5).integers(0, 2**31 - 1, (6, 4, 9)).astype(np.int32)
    np.testing.assert_array_equal(
        _reduce(ints, nl.bitwise_or, (2,), False, False, nl.int32), np.bitwise_or.reduce(ints, axis=2)
    )
    assert "arithmetic reductions only" in _raises(
        "tensor_reduce", _reduce, ints, nl.bitwise_or, (2,), True, False, nl.int32
    )


# -- nki.language ------------------------------------------------------------------------------------


def test_nl_matmul_without_transpose_x():
    @nki.jit
    def kernel(x, y):
        a, b = nl.load(x), nl.load(y)
        res = nl.matmul(a, b)  # x [M, K] @ y [K, N]; the compiler inserts the transpose of x
        sb = nl.ndarray(res.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(sb, res)
        out = nl.ndarray(res.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, sb)
        return out

    x, y = rand((13, 40)), rand((40, 21), seed=1)
    np.testing.assert_allclose(kernel(x, y), _f64(x) @ _f64(y), rtol=1e-5, atol=1e-4)


def test_num_programs_defaults_to_axis_0():
    @nki.jit
    def kernel(x):
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.memset(t[:, 0:1], nl.num_programs())
        nisa.memset(t[:, 1:2], nl.num_programs(axes=None))
        nl.store(out, t)
        return out

    x = rand((2, 2))
    np.testing.assert_array_equal(kernel[3, 2](x), [[3, 6]])
    np.testing.assert_array_equal(kernel(x), [[1, 1]])


def test_load_store_buffers():
    @nki.jit
    def kernel(x, on_chip_load):
        t = nl.load(x)
        if on_chip_load:
            t = nl.load(t)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out

    x = rand((5, 3))
    np.testing.assert_array_equal(kernel(x, False), x)
    assert "must be in HBM" in _raises("nl.load", kernel, x, True)
    assert not hasattr(nl, "ones_like") and not hasattr(nl, "full_like")  # not in nki.language
