"""The decode kernels' dense math on column tiles (nki_kernels.decode.tiles): RMSNorm, projections of dense and
factored weights, the gated MLP and the LM head (plain functions called inside @nki.jit kernels).

Projections keep weight tiles STATIONARY ([≤128 of K, ≤128 of N]) and column tiles MOVING ([≤128 of K, R]), so
PSUM holds [≤128 of N, R]: column tiles again. Weight blocks stream through a `ring.WeightRing` filled round robin
by a cursor that never resets, so the next blocks (of this layer or the next one) load while the current ones are
multiplied: with a list-scheduled DMA model a load waits only for the matmuls that read the bytes it overwrites
(prefetch depth = the ring's size). Matmul operands are in the model dtype, or fp8 weights (float8_e4m3, DMA'd
as they are) beside activations in the model dtype; PSUM, norms and the residual stream are float32.

fp8 weights (nki_kernels.decode.contract: Quantized, Factored with scales) carry one float32 scale per output
column: the float32 sums are multiplied by it as PSUM is evicted, the output features lying on the partitions (a
scale column tile per output tile, see `load_scales`; the fp8 LM head keeps its tiles stationary too, so the
vocabulary lies on the partitions: `_LogitColumns`). A factored weight's rank scales multiply (x·u)ᵀ before it is
rounded to the model dtype.
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.contract import PROJECTIONS, Quantized
from nki_kernels.decode.layouts import grouped_layout
from nki_kernels.decode.tiles import (
    column_tiles,
    evict_alternating,
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
# Logits columns one LM-head PSUM chunk accumulates: 4 banks of float32.
HEAD_COLUMNS = 4 * nl.tile_size.psum_bank_fmax
# Widest head column range: 8 KiB runs of each head row per DMA (the DMA curve's flat part: 4 KiB runs move at
# 96.5% of its rate, 8 KiB at 98.3%), 4096 bf16 or 8192 fp8 columns, where a ring block allows and the range's
# blocks fit a third of the ring (see head_projection).
HEAD_RUN_BYTES = 8192
# Widest head range whose logits are staged as float32 rows until stored (bf16 weights, or more than HEAD_TURN_ROWS
# rows): 16 KiB per partition a range, HEAD_STORE_DELAY ranges at once (head_staging_bytes).
HEAD_STAGED_COLUMNS = 4096
# Narrowest range the head's last full range is halved down to: what TensorE and the logits' turning and stores do
# after the last weight block arrives is one range's work, so the step ends sooner after its last byte (2 KiB fp8
# runs move at 81.5% of the DMA rate, for 1/128 of a 262,144-column head's bytes).
HEAD_TAIL_COLUMNS = 2048
# Column ranges an LM-head range's logits stores wait for: DMAs are queued in program order, so a store issued
# right after its range's matmuls (it waits for them) would sit ahead of the next ranges' weight blocks and leave
# the DMA engines idle until its logits are ready; issued after the blocks of the next HEAD_STORE_DELAY ranges, it
# queues behind a stream that is already busy. Its logits rows stay in SBUF that long (a few fp32 rows).
HEAD_STORE_DELAY = 1
# Most rows for which the fp8 head's logit columns gather over ranges into buffers of 128 groups that are turned
# into rows one row at a time (`_LogitColumns._flush`: R·m transposes per 128 groups, m = HEAD_COLUMNS / 128, where
# turning per range a group at a time takes 128 whatever R; each row's staged logits hold HEAD_COLUMNS float32 per
# partition until stored). More rows turn per range.
HEAD_TURN_ROWS = 4


def load_norm_weights(norms_hbm, layout, unit_offset):
    """norms_hbm [NN, F] (HBM) as float32 column tiles [128, tiles, NN] (+1 with unit_offset); zero padding."""
    count = norms_hbm.shape[0]
    w = column_tiles(layout, count, nl.float32, "norm_weights")
    load_columns(w, norms_hbm, layout)
    if unit_offset:
        for s0, n, size in tile_runs(layout):
            nisa.tensor_scalar(
                dst=w[0:size, s0 : s0 + n, 0:count], data=w[0:size, s0 : s0 + n, 0:count], op0=nl.add, operand0=1.0
            )
    return w


class NormConstants:
    """What every RMSNorm reuses: a ones [128, 128] float32 stationary (cross-partition sums) and eps as a
    [128, 1] bias vector (trn1's ScalarE takes no scalar bias)."""

    def __init__(self, eps):
        pmax = nl.tile_size.pmax
        self.ones = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf, name="ones")
        nisa.memset(dst=self.ones, value=1.0)
        self.eps = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf, name="norm_eps")
        nisa.memset(dst=self.eps, value=float(eps))


def rms_norm(dst, x, weight, layout, rows, consts, features=None):
    """dst = x·rsqrt(mean(x²) + eps)·weight over the features of `layout`, per row.

    x: float32 column tiles with zero padding; weight: [128, tiles, 1] float32 (already 1 + w for unit-offset
    norms); dst: column tiles in any dtype (a matmul operand in the model dtype, or float32).
    Sum of squares: squares summed over the tiles, then over partitions by a ones matmul, which leaves the total on
    every partition (no broadcast needed). Each norm is a chain of dependent instructions on the decode step's
    critical path, so one row (R = 1, batch-1 decode) takes a shorter one: the squares and their sum over the tiles
    are one ScalarE activation (its free-axis reduction), and rstd, a per-partition scalar then, scales x and the
    weight in one VectorE instruction: four instructions instead of six.
    """
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    rstd = _rstd(x, layout, rows, consts, features)
    if rows == 1:
        nisa.scalar_tensor_tensor(
            dst=dst[:, :, 0:1],
            data=x[:, :, 0:1],
            op0=nl.multiply,
            operand0=rstd[:, 0, :],
            op1=nl.multiply,
            operand1=weight[:, :, 0:1],
        )
        return
    scaled = nl.ndarray((pmax, tiles, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_scaled")
    nisa.tensor_tensor(dst=scaled, data1=x[:, :, 0:rows], data2=rstd.broadcast(1, tiles), op=nl.multiply)
    nisa.tensor_tensor(dst=dst[:, :, 0:rows], data1=scaled, data2=weight[:, :, 0:1].broadcast(2, rows), op=nl.multiply)


def rms_norm_add(x, y, weight, layout, consts):
    """x += rms_norm(y)·weight for one row (R = 1; x, y float32 column tiles with zero padding; weight as rms_norm's):
    y·weight on GpSimd while ScalarE and TensorE sum y's squares, then one VectorE instruction x + (y·weight)·rstd,
    where a norm into a tile of its own and an add were two VectorE instructions on the step's serial chain (the
    sandwich norms' residual adds)."""
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    yw = nl.ndarray((pmax, tiles, 1), dtype=nl.float32, buffer=nl.sbuf, name="norm_yw")
    nisa.tensor_tensor(dst=yw, data1=y[:, :, 0:1], data2=weight[:, :, 0:1], op=nl.multiply, engine=nisa.gpsimd_engine)
    rstd = _rstd(y, layout, 1, consts)
    nisa.scalar_tensor_tensor(
        dst=x[:, :, 0:1], data=yw, op0=nl.multiply, operand0=rstd[:, 0, :], op1=nl.add, operand1=x[:, :, 0:1]
    )


def _rstd(x, layout, rows, consts, features=None):
    """rsqrt(mean(x²) + eps) of each row of float32 column tiles x over `layout`'s features, on every partition:
    [128, 1, R] float32 (see rms_norm)."""
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    features = sum(size for size, _ in layout) if features is None else features
    partial = nl.ndarray((pmax, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_partial")
    if rows == 1:
        squares = nl.ndarray((pmax, tiles), dtype=nl.float32, buffer=nl.sbuf, name="norm_squares")
        nisa.activation(
            dst=squares,
            op=nl.square,
            data=x[:, :, 0],
            reduce_op=nl.add,
            reduce_res=partial,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
    else:
        squares = nl.ndarray((pmax, rows, tiles), dtype=nl.float32, buffer=nl.sbuf, name="norm_squares")
        x_by_row = x[:, :, 0:rows].permute((0, 2, 1))
        nisa.tensor_tensor(dst=squares, data1=x_by_row, data2=x_by_row, op=nl.multiply)
        nisa.tensor_reduce(dst=partial, op=nl.add, data=squares, axis=2)
    total = nl.ndarray((pmax, rows), dtype=nl.float32, buffer=nl.psum, name="norm_total")
    nisa.nc_matmul(dst=total, stationary=consts.ones, moving=partial, accumulate=False)
    rstd = nl.ndarray((pmax, 1, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_rstd")
    nisa.activation(dst=rstd[:, 0, :], op=nl.rsqrt, data=total, scale=1.0 / features, bias=consts.eps)
    return rstd


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
    one PE transpose for all those layers, where loading them layer by layer takes one per tile per layer (on Gemma 3
    270M's fp8 step, 54 transposes a layer, a seventh of the layer's TensorE time). A factored weight's u scales
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


def gated_mlp(
    h,
    hidden_layout,
    gate,
    up,
    down,
    ranks,
    inter_layout,
    rows,
    ring,
    activation_op,
    evict,
    scales=(None,) * 3,
    reduce=None,
):
    """down(act(h·gate) * (h·up)) with h column tiles of hidden_layout (model dtype); ranks (gate, up, down),
    None where dense. act(gate) is applied by ScalarE evicting PSUM; VectorE multiplies by up straight from
    PSUM; the intermediate (column tiles of inter_layout, model dtype) stays on chip. evict: as `dense_projection`'s,
    for the down projection's output (hidden features in hidden_layout); scales: `projection`'s for gate, up, down;
    reduce: `projection`'s, for down."""
    act = column_tiles(inter_layout, rows, nl.float32, "mlp_act", zero=False)
    projection(h, hidden_layout, gate, ranks[0], inter_layout, rows, ring, copy_into(act, activation_op), scales[0])
    hidden = column_tiles(inter_layout, rows, h.dtype, "mlp_hidden", zero=False)
    projection(h, hidden_layout, up, ranks[1], inter_layout, rows, ring, multiply_into(hidden, act), scales[1])
    del act
    projection(hidden, inter_layout, down, ranks[2], hidden_layout, rows, ring, evict, scales[2], reduce)


def head_projection(x, layout, w, rows, ring, out_rows, softcap=None, scale=None):
    """out_rows [R, V] (HBM, float32) = (x · w [K, V])·diag(scale), softcap·tanh(·/softcap) when softcap is set.

    w in the model dtype (scale None) or fp8 with float32 scales [V] (HBM); x: column tiles of `layout` in the
    model dtype. Head blocks (one per 128-row K tile) stream through the ring column range by column range,
    and each range's logits accumulate in PSUM chunks (`_LogitRows`: bf16 weights, HEAD_COLUMNS a chunk;
    `_LogitColumns`: fp8, as many 128-column groups as PROJECTION_PSUM_BANKS hold). A range whose logits fit one
    chunk multiplies each block as soon as it loads, which frees it, so only the ring's prefetch is in flight,
    whatever the ring's size; a range over several chunks, each accumulating over all its blocks, keeps its blocks
    live together. Ranges hold HEAD_RUN_BYTES of each weight row (one DMA run) where a ring block and the staged
    logits (HEAD_STAGED_COLUMNS) allow, halved while a range's blocks take over a third of the ring (the rest
    prefetches the next ranges), else HEAD_COLUMNS columns; the last one is halved down to HEAD_TAIL_COLUMNS
    (`head_ranges`). A range's logits are stored once the blocks of the next HEAD_STORE_DELAY ranges are queued.
    """
    k, v = w.shape
    in_blocks = layout_blocks(layout)
    moving = nl.tile_size.gemm_moving_fmax
    block_elements = ring.block_elements(w.dtype)
    out = _LogitRows(x, rows, out_rows, softcap) if scale is None else _LogitColumns(x, rows, out_rows, softcap, scale)
    columns = _widest_columns(w.dtype, out.widest_range, block_elements)
    blocks_elements = sum(count for _, _, _, count, _ in in_blocks)
    while columns > HEAD_COLUMNS and blocks_elements * columns > ring.ring_elements(w.dtype) // 3:
        # e.g. a head of rank 576 in fp8 on trn1: 4096-column ranges where 8192 take over a third of the ring
        columns = max(HEAD_COLUMNS, columns // 2)
    if blocks_elements * columns > ring.ring_elements(w.dtype) // 3:
        # e.g. a factored head of rank ~1600, or attention's cache tiles shrinking the ring: streamed ranges.
        columns = min(HEAD_COLUMNS, block_elements)
    if columns >= moving:
        columns -= columns % moving  # whole moving tiles per block
    columns = max(1, columns)

    # (first row, rows, first x tile, tiles, partitions of the layout block; the K tile in it)
    k_tiles = [(*block, i) for block in in_blocks for i in range(block[3])]

    def load(v0, vc, k0, ks, _, count, partitions, i):
        """K tile i of the layout block at row k0, columns [v0, v0 + vc): a ring block [partitions, 1, vc]. One
        load a tile, not a layout block: a tile's matmuls wait for its bytes only, so when the last weights land
        one tile's matmuls are left, not a block's."""
        rows_of_block = w[k0 : k0 + ks, v0 : v0 + vc].reshape_dim(0, (partitions, count))
        return ring.load(rows_of_block[:, i : i + 1, :], partitions, 1, vc)

    def issue(stores):
        for dst, src in stores:
            nisa.dma_copy(dst=dst, src=src)

    pending = []  # per range, its logits stores (dst in HBM, src in SBUF) not issued yet
    for v0, vc in head_ranges(v, columns):
        chunks = out.start(v0, vc)
        stores = []
        if len(chunks) == 1:
            acc = out.accumulator(chunks[0])
            for b, tile in enumerate(k_tiles):
                block = load(v0, vc, *tile)
                if b == len(k_tiles) - 1 and len(pending) == HEAD_STORE_DELAY:
                    issue(pending.pop(0))
                _, _, s0, _, partitions, i = tile
                out.multiply(acc, chunks[0], block, b, s0 + i, 1, partitions)
                del block
            stores += out.store(acc, chunks[0])
        else:
            blocks = [load(v0, vc, *tile) for tile in k_tiles]
            if len(pending) == HEAD_STORE_DELAY:
                issue(pending.pop(0))
            for chunk in chunks:
                acc = out.accumulator(chunk)
                for b, (block, (_, _, s0, _, partitions, i)) in enumerate(zip(blocks, k_tiles)):
                    out.multiply(acc, chunk, block, b, s0 + i, 1, partitions)
                stores += out.store(acc, chunk)
            del blocks
        pending.append(stores)
    for stores in pending:
        issue(stores)


def _widest_columns(dtype, widest_range, block_elements):
    """A head range's widest width before head_projection narrows it to a third of the ring: a ring block holds one
    K tile's row of the range (head_projection loads a block per tile)."""
    return min(HEAD_RUN_BYTES // dtype.itemsize, widest_range, block_elements)


def head_staging_bytes(dtype, fp8, rows, vocab, block_bytes):
    """SBUF bytes per partition at most that head_projection's staged logits hold at once, for a head of weights in
    `dtype` (fp8: with scales), R = rows, V = vocab, ring blocks of block_bytes: what the kernel keeps beside the
    weight ring in the head (where attention's cache tiles are no longer live). A range's logits are allocated once
    the oldest pending range's stores are issued, so HEAD_STORE_DELAY ranges' float32 rows are live at most (the fp8
    head's: its 128-group column buffer and the rows of its flushes, beside its scales for the whole vocabulary)."""
    pmax, ranges = nl.tile_size.pmax, max(1, HEAD_STORE_DELAY)
    if not fp8:
        columns = _widest_columns(dtype, HEAD_STAGED_COLUMNS, block_bytes // dtype.itemsize)
        if columns >= nl.tile_size.gemm_moving_fmax:
            columns -= columns % nl.tile_size.gemm_moving_fmax
        return ranges * min(max(columns, 1), vocab) * nl.float32.itemsize
    if rows <= HEAD_TURN_ROWS:  # a buffer of 128 groups; a flush stages HEAD_COLUMNS of each row
        staged = (pmax * rows + ranges * rows * HEAD_COLUMNS) * nl.float32.itemsize
    else:
        groups = -(-HEAD_STAGED_COLUMNS // pmax)  # a range's column tiles and its rows
        staged = ranges * (groups * rows + HEAD_STAGED_COLUMNS) * nl.float32.itemsize
    # The scales ([128, Q·m, 1]) stay live through the whole head; the rows they are read as (Q of 128·m columns)
    # are freed before any logits stage.
    count, m = _scale_rows(vocab)
    return count * m * nl.float32.itemsize + max(pmax * m * nl.float32.itemsize, staged)


def head_ranges(v, columns):
    """The head's column ranges [(first column, columns)]: `columns` wide, the last full-width one (with the
    narrower remainder after it, if any, when `columns` exceeds HEAD_TAIL_COLUMNS: then every piece is at most
    `columns` wide) split into halves, quarters, ... (in whole 128-column groups) down to HEAD_TAIL_COLUMNS."""
    pmax = nl.tile_size.pmax
    ranges = spans(v, columns)
    v0, vc = ranges.pop()
    if ranges and vc < columns and HEAD_TAIL_COLUMNS < columns:
        # A remainder alone at the end would leave the full range before it ending late: the step's last DMAs
        # need not land in issue order, and that range's whole work would follow its last bytes.
        v0, vc = ranges.pop()[0], vc + columns
    while vc > HEAD_TAIL_COLUMNS and vc >= 2 * pmax:
        half = vc // 2 - vc // 2 % pmax
        ranges.append((v0, half))
        v0, vc = v0 + half, vc - half
    return ranges + [(v0, vc)]


class _LogitRows:
    """The LM head with x STATIONARY ([≤128 of K, R]) and head tiles moving ([≤128 of K, ≤512 of V]): PSUM holds
    logits rows [R, ≤512] directly, a chunk being HEAD_COLUMNS columns. TensorE takes 128 weights a cycle this way
    (a 512-column moving tile in 512 cycles), more than DMA brings of bf16 weights on trn1 or trn2."""

    def __init__(self, x, rows, out_rows, softcap):
        self.x, self.rows, self.out_rows, self.softcap = x, rows, out_rows, softcap
        self.widest_range = HEAD_STAGED_COLUMNS

    def start(self, v0, vc):
        """The chunks of the range [v0, v0 + vc): (first column in the range, columns)."""
        self.v0 = v0
        return spans(vc, HEAD_COLUMNS)

    def accumulator(self, chunk):
        return nl.ndarray((self.rows, chunk[1]), dtype=nl.float32, buffer=nl.psum, name="logits_psum")

    def multiply(self, acc, chunk, block, b, s0, count, partitions):
        c0, cw = chunk
        moving = nl.tile_size.gemm_moving_fmax
        for i in range(count):
            for m0, ms in spans(cw, moving):
                nisa.nc_matmul(
                    dst=acc[0 : self.rows, m0 : m0 + ms],
                    stationary=self.x[0:partitions, s0 + i, 0 : self.rows],
                    moving=block[0:partitions, i, c0 + m0 : c0 + m0 + ms],
                    accumulate=b > 0 or i > 0,
                )

    def store(self, acc, chunk):
        """[(out's columns, SBUF rows)] to store: acc (soft-capped when softcap is set) through an SBUF row."""
        c0, cw = chunk
        logits = nl.ndarray(tuple(acc.shape), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
        if self.softcap is None:
            # A PSUM bank at a time, VectorE and ScalarE in turn: a row of a chunk is cw elements on one partition,
            # whose copy on one engine (cw cycles) follows the step's last matmuls (Gemma 3 270M: 1.9 µs on trn1).
            for k, (b0, bw) in enumerate(spans(cw, nl.tile_size.psum_bank_fmax)):
                evict_alternating(logits[:, b0 : b0 + bw], acc[:, b0 : b0 + bw], k)
        else:
            nisa.activation(dst=logits, op=nl.tanh, data=acc, scale=1.0 / self.softcap)
            nisa.tensor_scalar(dst=logits, data=logits, op0=nl.multiply, operand0=float(self.softcap))
        return [(self.out_rows[0 : self.rows, self.v0 + c0 : self.v0 + c0 + cw], logits)]


class _LogitColumns:
    """The LM head of fp8 weights with head tiles STATIONARY ([≤128 of K, ≤128 of V]) and x moving ([≤128 of K,
    R]): PSUM holds logits column tiles [≤128 of V, R], vocabulary on the partitions, one per 128-column group.
    TensorE takes 256 weights a cycle this way (64 cycles a tile) where the rows orientation takes 128, fewer than
    DMA brings of fp8 weights on trn2 (151 bytes a cycle). Turning the logits back into rows one PE transpose
    (128 cycles) per group made a group of a rank-448 factored head cost 384 cycles, as long as DMA takes for its
    bytes on trn2 (Gemma 3 270M, batch 1: TensorE busy 559 of 695 µs, the step 20 µs over its DMA time); with up
    to HEAD_TURN_ROWS rows the logit columns of 128 groups are turned m = HEAD_COLUMNS / 128 at a time (`_flush`),
    so a group costs the matmuls' 256 cycles plus 16 per row. The scales lie on the partitions too, so PSUM is
    scaled on the way out with one VectorE multiply per run of groups, then soft-capped; they are loaded once for
    the whole vocabulary (`_scale_groups`)."""

    def __init__(self, x, rows, out_rows, softcap, scale):
        self.x, self.rows, self.out_rows, self.softcap = x, rows, out_rows, softcap
        self.per_acc = PROJECTION_PSUM_BANKS * fp32_per_psum_bank(padded_rows(rows))  # groups an accumulator holds
        # Up to HEAD_TURN_ROWS rows, logits gather in buffers of 128 groups whatever a range's width; more rows
        # stage each range's logits rows.
        self.widest_range = out_rows.shape[1] if rows <= HEAD_TURN_ROWS else HEAD_STAGED_COLUMNS
        self.scales = _scale_groups(scale)
        self.buffer, self.buffer_column, self.buffered = None, 0, []  # see store: the groups not yet turned
        # The first buffer holds fewer groups so that the last holds m = HEAD_COLUMNS / 128 (one transpose per
        # row): turning the last buffer is work after the last weight block arrives.
        pmax, groups = nl.tile_size.pmax, -(-out_rows.shape[1] // nl.tile_size.pmax)
        self.capacity = (groups - HEAD_COLUMNS // pmax) % pmax or pmax

    def start(self, v0, vc):
        """The chunks of the range [v0, v0 + vc): (the range's first group in the vocabulary, [(column in the
        range, columns) of each 128-column group])."""
        pmax = nl.tile_size.pmax
        self.v0 = v0
        groups = spans(vc, pmax)
        return [(v0 // pmax + j0, groups[j0 : j0 + self.per_acc]) for j0 in range(0, len(groups), self.per_acc)]

    def accumulator(self, chunk):
        shape = (nl.tile_size.pmax, len(chunk[1]), padded_rows(self.rows))
        return nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum, name="logits_psum")

    def multiply(self, acc, chunk, block, b, s0, count, partitions):
        for j, (c0, cs) in enumerate(chunk[1]):
            for i in range(count):
                nisa.nc_matmul(
                    dst=acc[0:cs, j, 0 : self.rows],
                    stationary=block[0:partitions, i, c0 : c0 + cs],
                    moving=self.x[0:partitions, s0 + i, 0 : self.rows],
                    accumulate=b > 0 or i > 0,
                )

    def store(self, acc, chunk):
        """[(out's columns, SBUF rows)] to store: acc·scale (soft-capped when softcap is set) as scaled column tiles
        in an SBUF buffer of up to 128 consecutive groups (the first fewer) that spans ranges (`_flush` turns a
        full one into rows); with more than HEAD_TURN_ROWS rows, per range (`_store_range`)."""
        if self.rows > HEAD_TURN_ROWS:
            return self._store_range(acc, chunk)
        first_group, groups = chunk
        rows = self.rows
        stores = []
        j = 0
        while j < len(groups):
            if self.buffer is None:
                shape = (nl.tile_size.pmax, nl.tile_size.pmax, rows)
                self.buffer = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, name="logit_cols")
                self.buffer_column, self.buffered = self.v0 + groups[j][0], []
            # a run of equal-size groups that fits the buffer
            size, n = groups[j][1], 1
            room = self.capacity - len(self.buffered)
            while n < room and j + n < len(groups) and groups[j + n][1] == size:
                n += 1
            b0 = len(self.buffered)
            self._scaled(self.buffer[0:size, b0 : b0 + n, 0:rows], acc[0:size, j : j + n, 0:rows], first_group + j)
            self.buffered += [size] * n
            j += n
            end = self.buffer_column + sum(self.buffered)
            last = end == self.out_rows.shape[1]
            if len(self.buffered) == self.capacity or size < nl.tile_size.pmax or last:
                stores += self._flush(1 if last else HEAD_COLUMNS // nl.tile_size.pmax)
                self.capacity = nl.tile_size.pmax
        return stores

    def _scaled(self, dst, psum, group):
        """dst [size, n, R] = psum [size, n, R] (groups group .. group+n-1) times their scales, soft-capped when
        softcap is set."""
        size, n, rows = dst.shape
        scale = self.scales[0:size, group : group + n, 0:1].broadcast(2, rows)
        nisa.tensor_tensor(dst=dst, data1=psum, data2=scale, op=nl.multiply)
        if self.softcap is not None:
            nisa.activation(dst=dst, op=nl.tanh, data=dst, scale=1.0 / self.softcap)
            nisa.tensor_scalar(dst=dst, data=dst, op0=nl.multiply, operand0=float(self.softcap))

    def _store_range(self, acc, chunk):
        """`store` of more than HEAD_TURN_ROWS rows: acc·scale (soft-capped when softcap is set) as scaled column
        tiles in SBUF, turned into rows on the PE one group at a time (a transpose turns all R rows of a group), side
        by side in a PSUM row of up to HEAD_COLUMNS, so each DMA writes whole rows of logits (long runs, one engine
        per 8 rows)."""
        first_group, groups = chunk
        rows = self.rows
        logits = nl.ndarray((nl.tile_size.pmax, len(groups), rows), dtype=nl.float32, buffer=nl.sbuf, name="logit_cols")
        for g0, count, size in tile_runs(tuple((cs, None) for _, cs in groups)):
            self._scaled(
                logits[0:size, g0 : g0 + count, 0:rows], acc[0:size, g0 : g0 + count, 0:rows], first_group + g0
            )
        pmax = nl.tile_size.pmax
        per_row = HEAD_COLUMNS // pmax
        stores = []
        for j0 in range(0, len(groups), per_row):
            part = groups[j0 : j0 + per_row]
            first, width = part[0][0], part[-1][0] + part[-1][1] - part[0][0]
            turned = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
            for j, (c0, cs) in enumerate(part):
                nisa.nc_transpose(dst=turned[0:rows, c0 - first : c0 - first + cs], data=logits[0:cs, j0 + j, 0:rows])
            staged = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
            nisa.tensor_copy(dst=staged, src=turned)
            del turned
            stores.append((self.out_rows[0:rows, self.v0 + first : self.v0 + first + width], staged))
        return stores

    def _flush(self, m):
        """The buffered groups as rows of logits, per row: PE transposes of [128, n] column tiles, each turning n
        groups at once (max(128, min(64, n)) cycles however many it turns, where one per group took 128 cycles a
        group: on trn2 the head's TensorE time was its matmuls' plus half again, and its VectorE evictions one
        per 16 groups). Transpose j takes groups j, j + m, j + 2m, ... to PSUM columns [128·j, 128·(j+1)), so
        partition q holds m consecutive groups, evicted by one VectorE copy (128·m elements a partition) and stored
        a partition per DMA (spread over the DMA engines as the per-range rows were): m = HEAD_COLUMNS / 128 gives
        8 KiB runs of logits; the last buffer, turned after the last weights arrive, takes m = 1 (the shortest
        copy). The groups left over (fewer than m, the last maybe partial) turn one at a time into one row."""
        pmax = nl.tile_size.pmax
        buffered, column = self.buffered, self.buffer_column
        full = len(buffered) if buffered[-1] == pmax else len(buffered) - 1
        nq = full // m
        by_row = self.buffer.reshape_dim(1, (pmax // m, m))  # [128, 128 / m, m, R]: group q·m + j
        stores = []
        for r in range(self.rows):
            if nq:
                turned = nl.ndarray((nq, m * pmax), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
                for j in range(m):
                    nisa.nc_transpose(dst=turned[0:nq, j * pmax : (j + 1) * pmax], data=by_row[0:pmax, 0:nq, j, r])
                staged = nl.ndarray((nq, m * pmax), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
                nisa.tensor_copy(dst=staged, src=turned)
                del turned
                for q in range(nq):  # a DMA per partition: the stores of a flush spread over nq engines
                    c0 = column + q * m * pmax
                    stores.append((self.out_rows[r : r + 1, c0 : c0 + m * pmax], staged[q : q + 1, :]))
            rest = buffered[nq * m :]
            if rest:
                width = sum(rest)
                turned = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
                for i, cs in enumerate(rest):
                    g = nq * m + i
                    nisa.nc_transpose(dst=turned[0:1, i * pmax : i * pmax + cs], data=self.buffer[0:cs, g, r : r + 1])
                staged = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
                nisa.tensor_copy(dst=staged, src=turned)
                del turned
                c0 = column + nq * m * pmax
                stores.append((self.out_rows[r : r + 1, c0 : c0 + width], staged))
        self.buffer, self.buffered = None, []
        return stores


def _scale_rows(vocab):
    """(Q, m): `_scale_groups` reads a scale [V = vocab] as Q rows of 128·m columns (m = ⌈G/128⌉, G = ⌈V/128⌉)."""
    pmax = nl.tile_size.pmax
    groups = -(-vocab // pmax)
    m = -(-groups // pmax)
    return -(-vocab // (pmax * m)), m


def _scale_groups(scale):
    """scale [V] (HBM, float32) as [128, G, 1] SBUF (G = ⌈V/128⌉ groups of 128 columns, column g·128 + p on
    partition p of group g). One DMA reads it as Q ≤ 128 contiguous rows of B = 128·m columns (m = ⌈G/128⌉; 8 KiB
    a row for a 262144-token vocabulary), and m PE transposes of [Q, 128] slices lay it out: slice j of row q is
    group q·m + j. A ragged last row is zeroed first (an unwritten element would spoil a transpose on trn1)."""
    pmax = nl.tile_size.pmax
    v = scale.shape[0]
    count, m = _scale_rows(v)
    width = pmax * m
    full = v // width
    staged = nl.ndarray((count, width), dtype=nl.float32, buffer=nl.sbuf, name="head_scale_rows")
    if full < count:
        nisa.memset(dst=staged, value=0.0)
    if full:
        nisa.dma_copy(dst=staged[0:full, :], src=scale[0 : full * width].reshape((full, width)))
    if full < count:
        rest = v - full * width
        nisa.dma_copy(dst=staged[full:count, 0:rest], src=scale[full * width : v].reshape((1, rest)))
    out = nl.ndarray((pmax, count * m, 1), dtype=nl.float32, buffer=nl.sbuf, name="head_scales")
    by_row = out.reshape_dim(1, (count, m))  # [128, Q, m, 1]: group q·m + j
    for j in range(m):
        turned = nl.ndarray((pmax, count), dtype=nl.float32, buffer=nl.psum, name="head_scale_psum")
        nisa.nc_transpose(dst=turned, data=staged[0:count, j * pmax : (j + 1) * pmax])
        nisa.tensor_copy(dst=by_row[0:pmax, 0:count, j, 0], src=turned)
        del turned
    del staged
    return out


def lm_head(x, layout, final_norm_w, head, head_rank, rows, ring, consts, out_rows, dtype, softcap=None):
    """Final norm of the hidden state x (float32 column tiles) into the model dtype `dtype` and the LM head into
    out_rows [R, V] (HBM, float32): dense head [H, V], a Quantized, or a Factored u [H, r], v [r, V] (with fp8
    factors, their scales; stage 1 as a projection, stage 2 as the dense head from the on-chip (x·u)ᵀ)."""
    h = column_tiles(layout, rows, dtype, "final_normed", zero=False)
    rms_norm(h, x, final_norm_w, layout, rows, consts)
    head_logits(h, layout, head, head_rank, rows, ring, out_rows, softcap)


def head_logits(h, layout, head, head_rank, rows, ring, out_rows, softcap=None):
    """The LM head of normed column tiles h (model dtype, `layout`) into out_rows [R, V] (HBM, float32), as
    `lm_head` describes (head_rank None: dense or Quantized)."""
    if head_rank is None:
        w, scale = (head.w, head.scale) if isinstance(head, Quantized) else (head, None)
        head_projection(h, layout, w, rows, ring, out_rows, softcap, scale)
        return
    xu_layout = grouped_layout(head_rank, HEAD_COLUMNS)
    u_scales = None if head.u_scale is None else load_scales(head.u_scale[0:head_rank], xu_layout)
    xu = column_tiles(xu_layout, rows, h.dtype, "head_xuT", zero=False)
    dense_projection(h, layout, head.u[:, 0:head_rank], xu_layout, rows, ring, copy_into(xu), u_scales)
    head_projection(xu, xu_layout, head.v[0:head_rank, :], rows, ring, out_rows, softcap, head.v_scale)
