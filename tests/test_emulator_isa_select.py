"""nki.isa selection instructions (tensor_copy_predicated, select_reduce, range_select, affine_select, max8,
nc_find_index8, nc_match_replace8) against numpy references written from their documented semantics."""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand, run_tiles

from nki_kernels.binding import nisa, nl

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
FP32_MIN = float(np.finfo(np.float32).min)
raises = hardware_error_check(__file__)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@pytest.mark.parametrize("reverse", [False, True])
def test_tensor_copy_predicated_keeps_unselected_elements(reverse):
    src, old = rand((7, 130), seed=1), rand((7, 130), seed=2)
    predicate = (np.random.default_rng(3).random((7, 130)) < 0.4).astype(np.uint8)

    def body(src, old, predicate, out):
        nisa.tensor_copy(out, old)
        nisa.tensor_copy_predicated(out, src, predicate, reverse_pred=reverse)

    (got,) = run_tiles(body, [src, old, predicate], [((7, 130), F32)])
    take = (predicate == 0) if reverse else (predicate != 0)
    np.testing.assert_array_equal(got, np.where(take, src, old))


def test_tensor_copy_predicated_scalar_source_and_dtype_rules():
    old = rand((4, 9), seed=4)
    predicate = np.eye(4, 9, dtype=np.uint16)

    def body(old, predicate, out):
        nisa.tensor_copy(out, old)
        nisa.tensor_copy_predicated(out, -5.0, predicate)

    (got,) = run_tiles(body, [old, predicate], [((4, 9), F32)])
    np.testing.assert_array_equal(got, np.where(predicate != 0, -5.0, old))
    bad = predicate.astype(np.float32)
    raises(
        "tensor_copy_predicated",
        run_tiles,
        lambda o, p, out: nisa.tensor_copy_predicated(out, o, p),
        [old, bad],
        [((4, 9), F32)],
    )


def test_select_reduce_with_vector_on_false_and_running_max():
    on_true, more = rand((100, 50), seed=5), rand((100, 20), seed=6)
    predicate = (np.random.default_rng(7).random((100, 50)) < 0.5).astype(np.int8)
    on_false = rand((100, 1), seed=8)

    def body(on_true, more, predicate, on_false, out, out2, res):
        nisa.select_reduce(out, predicate, on_true, on_false, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        ones = nl.ndarray((100, 20), nl.int8, buffer=nl.sbuf)
        nisa.memset(ones, 1)
        nisa.select_reduce(out2, ones, more, -1.0, reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce, reverse_pred=True)

    out, out2, res = run_tiles(
        body, [on_true, more, predicate, on_false], [((100, 50), F32), ((100, 20), F32), ((100, 1), F32)]
    )
    first = np.where(predicate != 0, _f64(on_true), _f64(on_false))
    np.testing.assert_array_equal(out, first)
    np.testing.assert_array_equal(out2, np.full((100, 20), -1.0))
    np.testing.assert_allclose(res[:, 0], np.maximum(first.max(axis=1), -1.0))


@pytest.mark.parametrize("cols,start", [(1, 0), (130, 5), (512, 1000)])
def test_range_select_masks_free_indices_and_reduces_max(cols, start):
    x = rand((7, cols), seed=cols)
    rng = np.random.default_rng(cols)
    low = rng.integers(start - 3, start + cols, size=(7, 1)).astype(np.float32)
    high = (low + rng.integers(0, cols + 3, size=(7, 1))).astype(np.float32)

    def body(x, low, high, out, res):
        nisa.range_select(
            out, x, nl.greater_equal, nl.less, low, high, reduce_res=res, range_start=start, on_false_value=FP32_MIN
        )

    out, res = run_tiles(body, [x, low, high], [((7, cols), F32), ((7, 1), F32)])
    index = start + np.arange(cols)[None, :]
    expected = np.where((index >= low) & (index < high), _f64(x), FP32_MIN)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(res[:, 0], expected.max(axis=1))


def test_range_select_rules():
    x, bound = rand((4, 8)), np.zeros((4, 1), np.float32)

    def body(x, b0, b1, out, res, fill=FP32_MIN):
        nisa.range_select(out, x, nl.less, nl.less, b0, b1, reduce_res=res, on_false_value=fill)

    outputs = [((4, 8), F32), ((4, 1), F32)]
    raises("range_select", run_tiles, body, [x, bound, bound], outputs, target="trn1")
    raises(
        "range_select",
        run_tiles,
        lambda x, b0, b1, out, res: body(x, b0, b1, out, res, fill=0.0),
        [x, bound, bound],
        outputs,
    )


@pytest.mark.parametrize("multiplier,offset", [(1, 0), (-1, 3), (2, -60)])
def test_affine_select_causal_style_mask(multiplier, offset):
    x = rand((130 - 2, 64), seed=9)
    pattern = [[-1, 4], [1, 16]]  # affine = offset + p * multiplier - i0 + i1

    def body(x, out):
        nisa.affine_select(out, pattern, multiplier, x, -9999.0, cmp_op=nl.greater_equal, offset=offset)

    (got,) = run_tiles(body, [x], [((128, 64), F32)])
    p = np.arange(128)[:, None, None]
    i0 = np.arange(4)[None, :, None]
    i1 = np.arange(16)[None, None, :]
    affine = (offset + p * multiplier - i0 + i1).reshape(128, 64)
    np.testing.assert_array_equal(got, np.where(affine >= 0, x, -9999.0))


@pytest.mark.parametrize("shape", [(1, 8), (7, 130), (128, 4, 100)])
def test_max8_descending(shape):
    x = rand(shape, seed=sum(shape))
    (got,) = run_tiles(lambda x, out: nisa.max8(out, x), [x], [((shape[0], 8), F32)])
    flat = _f64(x).reshape(shape[0], -1)
    np.testing.assert_array_equal(got, -np.sort(-flat, axis=1)[:, :8])


def test_max8_size_limits():
    raises("max8", run_tiles, lambda x, out: nisa.max8(out, x), [rand((2, 7))], [((2, 8), F32)])


def test_find_index8_of_max8_and_sentinel():
    x = rand((32, 128), seed=10)

    def body(x, values, index, missing_index):
        nisa.max8(values, x)
        nisa.nc_find_index8(index, x, values)
        absent = nl.ndarray((32, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(absent, 1e6)
        nisa.nc_find_index8(missing_index, x, absent)

    values, index, missing = run_tiles(body, [x], [((32, 8), F32), ((32, 8), np.uint32), ((32, 8), np.uint16)])
    np.testing.assert_array_equal(index, np.argsort(-_f64(x), axis=1, kind="stable")[:, :8])
    np.testing.assert_array_equal(missing, np.full((32, 8), 0xFFFF))


def test_find_index8_duplicates_take_ascending_positions():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    (got,) = run_tiles(lambda d, v, out: nisa.nc_find_index8(out, d, v), [data, vals], [((1, 8), np.uint32)])
    np.testing.assert_array_equal(got[0], [2, 4, 5, 6, 7, 8, 9, 10])


def test_match_replace8_documented_duplicate_order():
    # the example of the nc_match_replace8 reference: duplicates fill dst_idx in descending order
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    def body(data, vals, out, idx):
        nisa.nc_match_replace8(out, data, vals, -1.0, dst_idx=idx)

    out, idx = run_tiles(body, [data, vals], [((1, 11), F32), ((1, 8), np.uint32)])
    np.testing.assert_array_equal(idx[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(out[0], [1, 2, -1, 4] + [-1] * 7)


def test_match_replace8_random_top8_removal():
    x = rand((100, 300), seed=11)

    def body(x, values, out):
        nisa.max8(values, x)
        nisa.nc_match_replace8(out, x, values, FP32_MIN)

    values, out = run_tiles(body, [x], [((100, 8), F32), ((100, 300), F32)])
    expected = _f64(x).copy()
    np.put_along_axis(expected, np.argsort(-expected, axis=1)[:, :8], FP32_MIN, axis=1)
    np.testing.assert_array_equal(out, expected)
