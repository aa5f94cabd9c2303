"""Decode-step attention in NKI: q/k head-dim RMSNorm, RoPE, the in-place KV-cache write, GQA over the cache.

Layouts: R = B·T rows (row r = b·T + t), features on partitions in natural column tiles (nki_kernels.decode.tiles):
a tensor of F features is SBUF [128, ceil(F/128), R] with element [p, i, r] = feature i·128 + p of row r. q has heads·D
features (feature h·D + d is head h's component d), k and v kv_heads·D; kv head g serves query heads g·G ..
g·G + G - 1 (G = heads / kv_heads). The head dim D must divide 128 (several heads per tile) or be a multiple of
256 (a head spans whole tiles and the rotate-half halves are whole tiles). heads·D and kv_heads·D need not be
multiples of 128: a ragged last tile is read only on the partitions its features use.

HBM operands (nki_kernels.decode.contract): k_cache, v_cache [L, B, S, kv_heads, D] (model dtype); write_index
[1, 1] int32 (the first slot of this step, a runtime value); cos, sin [NR, B, T, D] float32 rotate-half tables
(halves duplicated), table spec.layer_rope[layer]; mask_bias [NM, B, T, S] float32 (0 or float32 min), mask
spec.layer_mask[layer]; qk_norm_weights [L, 2, D] (q_norm, k_norm; raw weights, 1 + w when spec.norm_unit_offset)
or None.

How the work is laid out (at decode the cache read dominates; the cost model charges DMAs by their contiguous
run per partition):
- Norm and RoPE stay in column tiles (few free elements per instruction). The per-head mean square is a
  cross-partition sum: one matmul with a block-of-ones matrix (1/D inside each head's partitions). Rotate-half
  crosses partitions when D <= 128: one matmul with a signed permutation; for D >= 256 it swaps whole tiles.
- The fused kernels (`attention`) read a layer's cache window before this step's k and v are written, without
  waiting for the writes (the same HBM bytes): the window's copies of slots [write_index, write_index + T) are
  masked out (their earlier, finite contents get weight 0) and the new k and v enter the softmax from chip as one
  more score piece (NewSlots). Everything that waits for no projection (the window's row 0, the RoPE tables) is
  issued before the projections (`prefetch`). v and the rotated k are then turned into rows on the PE and written
  with one DMA per cache at slots [write_index, write_index + T) of every row (each slot's kv_heads·D values are
  contiguous in HBM). The per-op attention_kernel reads a cache already written (cache_write_kernel).
- A mask with a window (spec.mask_windows) makes only the last window_slots slots up to the last query's slot
  visible: attention reads just those (cache and mask bias), from a first slot computed on chip from write_index
  (clamped into the cache) and applied as a runtime DMA offset, so one compiled kernel serves every step.
  Slots below are relative to the window's first slot.
- The cache is read in blocks whose partition p holds slots s0 + p·q .. s0 + p·q + q - 1 (one long contiguous
  run per partition). A score "piece" is one slot column i of a block: slots s0 + p·q + i on partitions p.
  Scores are computed transposed, slots on partitions: scoresᵀ [np ≤ 128, G·T] = Kᵀ [D, np] stationary ×
  q [D, G·T] moving, accumulated over D tiles. Kᵀ (all kv heads' features as column tiles) comes straight from
  HBM by a transposing DMA for 2-byte dtypes when it carries CACHE_RUN_BYTES per partition, else from PE
  transposes of the K blocks (short windows: the K blocks' DMAs run at full rate, the transposing one would
  not). The mask row is one DMA, put in piece order by PE transposes; query_scaling is folded into q; tanh
  softcap before the mask.
- Softmax over slots = over partitions and pieces: per-partition max over pieces, then a PE transpose and a
  free-axis max; -max is spread back over the partitions by onesᵀ·diag(-max) (a matmul); exp on ScalarE; column
  sums by onesᵀ·(per-partition sums), which also spreads them over the output's D partitions. The weights are
  already [slots, G·T], the moving operand of attnᵀ [D, G·T] = V [np, D] stationary × weights, accumulated over
  pieces: the output lands features-on-partitions (D < 128: head h is moved to its partitions (h·D) mod 128 by a
  shift matmul). All kv heads of a row whose G·T columns fit 128 share one softmax pass.

Entry points: `attention` (a subroutine for fused kernels, with `prefetch`; its pieces norm_rope, write_rows and
attend are usable alone) and, for the per-op compositions with rows [B, T, F] in HBM between kernels, `rope_kernel`,
`cache_write_kernel` and `attention_kernel`.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode import contract
from nki_kernels.decode.contract import DecodeSpec
from nki_kernels.decode.tiles import (
    evict_alternating,
    feature_layout,
    fp32_per_psum_bank,
    load_natural_columns,
    natural_columns_to_rows,
    natural_tiles,
    rows_to_natural_columns,
    spread_across_partitions,
    store_natural_columns,
    tile_runs,
    transpose_to_tiles,
)
from nki_kernels.svd_matmul import spans

# Per-partition bytes of one cache block (K or V, one DMA each): long contiguous runs, a few blocks per row.
CACHE_BLOCK_BYTES = 16384
# Per-partition bytes each cache DMA should reach at least: the DMA efficiency curve is nearly flat from 4 KiB
# on (nki-dma-bandwidth-guide), while 512 B (one Gemma 3 slot per partition) runs at a fifth of the peak.
CACHE_RUN_BYTES = 4096
# Fewest bytes per partition a cache block spreads its slots to before it takes fewer partitions, with fp8 weights
# and several rows: their layers leave the DMA engines idle part of the time, and attention waits for the rows after
# the first (read as it reaches them), so their latency counts more than their bytes: a window on all 128
# partitions (16 DMA engines) at 2 KiB each (81% of the peak rate per engine) arrives sooner than on 32 partitions
# at 8 KiB (4 engines at 97%). One row is read before the projections (prefetch), off the critical path, so its
# DMA time counts: CACHE_RUN_BYTES runs (cache_spread_bytes). With 2-byte weights the DMA engines are the
# bottleneck throughout and the cache keeps the efficient runs of two CACHE_RUN_BYTES DMAs.
FP8_CACHE_SPREAD_BYTES = 2048
# Fills the partitions a ragged score piece leaves empty: below any real score, exp() of it is 0.
MASKED_SCORE = -3.0e38


def check_head_dim(head_dim, num_kv_heads):
    """ValueError unless each KV head's features tile the partitions as the kernels place them (kv_head_place)."""
    if head_dim % 2 or not (128 % head_dim == 0 or head_dim % 256 == 0):
        raise ValueError(
            f"DecodeSpec.head_dim: got {head_dim}, expected an even divisor of 128 or a multiple of "
            f"256 (heads must not straddle partition tiles; rotate-half halves must be whole tiles)"
        )
    if num_kv_heads > 1 and head_dim % 32:
        # KV head g starts at partition g·D; an instruction's partitions must start at 0, 32, 64 or 96.
        raise ValueError(
            f"DecodeSpec.head_dim: got {head_dim} with {num_kv_heads} KV heads, expected a multiple of 32 (or one "
            f"KV head): KV head 1 would start at partition {head_dim}, and a tile must start at 0, 32, 64 or 96"
        )


def head_tiles(head_dim):
    """(partitions, tiles) of one head's features: (D, 1) when D <= 128, else (128, D / 128)."""
    pmax = nl.tile_size.pmax
    return min(head_dim, pmax), max(1, head_dim // pmax)


class AttentionConstants:
    """On-chip fp32 matrices attention() needs; build once per kernel and pass them to every layer.

    shift [128, 256]: shift[p, c] = 1 iff c = p + 128, so shift[:, 128:256] is the identity (`identity`, a view),
    shift[0:128, 128+o : 128+o+D] moves partitions o..o+D-1 to 0..D-1 and shift[0:D, 128-o : 256-o] moves them back.
    ones [128, 128]; rotate [128, 128] (D <= 128): rotate-half as stationary.T @ x; head_mean [128, 128]: 1/D
    where two partitions hold features of the same head (D <= 128), 1/D everywhere for D >= 256; eps [128, 1]
    (spec.norm_eps, the RMSNorm's bias).
    """

    def __init__(self, spec):
        check_head_dim(spec.head_dim, spec.num_kv_heads)
        pmax = nl.tile_size.pmax
        d = spec.head_dim
        f32 = nl.float32
        self.ones = nl.ndarray((pmax, pmax), dtype=f32, buffer=nl.sbuf, name="attn_ones")
        nisa.memset(dst=self.ones, value=1.0)
        self.shift = nl.ndarray((pmax, 2 * pmax), dtype=f32, buffer=nl.sbuf, name="attn_shift")
        nisa.memset(dst=self.shift, value=1.0)
        nisa.affine_select(
            dst=self.shift,
            pattern=[[1, 2 * pmax]],
            channel_multiplier=-1,
            on_true_tile=self.shift,
            on_false_value=0.0,
            cmp_op=nl.equal,
            offset=-pmax,
        )
        self.identity = self.shift[:, pmax : 2 * pmax]
        self.rotate = self.head_mean = self.eps = None
        if d <= pmax:
            self.rotate = self._rotate_half(d)
        if spec.qk_norm:
            self.head_mean = self._head_mean(d)
            self.eps = nl.ndarray((pmax, 1), dtype=f32, buffer=nl.sbuf, name="attn_norm_eps")
            nisa.memset(dst=self.eps, value=float(spec.norm_eps))

    def _rotate_half(self, d):
        """rotate[src, dst] = -1 where dst is in a head's first half and src = dst + D/2; +1 where dst is in
        its second half and src = dst - D/2 (block diagonal, one block per head)."""
        pmax = nl.tile_size.pmax
        heads, half = pmax // d, d // 2
        rotate = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf, name="attn_rotate")
        minus = nl.ndarray((pmax, pmax // 2), dtype=nl.float32, buffer=nl.sbuf, name="attn_minus_ones")
        nisa.memset(dst=minus, value=-1.0)
        halves = rotate.reshape_dim(1, (heads, 2, half))
        # dst = (h, 0, e) takes src h·D + D/2 + e; dst = (h, 1, e) takes src h·D + e.
        nisa.affine_select(
            dst=halves[:, :, 0, :],
            pattern=[[-d, heads], [-1, half]],
            channel_multiplier=1,
            on_true_tile=minus,
            on_false_value=0.0,
            cmp_op=nl.equal,
            offset=-half,
        )
        nisa.affine_select(
            dst=halves[:, :, 1, :],
            pattern=[[-d, heads], [-1, half]],
            channel_multiplier=1,
            on_true_tile=self.ones[:, 0 : pmax // 2],
            on_false_value=0.0,
            cmp_op=nl.equal,
            offset=0,
        )
        return rotate

    def _head_mean(self, d):
        pmax = nl.tile_size.pmax
        head_mean = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf, name="attn_head_mean")
        if d >= pmax:
            nisa.memset(dst=head_mean, value=1.0 / d)
            return head_mean
        heads = pmax // d
        # member[h, p] = 1 iff partition p holds a feature of head h; head_mean = memberᵀ·member / D.
        member = nl.ndarray((heads, pmax), dtype=nl.float32, buffer=nl.sbuf, name="attn_head_member")
        nisa.memset(dst=member, value=1.0)
        nisa.affine_select(
            dst=member,
            pattern=[[1, pmax]],
            channel_multiplier=-d,
            on_true_tile=member,
            on_false_value=0.0,
            cmp_op=nl.greater_equal,
            offset=0,
        )
        nisa.affine_select(
            dst=member,
            pattern=[[1, pmax]],
            channel_multiplier=-d,
            on_true_tile=member,
            on_false_value=0.0,
            cmp_op=nl.less,
            offset=-d,
        )
        same = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.psum, name="attn_same_head_psum")
        nisa.nc_matmul(dst=same, stationary=member, moving=member)
        nisa.activation(dst=head_mean, op=nl.copy, data=same, scale=1.0 / d)
        return head_mean


# -- layout helpers ---------------------------------------------------------------------------------------


def load_head_table(table, first, count, head_dim, name):
    """`count` consecutive D-vectors of HBM `table` starting at element `first` (rows of a [..., D] tensor) as
    fp32 column tiles [128, D/128 or 1, count], each vector repeated over the 128/D heads of a tile when D < 128
    (so partition p of tile k holds component (k·128 + p) mod D)."""
    pmax = nl.tile_size.pmax
    repeat = max(1, pmax // head_dim)
    width = repeat * head_dim
    rows = nl.ndarray((count, width), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_rows")
    nisa.dma_copy(dst=rows, src=table.ap([[head_dim, count], [0, repeat], [1, head_dim]], offset=first))
    columns = nl.ndarray((pmax, width // pmax, count), dtype=nl.float32, buffer=nl.sbuf, name=name)
    rows_to_natural_columns(columns, rows)
    return columns


def per_head(columns, table, features, head_dim):
    """(x view [P, heads_tiles, nd, R], table view broadcast to it): pair each tile of a column-tile tensor with
    the table tile its partitions' head components use."""
    parts, tiles = natural_tiles(features)
    _, nd = head_tiles(head_dim)
    x = columns[0:parts, 0:tiles, :].reshape_dim(1, (tiles // nd, nd))
    t = table[0:parts, 0:nd, :].expand_dim(1).broadcast(1, tiles // nd)
    if t.shape[-1] != x.shape[-1]:
        t = t.broadcast(3, x.shape[-1])
    return x, t


# -- the pieces ----------------------------------------------------------------------------------------------


def rms_norm_heads(normed, x, features, weights, spec, constants, engine=None):
    """normed (fp32 column tiles) = x (column tiles of `features` = n·D features filling their tiles' partitions,
    any float dtype) normalized over each head's D features: x·rsqrt(mean(x²) + eps)·w; weights fp32 [128, nd, 1]
    in the load_head_table layout (already 1 + w). engine: the element-wise multiplies' (None: VectorE)."""
    engine = nisa.vector_engine if engine is None else engine
    d = spec.head_dim
    parts, tiles = natural_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    groups = tiles // nd  # one mean per head (D >= 256) or per tile (a block per head, D <= 128)
    squares = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_squares")
    nisa.activation(dst=squares, op=nl.square, data=x[0:parts, 0:tiles, :])
    rstd = nl.ndarray((parts, groups, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_rstd")
    if nd > 1:
        # A head's mean is the sum of its nd tiles' partial means: accumulated in PSUM by its nd matmuls (one
        # per tile), so rsqrt reads the sum there, with no VectorE reduce between the matmuls and it.
        for g0, gn in spans(groups, max(1, fp32_per_psum_bank(r))):
            mean = nl.ndarray((parts, gn, r), dtype=nl.float32, buffer=nl.psum, name="qk_norm_mean_psum")
            for g in range(gn):
                for j in range(nd):
                    nisa.nc_matmul(
                        dst=mean[0:parts, g, :],
                        stationary=constants.head_mean[0:parts, 0:parts],
                        moving=squares[0:parts, (g0 + g) * nd + j, :],
                        accumulate=j > 0,
                    )
            nisa.activation(dst=rstd[0:parts, g0 : g0 + gn, :], op=nl.rsqrt, data=mean, bias=constants.eps[0:parts])
    else:
        # Per-tile means on every partition of the head (one matmul per ≤512 columns, a PSUM bank of tiles).
        for t0, tn in spans(tiles, max(1, fp32_per_psum_bank(r))):
            mean = nl.ndarray((parts, tn, r), dtype=nl.float32, buffer=nl.psum, name="qk_norm_mean_psum")
            for c0, cn in spans(tn, max(1, nl.tile_size.gemm_moving_fmax // r)):
                nisa.nc_matmul(
                    dst=mean[0:parts, c0 : c0 + cn, :],
                    stationary=constants.head_mean[0:parts, 0:parts],
                    moving=squares[0:parts, t0 + c0 : t0 + c0 + cn, :],
                )
            nisa.activation(dst=rstd[0:parts, t0 : t0 + tn, :], op=nl.rsqrt, data=mean, bias=constants.eps[0:parts])
    view = normed[0:parts, 0:tiles].reshape_dim(1, (groups, nd))
    nisa.tensor_tensor(
        dst=view,
        data1=x[0:parts, 0:tiles, :].reshape_dim(1, (groups, nd)),
        data2=rstd.expand_dim(2).broadcast(2, nd),
        op=nl.multiply,
        engine=engine,
    )
    xw, w = per_head(normed, weights, features, d)
    nisa.tensor_tensor(dst=xw, data1=xw, data2=w, op=nl.multiply, engine=engine)


def rope_heads(out, x, features, cos_t, sin_t, spec, constants, name, engine=None):
    """out (fp32 column tiles) = x·cos + rotate_half(x)·sin of fp32 column tiles x (features = n·D filling their
    tiles' partitions). engine: the element-wise ops' (None: VectorE; x·sin on GpSimd when it is VectorE, else on
    VectorE; an add from PSUM on VectorE whatever it is)."""
    engine = nisa.vector_engine if engine is None else engine
    other = nisa.gpsimd_engine if engine is nisa.vector_engine else nisa.vector_engine
    d = spec.head_dim
    parts, tiles = natural_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    x_cos = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_cos")
    x_sin = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_sin")
    for product, table, on in ((x_cos, cos_t, engine), (x_sin, sin_t, other)):
        xv, tv = per_head(x, table, features, d)
        nisa.tensor_tensor(dst=product.reshape_dim(1, (tiles // nd, nd)), data1=xv, data2=tv, op=nl.multiply, engine=on)
    if constants.rotate is not None:
        # rotate_half(x)·sin = rotate_half(x·sin): sin's halves are equal, so one matmul per ≤512 columns.
        per_bank = max(1, nl.tile_size.gemm_moving_fmax // r)
        for t0, tn in spans(tiles, per_bank):
            turned = nl.ndarray((parts, tn, r), dtype=nl.float32, buffer=nl.psum, name="rope_psum")
            nisa.nc_matmul(
                dst=turned, stationary=constants.rotate[0:parts, 0:parts], moving=x_sin[0:parts, t0 : t0 + tn, :]
            )
            nisa.tensor_tensor(
                dst=out[0:parts, t0 : t0 + tn, :],
                data1=x_cos[0:parts, t0 : t0 + tn, :],
                data2=turned,
                op=nl.add,
                engine=nisa.vector_engine,  # GpSimd cannot read PSUM
            )
    else:
        half = nd // 2
        xc = x_cos.reshape_dim(1, (tiles // nd, 2, half))
        xs = x_sin.reshape_dim(1, (tiles // nd, 2, half))
        o = out[0:parts, 0:tiles].reshape_dim(1, (tiles // nd, 2, half))
        nisa.tensor_tensor(dst=o[:, :, 0], data1=xc[:, :, 0], data2=xs[:, :, 1], op=nl.subtract, engine=engine)
        nisa.tensor_tensor(dst=o[:, :, 1], data1=xc[:, :, 1], data2=xs[:, :, 0], op=nl.add, engine=engine)


def load_rope_tables(cos, sin, qk_norm_weights, layer, spec, rows):
    """(cos, sin, norm weights) of layer `layer` as fp32 column tiles for norm_rope: cos/sin [128, nd, R] (table
    spec.layer_rope[layer]); weights [128, nd, 2] (q_norm, k_norm; 1 + w with norm_unit_offset) or None."""
    d = spec.head_dim
    _, batch, t, _ = cos.shape
    first = spec.layer_rope[layer] * batch * t * d
    cos_t = load_head_table(cos, first, rows, d, "rope_cos")
    sin_t = load_head_table(sin, first, rows, d, "rope_sin")
    weights = None
    if spec.qk_norm:
        weights = load_head_table(qk_norm_weights, layer * 2 * d, 2, d, "qk_norm_weights")
        if spec.norm_unit_offset:
            nisa.tensor_scalar(dst=weights, data=weights, op0=nl.add, operand0=1.0)
    return cos_t, sin_t, weights


def norm_rope(x, which, tables, spec, constants, engine=None):
    """fp32 column tiles of q (which = 0) or k (which = 1) after the optional head-dim RMSNorm and RoPE, from
    x (column tiles, any float dtype) and load_rope_tables' tables. engine: the element-wise ops' (None: VectorE;
    rms_norm_heads, rope_heads)."""
    d = spec.head_dim
    features = (spec.num_heads, spec.num_kv_heads)[which] * d
    cos_t, sin_t, weights = tables
    name = ("q_rope", "k_rope")[which]
    out = nl.ndarray((nl.tile_size.pmax, x.shape[1], x.shape[2]), dtype=nl.float32, buffer=nl.sbuf, name=name)
    normed = None
    if spec.qk_norm:
        normed = nl.ndarray(out.shape, dtype=nl.float32, buffer=nl.sbuf, name="qk_normed")
    # Whole tiles, then a ragged last tile (F not a multiple of 128) on its own partitions: the partitions past F
    # are never read, since the cross-partition matmuls would carry whatever they hold into every head.
    for t0, count, size in natural_runs(features):
        tiles_of = (slice(0, size), slice(t0, t0 + count))
        source = x[tiles_of]
        if normed is not None:
            w = weights[:, :, which : which + 1]
            rms_norm_heads(normed[tiles_of], source, size * count, w, spec, constants, engine)
            source = normed[tiles_of]
        rope_heads(out[tiles_of], source, size * count, cos_t, sin_t, spec, constants, name, engine)
    return out


def natural_runs(features):
    """[(first tile, tiles, partitions)] of natural column tiles of `features`: the whole tiles, then a ragged last
    one (the tiles.tile_runs of the natural layout)."""
    return tile_runs(feature_layout(features))


def load_write_index(write_index):
    """The [1, 1] int32 write slot in SBUF, for DMA offsets read at run time."""
    index = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="write_index")
    nisa.dma_copy(dst=index, src=write_index)
    return index


def cache_rows(columns, features, dtype, name, turn=0):
    """Rows [R, F] in `dtype` (the cache's) of column tiles [128, ceil(F/128), R] of F features (any float dtype):
    what write_rows writes. turn: natural_columns_to_rows' first eviction turn (1: ScalarE first)."""
    rows = nl.ndarray((columns.shape[2], features), dtype=dtype, buffer=nl.sbuf, name=name)
    natural_columns_to_rows(rows, columns, turn)
    return rows


def write_rows(rows, cache, layer, index):
    """cache[layer, b, w:w+T] = rows [R, kv_heads·D] (SBUF, the cache dtype) IN PLACE, w = index[0, 0]
    (load_write_index) read at run time: one DMA, since every row's T slots of kv_heads·D values are one
    contiguous run in HBM."""
    _, batch, s, kv, d = cache.shape
    r = rows.shape[0]
    slots = cache.ap(
        [[s * kv * d, batch], [kv * d, r // batch], [1, kv * d]],
        offset=layer * batch * s * kv * d,
        scalar_offset=index,
        indirect_dim=2,
    )
    nisa.dma_copy(dst=slots, src=rows)


def cache_spread_bytes(spec, batch):
    """The per-partition bytes `slot_blocks` spreads a cache window's slots to, for `spec`'s weights and B = batch
    rows (see FP8_CACHE_SPREAD_BYTES)."""
    if not spec.fp8_weights:
        return 2 * CACHE_RUN_BYTES
    return CACHE_RUN_BYTES if batch == 1 else FP8_CACHE_SPREAD_BYTES


def slot_blocks(s, slot_bytes, spread_bytes):
    """[(s0, np, q)]: cache blocks covering slots 0..S-1; block slot s0 + p·q + i lives at partition p < np,
    slot column i < q. A block holds at least q_min slots per partition (spread_bytes of them) and at most
    CACHE_BLOCK_BYTES: on all 128 partitions while the slots last, then on fewer partitions (a short cache: fewer
    DMA engines, but each at a high rate); what is left below q_min slots, one slot per partition."""
    pmax = nl.tile_size.pmax
    q_max = max(1, CACHE_BLOCK_BYTES // slot_bytes)
    q_min = min(q_max, -(-spread_bytes // slot_bytes))
    blocks, s0 = [], 0
    while s - s0 >= pmax * q_min:
        q = min(q_max, (s - s0) // pmax)
        blocks.append((s0, pmax, q))
        s0 += pmax * q
    if s - s0 >= q_min:
        np_ = (s - s0) // q_min
        blocks.append((s0, np_, q_min))
        s0 += np_ * q_min
    if s0 < s:
        blocks.append((s0, s - s0, 1))
    return blocks


def keys_by_dma_transpose(blocks, features, dtype):
    """Whether Kᵀ comes from transposing DMAs of the cache (2-byte dtypes, when they carry at least
    CACHE_RUN_BYTES per partition: kv·D/128 tiles × the window's slots) rather than PE transposes of K blocks."""
    _, kt = natural_tiles(features)
    slots = sum(np_ * q for _, np_, q in blocks)
    return dtype.itemsize == 2 and kt * slots * dtype.itemsize >= CACHE_RUN_BYTES


def score_chunks(blocks):
    """[(block, i0, ni, c0)]: ≤512-column pieces of the permuted slot order (block by block, slot column i
    major), c0 the first column; each piece holds whole slot columns of one block."""
    chunks, c0 = [], 0
    for index, (_, np_, q) in enumerate(blocks):
        per_chunk = max(1, nl.tile_size.gemm_moving_fmax // np_)
        for i0, ni in spans(q, per_chunk):
            chunks.append((index, i0, ni, c0))
            c0 += ni * np_
    return chunks


def kv_head_place(g, d):
    """(partition offset, first column tile) of kv head g's features in column tiles of kv_heads·D features."""
    pmax = nl.tile_size.pmax
    return (g * d) % pmax, (g * d) // pmax


def prepare_queries(q, spec, batch, dtype, constants):
    """qs [128, nd, B, kv, G, T] in `dtype`, times query_scaling: the query heads of kv head g of row b with
    their head dim on the same partitions as g's features in the keys' column tiles (partitions o..o+Dp-1,
    o = kv_head_place(g, D)[0]), so each (tile, b, g) is a stationary [Dp, G·T] contracting against Kᵀ."""
    d = spec.head_dim
    pmax = nl.tile_size.pmax
    dp, nd = head_tiles(d)
    heads, kv = spec.num_heads, spec.num_kv_heads
    g_size = heads // kv
    r = q.shape[2]
    t = r // batch
    qs = nl.ndarray((pmax, nd, batch, kv, g_size, t), dtype=dtype, buffer=nl.sbuf, name="attn_queries")
    if d >= pmax:
        source = q.reshape_dim(1, (kv, g_size, nd))
        for k in range(nd):
            nisa.activation(
                dst=qs[:, k].permute((0, 2, 3, 1, 4)),
                op=nl.copy,
                data=source[:, :, :, k, :].reshape_dim(3, (batch, t)),
                scale=float(spec.query_scaling),
            )
        return qs
    # Head h moves from partitions o_h.. of its tile to o_g..: a shift matmul whose output rows below o_g are 0.
    parts, _ = natural_tiles(heads * d)
    per_bank = max(1, fp32_per_psum_bank(r))
    for g in range(kv):
        o_g, _ = kv_head_place(g, d)
        by_head = qs[o_g : o_g + d, 0, :, g].permute((0, 2, 1, 3))  # [D, G, B, T]
        for j0, jn in spans(g_size, per_bank):
            moved = nl.ndarray((o_g + d, jn, r), dtype=nl.float32, buffer=nl.psum, name="queries_psum")
            for j in range(jn):
                h = g * g_size + j0 + j
                o_h, tile = (h * d) % pmax, h * d // pmax
                size = min(parts, heads * d - tile * pmax)  # a ragged last tile: only its features' partitions
                nisa.nc_matmul(
                    dst=moved[:, j, :],
                    moving=q[0:size, tile, 0:r],
                    stationary=constants.shift[0:size, pmax - o_g + o_h : pmax + o_h + d],
                )
            nisa.activation(
                dst=by_head[:, j0 : j0 + jn],
                op=nl.copy,
                data=moved[o_g : o_g + d].reshape_dim(2, (batch, t)),
                scale=float(spec.query_scaling),
            )
    return qs


def load_window_start(index, span, slots, tokens):
    """The first slot of the window of `span` slots a row's `tokens` queries can see (DecodeSpec.window_slots):
    the window ends at the last query's slot, write_index + T - 1, clamped into [0, S - span]; an SBUF [1, 1]
    int32 computed at run time from the write slot tile (load_write_index), or None when span = S (a static 0).
    On GpSimd, which attention leaves idle: the window's reads wait for no other engine's work."""
    if span == slots:
        return None
    start = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="window_start")
    gpsimd = nisa.gpsimd_engine
    nisa.tensor_scalar(
        dst=start, data=index, op0=nl.add, operand0=tokens - span, op1=nl.maximum, operand1=0, engine=gpsimd
    )
    nisa.tensor_scalar(dst=start, data=start, op0=nl.minimum, operand0=slots - span, engine=gpsimd)
    return start


def window_view(tensor, first, pattern, start, slot_axis):
    """The HBM view `pattern` of `tensor` from element `first`, moved by start (load_window_start) slots along
    axis slot_axis at run time, or static when start is None."""
    if start is None:
        return tensor.ap(pattern, offset=first)
    return tensor.ap(pattern, offset=first, scalar_offset=start, indirect_dim=slot_axis)


def load_mask_columns(mask_bias, mask, b, blocks, pieces, start, new=None):
    """fp32 [128, pieces, T]: element [p, n, t] = mask_bias[mask, b, t, start + slot] for the window slot at
    partition p of score piece n (slot s0 + p·q + i of piece (block, i)). The row's [T, window] bias is one DMA
    (T contiguous runs); the permutation is done by PE transposes of strided columns.

    With `new` (NewSlots: the window was read before this step's slots were written), those slots' biases in the
    window become MASKED_SCORE, and one more piece, the new tokens' (NewSlots.partitions of them), holds
    mask_bias[mask, b, t, w + t'] at partition b·T + t' (the other rows' tokens MASKED_SCORE)."""
    pmax = nl.tile_size.pmax
    _, batch, t, s = mask_bias.shape
    span = sum(np_ * q for _, np_, q in blocks)
    first = (mask * batch + b) * t * s
    rows = nl.ndarray((t, span), dtype=nl.float32, buffer=nl.sbuf, name="mask_rows")
    nisa.dma_copy(dst=rows, src=window_view(mask_bias, first, [[s, t], [1, span]], start, 3))
    columns = nl.ndarray(
        (pmax, len(pieces) + (new is not None), t), dtype=nl.float32, buffer=nl.sbuf, name="mask_columns"
    )
    if new is not None:
        # Slots [w, w + T) of the window: a DMA at the runtime offset, since only the index says where they are.
        hidden = rows.ap([[span, t], [1, t]], offset=0, scalar_offset=new.window_offset, indirect_dim=1)
        nisa.dma_copy(dst=hidden, src=new.masked[0:t, 0:t])
        piece = columns[:, len(pieces), :]
        nisa.memset(dst=piece[0 : new.partitions], value=MASKED_SCORE, engine=nisa.gpsimd_engine)
        own = mask_bias.ap([[1, t], [s, t]], offset=first, scalar_offset=new.index, indirect_dim=3)
        nisa.dma_copy(dst=piece[b * t : (b + 1) * t], src=own)
    per_bank = max(1, fp32_per_psum_bank(t))
    groups = []  # runs of pieces of one block, at most a PSUM bank each
    for n, (index, i) in enumerate(pieces):
        if groups and groups[-1][0] == index and len(groups[-1][1]) < per_bank:
            groups[-1][1].append((n, i))
        else:
            groups.append((index, [(n, i)]))
    for index, members in groups:
        s0, np_, q = blocks[index]
        first = members[0][0]
        transpose_to_tiles(
            columns[0:np_, first : first + len(members), :],
            [rows[0:t, s0 + i : s0 + np_ * q : q] for _, i in members],
            "mask_psum",
        )
    return columns


def turn_keys(k_blocks, blocks, chunks, features, dtype):
    """Kᵀ column tiles [min(F, 128), ceil(F/128), S] of all kv heads (F = kv_heads·D features) in score order
    (score_chunks) from cache blocks, by PE transposes; PSUM evictions alternate between VectorE and ScalarE."""
    kp, kt = natural_tiles(features)
    s = sum(np_ * q for _, np_, q in blocks)
    keys = nl.ndarray((kp, kt, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
    for n, (index, i0, ni, c0) in enumerate(chunks):
        np_ = blocks[index][1]
        width = ni * np_
        # The last tile is ragged when F is not a multiple of 128 (e.g. 3 kv heads of 64): its partitions past F
        # are left unwritten, and no score reads them (kv_head_place).
        for k, (f0, fs) in enumerate(spans(features, kp)):
            turned = nl.ndarray((fs, width), dtype=dtype, buffer=nl.psum, name="keysT_psum")
            for j in range(ni):
                nisa.nc_transpose(
                    dst=turned[0:fs, j * np_ : (j + 1) * np_],
                    data=k_blocks[index][0:np_, i0 + j, f0 : f0 + fs],
                )
            evict_alternating(keys[0:fs, k, c0 : c0 + width], turned, n + k)
    return keys


def cache_sbuf_bytes(k_cache, spec, tokens):
    """SBUF bytes per partition that `attend` holds for one row's cache tiles (Kᵀ column tiles and V blocks, plus
    the K blocks when they are turned on the PE, keys_by_dma_transpose), for a k_cache [L, B, S, kv_heads, D],
    T = tokens, at the window of any layer that needs the most."""
    _, batch, slots, kv, d = k_cache.shape
    itemsize = k_cache.dtype.itemsize
    _, kt = natural_tiles(kv * d)
    largest = 0
    for s in {spec.window_slots(mask, slots, tokens) for mask in spec.layer_mask}:
        blocks = slot_blocks(s, kv * d * itemsize, cache_spread_bytes(spec, batch))
        values = sum(q for _, _, q in blocks) * kv * d * itemsize
        k_blocks = 0 if keys_by_dma_transpose(blocks, kv * d, k_cache.dtype) else values
        largest = max(largest, kt * s * itemsize + values + k_blocks)
    return largest


def read_cache(k_cache, v_cache, layer, b, blocks, chunks, start):
    """(Kᵀ, V blocks) of row b's window (slots start + 0 .. start + span - 1, `blocks` over the span; start from
    load_window_start, None: slot 0): Kᵀ column tiles [min(F, 128), ceil(F/128), span] of all kv heads' F = kv·D
    features (keys_by_dma_transpose: slots in cache order, by a transposing DMA per block; else in score order, K
    blocks turned on the PE), V blocks [np, q, F] (window slot s0 + p·q + i at [p, i])."""
    _, batch, slots, kv, d = k_cache.shape
    dtype = k_cache.dtype
    f = kv * d
    kp, kt = natural_tiles(f)
    s = sum(np_ * q for _, np_, q in blocks)
    row = (layer * batch + b) * slots * f  # element of the row's slot 0
    keys, k_blocks, v_blocks = None, [], []
    for which in ("k", "v"):
        cache = k_cache if which == "k" else v_cache
        if which == "k" and keys_by_dma_transpose(blocks, f, dtype):
            keys = nl.ndarray((kp, kt, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
            full, rest = divmod(f, kp)
            for s0, np_, q in blocks:  # a DMA per block (whole slot rows: long contiguous runs)
                n = np_ * q
                if full:
                    source = window_view(cache, row + s0 * f, [[f, n], [kp, full], [1, kp]], start, 2)
                    nisa.dma_transpose(dst=keys[:, 0:full, s0 : s0 + n], src=source)
                if rest:  # a ragged last tile (F not a multiple of 128): its own DMA, not reading past a slot
                    source = window_view(cache, row + s0 * f + full * kp, [[f, n], [1, rest]], start, 2)
                    nisa.dma_transpose(dst=keys[0:rest, full, s0 : s0 + n], src=source)
            continue
        for s0, np_, q in blocks:
            tile = nl.ndarray((np_, q, f), dtype=dtype, buffer=nl.sbuf, name="cache_block")
            # Two DMAs per block where each still moves CACHE_RUN_BYTES per partition: work on the first slot
            # columns starts while the rest arrives.
            halves = 2 if q * f * dtype.itemsize >= 2 * CACHE_RUN_BYTES else 1
            for i0, ni in spans(q, -(-q // halves)):
                source = window_view(cache, row + (s0 + i0) * f, [[q * f, np_], [f, ni], [1, f]], start, 2)
                nisa.dma_copy(dst=tile[:, i0 : i0 + ni, :], src=source)
            (k_blocks if which == "k" else v_blocks).append(tile)
    if keys is None:
        keys = turn_keys(k_blocks, blocks, chunks, kv * d, dtype)
    return keys, v_blocks


@dataclasses.dataclass(frozen=True)
class CacheWindow:
    """How `attend` reads one layer's window of `span` cache slots (all of them without a sliding window).

    blocks: slot_blocks' [(s0, np, q)]; chunks: score_chunks' pieces of the permuted slot order; pieces: one score
    piece per slot column of a block, (block, i) in score order ([np ≤ 128 slots on partitions, G·T]);
    keys_by_dma: whether Kᵀ comes from transposing DMAs (keys_by_dma_transpose); key_columns: per piece, its Kᵀ
    columns (slots s0 + i, s0 + i + q, ... in cache order by DMA, or the piece's np consecutive columns in score
    order by PE transposes).
    """

    span: int
    blocks: tuple
    chunks: tuple
    pieces: tuple
    keys_by_dma: bool
    key_columns: tuple


def plan_window(span, features, dtype, spread_bytes, blocks=None):
    """The CacheWindow of `span` slots of a cache whose slots hold `features` values (kv_heads·D) in `dtype`,
    blocks spread to spread_bytes per partition (cache_spread_bytes), or `blocks` given (a paged cache's, whose
    gathered blocks are turned on the PE)."""
    paged = blocks is not None
    blocks = blocks if paged else slot_blocks(span, features * dtype.itemsize, spread_bytes)
    chunks = score_chunks(blocks)
    pieces = [(index, i) for index, (_, _, q) in enumerate(blocks) for i in range(q)]
    keys_by_dma = not paged and keys_by_dma_transpose(blocks, features, dtype)
    key_columns = []
    for index, (s0, np_, q) in enumerate(blocks):
        column0 = next(c0 for (n, _, _, c0) in chunks if n == index)
        for i in range(q):
            key_columns.append(
                slice(s0 + i, s0 + np_ * q, q) if keys_by_dma else slice(column0 + i * np_, column0 + (i + 1) * np_)
            )
    return CacheWindow(span, tuple(blocks), tuple(chunks), tuple(pieces), keys_by_dma, tuple(key_columns))


@dataclasses.dataclass(frozen=True)
class RowCache:
    """One row's window on chip: Kᵀ column tiles (read_cache), V blocks and the mask columns (load_mask_columns)."""

    keys: object
    values: list
    mask: object


@dataclasses.dataclass(frozen=True)
class NewSlots:
    """This step's tokens for a window read before their slots [w, w + T) were written (WindowReader's new_slots):
    one more score piece of `partitions` = R = B·T, row b's T tokens on partitions b·T .. b·T + T - 1 (for row b,
    load_mask_columns masks the other rows' there), with keys (Kᵀ column tiles [min(F, 128), ceil(F/128), R]) and
    values (rows [R, F]) from chip in the cache dtype, given at attend; the window's stale copies of those slots
    are masked out. index: the write slot tile (load_write_index); window_offset: w less the window's first slot
    (SBUF [1, 1] int32); masked: fp32 [T, T] of MASKED_SCORE, what those copies' mask biases become."""

    index: object
    window_offset: object
    masked: object
    partitions: int
    keys: object = None
    values: object = None

    @classmethod
    def of(cls, index, start, rows, tokens):
        """NewSlots of the write slot tile `index`, the window's first slot `start` (load_window_start: None for
        slot 0) and R = rows, T = tokens. On GpSimd, which nothing else keeps busy here: issued before the
        projections, these wait for none of their work."""
        offset = index
        if start is not None:
            offset = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="window_write_offset")
            nisa.tensor_tensor(dst=offset, data1=index, data2=start, op=nl.subtract, engine=nisa.gpsimd_engine)
        masked = nl.ndarray((tokens, tokens), dtype=nl.float32, buffer=nl.sbuf, name="masked_slots")
        nisa.memset(dst=masked, value=MASKED_SCORE, engine=nisa.gpsimd_engine)
        return cls(index, offset, masked, rows)


@dataclasses.dataclass(frozen=True)
class AttentionOutput:
    """Where softmax_pass writes: attn, column tiles [128, ceil(heads·D/128), R] (written directly when D >= 128),
    and by_head [D, heads, R] fp32 (D < 128: each head on partitions 0..D-1, placed into attn by place_heads)."""

    attn: object
    by_head: object


def _piece_runs(window, new, per_bank):
    """[(partitions, first piece, pieces)]: runs of score pieces of one block, at most per_bank of them (one PSUM
    accumulator each), then the new tokens' piece (NewSlots) when there is one."""
    runs, piece0 = [], 0
    for _, np_, q in window.blocks:
        runs.extend((np_, piece0 + i0, ni) for i0, ni in spans(q, per_bank))
        piece0 += q
    if new is not None:
        runs.append((new.partitions, piece0, 1))
    return runs


def _piece_keys(n, b, rows, window, new):
    """(Kᵀ column tiles, their columns) of score piece n of row b: the window's, or the new tokens' piece."""
    if n < len(window.pieces):
        return rows[b].keys, window.key_columns[n]
    return new.keys, slice(0, new.partitions)


def _piece_values(n, b, rows, window, new):
    """V [np, F] of score piece n of row b (its slots on the partitions): the window's, or the new tokens'."""
    if n < len(window.pieces):
        index, i = window.pieces[n]
        return rows[b].values[index][0 : window.blocks[index][1], i, :]
    return new.values


def _masked_scores(units, qs, rows, window, spec, new):
    """scoresᵀ fp32 [128, pieces, units, G·T] of the (row b, kv head g) `units`: Kᵀ [D, np] stationary × q [D, G·T]
    moving per piece, accumulated over the head dim's tiles, softcapped (tanh) when the spec says so, plus the
    mask bias; the window's pieces, then the new tokens' (NewSlots, or None). Partitions a ragged piece leaves
    empty hold MASKED_SCORE."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    dp, nd = head_tiles(d)
    g_size = spec.num_heads // spec.num_kv_heads
    t = rows[units[0][0]].mask.shape[2]
    gt = g_size * t
    row_ids = sorted({b for b, _ in units})
    row_units = {b: [u for u, (ub, _) in enumerate(units) if ub == b] for b in row_ids}  # consecutive per row
    runs = _piece_runs(window, new, max(1, fp32_per_psum_bank(len(units) * gt)))
    count = len(window.pieces) + (new is not None)
    scores = nl.ndarray((pmax, count, len(units), gt), dtype=nl.float32, buffer=nl.sbuf, name="scoresT")
    for np_, piece0, ni in runs:
        if np_ < pmax:  # partitions a ragged piece leaves empty must not win the max
            nisa.memset(dst=scores[:, piece0 : piece0 + ni], value=MASKED_SCORE)
        acc = nl.ndarray((np_, ni, len(units), gt), dtype=nl.float32, buffer=nl.psum, name="scoresT_psum")
        for k in range(nd):
            for j in range(ni):
                for u, (b, g) in enumerate(units):
                    keys, slots = _piece_keys(piece0 + j, b, rows, window, new)
                    o_g, tile_g = kv_head_place(g, d)
                    nisa.nc_matmul(
                        dst=acc[0:np_, j, u],
                        moving=qs[o_g : o_g + dp, k, b, g],
                        accumulate=k > 0,
                        stationary=keys[o_g : o_g + dp, tile_g + k, slots],
                    )
        for b in row_ids:
            u0, un = row_units[b][0], len(row_units[b])
            out = scores[0:np_, piece0 : piece0 + ni, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)
            bias = rows[b].mask[0:np_, piece0 : piece0 + ni, :].expand_dim(2).broadcast(2, un * g_size)
            logits = acc[:, :, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)  # [np, ni, un·G, T]
            if spec.attn_logit_softcap:
                cap = float(spec.attn_logit_softcap)
                nisa.activation(dst=out, op=nl.tanh, data=logits, scale=1.0 / cap)
                nisa.scalar_tensor_tensor(dst=out, data=out, op0=nl.multiply, operand0=cap, op1=nl.add, operand1=bias)
            else:
                nisa.tensor_tensor(dst=out, data1=logits, data2=bias, op=nl.add)
        del acc
    return scores


def _softmax_weights(units, qs, rows, window, spec, constants, new):
    """(weights [128, pieces, columns] in the cache dtype, scale [Dp, columns] fp32): exp(score - column max) of
    _masked_scores' scores (the new tokens' piece last when `new` is given), and 1 / the column sums of the
    weights (as rounded for the matmul) on every output partition. The column max: per partition over pieces, then
    across partitions by a PE transpose and a free-axis max, spread back by onesᵀ·diag(-max); the column sums by
    onesᵀ·(per-partition sums)."""
    pmax = nl.tile_size.pmax
    dp, _ = head_tiles(spec.head_dim)
    dtype = rows[units[0][0]].keys.dtype
    scores = _masked_scores(units, qs, rows, window, spec, new)
    flat = scores.flatten_dims(2, 3)  # [128, pieces, columns]
    pieces, columns = flat.shape[1], flat.shape[2]
    column_max = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.sbuf, name="scores_partition_max")
    nisa.tensor_reduce(dst=column_max, op=nl.maximum, data=flat.permute((0, 2, 1)), axis=2)
    turned = nl.ndarray((columns, pmax), dtype=nl.float32, buffer=nl.psum, name="scores_max_psum")
    nisa.nc_transpose(dst=turned, data=column_max)
    neg_max = nl.ndarray((columns, 1), dtype=nl.float32, buffer=nl.sbuf, name="scores_neg_max")
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=turned, axis=1, negate=True)
    del turned
    # PSUM [128, columns]: -max of each column on every partition.
    shift = spread_across_partitions(neg_max, pmax, constants.ones, constants.identity)
    nisa.tensor_tensor(dst=flat, data1=flat, data2=shift.expand_dim(1).broadcast(1, pieces), op=nl.add)
    del shift
    weights = nl.ndarray((pmax, pieces, columns), dtype=dtype, buffer=nl.sbuf, name="weightsT")
    nisa.activation(dst=weights, op=nl.exp, data=flat)
    del scores, flat
    partial = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.sbuf, name="weights_partition_sum")
    nisa.tensor_reduce(dst=partial, op=nl.add, data=weights.permute((0, 2, 1)), axis=2)
    total = nl.ndarray((dp, columns), dtype=nl.float32, buffer=nl.psum, name="weights_sum_psum")
    nisa.nc_matmul(dst=total, stationary=constants.ones[0:pmax, 0:dp], moving=partial)
    scale = nl.ndarray((dp, columns), dtype=nl.float32, buffer=nl.sbuf, name="weights_recip")
    nisa.reciprocal(dst=scale, data=total)
    del total
    return weights, scale


def _weighted_values(units, weights, scale, rows, window, out, spec, new):
    """out ← weights·V / column sums of each unit: attnᵀ [Dp, G·T] = V [np, Dp] stationary × weights moving,
    accumulated over the pieces (the new tokens' last, when `new` is given), per tile of the head dim; row b's
    columns of kv head g's query heads."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    dp, nd = head_tiles(d)
    kv = spec.num_kv_heads
    g_size = spec.num_heads // kv
    t = rows[units[0][0]].mask.shape[2]
    gt = g_size * t
    nq_tiles = out.attn.shape[1]
    for u, (b, g) in enumerate(units):
        mine = slice(u * gt, (u + 1) * gt)
        for k in range(nd):
            acc = nl.ndarray((dp, gt), dtype=nl.float32, buffer=nl.psum, name="attnT_psum")
            f0 = g * d + k * pmax
            for n in range(weights.shape[1]):
                values = _piece_values(n, b, rows, window, new)
                np_ = values.shape[0]
                nisa.nc_matmul(
                    dst=acc,
                    stationary=values[0:np_, f0 : f0 + dp],
                    moving=weights[0:np_, n, mine],
                    accumulate=n > 0,
                )
            if out.by_head is None:
                heads = out.attn.reshape_dim(1, (kv, g_size, nq_tiles // (kv * g_size)))
                dst = heads[:, g, :, k, b * t : (b + 1) * t]
            else:
                dst = out.by_head[:, g * g_size : (g + 1) * g_size, b * t : (b + 1) * t]
            nisa.tensor_tensor(dst=dst, data1=acc, data2=scale[:, mine], op=nl.multiply)
            del acc


def softmax_pass(units, qs, rows, window, out, spec, constants, new=None):
    """Scores, softmax and weights·V of several (row b, kv head g) `units` together (their G·T query columns side
    by side, at most 128) into `out` (AttentionOutput). qs: prepare_queries' queries; rows: {b: RowCache} of the
    units' rows; window: the layer's CacheWindow; new: NewSlots when the window was read before this step's slots
    were written (their k and v then come from chip), else None."""
    weights, scale = _softmax_weights(units, qs, rows, window, spec, constants, new)
    _weighted_values(units, weights, scale, rows, window, out, spec, new)


def place_heads(out, spec, constants):
    """out.attn ← out.by_head (D < 128): head h's D outputs move from partitions 0..D-1 to (h·D) mod 128 of tile
    h·D / 128, by shift matmuls."""
    pmax = nl.tile_size.pmax
    d, heads = spec.head_dim, spec.num_heads
    q_parts, q_tiles = natural_tiles(heads * d)
    r = out.by_head.shape[2]
    heads_per_tile = pmax // d
    for i in range(q_tiles):
        placed = nl.ndarray((q_parts, r), dtype=nl.float32, buffer=nl.psum, name="attn_place_psum")
        members = range(i * heads_per_tile, min(heads, (i + 1) * heads_per_tile))
        for n, h in enumerate(members):
            offset = (h * d) % pmax
            nisa.nc_matmul(
                dst=placed,
                stationary=constants.shift[0:d, pmax - offset : pmax - offset + q_parts],
                moving=out.by_head[0:d, h, 0:r],
                accumulate=n > 0,
            )
        nisa.tensor_copy(dst=out.attn[0:q_parts, i, :], src=placed)


class WindowReader:
    """One layer's cache window as `attend` reads it, row by row: the plan (CacheWindow) of the slots its mask can
    make visible (all S, or with spec.mask_windows the window of spec.window_slots(...) slots ending at the last
    query's slot), the window's first slot at run time (load_window_start, from the write slot tile `index`), and
    with new_slots the masking of this step's slots for a window read before they are written (NewSlots).

    Nothing here waits for this step's q, k or v: a kernel opens the reader and loads row 0 (`load`) before its
    projections, so the row's DMAs, PE transposes and evictions fill the engines' wait for the norm and the
    projections instead of following them; later rows load as attend reaches them (their reads overlap the
    previous row's softmax).
    """

    def __init__(self, k_cache, v_cache, mask_bias, layer, index, spec, rows, *, new_slots):
        _, batch, s, kv, d = k_cache.shape
        t = rows // batch
        self.k_cache, self.v_cache, self.mask_bias = k_cache, v_cache, mask_bias
        self.layer, self.index, self.spec, self.batch = layer, index, spec, batch
        self.mask = spec.layer_mask[layer]
        spread = cache_spread_bytes(spec, batch)
        self.plan = plan_window(spec.window_slots(self.mask, s, t), kv * d, k_cache.dtype, spread)
        self.start = load_window_start(index, self.plan.span, s, t)
        self.new = NewSlots.of(index, self.start, rows, t) if new_slots else None
        self._loaded = {}

    def load(self, b):
        """Issue row b's reads now: its mask columns, Kᵀ and V blocks (`row` hands them out)."""
        plan = self.plan
        visible = load_mask_columns(self.mask_bias, self.mask, b, plan.blocks, plan.pieces, self.start, self.new)
        keys, values = read_cache(self.k_cache, self.v_cache, self.layer, b, plan.blocks, plan.chunks, self.start)
        self._loaded[b] = RowCache(keys, values, visible)

    def row(self, b):
        """Row b's RowCache, loaded now unless `load` was called for it."""
        if b not in self._loaded:
            self.load(b)
        return self._loaded.pop(b)

    def write(self, rows, cache, layer):
        """This step's rows [R, kv_heads·D] (SBUF, the cache dtype) into `cache` at the write slot (write_rows)."""
        write_rows(rows, cache, layer, self.index)


@dataclasses.dataclass(frozen=True)
class Prefetched:
    """What attention() takes of one layer that does not depend on this step's projections (`prefetch`): the RoPE
    tables and head-norm weights (load_rope_tables) and the cache window's reader (this step's slots masked, their
    k and v from chip) with row 0 loaded."""

    tables: tuple
    reader: WindowReader


def prefetch(k_cache, v_cache, layer, write_index, cos, sin, mask_bias, qk_norm_weights, spec, rows, paged=None):
    """Prefetched for attention() of layer `layer` (operands as attention's, rows: R = B·T): what a kernel issues
    before this step's projections, so that its loads, PE transposes and evictions fill the engines' wait for the
    norm and the projections instead of following them. paged: a paged spec's nki_kernels.decode.paged.PagedRows
    (write_index then None), whose reader reads each row's window through its block table."""
    if paged is None:
        index = load_write_index(write_index)
        reader = WindowReader(k_cache, v_cache, mask_bias, layer, index, spec, rows, new_slots=True)
    else:
        reader = paged.reader(k_cache, v_cache, mask_bias, layer, spec, rows)
    reader.load(0)
    return Prefetched(load_rope_tables(cos, sin, qk_norm_weights, layer, spec, rows), reader)


def attend(qT, reader, constants, *, new_kv=None):
    """attnT column tiles [128, ceil(heads·D/128), R] in the cache dtype: softmax(q·Kᵀ·scaling (softcapped) +
    mask)·V of each row's T queries over the window of the cache that `reader` (WindowReader) reads. qT: fp32
    column tiles of the rotated (and normed) queries.

    new_kv: with a reader of new_slots (the cache need not hold this step's k and v yet), (Kᵀ column tiles
    [min(F, 128), ceil(F/128), R], rows [R, F]) of them in the cache dtype (F = kv·D): they enter as one more score
    piece, their slots' copies in the window masked out, so the cache reads need not wait for this step's
    writes. None with a reader whose cache already holds them at [w, w + T)."""
    if (reader.new is None) != (new_kv is None):
        raise ValueError("attend: new_kv must be given exactly when the reader masks this step's slots (new_slots)")
    spec = reader.spec
    pmax = nl.tile_size.pmax
    batch, (kv, d) = reader.batch, reader.k_cache.shape[3:]
    dtype = reader.k_cache.dtype
    r = qT.shape[2]
    gt = spec.num_heads // kv * (r // batch)
    new = None if new_kv is None else dataclasses.replace(reader.new, keys=new_kv[0], values=new_kv[1])
    qs = prepare_queries(qT, spec, batch, dtype, constants)
    dp, _ = head_tiles(d)
    _, q_tiles = natural_tiles(spec.num_heads * d)
    out = AttentionOutput(
        nl.ndarray((pmax, q_tiles, r), dtype=dtype, buffer=nl.sbuf, name="attnT"),
        nl.ndarray((dp, spec.num_heads, r), dtype=nl.float32, buffer=nl.sbuf, name="attn_by_head")
        if d < pmax
        else None,
    )
    # Row by row; one softmax pass for as many of the row's kv heads as fit 128 query columns.
    for b in range(batch):
        rows = {b: reader.row(b)}
        for g0, gn in spans(kv, max(1, pmax // gt)):
            softmax_pass([(b, g) for g in range(g0, g0 + gn)], qs, rows, reader.plan, out, spec, constants, new)
        del rows
    if out.by_head is not None:
        place_heads(out, spec, constants)
    return out.attn


def check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer):
    """attention()'s arguments: its HBM operands as the contract gives them (contract.check_named, B and S from
    k_cache, T from cos, the model's dtype k_cache's; a paged spec's pools and S from mask_bias, their block
    table checked by the kernel's contract.check), and what attention itself needs: a head dim it can tile
    (check_head_dim), a static layer, B·T rows and G·T queries per kv head within one partition tile, and qT, kT,
    vT natural column tiles of B·T rows."""
    pmax = nl.tile_size.pmax
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"attention: spec: got {type(spec).__name__}, expected a nki_kernels.decode.DecodeSpec")
    check_head_dim(spec.head_dim, spec.num_kv_heads)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise ValueError(f"attention: layer: got {layer!r}, expected a static int in [0, {spec.num_layers})")
    if len(k_cache.shape) != 5 or len(cos.shape) != 4:
        raise ValueError(
            f"attention: k_cache {tuple(k_cache.shape)}, cos {tuple(cos.shape)}: expected [L, B, S, kv_heads, D] "
            f"and [NR, B, T, D]"
        )
    _, batch, slots, _, _ = k_cache.shape
    t = cos.shape[2]
    hbm = dict(
        k_cache=k_cache,
        v_cache=v_cache,
        write_index=write_index,
        cos=cos,
        sin=sin,
        mask_bias=mask_bias,
        qk_norms=qk_norm_weights,
    )
    if spec.paged:
        batch, slots = cos.shape[1], mask_bias.shape[3]
        for name in ("k_cache", "v_cache", "write_index"):
            del hbm[name]
    contract.check_named(spec, hbm, "attention", batch=batch, tokens=t, slots=slots, model_dtype=k_cache.dtype)
    r = batch * t
    g_size = spec.num_heads // spec.num_kv_heads
    if r > pmax or g_size * t > pmax:
        raise ValueError(
            f"attention: B·T = {r} rows and G·T = {g_size * t} queries per kv head must each be at most {pmax}"
        )
    d = spec.head_dim
    for name, x, features in (
        ("qT", qT, spec.num_heads * d),
        ("kT", kT, spec.num_kv_heads * d),
        ("vT", vT, spec.num_kv_heads * d),
    ):
        if x is None:
            continue
        expected = (pmax, -(-features // pmax), r)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"attention: {name}: got shape {tuple(x.shape)}, expected column tiles {list(expected)} "
                f"({features} features, B·T = {r} rows)"
            )


def attention(
    qT,
    kT,
    vT,
    k_cache,
    v_cache,
    layer,
    write_index,
    cos,
    sin,
    mask_bias,
    qk_norm_weights,
    spec,
    *,
    constants=None,
    prefetched=None,
    writes=None,
    paged=None,
):
    """One layer's attention at decode, inside a kernel; returns attnT column tiles [128, ceil(heads·D/128), R]
    in the cache dtype (ready as the o projection's moving operand).

    qT [128, ceil(heads·D/128), R], kT and vT [128, ceil(kv·D/128), R]: SBUF column tiles (any float dtype) of
    this step's projections. layer: static int. Other operands in HBM as the module docstring says. Attends over
    the slots its mask can make visible (attend) with this step's k (normed, rotated) and v from chip, then writes
    them into the caches at [write_index, write_index + T) IN PLACE. constants: AttentionConstants(spec), built
    once per kernel when attention runs for several layers. prefetched: prefetch(...) of this layer, issued before
    the projections (None: issued here). writes: None (the cache writes are issued here, last), or a list that
    receives them as functions to call later (`write_rows` at a runtime slot orders every later read of the cache
    after it, so a kernel that reads another layer's window next issues them after that read). paged: a paged
    spec's nki_kernels.decode.paged.PagedRows (write_index None): the caches are pools, each row written at its
    own slot and its window read through its block table.
    """
    check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer)
    constants = constants or AttentionConstants(spec)
    rows = qT.shape[2]
    early = prefetched or prefetch(
        k_cache, v_cache, layer, write_index, cos, sin, mask_bias, qk_norm_weights, spec, rows, paged
    )
    features = spec.num_kv_heads * spec.head_dim
    kp, _ = natural_tiles(features)
    # k's element-wise chain on GpSimd, q's on VectorE: the two run side by side, not one after the other.
    k_rotated = norm_rope(kT, 1, early.tables, spec, constants, nisa.gpsimd_engine)
    # The new piece's Kᵀ, cast on GpSimd: VectorE carries the norm and RoPE chains.
    keys = nl.ndarray((kp, k_rotated.shape[1], rows), dtype=k_cache.dtype, buffer=nl.sbuf, name="new_keysT")
    for t0, count, size in natural_runs(features):
        tiles_of = (slice(0, size), slice(t0, t0 + count))
        nisa.tensor_copy(dst=keys[tiles_of], src=k_rotated[tiles_of], engine=nisa.gpsimd_engine)
    q_rotated = norm_rope(qT, 0, early.tables, spec, constants)
    values = cache_rows(vT, features, v_cache.dtype, "new_value_rows")
    attn = attend(q_rotated, early.reader, constants, new_kv=(keys, values))
    # Written last (or later, by the caller): the window was read without waiting for these writes (the same HBM
    # bytes). The k rows evict on ScalarE first: VectorE carries the o projection's inputs next.
    reader = early.reader
    key_rows = cache_rows(k_rotated, features, k_cache.dtype, "new_key_rows", turn=1)
    issue = [lambda: reader.write(values, v_cache, layer), lambda: reader.write(key_rows, k_cache, layer)]
    if writes is None:
        for write in issue:
            write()
    else:
        writes += issue
    return attn


# -- per-op kernels: HBM in, HBM out --------------------------------------------------------


def _rows_count(x, name, features):
    if len(x.shape) != 3 or x.shape[2] != features:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected rows [B, T, {features}]")
    return x.shape[0] * x.shape[1]


@nki.jit
def rope_kernel(q, k, cos, sin, qk_norms, *, layer, spec):
    """q/k head-dim RMSNorm and RoPE as one kernel.

    Dimensions: B, T (B·T <= 128), heads and kv_heads of D features, NR RoPE tables, L layers.
    Args:
        q: [B, T, heads·D] and k: [B, T, kv_heads·D] rows in HBM (any float dtype).
        cos, sin: [NR, B, T, D] float32 in HBM (layer `layer` reads table spec.layer_rope[layer]).
        qk_norms: [L, 2, D] in HBM (q_norm, k_norm), or None without spec.qk_norm.
        layer: static int. spec: DecodeSpec (static).
    Returns:
        (q', k'): new [B, T, heads·D] / [B, T, kv_heads·D] in HBM, in q's / k's dtype.
    """
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    _rows_count(k, "k", spec.num_kv_heads * d)
    constants = AttentionConstants(spec)
    qT, kT = load_natural_columns(q, name="q_columns"), load_natural_columns(k, name="k_columns")
    tables = load_rope_tables(cos, sin, qk_norms, layer, spec, qT.shape[2])
    q_out, k_out = norm_rope(qT, 0, tables, spec, constants), norm_rope(kT, 1, tables, spec, constants)
    q_rows = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm, name="q_rope")
    k_rows = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm, name="k_rope")
    store_natural_columns(q_rows, q_out)
    store_natural_columns(k_rows, k_out)
    return q_rows, k_rows


@nki.jit
def cache_write_kernel(k, v, k_cache, v_cache, write_index, *, layer):
    """The KV-cache write as one kernel: k_cache[layer, b, w:w+T] = k[b], v_cache[layer, b, w:w+T] = v[b] IN PLACE.

    Dimensions: B, T (B·T <= 128), S slots, kv_heads of D features, L layers.
    Args:
        k, v: [B, T, kv_heads·D] rows in HBM (any float dtype; cast to the cache's).
        k_cache, v_cache: [L, B, S, kv_heads, D] in HBM.
        write_index: [1, 1] int32 in HBM, w (read at run time). layer: static int.
    Returns:
        (k_cache, v_cache), written in place.
    """
    features = k_cache.shape[3] * k_cache.shape[4]
    _rows_count(k, "k", features)
    _rows_count(v, "v", features)
    index = load_write_index(write_index)
    write_rows(
        cache_rows(load_natural_columns(k, name="k_columns"), features, k_cache.dtype, "k_rows"), k_cache, layer, index
    )
    write_rows(
        cache_rows(load_natural_columns(v, name="v_columns"), features, v_cache.dtype, "v_rows"), v_cache, layer, index
    )
    return k_cache, v_cache


@nki.jit
def attention_kernel(q, k_cache, v_cache, write_index, mask_bias, *, layer, spec):
    """Attention over the cache as one kernel: softmax(q·Kᵀ·scaling (softcapped) + mask)·V, as attend().

    Dimensions: B, T (B·T <= 128), S slots, heads and kv_heads of D features, NM mask tables, L layers.
    Args:
        q: [B, T, heads·D] rotated (and normed) query rows in HBM (any float dtype).
        k_cache, v_cache: [L, B, S, kv_heads, D] in HBM (this step's slots already written).
        write_index: [1, 1] int32 in HBM (this step's first slot: places a windowed mask's slots).
        mask_bias: [NM, B, T, S] float32 in HBM (layer `layer` reads table spec.layer_mask[layer]).
        layer: static int. spec: DecodeSpec (static).
    Returns:
        attn [B, T, heads·D] in HBM, in the cache dtype.
    """
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    constants = AttentionConstants(spec)
    qT = load_natural_columns(q, dtype=nl.float32, name="q_columns")
    index = load_write_index(write_index)
    reader = WindowReader(k_cache, v_cache, mask_bias, layer, index, spec, qT.shape[2], new_slots=False)
    attn = attend(qT, reader, constants)
    out = nl.ndarray(q.shape, dtype=k_cache.dtype, buffer=nl.shared_hbm, name="attn")
    store_natural_columns(out, attn)
    return out
