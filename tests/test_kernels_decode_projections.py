"""The decode-step subroutines (nki_kernels.decode.tiles, ring, projections) inside small test kernels, against
float64 numpy.

Natural (ragged) and row-grouped layouts, dense and factored projections into layouts of another group, the gated
MLP, the LM head with a softcap, and rows ↔ column tiles round trips; a small weight ring so blocks wrap.
"""

import numpy as np
import pytest

from nki_kernels.activations import ACTIVATIONS
from nki_kernels.binding import nki, nl
from nki_kernels.decode import logits as head_stage
from nki_kernels.decode import projections, tiles
from nki_kernels.decode.contract import Factored
from nki_kernels.decode.ring import WeightRing
from nki_kernels.svd_mlp import activation_op


@nki.jit
def norm_project_kernel(x, norm_w, w, u, v, *, rank, group_in, group_out, unit_offset, softcap):
    """Returns (norm(x)·w + norm(x)·u[:, :rank]·v[:rank], softcap(norm(x)·w) through the head path)."""
    rows, h = x.shape
    n = w.shape[1]
    layout, out_layout = tiles.feature_layout(h, group_in), tiles.feature_layout(n, group_out)
    ring = WeightRing(block_bytes=4096, ring_bytes=10000)
    consts = projections.NormConstants(1e-6)
    xc = tiles.column_tiles(layout, rows, nl.float32, "x")
    tiles.load_columns(xc, x, layout)
    wc = projections.load_norm_weights(norm_w, layout, unit_offset)
    hc = tiles.column_tiles(layout, rows, w.dtype, "h", zero=False)
    projections.rms_norm(hc, xc, wc[:, :, 0:1], layout, rows, consts)
    y = tiles.column_tiles(out_layout, rows, nl.float32, "y")
    projections.projection(hc, layout, w, None, out_layout, rows, ring, projections.copy_into(y))
    projections.projection(hc, layout, Factored(u, v), rank, out_layout, rows, ring, projections.add_into(y))
    out = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    tiles.store_columns(out, y, out_layout)
    logits = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    projections.head_projection(hc, layout, w, rows, ring, logits, softcap)
    return out, logits


@nki.jit
def mlp_kernel(x, gate, up, down_u, down_v, *, rank, activation, group_h, group_i):
    """x + down(act(x·gate) * (x·up)) with a factored down projection, x rows [R, H]."""
    rows, h = x.shape
    i = gate.shape[1]
    hidden, inter = tiles.feature_layout(h, group_h), tiles.feature_layout(i, group_i)
    ring = WeightRing(block_bytes=8192, ring_bytes=20000)
    xc = tiles.column_tiles(hidden, rows, nl.float32, "x")
    tiles.load_columns(xc, x, hidden)
    hc = tiles.column_tiles(hidden, rows, gate.dtype, "h", zero=False)
    tiles.load_columns(hc, x, hidden)
    mlp = projections.GatedMlp(gate, up, Factored(down_u, down_v), activation_op(activation), (None, None, rank))
    projections.gated_mlp(hc, hidden, inter, mlp, rows, ring, projections.add_into(xc))
    out = nl.ndarray((rows, h), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    tiles.store_columns(out, xc, hidden)
    return out


def f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rms_norm_f64(x, w, unit_offset, eps=1e-6):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * ((1 + w) if unit_offset else w)


@pytest.mark.parametrize(
    "rows, h, n, rank, group_in, group_out, unit_offset, softcap",
    [
        (3, 200, 300, 37, 1, 1, False, None),  # ragged natural tiles
        (1, 200, 300, 37, 1, 1, True, None),  # one row (rms_norm's single-row chain), ragged natural tiles
        (1, 256, 384, 130, 2, 3, True, 3.0),  # grouped in and out, rank over a tile
        (2, 640, 256, 1, 5, 1, True, None),  # Gemma 3 270M's hidden grouping, rank 1; 5-row blocks split 4 + 1
    ],
)
def test_norm_and_projections(rng, rows, h, n, rank, group_in, group_out, unit_offset, softcap):
    x, norm_w = f32(rng, (rows, h)), f32(rng, (1, h), 0.3)
    w, u, v = f32(rng, (h, n), h**-0.5), f32(rng, (h, rank + 5), h**-0.5), f32(rng, (rank + 5, n), rank**-0.5)
    out, logits = norm_project_kernel(
        x, norm_w, w, u, v, rank=rank, group_in=group_in, group_out=group_out, unit_offset=unit_offset, softcap=softcap
    )
    hn = rms_norm_f64(x, norm_w[0].astype(np.float64), unit_offset)
    want = hn @ w + (hn @ u[:, :rank]) @ v[:rank]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    head = hn @ w
    if softcap:
        head = np.tanh(head / softcap) * softcap
    np.testing.assert_allclose(logits, head, rtol=1e-5, atol=1e-5 * np.abs(head).max())


@pytest.mark.parametrize(
    "rows, h, i, rank, activation, group_h, group_i",
    [
        (3, 200, 200, 50, "silu", 1, 1),
        (2, 256, 512, 129, "gelu_tanh", 2, 4),
    ],
)
def test_gated_mlp(rng, rows, h, i, rank, activation, group_h, group_i):
    x = f32(rng, (rows, h))
    gate, up = f32(rng, (h, i), h**-0.5), f32(rng, (h, i), h**-0.5)
    down_u, down_v = f32(rng, (i, rank), i**-0.5), f32(rng, (rank, h), rank**-0.5)
    out = mlp_kernel(x, gate, up, down_u, down_v, rank=rank, activation=activation, group_h=group_h, group_i=group_i)
    x64 = x.astype(np.float64)
    act = ACTIVATIONS[activation].reference
    want = x64 + ((act(x64 @ gate) * (x64 @ up)) @ down_u) @ down_v
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_layouts_cover_every_feature_once():
    for features, group in ((200, 1), (640, 5), (384, 3), (300, 2), (1664, 7), (1728, 7)):
        layout = tiles.feature_layout(features, group)
        covered = np.concatenate([np.arange(features)[feats] for _, feats in layout])
        assert sorted(covered) == list(range(features))
        assert all(size == len(range(features)[feats]) for size, feats in layout)
    assert tiles.choose_group(640, 256) == 5 and tiles.choose_group(2048, 640) == 8 and tiles.choose_group(200, 10) == 1
    assert tiles.choose_group(4096, 1024) == 4 and tiles.choose_group(4096, 8) == tiles.MAX_GROUP
    # 12 tiles against 640 columns: no group reaches RUN_ELEMENTS, 6 divides them (blocks of 7 would leave 5).
    assert tiles.choose_group(1536, 640) == 6


def test_a_prime_tile_count_groups_in_unequal_blocks():
    """13 tiles (an MLP pruned to 1664 neurons) against 640 columns: blocks of 7 and 6 tiles (runs of 4480 and 3840
    elements a partition), where a divisor of 13 could only be 1 (640); a ragged 64 after them stays alone."""
    assert tiles.choose_group(1664, 640) == 7
    blocks = [(k0, ks, count) for k0, ks, _, count, _ in tiles.layout_blocks(tiles.feature_layout(1728, 7))]
    assert blocks == [(0, 896, 7), (896, 768, 6), (1664, 64, 1)]
    # Gemma 3 1B's 6912 neurons pruned to 5504 (43 tiles) against its 1152 columns: blocks of 4 and a last one of 3.
    assert tiles.choose_group(5504, 1152) == 4


def test_rows_per_block_keeps_whole_rows():
    """A weight block takes whole rows (one contiguous run per partition) where a layout block's rows do not fit a
    slot at the full width: e.g. u [4096, 2560] of a factored gate after 8-row groups, 6 rows of 2560 (not 2048 +
    512 columns); unchanged where they fit; one row when a row alone exceeds the slot."""
    assert projections.rows_per_block(8, 2560, 16384) == 6
    assert (
        projections.rows_per_block(4, 4096, 16384) == 4 and projections.rows_per_block(5, 256, 1024) == 4
    )  # the latter: test above
    assert projections.rows_per_block(4, 14336, 16384) == 1 and projections.rows_per_block(8, 40000, 16384) == 1


def test_ring_rejects_a_block_over_its_limit(rng):
    @nki.jit
    def kernel(w):
        ring = WeightRing(block_bytes=1024, ring_bytes=4096)
        ring.load(w.reshape_dim(0, (128, 1)), 128, 1, w.shape[1])
        return w

    with pytest.raises(ValueError, match="block limit"):
        kernel(f32(rng, (128, 300)))


@nki.jit
def head_kernel(h, w, *, block_bytes, ring_bytes, group, softcap):
    """head_projection of rows h [R, K] (K in feature_layout(K, group)) by w [K, V]."""
    rows, k = h.shape
    layout = tiles.feature_layout(k, group)
    ring = WeightRing(block_bytes=block_bytes, ring_bytes=ring_bytes)
    hc = tiles.column_tiles(layout, rows, w.dtype, "h", zero=False)
    tiles.load_columns(hc, h, layout)
    logits = nl.ndarray((rows, w.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    projections.head_projection(hc, layout, w, rows, ring, logits, softcap)
    return logits


def test_head_ranges_narrow_to_the_tail():
    """The head's column ranges cover the vocabulary in order; the last full-width one, with a narrower remainder
    after it, is halved down to HEAD_TAIL_COLUMNS in whole 128-column groups; a range narrower than that is left as
    it is."""
    tail = projections.HEAD_TAIL_COLUMNS

    def widths(v, columns):
        ranges = projections.head_ranges(v, columns)
        assert [v0 for v0, _ in ranges] == list(np.cumsum([0] + [vc for _, vc in ranges[:-1]]))
        assert sum(vc for _, vc in ranges) == v
        return [vc for _, vc in ranges]

    assert widths(262144, 4 * tail) == [4 * tail] * (262144 // (4 * tail) - 1) + [2 * tail, tail, tail]
    assert widths(4700, 8192) == [2304, 1152, 1244]  # one ragged range, cut at group boundaries
    assert widths(130 * 128 + 77, 1536) == [1536] * 10 + [1357]  # no wider than HEAD_TAIL_COLUMNS: as they are
    assert widths(65536, 3072) == [3072] * 20 + [2048, 2048]  # 3072 + 1024: no 3072-wide range at the end
    assert widths(6000, 4096) == [2944, 1408, 1648]
    assert widths(8191, 4096) == [3968, 2048, 1024, 1151]  # 4096 + 4095: every piece within `columns`
    assert widths(100, 8192) == [100]


@pytest.mark.parametrize("rows, k, v, softcap", [(2, 256, 5000, None), (1, 640, 4700, 3.0)])
def test_head_blocks_wider_than_a_psum_chunk(rng, rows, k, v, softcap, monkeypatch):
    """A head block holding all K rows spans several HEAD_COLUMNS PSUM chunks (and a ragged last one)."""
    monkeypatch.setattr(head_stage, "HEAD_RUN_BYTES", 16384)  # float32 weights: as wide as bf16 ones get
    assert len(tiles.layout_blocks(tiles.feature_layout(k, tiles.head_group(k)))) == 1
    h, w = f32(rng, (rows, k)), f32(rng, (k, v), k**-0.5)
    count = tiles.head_group(k)  # rows per partition of the one layout block
    block_bytes = 4 * count * (projections.HEAD_COLUMNS + 512)  # 2560 columns
    logits = head_kernel(h, w, block_bytes=block_bytes, ring_bytes=2 * block_bytes, group=count, softcap=softcap)
    want = h.astype(np.float64) @ w
    if softcap:
        want = np.tanh(want / softcap) * softcap
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows, k, group, v", [(3, 1000, 1, 1300), (1, 1024, 2, 2100)])
def test_head_blocks_of_a_column_range_over_the_ring(rng, rows, k, group, v):
    """Several layout blocks of K rows whose head blocks for one column range need more than the whole ring (as
    when attention's cache tiles shrink the looped kernel's ring at a long cache): each block must be multiplied
    before the ring wraps onto it."""
    block_bytes, ring_bytes = 4096, 3 * 4096  # float32: blocks of 1024 elements per partition, a ring of 3
    blocks = tiles.layout_blocks(tiles.feature_layout(k, group))
    columns = min(projections.HEAD_COLUMNS, 1024 // max(count for _, _, _, count, _ in blocks))
    assert len(blocks) > 1 and sum(count for _, _, _, count, _ in blocks) * columns > ring_bytes // 4
    h, w = f32(rng, (rows, k)), f32(rng, (k, v), k**-0.5)
    logits = head_kernel(h, w, block_bytes=block_bytes, ring_bytes=ring_bytes, group=group, softcap=None)
    want = h.astype(np.float64) @ w
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
