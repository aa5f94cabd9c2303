"""The emulator's gathering transpose (`nisa.dma_transpose` of a src with a vector_offset, lowered to software DGE's
dma_gather_transpose) against numpy, and its documented limits (aws-neuron-sdk nki/api, nki.isa.dma_transpose:
"DMA Indirect Transpose Constraints"): rows gathered by a uint32 index tile in SBUF, [P, 1] or [128, M] read
column-major, a 2-byte src in HBM, rows a multiple of 16, NeuronCore-v3+ only.
"""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl

_raises = hardware_error_check(__file__)
BF16 = ml_dtypes.bfloat16


@nki.jit
def _gather_transpose(table, indices, tile, dge_mode):
    """out [tile, F / tile, rows] = table[rows of indices (column-major)] as [rows, F / tile, tile], transposed."""
    rows_per_column, columns = indices.shape
    n, f = rows_per_column * columns, table.shape[1]
    index = nl.ndarray(indices.shape, dtype=indices.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=index, src=indices)
    turned = nl.ndarray((tile, f // tile, n), dtype=table.dtype, buffer=nl.sbuf)
    source = table.ap([[f, n], [tile, f // tile], [1, tile]], offset=0, vector_offset=index, indirect_dim=0)
    nisa.dma_transpose(dst=turned, src=source, dge_mode=dge_mode)
    out = nl.ndarray(turned.shape, dtype=table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=turned)
    return out


def _expected(table, indices, tile):
    rows = table[indices.T.reshape(-1)]
    return rows.reshape(rows.shape[0], -1, tile).transpose(2, 1, 0)


@pytest.mark.parametrize("rows_per_column, columns, f, tile", [(48, 1, 200, 100), (128, 3, 96, 96)])
def test_gathering_transpose_matches_numpy(rows_per_column, columns, f, tile):
    """Rows drawn at random (repeats allowed) from a ragged table; a [128, M] index tile is read column-major."""
    rng = np.random.default_rng(7)
    table = rand((517, f)).astype(BF16)
    indices = rng.integers(0, table.shape[0], size=(rows_per_column, columns)).astype(np.uint32)
    got = _gather_transpose(table, indices, tile, nisa.dge_mode.unknown)
    np.testing.assert_array_equal(got.view(np.uint16), _expected(table, indices, tile).view(np.uint16))
    swdge = _gather_transpose(table, indices, tile, nisa.dge_mode.swdge)
    np.testing.assert_array_equal(swdge.view(np.uint16), got.view(np.uint16))


def test_gathering_transpose_limits():
    table = rand((300, 64)).astype(BF16)
    indices = np.arange(32, dtype=np.uint32)[:, None] * 7
    with emulator.use_target("trn1"):
        assert "NeuronCore-v3" in _raises("dma_transpose", _gather_transpose, table, indices, 64, nisa.dge_mode.unknown)
    wide = table.astype(np.float32)
    assert "2 bytes" in _raises("dma_transpose", _gather_transpose, wide, indices, 64, nisa.dge_mode.unknown)
    signed = indices.astype(np.int32)
    assert "uint32" in _raises("dma_transpose", _gather_transpose, table, signed, 64, nisa.dge_mode.unknown)
    assert "multiple of 16" in _raises(
        "dma_transpose", _gather_transpose, table, indices[:24], 64, nisa.dge_mode.unknown
    )
    assert "not valid here" in _raises("dma_transpose", _gather_transpose, table, indices, 64, nisa.dge_mode.hwdge)


def test_a_many_column_index_tile_needs_128_rows():
    table = rand((300, 64)).astype(BF16)
    indices = np.arange(128, dtype=np.uint32).reshape(64, 2)
    with pytest.raises(emulator.NkiHardwareError, match="needs P == 128"):
        _gather_transpose(table, indices, 64, nisa.dge_mode.unknown)
