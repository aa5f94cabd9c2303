"""Tensor views of the emulator beyond slicing: NKIObject, annotations, item assignment, dtype views of other
sizes, rearrange, explicit access patterns with scalar / vector (indirect) offsets, dynamic select."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import rand

from nki_kernels.binding import nisa, nki, nl

BF16 = np.dtype(ml_dtypes.bfloat16)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def test_nkiobject_dataclasses_and_tensor_annotations():
    @dataclasses.dataclass
    class Config(nl.NKIObject):
        rows: int
        scale: float = 2.0

    plain = nl.NKIObject(alpha=3)
    assert plain.alpha == 3

    @nki.jit
    def kernel(x: nki.typing.tensor[7, 130], cfg: Config):
        tile: nki.typing.tensor[7, 130] = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        nisa.tensor_scalar(tile, tile, nl.multiply, cfg.scale)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        return out

    x = rand((7, 130))
    assert isinstance(nl.ndarray, object) and issubclass(nki.typing.tensor, nl.NKIObject)
    np.testing.assert_allclose(kernel(x, Config(rows=7, scale=-1.5)), x * -1.5, rtol=1e-6)


def test_item_assignment_copies_tiles_and_fills_numbers():
    @nki.jit
    def kernel(x):
        rows, cols = x.shape
        tile = nl.ndarray((rows, cols), x.dtype, buffer=nl.sbuf)
        tile[...] = x  # HBM -> SBUF: a DMA
        doubled = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
        doubled[:, :] = nl.add(tile, tile)  # tile -> tile: tensor_copy with a cast
        doubled[:, 0:3] = 7.0  # a number: memset
        out = nl.ndarray((rows, cols), nl.float32, buffer=nl.shared_hbm)
        out[...] = doubled
        return out

    x = rand((130 - 2, 100), BF16, seed=3)
    expected = 2 * _f64(x)
    expected[:, 0:3] = 7.0
    np.testing.assert_allclose(kernel(x), expected, rtol=1e-6)


@pytest.mark.parametrize("wide,narrow", [(np.float32, np.uint8), (np.float32, BF16), (np.int32, np.int16)])
def test_view_reinterprets_bytes_of_another_size(wide, narrow):
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        small = tile.view(narrow)  # last dim x ratio
        ratio = np.dtype(wide).itemsize // np.dtype(narrow).itemsize
        assert small.shape == (x.shape[0], x.shape[1] * ratio)
        back = small[:, 0 : x.shape[1] * ratio].view(wide)
        out_small = nl.ndarray(small.shape, narrow, buffer=nl.shared_hbm)
        out_back = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out_small, small)
        nisa.dma_copy(out_back, back)
        return out_small, out_back

    x = (rand((7, 13), np.float64, seed=5) * 1000).astype(wide)
    small, back = kernel(x)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}
    np.testing.assert_array_equal(small.view(bits[small.itemsize]), x.view(narrow).view(bits[small.itemsize]))
    np.testing.assert_array_equal(back.view(bits[back.itemsize]), x.view(bits[x.itemsize]))


def test_view_rejects_a_strided_last_dimension():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        return tile[:, 0:8:2].view(nl.uint8)

    with pytest.raises(ValueError, match="contiguous"):
        kernel(rand((4, 8)))


def test_rearrange_splits_permutes_and_merges():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        view = tile.rearrange(("p", ("h", "w")), ("p", "w", "h"), {"h": 4})
        out = nl.ndarray(view.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, view)
        merged = tile.reshape((x.shape[0], 4, 6)).rearrange(("p", "h", "w"), ("p", ("h", "w")))
        out2 = nl.ndarray(merged.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out2, merged)
        return out, out2

    x = rand((7, 24), seed=2)
    got, got2 = kernel(x)
    np.testing.assert_array_equal(got, x.reshape(7, 4, 6).transpose(0, 2, 1))
    np.testing.assert_array_equal(got2, x)


def test_rearrange_cannot_merge_permuted_dimensions():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        return tile.rearrange(("p", ("h", "w")), ("p", ("w", "h")), {"h": 4})

    with pytest.raises(ValueError, match="not contiguous"):
        kernel(rand((7, 24)))


def test_reshape_dim_splits_a_strided_view():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        view = tile[:, 2:26].reshape_dim(1, (4, -1))
        out = nl.ndarray(view.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, view)
        return out

    x = rand((5, 30), seed=4)
    np.testing.assert_array_equal(kernel(x), x[:, 2:26].reshape(5, 4, 6))


def test_ap_with_scalar_offset_and_dtype_reinterpretation():
    @nki.jit
    def kernel(x, index):
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, index)
        tile = nl.ndarray((1, 3), x.dtype, buffer=nl.sbuf)
        # row index[0] of x: the indirect offset is scaled by the stride of dim 0
        nisa.dma_copy(tile, x.ap([[x.shape[1], 1], [1, 3]], offset=1, scalar_offset=idx, indirect_dim=0))
        halves = nl.ndarray((1, 6), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(halves, x.ap([[2 * x.shape[1], 1], [1, 6]], dtype=nl.bfloat16))
        out = nl.ndarray((1, 3), x.dtype, buffer=nl.shared_hbm)
        out_h = nl.ndarray((1, 6), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        nisa.dma_copy(out_h, halves)
        return out, out_h

    x = rand((9, 10), seed=6)
    for row in (0, 4, 8):
        got, halves = kernel(x, np.array([[row]], np.int32))
        np.testing.assert_array_equal(got[0], x[row, 1:4])
        np.testing.assert_array_equal(halves[0], x[0].view(BF16)[:6])


def test_scalar_offset_write_orders_every_later_read_of_the_tensor():
    """A write at a runtime slot may hit any slot on hardware, so the cost model must make a read of another
    slot wait for it (the emulated index value says nothing about other runs)."""
    from nki_kernels.emulator import cost_model, trace

    @nki.jit
    def kernel(cache, index, row):
        idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, index)
        new = nl.ndarray((1, cache.shape[1]), cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(new, row)
        nisa.dma_copy(
            cache.ap([[cache.shape[1], 1], [1, cache.shape[1]]], offset=0, scalar_offset=idx, indirect_dim=0), new
        )
        other = nl.ndarray((1, cache.shape[1]), cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(other, cache[cache.shape[0] - 1 : cache.shape[0], :])  # a slot the write did not touch
        out = nl.ndarray((1, cache.shape[1]), cache.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, other)
        return out

    cache, row = rand((6, 40), seed=8), rand((1, 40), seed=9)
    runs = []
    trace.add_listener(runs.append)
    try:
        got = kernel(cache, np.array([[1]], np.int32), row)
    finally:
        trace.remove_listener(runs.append)
    np.testing.assert_array_equal(got, cache[-1:])
    sched = cost_model.schedule(runs[-1], "trn1")
    write, read = 2, 3  # record order: index load, row load, slot write, slot read, store
    assert sched.start_us[read] >= sched.finish_us[write]


def test_ap_vector_offset_gathers_and_scatters_rows():
    rows, cols, picks = 50, 12, 7

    @nki.jit
    def kernel(table, index):
        idx = nl.ndarray((picks, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, index)
        tile = nl.ndarray((picks, cols), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, table.ap([[cols, picks], [1, cols]], offset=0, vector_offset=idx, indirect_dim=0))
        gathered = nl.ndarray((picks, cols), table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(gathered, tile)
        scattered = nl.ndarray((rows, cols), table.dtype, buffer=nl.shared_hbm)
        zero = nl.zeros((rows, cols), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(scattered, zero)
        nisa.dma_copy(scattered.vector_select(0, idx), tile)  # the same rows written back
        return gathered, scattered

    table = rand((rows, cols), seed=7)
    index = np.random.default_rng(8).choice(rows, size=picks, replace=False).astype(np.int32)[:, None]
    gathered, scattered = kernel(table, index)
    np.testing.assert_array_equal(gathered, table[index[:, 0]])
    expected = np.zeros_like(table)
    expected[index[:, 0]] = table[index[:, 0]]
    np.testing.assert_array_equal(scattered, expected)


def test_vector_offset_out_of_bounds_raises_or_is_skipped():
    @nki.jit
    def kernel(table, index, skip):
        idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, index)
        tile = nl.full((3, 4), -1.0, nl.float32, buffer=nl.sbuf)
        mode = nisa.oob_mode.skip if skip else nisa.oob_mode.error
        nisa.dma_copy(tile, table.ap([[4, 3], [1, 4]], vector_offset=idx, indirect_dim=0), oob_mode=mode)
        out = nl.ndarray((3, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        scattered = nl.ndarray(table.shape, table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(scattered, table)
        nisa.dma_copy(scattered.ap([[4, 3], [1, 4]], vector_offset=idx, indirect_dim=0), tile, oob_mode=mode)
        return out, scattered

    table = rand((5, 4), seed=10)
    index = np.array([[4], [7], [0]], np.int32)  # row 7 is outside the 5-row table
    with pytest.raises(nki.isa.NkiValidationError, match="out of bounds"):
        kernel(table, index, False)
    got, scattered = kernel(table, index, True)
    np.testing.assert_array_equal(got[[0, 2]], table[[4, 0]])
    np.testing.assert_array_equal(got[1], np.full(4, -1.0))  # skipped: dst keeps its value
    np.testing.assert_array_equal(scattered, table)  # rows 4 and 0 written back unchanged, row 7 skipped


def test_dynamic_select_reads_the_index_tile():
    @nki.jit
    def kernel(cache, position):
        pos = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(pos, position)
        row = cache.select(1, pos)  # [B, S, d] -> [B, d] at S = position
        assert row.is_indirect() and not cache.is_indirect()
        tile = nl.ndarray(row.shape, cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, row)
        out = nl.ndarray(row.shape, cache.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        return out

    cache = rand((3, 130, 5), seed=9)
    np.testing.assert_array_equal(kernel(cache, np.array([[129]], np.int32)), cache[:, 129])
    np.testing.assert_array_equal(kernel(cache, np.array([[17]], np.int32)), cache[:, 17])


def test_kernel_arguments_may_be_lists_of_arrays():
    @nki.jit
    def kernel(xs):
        out = nl.ndarray(xs[0].shape, xs[0].dtype, buffer=nl.shared_hbm)
        acc = nl.zeros(xs[0].shape, nl.float32, buffer=nl.sbuf)
        for x in xs:
            tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(tile, x)
            nisa.tensor_tensor(acc, acc, tile, nl.add)
        nisa.dma_copy(out, acc)
        return out

    xs = [rand((7, 33), seed=s) for s in range(3)]
    np.testing.assert_allclose(kernel(xs), sum(_f64(x) for x in xs), rtol=1e-5, atol=1e-6)


def test_indirect_views_are_trn3_only():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        return tile.indirect(tile)

    with pytest.raises(NotImplementedError, match="trn3"):
        kernel(rand((4, 4)))
