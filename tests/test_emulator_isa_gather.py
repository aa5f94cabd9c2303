"""nki.isa data movement inside SBUF (tensor_partition_reduce, nc_stream_shuffle, local_gather, nc_n_gather,
sequence_bounds, nonzero_with_count, topk) against numpy references written from their documented semantics."""

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


@pytest.mark.parametrize("op,reduce", [(nl.add, np.sum), (nl.maximum, np.max), (nl.average, np.mean)])
def test_tensor_partition_reduce(op, reduce):
    x = rand((100, 7, 3), seed=1)
    (got,) = run_tiles(lambda x, out: nisa.tensor_partition_reduce(out, op, x), [x], [((1, 7, 3), F32)])
    np.testing.assert_allclose(got, reduce(_f64(x), axis=0, keepdims=True), rtol=1e-5, atol=1e-6)


def test_tensor_partition_reduce_bitwise_or():
    x = np.random.default_rng(2).integers(0, 2**20, size=(33, 5)).astype(np.int32)
    (got,) = run_tiles(lambda x, out: nisa.tensor_partition_reduce(out, nl.bitwise_or, x), [x], [((1, 5), np.int32)])
    np.testing.assert_array_equal(got[0], np.bitwise_or.reduce(x, axis=0))


def test_stream_shuffle_per_quadrant_with_unchanged_lanes():
    x = rand((128, 40), seed=3)
    old = rand((128, 40), seed=4)
    mask = [(i + 5) % 32 for i in range(32)]
    mask[7] = 255

    def body(x, old, out):
        nisa.tensor_copy(out, old)
        nisa.nc_stream_shuffle(out, x, mask)

    (got,) = run_tiles(body, [x, old], [((128, 40), F32)])
    expected = old.copy()
    for p in range(128):
        quadrant, i = divmod(p, 32)
        if mask[i] != 255:
            expected[p] = x[quadrant * 32 + mask[i]]
    np.testing.assert_array_equal(got, expected)


def test_stream_shuffle_broadcasts_one_partition():
    x = rand((1, 9), seed=5)
    (got,) = run_tiles(lambda x, out: nisa.nc_stream_shuffle(out, x, [0] * 32), [x], [((32, 9), F32)])
    np.testing.assert_array_equal(got, np.repeat(x, 32, axis=0))


def test_stream_shuffle_start_partition_rule():
    def body(x, out):
        nisa.nc_stream_shuffle(out[16:48], x[0:32], list(range(32)))

    raises("nc_stream_shuffle", run_tiles, body, [rand((32, 4))], [((64, 4), F32)])


@pytest.mark.parametrize("elements,valid", [(1, None), (4, 20), (2, 64)])
def test_local_gather_per_core_partition_first_indices(elements, valid):
    rng = np.random.default_rng(elements)
    src = rand((128, 50 * elements), seed=6)
    index = rng.integers(0, 50, size=(128, 4)).astype(np.uint16) * elements
    count = 64 if valid is None else valid

    def body(src, index, out):
        nisa.local_gather(out, src, index, num_elem_per_idx=elements, num_valid_indices=valid)

    (got,) = run_tiles(body, [src, index], [((128, count * elements), F32)])
    expected = np.empty((128, count, elements), np.float32)
    for core in range(8):
        rows = slice(16 * core, 16 * core + 16)
        starts = index[rows].flatten(order="F")[:count].astype(np.int64)
        positions = starts[:, None] + np.arange(elements)[None, :]
        expected[rows] = src[rows][:, positions]
    np.testing.assert_array_equal(got, expected.reshape(128, -1))


def test_local_gather_rules():
    src, index = rand((20, 8)), np.zeros((20, 1), np.uint16)
    raises("local_gather", run_tiles, lambda s, i, out: nisa.local_gather(out, s, i), [src, index], [((20, 16), F32)])


def test_nc_n_gather_per_partition():
    data = rand((7, 3, 50), seed=7)
    indices = np.random.default_rng(8).integers(0, 150, size=(7, 1000)).astype(np.uint32)
    (got,) = run_tiles(lambda d, i, out: nisa.nc_n_gather(out, d, i), [data, indices], [((7, 1000), F32)])
    np.testing.assert_array_equal(got, np.take_along_axis(data.reshape(7, -1), indices.astype(np.int64), axis=1))


def test_nc_n_gather_index_out_of_range():
    indices = np.full((2, 3), 8, np.uint32)
    raises(
        "nc_n_gather",
        run_tiles,
        lambda d, i, out: nisa.nc_n_gather(out, d, i),
        [rand((2, 8)), indices],
        [((2, 3), F32)],
    )


def _bounds(ids):
    """The nisa.sequence_bounds reference: per element the [start, end) of its run of equal nonzero ids."""
    n = len(ids)
    start, end = np.zeros(n), np.zeros(n)
    for i in range(n):
        start[i] = n if ids[i] == 0 else (start[i - 1] if i and ids[i] == ids[i - 1] else i)
    for i in reversed(range(n)):
        end[i] = -1 if ids[i] == 0 else (end[i + 1] if i < n - 1 and ids[i] == ids[i + 1] else i + 1)
    return np.stack([start, end])


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_sequence_bounds(dtype):
    ids = np.sort(np.random.default_rng(9).integers(0, 12, size=130)).astype(dtype)[None, :]
    (got,) = run_tiles(lambda s, out: nisa.sequence_bounds(out, s), [ids], [((1, 2, 130), dtype)])
    np.testing.assert_array_equal(got[0], _bounds(ids[0]))


def test_nonzero_with_count_touches_one_partition_per_core():
    x = (np.random.default_rng(10).random((128, 33)) < 0.3).astype(np.float32) * rand((128, 33), seed=11)
    old = np.full((128, 34), 77, np.int32)

    def body(x, old, out):
        nisa.tensor_copy(out, old)
        nisa.nonzero_with_count(out, x, index_offset=16, padding_val=-1)

    (got,) = run_tiles(body, [x, old], [((128, 34), np.int32)])
    for p in range(128):
        if p % 16:
            np.testing.assert_array_equal(got[p], old[p])
            continue
        found = np.flatnonzero(x[p])
        row = np.full(34, -1)
        row[: found.size] = found + 16
        row[33] = found.size
        np.testing.assert_array_equal(got[p], row)
    raises("nonzero_with_count", run_tiles, body, [x, old], [((128, 34), np.int32)], target="trn1")


def test_topk_over_the_16_partition_snake():
    n, k = 42, 8
    src = rand((32, 3), BF16, seed=12)

    def body(src, values, index):
        nisa.topk(values, index, src, n)

    values, index = run_tiles(body, [src], [((32, k), BF16), ((32, k), np.uint32)])
    for group in range(2):
        snake = _f64(src[16 * group : 16 * group + 16]).flatten(order="F")[:n]
        order = np.argsort(-snake, kind="stable")[:k][::-1]
        for p in range(16 * group, 16 * group + 16):
            np.testing.assert_array_equal(_f64(values[p]), snake[order])
            np.testing.assert_array_equal(index[p], order)


def test_documented_costs_of_new_instructions():
    from nki_kernels.emulator import cost_model, trace

    runs = []
    trace.add_listener(runs.append)
    try:
        run_tiles(
            lambda src, values, index: nisa.topk(values, index, src, 42),
            [rand((16, 3), BF16)],
            [((16, 8), BF16), ((16, 8), np.uint32)],
        )
        run_tiles(
            lambda x, out, res: nisa.tensor_scalar_reduce(out, x, nl.add, 1.0, nl.add, reduce_res=res),
            [rand((4, 300))],
            [((4, 300), F32), ((4, 1), F32)],
        )
        run_tiles(
            lambda x, out, res: nisa.activation_reduce(out, nl.square, x, nl.add, res),
            [rand((4, 20))],
            [((4, 20), F32), ((4, 1), F32)],
        )
    finally:
        trace.remove_listener(runs.append)
    records = {r.opcode: r for run in runs for r in run.records}
    hardware = cost_model.HARDWARE["trn2"]
    assert cost_model.compute_cycles(records["topk"], hardware) == 4 * 42 + 8  # documented 4n + K
    assert cost_model.compute_cycles(records["tensor_scalar_reduce"], hardware) == 300 + 64  # max(MIN_II, N) + MIN_II
    # activation_reduce: max(MIN_II, N) + MIN_II, and reduce_res is written (later readers wait for it).
    assert cost_model.compute_cycles(records["activation"], hardware) == 64 + 64
    assert len(records["activation"].writes) == 2
