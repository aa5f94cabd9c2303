"""nki.isa arithmetic added for NKI 0.6 coverage (reciprocal, scalar_tensor_tensor, tensor_scalar_reduce,
tensor_scalar_cumulative, activation_reduce, bn_stats / bn_aggr) against float64 numpy references."""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand, run_tiles

from nki_kernels.binding import nisa, nl

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
raises = hardware_error_check(__file__)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@pytest.mark.parametrize("rows,cols", [(1, 7), (130 - 2, 100), (128, 513)])
def test_reciprocal(rows, cols):
    x = rand((rows, cols), seed=rows + cols) + 3.0
    (got,) = run_tiles(lambda x, out: nisa.reciprocal(out, x), [x], [((rows, cols), F32)])
    np.testing.assert_allclose(got, 1.0 / _f64(x), rtol=1e-6)


@pytest.mark.parametrize("reverse0,reverse1", [(False, False), (True, True)])
def test_scalar_tensor_tensor_vector_operand(reverse0, reverse1):
    data, other = rand((7, 130), seed=1), rand((7, 130), seed=2)
    column = rand((7, 1), seed=3)

    def body(data, other, column, out):
        nisa.scalar_tensor_tensor(
            out, data, nl.subtract, column, nl.multiply, other, reverse0=reverse0, reverse1=reverse1
        )

    (got,) = run_tiles(body, [data, other, column], [((7, 130), BF16)])
    first = _f64(column) - _f64(data) if reverse0 else _f64(data) - _f64(column)
    np.testing.assert_allclose(_f64(got), first * _f64(other), rtol=1e-2, atol=1e-2)


def test_scalar_tensor_tensor_rejects_bitvec_operators():
    def body(data, out):
        nisa.scalar_tensor_tensor(out, data, nl.bitwise_and, 1, nl.add, data)

    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    raises("scalar_tensor_tensor", run_tiles, body, [x], [((2, 4), np.int32)])


def test_tensor_scalar_reduce_accumulates_across_calls():
    a, b = rand((100, 70), seed=4), rand((100, 200), seed=5)

    def body(a, b, out_a, out_b, first, total, negated):
        nisa.tensor_scalar_reduce(out_a, a, nl.multiply, 2.0, nl.maximum, reduce_res=first)
        nisa.tensor_scalar_reduce(
            out_b, b, nl.multiply, 2.0, nl.maximum, reduce_res=total, reduce_cmd=nisa.reduce_cmd.reduce
        )
        nisa.tensor_scalar_reduce(out_b, b, nl.add, 1.0, nl.add, reduce_res=negated, reduce_res_negate=True)

    outs = run_tiles(
        body, [a, b], [((100, 70), F32), ((100, 200), F32), ((100, 1), F32), ((100, 1), F32), ((100, 1), F32)]
    )
    out_a, out_b, first, total, negated = map(_f64, outs)
    np.testing.assert_allclose(out_a, 2 * _f64(a), rtol=1e-6)
    np.testing.assert_allclose(first[:, 0], (2 * _f64(a)).max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(total[:, 0], np.maximum((2 * _f64(a)).max(axis=1), (2 * _f64(b)).max(axis=1)), rtol=1e-6)
    np.testing.assert_allclose(negated[:, 0], -(_f64(b) + 1).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(out_b, _f64(b) + 1, rtol=1e-6)


def test_tensor_scalar_reduce_load_reduce_needs_reduce_init():
    def body(x, out, res):
        nisa.tensor_scalar_reduce(out, x, nl.add, 1.0, nl.add, reduce_res=res, reduce_cmd=nisa.reduce_cmd.load_reduce)

    raises("tensor_scalar_reduce", run_tiles, body, [rand((4, 8))], [((4, 8), F32), ((4, 1), F32)])


@pytest.mark.parametrize(
    "op1,numpy_scan", [(nl.add, np.cumsum), (nl.maximum, np.maximum.accumulate), (nl.multiply, np.cumprod)]
)
def test_tensor_scalar_cumulative(op1, numpy_scan):
    x = rand((7, 33), seed=6) * 0.5

    def body(x, out):
        nisa.tensor_scalar_cumulative(out, x, nl.multiply, op1, 1.5)

    (got,) = run_tiles(body, [x], [((7, 33), F32)])
    np.testing.assert_allclose(got, numpy_scan(1.5 * _f64(x), axis=1), rtol=1e-5, atol=1e-6)


def test_tensor_scalar_cumulative_load_reduce_then_continue():
    x, y = rand((5, 10), seed=7), rand((5, 6), seed=8)
    start = rand((5, 1), seed=9)

    def body(x, y, start, out_x, out_y):
        nisa.tensor_scalar_cumulative(out_x, x, nl.add, nl.add, 0.0, imm1=start, reduce_cmd=nisa.reduce_cmd.load_reduce)
        nisa.tensor_scalar_cumulative(out_y, y, nl.add, nl.add, 0.0, reduce_cmd=nisa.reduce_cmd.reduce)

    out_x, out_y = run_tiles(body, [x, y, start], [((5, 10), F32), ((5, 6), F32)])
    running = np.cumsum(np.concatenate([_f64(x), _f64(y)], axis=1), axis=1) + _f64(start)
    np.testing.assert_allclose(out_x, running[:, :10], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_y, running[:, 10:], rtol=1e-5, atol=1e-6)


def test_tensor_scalar_cumulative_rejects_int32():
    def body(x, out):
        nisa.tensor_scalar_cumulative(out, x, nl.add, nl.add, 0.0)

    raises("tensor_scalar_cumulative", run_tiles, body, [np.ones((2, 4), np.int32)], [((2, 4), np.int32)])


def test_activation_reduce_sums_the_activated_values():
    x = rand((130 - 2, 77), seed=10)
    bias = rand((128, 1), seed=11)

    def body(x, bias, out, res):
        nisa.activation_reduce(out, nl.exp, x, nl.add, res, bias=bias, scale=0.5)

    out, res = run_tiles(body, [x, bias], [((128, 77), F32), ((128, 1), F32)])
    expected = np.exp(0.5 * _f64(x) + _f64(bias))
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    np.testing.assert_allclose(res[:, 0], expected.sum(axis=1), rtol=1e-5)


@pytest.mark.parametrize("cols", [1, 7, 512, 1000])
def test_bn_stats_and_bn_aggr_give_mean_and_variance(cols):
    x = rand((100, cols), seed=cols) * 3 + 1
    chunks = [(s, min(512, cols - s)) for s in range(0, cols, 512)]

    def body(x, out):
        stats = nl.ndarray((100, 6 * len(chunks)), nl.float32, buffer=nl.sbuf)
        for i, (start, size) in enumerate(chunks):
            nisa.bn_stats(stats[:, 6 * i : 6 * i + 6], x[:, start : start + size])
        nisa.bn_aggr(out, stats)

    (got,) = run_tiles(body, [x], [((100, 2), F32)])
    np.testing.assert_allclose(got[:, 0], _f64(x).mean(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 1], _f64(x).var(axis=1), rtol=1e-4, atol=1e-5)


def test_bn_stats_layout_and_limit():
    x = rand((3, 9), seed=12)
    (got,) = run_tiles(lambda x, out: nisa.bn_stats(out, x), [x], [((3, 6), F32)])
    even, odd = _f64(x)[:, 0::2], _f64(x)[:, 1::2]
    expected = np.stack(
        [np.full(3, 5.0), even.mean(1), even.var(1) * 5, np.full(3, 4.0), odd.mean(1), odd.var(1) * 4], axis=1
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    raises("bn_stats", run_tiles, lambda x, out: nisa.bn_stats(out, x), [rand((2, 513))], [((2, 6), F32)])
