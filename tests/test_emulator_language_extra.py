"""nki.language functions added for NKI 0.6 coverage (where, softmax, rms_norm, all, gather_flattened,
load_transpose2d, shared_constant, shared_identity_matrix) against float64 numpy references."""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import rand

from nki_kernels.binding import nisa, nki, nl

BF16 = np.dtype(ml_dtypes.bfloat16)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _tile(x):
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(tile, x)
    return tile


def _store(tile):
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, tile)
    return out


def test_where_with_tiles_and_numbers():
    cond = (np.random.default_rng(1).random((7, 130)) < 0.5).astype(np.float32)
    x, y = rand((7, 130), seed=2), rand((7, 130), seed=3)

    @nki.jit
    def kernel(cond, x, y):
        c, a, b = _tile(cond), _tile(x), _tile(y)
        return _store(nl.where(c, a, b)), _store(nl.where(c, a, -4.0))

    both, scalar = kernel(cond, x, y)
    np.testing.assert_array_equal(both, np.where(cond != 0, x, y))
    np.testing.assert_array_equal(scalar, np.where(cond != 0, x, -4.0))


@pytest.mark.parametrize("shape,axis", [((7, 130), 1), ((128, 4, 100), 2), ((3, 5, 6), (1, 2))])
def test_softmax(shape, axis):
    x = rand(shape, seed=sum(shape)) * 4

    @nki.jit
    def kernel(x):
        return _store(nl.softmax(_tile(x), axis=axis))

    xf = _f64(x)
    expected = np.exp(xf - xf.max(axis=axis, keepdims=True))
    expected /= expected.sum(axis=axis, keepdims=True)
    np.testing.assert_allclose(kernel(x), expected, rtol=1e-5, atol=1e-7)


def test_rms_norm_with_broadcast_weight():
    x, w = rand((100, 200), BF16, seed=4), rand((1, 200), seed=5)

    @nki.jit
    def kernel(x, w):
        weight = nl.broadcast_to(_tile(w), (100, 200))
        return _store(nl.rms_norm(_tile(x), weight, axis=1, n=200, epsilon=1e-5, dtype=nl.float32))

    xf = _f64(x)
    expected = xf / np.sqrt((xf * xf).sum(axis=1, keepdims=True) / 200 + 1e-5) * _f64(w)
    np.testing.assert_allclose(kernel(x, w), expected, rtol=1e-5, atol=1e-6)


def test_all_reduces_logical_and():
    x = (np.random.default_rng(6).random((9, 5)) < 0.8).astype(np.float32)
    x[0] = 1

    @nki.jit
    def kernel(x):
        return _store(nl.all(_tile(x), axis=1))

    np.testing.assert_array_equal(kernel(x)[:, 0], np.all(x != 0, axis=1))


def test_gather_flattened_and_load_transpose2d():
    data = rand((7, 3, 40), seed=7)
    indices = np.random.default_rng(8).integers(0, 120, size=(7, 130)).astype(np.int32)
    matrix = rand((33, 100), BF16, seed=9)

    @nki.jit
    def kernel(data, indices, matrix):
        return _store(nl.gather_flattened(_tile(data), _tile(indices))), _store(nl.load_transpose2d(matrix))

    gathered, transposed = kernel(data, indices, matrix)
    np.testing.assert_array_equal(gathered, np.take_along_axis(data.reshape(7, -1), indices, axis=1))
    np.testing.assert_array_equal(transposed, matrix.T)


def test_shared_constant_from_array_and_npy_file(tmp_path):
    table = rand((5, 7), seed=10)
    path = tmp_path / "table.npy"
    np.save(path, table * 2)

    @nki.jit
    def kernel():
        a = nl.shared_constant(table)
        b = nl.shared_constant(str(path))
        return _store(_tile(a)), _store(_tile(b))

    a, b = kernel()
    np.testing.assert_array_equal(a, table)
    np.testing.assert_array_equal(b, table * 2)


@pytest.mark.parametrize("n,dtype", [(128, np.float32), (7, np.uint8), (130 - 2, BF16)])
def test_shared_identity_matrix(n, dtype):
    @nki.jit
    def kernel():
        return _store(nl.shared_identity_matrix(n, dtype=dtype))

    got = kernel()
    assert got.dtype == dtype
    np.testing.assert_array_equal(_f64(got), np.eye(n))


def test_gelu_apprx_sigmoid_dx_is_the_derivative():
    x = rand((7, 130), seed=11) * 3

    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(out, nl.gelu_apprx_sigmoid_dx, _tile(x))
        return _store(out)

    xf, h = _f64(x), 1e-5
    gelu = lambda v: v / (1 + np.exp(-1.702 * v))  # noqa: E731 - the documented sigmoid approximation
    np.testing.assert_allclose(kernel(x), (gelu(xf + h) - gelu(xf - h)) / (2 * h), rtol=1e-4, atol=1e-5)
