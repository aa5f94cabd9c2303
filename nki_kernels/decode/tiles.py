"""The column-tile library of the decode kernels: F features of R rows (R = B·T ≤ 128) in SBUF, features on
partitions, and the moves between such tiles and rows (plain functions called inside @nki.jit kernels).

Naming, across nki_kernels.decode: a *tile* is one [≤128 partitions, R] column tile (the middle dimension of a
[128, tiles, R] tensor counts them); the partitions a tile uses are its *size* (`partitions`, `parts` in
attention); a *slot* is only ever a KV-cache position; a *block* is what one DMA moves (a weight block in the
ring, a cache block). The dst operand comes first, as in NKI's ISA calls.

Feature layouts: F features live as cols[0:size_s, s, 0:R] for tile s of a *feature layout*, a tuple of (size, features)
per tile, `features` a slice whose p-th element is the feature on partition p. `feature_layout(F, 1)` is the natural
tiling (tile i ↔ features i·128 .. i·128+127, the last tile ragged). With a group g > 1, each block of 128·g features
(the last one the whole tiles left, then any ragged rest alone) is permuted so that partition p holds g consecutive
features (tile i of the block ↔ features p·g + i): a weight whose rows follow that layout is read with g whole rows per
partition, one contiguous run of g·N elements, which the DMA efficiency curve needs when N is small (Gemma 3 270M's k/v:
N = 256). The layout of a vector only matters to the projections that contract over it; q, k, v and the attention output
keep the natural layout (what attention takes and returns), the hidden state and the MLP intermediate use
`choose_group`'s. Column tiles that feed a norm or the residual stream are zeroed when allocated, so whole-tile
instructions may cover a ragged tile's unused partitions.

Two ways of moving rows <-> column tiles: `rows_to_columns` / `columns_to_rows` (any feature layout; PSUM rows
padded to a power of two so per-tile accumulators never straddle a bank) and the natural-layout
`rows_to_natural_columns` / `natural_columns_to_rows` that attention uses (one eviction per PSUM bank of whole
tiles; evictions alternating VectorE and ScalarE). They schedule differently and the modeled timings of the
decode step depend on both as they are. Smaller moves on TensorE, shared with attention's own layouts (its mask
in score order, Kᵀ, the softmax): `transpose_to_tiles` (views of rows into tiles through one PSUM tensor; the
natural layout's step), `evict_alternating` (natural_columns_to_rows' evictions) and `spread_across_partitions`
(a vector on partitions as a row on every partition).
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.svd_matmul import k_slots, spans

# Elements per weight row run worth grouping rows for: 8 KiB of bf16 sits on the flat part of the DMA curve.
RUN_ELEMENTS = 4096
# Largest group: a grouped block of output features (128·group wide) times a grouped input's rows per partition
# stays within a ring block (8·1024 elements: float32 at ring.RING_BLOCK_BYTES).
MAX_GROUP = 8


def feature_layout(features, group=1):
    """((size, features slice), ...) per tile: blocks of 128·group features, partition p of tile i of a block ↔
    feature block_start + p·group + i; the last block holds the whole tiles left (fewer than group), permuted
    alike, then the last features % 128 in a tile of their own."""
    pmax = nl.tile_size.pmax
    tiles = []
    for k0, ks in spans(features, pmax * group):
        whole = ks - ks % pmax
        for start, size in ((k0, whole), (k0 + whole, ks - whole)):
            if size:
                tiles.extend(k_slots(start, size))
    return tuple(tiles)


def layout_blocks(layout):
    """[(k0, ks, first tile, tiles, partitions)]: runs of tiles whose features form one contiguous range
    [k0, k0+ks) (one permuted block, or one natural tile): what one DMA of rows can cover."""
    blocks = []
    s = 0
    while s < len(layout):
        size, feats = layout[s]
        step = feats.step or 1
        count = step  # a permuted block has `step` tiles of 128 features each
        blocks.append((feats.start, size * step, s, count, size))
        s += count
    return blocks


def choose_group(features, row_elements):
    """Group for a vector of `features` contracted against weights with `row_elements` columns: blocks of g tiles
    (the last one the tiles % g left), g ≤ MAX_GROUP the smallest whose every block reads runs of at least
    RUN_ELEMENTS, else the one whose shortest block is longest, a divisor of the tile count on a tie (a prime count
    above MAX_GROUP, 13 tiles of an MLP pruned to 1664 neurons against 640 columns, takes blocks of 7 and 6 where
    a divisor could only be 1); 1 when features is not a multiple of 128."""
    pmax = nl.tile_size.pmax
    if features % pmax:
        return 1
    tiles = features // pmax

    def shortest(group):
        return min(group, tiles % group or group)

    groups = range(1, min(tiles, MAX_GROUP) + 1)
    return next((g for g in groups if shortest(g) * row_elements >= RUN_ELEMENTS), max(groups, key=shortest))


def head_group(features):
    """Group for the LM head's input vector: all of it in one layout block where it fits (≤ 128·MAX_GROUP
    features, a multiple of 128), so every head DMA block holds all K rows and can be as wide as a ring block."""
    pmax = nl.tile_size.pmax
    if features % pmax:
        return 1
    tiles = features // pmax
    return max(d for d in range(1, min(tiles, MAX_GROUP) + 1) if tiles % d == 0)


def fp32_per_psum_bank(width):
    """How many float32 accumulators [*, width] fit side by side in one PSUM bank of a partition."""
    return nl.tile_size.psum_bank_fmax_bytes // (width * nl.float32.itemsize)


def padded_rows(rows):
    """Rows rounded up to a power of two, so per-tile accumulators of a PSUM tensor never straddle a bank."""
    return 1 << (rows - 1).bit_length()


def tile_runs(layout, first=0, last=None):
    """[(s0, count, size)]: maximal runs of consecutive tiles of equal size in layout[first:last], so an
    element-wise step over column tiles is one instruction per run."""
    runs = []
    for s in range(first, len(layout) if last is None else last):
        size = layout[s][0]
        if runs and runs[-1][2] == size:
            runs[-1][1] += 1
        else:
            runs.append([s, 1, size])
    return [tuple(r) for r in runs]


def column_tiles(layout, rows, dtype, name, zero=True):
    """A fresh [128, tiles, rows] SBUF tile for `layout`; zeroed (see the module docstring) unless zero=False."""
    cols = nl.ndarray((nl.tile_size.pmax, len(layout), rows), dtype=dtype, buffer=nl.sbuf, name=name)
    if zero:
        nisa.memset(dst=cols, value=0.0)
    return cols


def rows_to_columns(cols, staged, layout):
    """cols (column tiles of `layout`) ← staged [R, F] rows in SBUF (same dtype): one PE transpose per tile,
    evicted one PSUM bank at a time."""
    rows = staged.shape[0]
    pmax = nl.tile_size.pmax
    per_bank = max(1, nl.tile_size.psum_bank_fmax_bytes // (padded_rows(rows) * cols.dtype.itemsize))
    for c0 in range(0, len(layout), per_bank):
        chunk = layout[c0 : c0 + per_bank]
        turned = nl.ndarray((pmax, len(chunk), padded_rows(rows)), dtype=cols.dtype, buffer=nl.psum, name="cols_psum")
        for j, (size, feats) in enumerate(chunk):
            nisa.nc_transpose(dst=turned[0:size, j, 0:rows], data=staged[0:rows, feats])
        for s0, count, size in tile_runs(layout, c0, c0 + len(chunk)):
            nisa.tensor_copy(
                dst=cols[0:size, s0 : s0 + count, 0:rows], src=turned[0:size, s0 - c0 : s0 - c0 + count, 0:rows]
            )
        del turned


def columns_to_rows(staged, cols, layout):
    """staged [R, F] rows in SBUF (same dtype) ← cols (column tiles of `layout`): one PE transpose per tile."""
    rows = staged.shape[0]
    pmax = nl.tile_size.pmax
    per_bank = max(1, nl.tile_size.psum_bank_fmax_bytes // (pmax * cols.dtype.itemsize))
    for k0, ks, s0, count, partitions in layout_blocks(layout):
        # Within a block, partition p of tile i is feature k0 + p·count + i.
        block_rows = staged[0:rows, k0 : k0 + ks].reshape_dim(1, (partitions, count))
        for c0 in range(0, count, per_bank):
            n = min(per_bank, count - c0)
            turned = nl.ndarray((rows, n, pmax), dtype=cols.dtype, buffer=nl.psum, name="rows_psum")
            for j in range(n):
                nisa.nc_transpose(dst=turned[0:rows, j, 0:partitions], data=cols[0:partitions, s0 + c0 + j, 0:rows])
            nisa.tensor_copy(
                dst=block_rows[:, :, c0 : c0 + n], src=turned[0:rows, 0:n, 0:partitions].permute((0, 2, 1))
            )
            del turned


def load_columns(cols, rows_hbm, layout):
    """cols ← rows_hbm [R, F] (HBM) in `layout`: one contiguous DMA of the rows onto R partitions (casting to
    cols' dtype), then PE transposes (a per-element strided DMA would cost ~2 bytes per DMA buffer)."""
    staged = nl.ndarray(tuple(rows_hbm.shape), dtype=cols.dtype, buffer=nl.sbuf, name="rows_staged")
    nisa.dma_copy(dst=staged, src=rows_hbm)
    rows_to_columns(cols, staged, layout)


def store_columns(rows_hbm, cols, layout):
    """rows_hbm [R, F] (HBM) ← cols in `layout`: PE transposes into rows on R partitions, one contiguous DMA."""
    staged = nl.ndarray(tuple(rows_hbm.shape), dtype=cols.dtype, buffer=nl.sbuf, name="rows_staged")
    columns_to_rows(staged, cols, layout)
    nisa.dma_copy(dst=rows_hbm, src=staged)


def relayout(cols, layout, new_layout, rows):
    """cols (column tiles of `layout`) as column tiles of `new_layout`, on chip through rows (two PE transposes
    per tile): e.g. the attention output regrouped so the o projection reads long runs of its weight rows."""
    features = sum(size for size, _ in layout)
    staged = nl.ndarray((rows, features), dtype=cols.dtype, buffer=nl.sbuf, name="relayout_rows")
    columns_to_rows(staged, cols, layout)
    out = column_tiles(new_layout, rows, cols.dtype, "relayout_cols", zero=False)
    rows_to_columns(out, staged, new_layout)
    return out


# -- moves between partitions and the free axis, on TensorE ---------------------------------------------


def transpose_to_tiles(dst, sources, name):
    """dst[0:p, j, 0:R] = sources[j]ᵀ for SBUF views sources[j] [R, p] (R rows of p features each): PE transposes
    into one PSUM tensor [p, len(sources), R] in the sources' dtype named `name`, then one eviction into dst
    (cast to dst's dtype). The caller keeps the PSUM tensor within one bank."""
    r, p = sources[0].shape
    turned = nl.ndarray((p, len(sources), r), dtype=sources[0].dtype, buffer=nl.psum, name=name)
    for j, source in enumerate(sources):
        nisa.nc_transpose(dst=turned[0:p, j, 0:r], data=source)
    nisa.tensor_copy(dst=dst, src=turned)


def evict_alternating(dst, psum, turn):
    """dst ← psum (cast to dst's dtype) as eviction number `turn` of a sequence: even turns a tensor_copy on VectorE,
    odd ones a copy activation on ScalarE, so long runs of evictions share the two engines."""
    if turn % 2:
        nisa.activation(dst=dst, op=nl.copy, data=psum)
    else:
        nisa.tensor_copy(dst=dst, src=psum)


def spread_across_partitions(values, partitions, ones, identity):
    """PSUM [partitions, n] float32 whose every partition holds values (SBUF [n, 1] float32, one value per
    partition) as a row: onesᵀ·diag(values), one matmul. ones: float32 ones [≥ n, ≥ partitions]; identity: the
    float32 identity [≥ n, ≥ n] (diag(values) is identity·values)."""
    n = values.shape[0]
    diag = nl.ndarray((n, n), dtype=nl.float32, buffer=nl.sbuf, name="spread_diag")
    nisa.tensor_scalar(dst=diag, data=identity[0:n, 0:n], op0=nl.multiply, operand0=values)
    spread = nl.ndarray((partitions, n), dtype=nl.float32, buffer=nl.psum, name="spread_psum")
    nisa.nc_matmul(dst=spread, stationary=ones[0:n, 0:partitions], moving=diag)
    return spread


# -- the natural layout (features i·128 + p on partition p of tile i) ------------------------------------


def natural_tiles(features):
    """(partitions used, tiles) of a column-tile tensor of `features` features."""
    pmax = nl.tile_size.pmax
    return min(features, pmax), -(-features // pmax)


def rows_to_natural_columns(columns, rows):
    """columns[0:pt, i, 0:R] = rows[0:R, i·128 : i·128 + pt]ᵀ (rows SBUF [R, F], columns SBUF [128, nt, R]) by
    PE transposes in rows' dtype, one eviction (with cast) per PSUM bank of whole tiles."""
    pmax = nl.tile_size.pmax
    r, f = rows.shape[0], rows.shape[1]
    tiles = spans(f, pmax)
    per_bank = max(1, nl.tile_size.psum_bank_fmax_bytes // (r * rows.dtype.itemsize))
    groups = [tiles[i : i + per_bank] for i in range(0, len(tiles), per_bank)]
    if len(groups[-1]) > 1 and groups[-1][-1][1] != pmax:  # a ragged last tile is evicted alone
        groups[-1:] = [groups[-1][:-1], groups[-1][-1:]]
    for group in groups:
        pt, first = group[0][1], group[0][0] // pmax
        transpose_to_tiles(
            columns[0:pt, first : first + len(group), 0:r], [rows[0:r, f0 : f0 + pt] for f0, _ in group], "columns_psum"
        )


def natural_columns_to_rows(rows, columns, turn=0):
    """rows[0:R, i·128 : i·128 + pt] = columns[0:pt, i, 0:R]ᵀ (the inverse of rows_to_natural_columns); evictions (with
    cast to rows' dtype) of ≤512 columns, alternating VectorE and ScalarE (few rows make long evictions) from
    evict_alternating's turn `turn`."""
    pmax = nl.tile_size.pmax
    r, f = rows.shape[0], rows.shape[1]
    step = nl.tile_size.gemm_moving_fmax
    for n, (c0, cw) in enumerate(spans(f, step)):
        turned = nl.ndarray((r, cw), dtype=columns.dtype, buffer=nl.psum, name="rows_psum")
        for f0, pt in spans(cw, pmax):
            nisa.nc_transpose(dst=turned[0:r, f0 : f0 + pt], data=columns[0:pt, (c0 + f0) // pmax, 0:r])
        evict_alternating(rows[0:r, c0 : c0 + cw], turned, turn + n)


def load_natural_columns(x, dtype=None, name="x_columns"):
    """Rows x [B, T, F] (or [R, F]) in HBM as column tiles SBUF [128, ceil(F/128), R] in `dtype` (default x's)."""
    pmax = nl.tile_size.pmax
    f = x.shape[-1]
    r = 1
    for n in x.shape[:-1]:
        r *= n
    rows = nl.ndarray((r, f), dtype=x.dtype, buffer=nl.sbuf, name=f"{name}_rows")
    nisa.dma_copy(dst=rows, src=x.reshape((r, f)))
    columns = nl.ndarray((pmax, -(-f // pmax), r), dtype=dtype or x.dtype, buffer=nl.sbuf, name=name)
    rows_to_natural_columns(columns, rows)
    return columns


def store_natural_columns(out, columns):
    """Column tiles [128, nt, R] into rows out [B, T, F] (or [R, F]) in HBM (cast to out's dtype)."""
    f = out.shape[-1]
    r = columns.shape[2]
    rows = nl.ndarray((r, f), dtype=out.dtype, buffer=nl.sbuf, name="out_rows")
    natural_columns_to_rows(rows, columns)
    nisa.dma_copy(dst=out.reshape((r, f)), src=rows)
