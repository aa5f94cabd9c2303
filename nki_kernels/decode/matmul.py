"""Projections of column tiles (nki_kernels.decode.tiles) by dense and factored weights for the decode kernels.

Weight tiles are STATIONARY ([≤128 of K, ≤128 of N]) and column tiles MOVING ([≤128 of K, R]), so PSUM holds [≤128 of N,
R]: column tiles again. Weight blocks stream through a `ring.WeightRing` filled round robin by a cursor that never
resets, so the next blocks (of this layer or the next one) load while the current ones are multiplied: a load waits
only for the matmuls that read the bytes it overwrites (prefetch depth = the ring's size). Matmul operands are in the
model dtype, or fp8 weights (float8_e4m3, DMA'd as they are) beside activations in the model dtype; PSUM is float32.

fp8 weights (nki_kernels.decode.contract: Quantized, Factored with scales) carry one float32 scale per output column:
the float32 sums are multiplied by it as PSUM is evicted, the output features lying on the partitions (a scale column
tile per output tile, see `load_scales`). A factored weight's rank scales multiply (x·u)ᵀ before it is rounded to the
model dtype.
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.contract import PROJECTIONS, Quantized
from nki_kernels.decode.layouts import grouped_layout
from nki_kernels.decode.tiles import (
    column_tiles,
    fp32_per_psum_bank,
    layout_blocks,
    load_columns,
    padded_rows,
    tile_runs,
)
from nki_kernels.svd_matmul import spans

# PSUM banks a projection's accumulators may use at once (of 8): the rest is for the norm, attention, the head.
PROJECTION_PSUM_BANKS = 4
# Run length under which a DMA run costs about as long as one of this length: the DMA efficiency curve (NKI docs,
# figure nki-dma-intro-1: 21% of the rate at 512 B, 42% at 1 KiB, 82% at 2 KiB, i.e. a fixed cost per run; the DMA
# bandwidth guide: runs of 2 KiB or more approach the peak). See `whole_rows`.
SHORT_RUN_BYTES = 2048


def _column_chunks(out_layout, per_block, block_elements, rows):
    """Output blocks grouped into chunks of consecutive features whose weight block (per_block rows per partition
    × chunk width) fits a ring block and whose accumulators fit PROJECTION_PSUM_BANKS:
    [(n0, width, first tile, tiles)]."""
    max_slots = PROJECTION_PSUM_BANKS * fp32_per_psum_bank(padded_rows(rows))
    chunks = []
    for k0, ks, s0, count, _ in layout_blocks(out_layout):
        if (
            chunks
            and chunks[-1][0] + chunks[-1][1] == k0
            and (chunks[-1][1] + ks) * per_block <= block_elements
            and chunks[-1][3] + count <= max_slots
        ):
            chunks[-1][1] += ks
            chunks[-1][3] += count
        else:
            chunks.append([k0, ks, s0, count])
    return [tuple(c) for c in chunks]


def rows_per_block(in_count_max, n, block_elements):
    """Weight rows per partition in one ring block of a projection with N = n columns: an input layout block's
    rows where they fit a ring block at the full width, else as many whole rows as a block holds (at least one). Whole
    rows are one contiguous run per partition; cutting the columns instead leaves runs of the chunk's width
    (e.g. a factored gate's u [4096, 2560] in 8-row blocks: 2048 + 512 columns, the 1 KiB runs at 42% of the DMA
    rate)."""
    if n * in_count_max <= block_elements:
        return in_count_max
    return max(1, min(in_count_max, block_elements // n))


def load_scales(scale, layout):
    """scale [F] or [M, F] (HBM, float32: per-column scales of an fp8 weight, M of them) as float32 column tiles
    [128, tiles, M] of `layout` (one DMA of the M rows onto M partitions, then one PE transpose per tile for all M);
    None for None."""
    if scale is None:
        return None
    rows = scale.reshape((1, scale.shape[0])) if len(scale.shape) == 1 else scale
    cols = column_tiles(layout, rows.shape[0], nl.float32, "scales", zero=False)
    load_columns(cols, rows, layout)
    return cols


class LayerScales:
    """The per-column scales of every layer's fp8 projections as float32 column tiles with a column per layer,
    loaded once when a kernel starts: the rows of a scale [L, F] go onto L partitions in one DMA and each tile takes
    one PE transpose for all those layers, where loading them layer by layer takes one per tile per layer (TensorE
    time every layer would spend on its scales). A factored weight's u scales
    load per run of consecutive layers of one rank (the rank decides their layout), so every scale byte is read
    once. `of(name, layer, rank)` gives what `projection` takes as `scales`. Up to 128 layers (one partition each).
    """

    def __init__(self, weights, spec, out_layouts):
        """weights: {projection: stacked stored weight (HBM)}; out_layouts: {projection: its output's layout}."""
        if spec.num_layers > nl.tile_size.pmax:
            raise ValueError(f"LayerScales: {spec.num_layers} layers, expected at most {nl.tile_size.pmax}")
        self.tiles, self.u_runs = {}, {}
        for name, weight in weights.items():
            if not spec.fp8(name):
                continue
            if not spec.factored(name):
                self.tiles[name] = load_scales(weight.scale, out_layouts[name])
                continue
            self.tiles[name] = load_scales(weight.v_scale, out_layouts[name])
            # Layers left dense in the stack have no u scales to read: W's scales are v_scale's.
            self.u_runs[name] = [
                (l0, l1, load_scales(weight.u_scale[l0:l1, 0:rank], grouped_layout(rank, spec.out_features(name))))
                for l0, l1, rank in rank_runs(spec.ranks[PROJECTIONS.index(name)])
                if rank is not None
            ]

    @staticmethod
    def sbuf_bytes(spec, out_layouts):
        """SBUF bytes per partition the tiles of `spec`'s fp8 projections take (float32, a column per layer)."""
        tiles = 0
        for name in PROJECTIONS:
            if not spec.fp8(name):
                continue
            tiles += len(out_layouts[name]) * spec.num_layers
            if spec.factored(name):
                columns = spec.out_features(name)
                tiles += sum(
                    len(grouped_layout(rank, columns)) * (l1 - l0)
                    for l0, l1, rank in rank_runs(spec.ranks[PROJECTIONS.index(name)])
                    if rank is not None
                )
        return tiles * nl.float32.itemsize

    def of(self, name, layer, rank):
        """Layer `layer`'s scales of projection `name` (rank: its rank there, None when dense): the [128, tiles,
        1] tiles of a Quantized weight or of a dense layer in a factored stack (its v_scale), or (u's, v's) of a
        factored layer; None when the projection is not fp8."""
        if name not in self.tiles:
            return None
        scales = self.tiles[name][:, :, layer : layer + 1]
        if rank is None:
            return scales
        l0, _, u_tiles = next(run for run in self.u_runs[name] if run[0] <= layer < run[1])
        return u_tiles[:, :, layer - l0 : layer - l0 + 1], scales


def rank_runs(ranks):
    """[(first layer, end layer, rank)]: maximal runs of consecutive layers of one rank."""
    runs = []
    for layer, rank in enumerate(ranks):
        if runs and runs[-1][2] == rank:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1, rank])
    return [tuple(run) for run in runs]


class OnChipWeight:
    """A weight [K, N] already in SBUF (a layer's packed weights, nki_kernels.decode.packing.load_packed): blocks[b]
    is the [partitions, count, N] view of block b of its input layout (tiles.layout_blocks), partition p holding
    rows k0 + p·count .. k0 + p·count + count - 1 of that block."""

    def __init__(self, blocks, rows, columns):
        self.blocks = blocks
        self.shape = (rows, columns)
        self.dtype = blocks[0].dtype


def whole_rows(columns, stored, itemsize):
    """Whether a weight whose rows hold `columns` values of `stored` (a factor's u stacked past this layer's rank)
    is read as whole stored rows: when its own runs are shorter than SHORT_RUN_BYTES and a stored row is no
    longer. A run under 2 KiB takes about as long as a 2 KiB one, so such a row costs no more read whole, and the
    rows of a block then make one run (a rank-320 layer's u in a stack of rank 448, bf16: 640-byte runs at 26% of
    the DMA rate, or 896-byte rows read in one run at 97%)."""
    return columns < stored and stored * itemsize <= SHORT_RUN_BYTES


def dense_projection(x, in_layout, w, out_layout, rows, ring, evict, scales=None, columns=None):
    """x [K features] @ w [K, N] (an HBM view in the model dtype, or fp8; or an OnChipWeight) for `rows` rows, out
    in `out_layout`. columns: N when w's rows are longer (w [K, ≥N], e.g. a factor's u stacked past the layer's
    rank; its first N columns are the weight): the rest is never multiplied, and read only where `whole_rows`
    makes longer DMA runs of it.

    x: column tiles of in_layout in the model dtype. Weights in HBM stream through `ring`, one DMA per (input block,
    column chunk), an input block split into blocks of rows_per_block rows per partition where its rows do not fit
    a ring block at the full width; each block's tiles feed every output tile of the chunk. An OnChipWeight's
    blocks are already loaded (its column chunks are views of them).
    evict(psum, s0, count, size, scale) is called once per run of equal-size output tiles with the float32
    accumulators psum [size, count, rows] (tiles s0 .. s0+count-1 of out_layout) and their scales: None, or (fp8
    weights, `scales` the load_scales tiles of out_layout) a float32 [size, count, rows] view to multiply psum by;
    the PSUM is freed after the chunk.
    """
    pmax = nl.tile_size.pmax
    k, stored = w.shape
    n = stored if columns is None else columns
    in_blocks = layout_blocks(in_layout)
    in_count_max = max(count for _, _, _, count, _ in in_blocks)
    on_chip = isinstance(w, OnChipWeight)
    if on_chip and n != stored:
        raise ValueError(f"dense_projection: an OnChipWeight of {stored} columns, columns={n}; expected all of them")
    block_elements = in_count_max * n if on_chip else ring.block_elements(w.dtype)
    # Columns past N a chunk ending at N reads with it (whole stored rows), and the block elements they leave.
    whole = not on_chip and whole_rows(n, stored, w.dtype.itemsize) and stored <= block_elements
    padding = stored - n if whole else 0
    per_block = rows_per_block(in_count_max, n + padding, block_elements)
    rows_pad = padded_rows(rows)

    def weight_blocks(b, k0, ks, count, partitions, n0, width):
        """(first row in the block, rows, [partitions, rows, width] SBUF) of input block b, loaded as needed."""
        if on_chip:
            yield 0, count, w.blocks[b][0:partitions, :, n0 : n0 + width]
            return
        width += padding if n0 + width == n else 0
        view = w[k0 : k0 + ks, n0 : n0 + width].reshape_dim(0, (partitions, count))
        for i0, ic in spans(count, per_block):
            yield i0, ic, ring.load(view if ic == count else view[:, i0 : i0 + ic, :], partitions, ic, width)

    for n0, width, out_s0, out_count in _column_chunks(
        out_layout, per_block, block_elements - per_block * padding, rows
    ):
        acc = nl.ndarray((pmax, out_count, rows_pad), dtype=nl.float32, buffer=nl.psum, name="proj_psum")
        for b, (k0, ks, s0, count, partitions) in enumerate(in_blocks):
            for i0, ic, block in weight_blocks(b, k0, ks, count, partitions, n0, width):
                for j in range(out_count):
                    size, feats = out_layout[out_s0 + j]
                    columns = slice(feats.start - n0, feats.stop - n0, feats.step)
                    for i in range(ic):
                        nisa.nc_matmul(
                            dst=acc[0:size, j, 0:rows],
                            stationary=block[0:partitions, i, columns],
                            moving=x[0:partitions, s0 + i0 + i, 0:rows],
                            accumulate=b > 0 or i0 + i > 0,
                        )
                del block
        for s0, count, size in tile_runs(out_layout, out_s0, out_s0 + out_count):
            scale = None if scales is None else scales[0:size, s0 : s0 + count, 0:1].broadcast(2, rows)
            evict(acc[0:size, s0 - out_s0 : s0 - out_s0 + count, 0:rows], s0, count, size, scale)
        del acc


def _scaled(psum, scale):
    """psum · scale (float32, [size, count, rows]) into a fresh float32 SBUF tile, on VectorE."""
    out = nl.ndarray(tuple(psum.shape), dtype=nl.float32, buffer=nl.sbuf, name="scaled_psum")
    nisa.tensor_tensor(dst=out, data1=psum, data2=scale, op=nl.multiply)
    return out


def copy_into(dst, op=None):
    """An evict for `dense_projection`: dst[tiles] = psum·scale (or op(psum·scale) on ScalarE), casting to dst's
    dtype; one instruction without a scale or an op."""

    def evict(psum, s0, count, size, scale):
        view = dst[0:size, s0 : s0 + count, 0 : psum.shape[2]]
        if op is None and scale is None:
            nisa.tensor_copy(dst=view, src=psum)
        elif op is None:
            nisa.tensor_tensor(dst=view, data1=psum, data2=scale, op=nl.multiply)
        else:
            nisa.activation(dst=view, op=op, data=psum if scale is None else _scaled(psum, scale))

    return evict


def add_into(dst):
    """An evict for `dense_projection`: dst[tiles] += psum·scale (the residual add, float32)."""

    def evict(psum, s0, count, size, scale):
        view = dst[0:size, s0 : s0 + count, 0 : psum.shape[2]]
        nisa.tensor_tensor(dst=view, data1=view, data2=psum if scale is None else _scaled(psum, scale), op=nl.add)

    return evict


def multiply_into(dst, other):
    """An evict for `dense_projection`: dst[tiles] = other[tiles] * psum·scale (the gated MLP's act(gate)·up)."""

    def evict(psum, s0, count, size, scale):
        rows = psum.shape[2]
        nisa.tensor_tensor(
            dst=dst[0:size, s0 : s0 + count, 0:rows],
            data1=other[0:size, s0 : s0 + count, 0:rows],
            data2=psum if scale is None else _scaled(psum, scale),
            op=nl.multiply,
        )

    return evict


def projection(x, in_layout, weight, rank, out_layout, rows, ring, evict, scales=None, reduce=None):
    """`dense_projection` of one layer's weight (HBM views): a dense [K, N] or a Quantized (rank None), or a
    Factored u [K, ≥rank], v [≥rank, N] (with fp8 factors, their scales); a packed weight's values are
    OnChipWeights instead (a Factored's exactly [K, rank] and [rank, N]). Factored: stage 1 leaves (x·u)ᵀ in SBUF
    as column tiles over the rank in x's dtype (rank on the partitions, grouped for v's rows; scaled by u_scale
    first), stage 2 multiplies it by v: the rank-r intermediate never leaves the chip.

    scales: the fp8 scales already on chip (`LayerScales.of`), else they are loaded here.
    reduce: None, or a function summing a float32 column-tile tensor over the tensor-parallel ranks in place
    (nki_kernels.decode.parallel.all_reduce_columns) for a weight whose rows the ranks split: the partial product
    (the output; a factored weight's (x·u)ᵀ, before v) is then evicted to float32 SBUF, scaled, summed, and goes on
    from there (evict then sees SBUF tiles and no scale)."""
    if rank is None:
        w = weight
        if isinstance(weight, Quantized):
            w, scales = weight.w, load_scales(weight.scale, out_layout) if scales is None else scales
        if reduce is None:
            dense_projection(x, in_layout, w, out_layout, rows, ring, evict, scales)
            return
        partial = column_tiles(out_layout, rows, nl.float32, "partial_out")
        dense_projection(x, in_layout, w, out_layout, rows, ring, copy_into(partial), scales)
        reduce(partial)
        for s0, count, size in tile_runs(out_layout):
            evict(partial[0:size, s0 : s0 + count, 0:rows], s0, count, size, None)
        return
    u, v = weight.u, weight.v
    if not isinstance(u, OnChipWeight):  # stacked to the largest rank in HBM; packed ones are the layer's
        v = v[0:rank, :]  # u's first rank columns: dense_projection reads them, or whole rows (whole_rows)
    layout = grouped_layout(rank, v.shape[1])
    if scales is None:
        u_scales = None if weight.u_scale is None else load_scales(weight.u_scale[0:rank], layout)
        v_scales = load_scales(weight.v_scale, out_layout)
    else:
        u_scales, v_scales = scales
    xu = column_tiles(layout, rows, x.dtype, "xuT", zero=False)
    if reduce is None:
        dense_projection(x, in_layout, u, layout, rows, ring, copy_into(xu), u_scales, rank)
    else:
        # Summed in float32, then rounded to x's dtype once (as one rank rounds its whole sum).
        partial = column_tiles(layout, rows, nl.float32, "partial_xuT")
        dense_projection(x, in_layout, u, layout, rows, ring, copy_into(partial), u_scales, rank)
        reduce(partial)
        nisa.tensor_copy(dst=xu[:, :, 0:rows], src=partial[:, :, 0:rows])
    dense_projection(xu, layout, v, out_layout, rows, ring, evict, v_scales)
