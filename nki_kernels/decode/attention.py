"""Decode-step attention in NKI: q/k head-dim RMSNorm, RoPE, the in-place KV-cache write, GQA over the cache.

Layouts: R = B·T rows (row r = b·T + t), features on partitions in natural column tiles (nki_kernels.decode.tiles):
a tensor of F features is SBUF [128, ceil(F/128), R] with element [p, i, r] = feature i·128 + p of row r. q has heads·D
features (feature h·D + d is head h's component d), k and v kv_heads·D; kv head g serves query heads g·G ..
g·G + G - 1 (G = heads / kv_heads). The head dim D must divide 128 (several heads per tile) or be a multiple of
256 (a head spans whole tiles and the rotate-half halves are whole tiles).

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
- v, then the rotated k, are turned into rows on the PE and written with one DMA per cache at slots
  [write_index, write_index + T) of every row (each slot's kv_heads·D values are contiguous in HBM). The cache
  reads come after the writes (the same HBM bytes), V's first since its write goes out first.
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

Entry points: `attention` (a subroutine for fused kernels; its pieces norm_rope, write_rows and attend are
usable alone) and, for the per-op compositions with rows [B, T, F] in HBM between kernels, `rope_kernel`,
`cache_write_kernel` and `attention_kernel`.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode import contract
from nki_kernels.decode.contract import DecodeSpec
from nki_kernels.decode.tiles import (
    evict_alternating,
    fp32_per_psum_bank,
    load_natural_columns,
    natural_columns_to_rows,
    natural_tiles,
    rows_to_natural_columns,
    spread_across_partitions,
    store_natural_columns,
    transpose_to_tiles,
)
from nki_kernels.svd_matmul import spans

# Per-partition bytes of one cache block (K or V, one DMA each): long contiguous runs, a few blocks per row.
CACHE_BLOCK_BYTES = 16384
# Per-partition bytes each cache DMA should reach at least: the DMA efficiency curve is nearly flat from 4 KiB
# on (nki-dma-bandwidth-guide), while 512 B (one Gemma 3 slot per partition) runs at a fifth of the peak.
CACHE_RUN_BYTES = 4096
# Fewest bytes per partition a cache block spreads its slots to before it takes fewer partitions, with fp8 weights:
# their layers leave the DMA engines idle part of the time, and attention waits for the cache, so its latency
# counts more than its bytes: a window on all 128 partitions (16 DMA engines) at 2 KiB each (81% of the peak rate
# per engine) arrives sooner than on 32 partitions at 8 KiB (4 engines at 97%). With 2-byte weights the DMA engines
# are the bottleneck throughout and the cache keeps the efficient runs of two CACHE_RUN_BYTES DMAs.
FP8_CACHE_SPREAD_BYTES = 2048
# Fills the partitions a ragged score piece leaves empty: below any real score, exp() of it is 0.
MASKED_SCORE = -3.0e38


def check_head_dim(head_dim):
    if head_dim % 2 or not (128 % head_dim == 0 or head_dim % 256 == 0):
        raise ValueError(
            f"DecodeSpec.head_dim: got {head_dim}, expected an even divisor of 128 or a multiple of "
            f"256 (heads must not straddle partition tiles; rotate-half halves must be whole tiles)"
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
        check_head_dim(spec.head_dim)
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


def rms_norm_heads(x, features, weights, spec, constants):
    """fp32 column tiles of x (column tiles of `features` = n·D features, any float dtype) normalized over each
    head's D features: x·rsqrt(mean(x²) + eps)·w; weights fp32 [128, nd, 1] in the load_head_table layout
    (already 1 + w)."""
    d = spec.head_dim
    parts, tiles = natural_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    groups = tiles // nd  # one mean per head (D >= 256) or per tile (a block per head, D <= 128)
    squares = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_squares")
    nisa.activation(dst=squares, op=nl.square, data=x[0:parts, 0:tiles, :])
    rstd = nl.ndarray((parts, groups, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_rstd")
    # Per-tile partial means on every partition of the head (one matmul per PSUM bank of tiles).
    per_bank = max(nd, (fp32_per_psum_bank(r)) // nd * nd)
    for t0, tn in spans(tiles, per_bank):
        mean = nl.ndarray((parts, tn, r), dtype=nl.float32, buffer=nl.psum, name="qk_norm_mean_psum")
        for c0, cn in spans(tn, max(1, nl.tile_size.gemm_moving_fmax // r)):
            nisa.nc_matmul(
                dst=mean[0:parts, c0 : c0 + cn, :],
                stationary=constants.head_mean[0:parts, 0:parts],
                moving=squares[0:parts, t0 + c0 : t0 + c0 + cn, :],
            )
        out = rstd[0:parts, t0 // nd : (t0 + tn) // nd, :]
        if nd > 1:  # a head's mean is the sum of its tiles' partial means
            total = nl.ndarray((parts, tn // nd, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_mean")
            nisa.tensor_reduce(
                dst=total, op=nl.add, data=mean.reshape_dim(1, (tn // nd, nd)).permute((0, 1, 3, 2)), axis=3
            )
            nisa.activation(dst=out, op=nl.rsqrt, data=total, bias=constants.eps[0:parts])
        else:
            nisa.activation(dst=out, op=nl.rsqrt, data=mean, bias=constants.eps[0:parts])
    normed = nl.ndarray((nl.tile_size.pmax, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_normed")
    view = normed[0:parts].reshape_dim(1, (groups, nd))
    nisa.tensor_tensor(
        dst=view,
        data1=x[0:parts, 0:tiles, :].reshape_dim(1, (groups, nd)),
        data2=rstd.expand_dim(2).broadcast(2, nd),
        op=nl.multiply,
    )
    xw, w = per_head(normed, weights, features, d)
    nisa.tensor_tensor(dst=xw, data1=xw, data2=w, op=nl.multiply)
    return normed


def rope_heads(x, features, cos_t, sin_t, spec, constants, name):
    """x·cos + rotate_half(x)·sin of fp32 column tiles x (features = n·D), into a new fp32 tile."""
    d = spec.head_dim
    parts, tiles = natural_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    x_cos = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_cos")
    x_sin = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_sin")
    out = nl.ndarray((nl.tile_size.pmax, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=name)
    for product, table, engine in ((x_cos, cos_t, nisa.vector_engine), (x_sin, sin_t, nisa.gpsimd_engine)):
        xv, tv = per_head(x, table, features, d)
        nisa.tensor_tensor(
            dst=product.reshape_dim(1, (tiles // nd, nd)), data1=xv, data2=tv, op=nl.multiply, engine=engine
        )
    if constants.rotate is not None:
        # rotate_half(x)·sin = rotate_half(x·sin): sin's halves are equal, so one matmul per ≤512 columns.
        per_bank = max(1, nl.tile_size.gemm_moving_fmax // r)
        for t0, tn in spans(tiles, per_bank):
            turned = nl.ndarray((parts, tn, r), dtype=nl.float32, buffer=nl.psum, name="rope_psum")
            nisa.nc_matmul(
                dst=turned, stationary=constants.rotate[0:parts, 0:parts], moving=x_sin[0:parts, t0 : t0 + tn, :]
            )
            nisa.tensor_tensor(
                dst=out[0:parts, t0 : t0 + tn, :], data1=x_cos[0:parts, t0 : t0 + tn, :], data2=turned, op=nl.add
            )
    else:
        half = nd // 2
        xc = x_cos.reshape_dim(1, (tiles // nd, 2, half))
        xs = x_sin.reshape_dim(1, (tiles // nd, 2, half))
        o = out.reshape_dim(1, (tiles // nd, 2, half))
        nisa.tensor_tensor(dst=o[:, :, 0], data1=xc[:, :, 0], data2=xs[:, :, 1], op=nl.subtract)
        nisa.tensor_tensor(dst=o[:, :, 1], data1=xc[:, :, 1], data2=xs[:, :, 0], op=nl.add)
    return out


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


def norm_rope(x, which, tables, spec, constants):
    """fp32 column tiles of q (which = 0) or k (which = 1) after the optional head-dim RMSNorm and RoPE, from
    x (column tiles, any float dtype) and load_rope_tables' tables."""
    d = spec.head_dim
    features = (spec.num_heads, spec.num_kv_heads)[which] * d
    cos_t, sin_t, weights = tables
    if spec.qk_norm:
        x = rms_norm_heads(x, features, weights[:, :, which : which + 1], spec, constants)
    return rope_heads(x, features, cos_t, sin_t, spec, constants, ("q_rope", "k_rope")[which])


def load_write_index(write_index):
    """The [1, 1] int32 write slot in SBUF, for DMA offsets read at run time."""
    index = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="write_index")
    nisa.dma_copy(dst=index, src=write_index)
    return index


def write_rows(columns, cache, layer, index):
    """cache[layer, b, w:w+T] = the rows of `columns` (column tiles of kv_heads·D features, any float dtype, cast
    to the cache dtype) IN PLACE, w = index[0, 0] (load_write_index) read at run time: one DMA, since every
    row's T slots of kv_heads·D values are one contiguous run in HBM."""
    _, batch, s, kv, d = cache.shape
    r = columns.shape[2]
    rows = nl.ndarray((r, kv * d), dtype=cache.dtype, buffer=nl.sbuf, name="cache_rows")
    natural_columns_to_rows(rows, columns)
    slots = cache.ap(
        [[s * kv * d, batch], [kv * d, r // batch], [1, kv * d]],
        offset=layer * batch * s * kv * d,
        scalar_offset=index,
        indirect_dim=2,
    )
    nisa.dma_copy(dst=slots, src=rows)


def cache_spread_bytes(spec):
    """The per-partition bytes `slot_blocks` spreads a cache window's slots to, for `spec`'s weights."""
    return FP8_CACHE_SPREAD_BYTES if spec.fp8_weights else 2 * CACHE_RUN_BYTES


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
                o_h = (h * d) % pmax
                nisa.nc_matmul(
                    dst=moved[:, j, :],
                    moving=q[0:parts, h * d // pmax, 0:r],
                    stationary=constants.shift[0:parts, pmax - o_g + o_h : pmax + o_h + d],
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
    int32 computed at run time from the write slot tile (load_write_index), or None when span = S (a static 0)."""
    if span == slots:
        return None
    start = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="window_start")
    nisa.tensor_scalar(dst=start, data=index, op0=nl.add, operand0=tokens - span, op1=nl.maximum, operand1=0)
    nisa.tensor_scalar(dst=start, data=start, op0=nl.minimum, operand0=slots - span)
    return start


def window_view(tensor, first, pattern, start, slot_axis):
    """The HBM view `pattern` of `tensor` from element `first`, moved by start (load_window_start) slots along
    axis slot_axis at run time, or static when start is None."""
    if start is None:
        return tensor.ap(pattern, offset=first)
    return tensor.ap(pattern, offset=first, scalar_offset=start, indirect_dim=slot_axis)


def load_mask_columns(mask_bias, mask, b, blocks, pieces, start):
    """fp32 [128, pieces, T]: element [p, n, t] = mask_bias[mask, b, t, start + slot] for the window slot at
    partition p of score piece n (slot s0 + p·q + i of piece (block, i)). The row's [T, window] bias is one DMA
    (T contiguous runs); the permutation is done by PE transposes of strided columns."""
    pmax = nl.tile_size.pmax
    _, batch, t, s = mask_bias.shape
    span = sum(np_ * q for _, np_, q in blocks)
    rows = nl.ndarray((t, span), dtype=nl.float32, buffer=nl.sbuf, name="mask_rows")
    nisa.dma_copy(dst=rows, src=window_view(mask_bias, (mask * batch + b) * t * s, [[s, t], [1, span]], start, 3))
    columns = nl.ndarray((pmax, len(pieces), t), dtype=nl.float32, buffer=nl.sbuf, name="mask_columns")
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
        for k in range(kt):
            turned = nl.ndarray((kp, width), dtype=dtype, buffer=nl.psum, name="keysT_psum")
            for j in range(ni):
                nisa.nc_transpose(
                    dst=turned[0:kp, j * np_ : (j + 1) * np_],
                    data=k_blocks[index][0:np_, i0 + j, k * kp : (k + 1) * kp],
                )
            evict_alternating(keys[0:kp, k, c0 : c0 + width], turned, n + k)
    return keys


def cache_sbuf_bytes(k_cache, spec, tokens):
    """SBUF bytes per partition that `attend` holds for one row's cache tiles (Kᵀ column tiles and V blocks, plus
    the K blocks when they are turned on the PE, keys_by_dma_transpose), for a k_cache [L, B, S, kv_heads, D],
    T = tokens, at the window of any layer that needs the most."""
    _, _, slots, kv, d = k_cache.shape
    itemsize = k_cache.dtype.itemsize
    _, kt = natural_tiles(kv * d)
    largest = 0
    for s in {spec.window_slots(mask, slots, tokens) for mask in spec.layer_mask}:
        blocks = slot_blocks(s, kv * d * itemsize, cache_spread_bytes(spec))
        values = sum(q for _, _, q in blocks) * kv * d * itemsize
        k_blocks = 0 if keys_by_dma_transpose(blocks, kv * d, k_cache.dtype) else values
        largest = max(largest, kt * s * itemsize + values + k_blocks)
    return largest


def read_cache(k_cache, v_cache, layer, b, blocks, chunks, values_first, start):
    """(Kᵀ, V blocks) of row b's window (slots start + 0 .. start + span - 1, `blocks` over the span; start from
    load_window_start, None: slot 0): Kᵀ column tiles [min(F, 128), ceil(F/128), span] of all kv heads' F = kv·D
    features (keys_by_dma_transpose: slots in cache order, by a transposing DMA per block; else in score order, K
    blocks turned on the PE), V blocks [np, q, F] (window slot s0 + p·q + i at [p, i]). values_first: issue V's DMAs
    first (its write went out before k's)."""
    _, batch, slots, kv, d = k_cache.shape
    dtype = k_cache.dtype
    f = kv * d
    kp, kt = natural_tiles(f)
    s = sum(np_ * q for _, np_, q in blocks)
    row = (layer * batch + b) * slots * f  # element of the row's slot 0
    keys, k_blocks, v_blocks = None, [], []
    for which in ("v", "k") if values_first else ("k", "v"):
        cache = k_cache if which == "k" else v_cache
        if which == "k" and keys_by_dma_transpose(blocks, f, dtype):
            keys = nl.ndarray((kp, kt, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
            for s0, np_, q in blocks:  # a DMA per block (whole slot rows: long contiguous runs)
                n = np_ * q
                source = window_view(cache, row + s0 * f, [[f, n], [kp, kt], [1, kp]], start, 2)
                nisa.dma_transpose(dst=keys[:, :, s0 : s0 + n], src=source)
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


def plan_window(span, features, dtype, spread_bytes):
    """The CacheWindow of `span` slots of a cache whose slots hold `features` values (kv_heads·D) in `dtype`,
    blocks spread to spread_bytes per partition (cache_spread_bytes)."""
    blocks = slot_blocks(span, features * dtype.itemsize, spread_bytes)
    chunks = score_chunks(blocks)
    pieces = [(index, i) for index, (_, _, q) in enumerate(blocks) for i in range(q)]
    keys_by_dma = keys_by_dma_transpose(blocks, features, dtype)
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
class AttentionOutput:
    """Where softmax_pass writes: attn, column tiles [128, ceil(heads·D/128), R] (written directly when D >= 128),
    and by_head [D, heads, R] fp32 (D < 128: each head on partitions 0..D-1, placed into attn by place_heads)."""

    attn: object
    by_head: object


def _masked_scores(units, qs, rows, window, spec):
    """scoresᵀ fp32 [128, pieces, units, G·T] of the (row b, kv head g) `units`: Kᵀ [D, np] stationary × q [D, G·T]
    moving per piece, accumulated over the head dim's tiles, softcapped (tanh) when the spec says so, plus the
    mask bias. Partitions a ragged piece leaves empty hold MASKED_SCORE."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    dp, nd = head_tiles(d)
    g_size = spec.num_heads // spec.num_kv_heads
    t = rows[units[0][0]].mask.shape[2]
    gt = g_size * t
    blocks, pieces = window.blocks, window.pieces
    row_ids = sorted({b for b, _ in units})
    row_units = {b: [u for u, (ub, _) in enumerate(units) if ub == b] for b in row_ids}  # consecutive per row
    first_piece = [sum(q for _, _, q in blocks[:index]) for index in range(len(blocks))]
    per_bank = max(1, fp32_per_psum_bank(len(units) * gt))
    scores = nl.ndarray((pmax, len(pieces), len(units), gt), dtype=nl.float32, buffer=nl.sbuf, name="scoresT")
    for index, (_, np_, q) in enumerate(blocks):
        if np_ < pmax:  # partitions a ragged piece leaves empty must not win the max
            nisa.memset(dst=scores[:, first_piece[index] : first_piece[index] + q], value=MASKED_SCORE)
        for i0, ni in spans(q, per_bank):
            acc = nl.ndarray((np_, ni, len(units), gt), dtype=nl.float32, buffer=nl.psum, name="scoresT_psum")
            for k in range(nd):
                for j in range(ni):
                    slots = window.key_columns[first_piece[index] + i0 + j]
                    for u, (b, g) in enumerate(units):
                        o_g, tile_g = kv_head_place(g, d)
                        nisa.nc_matmul(
                            dst=acc[0:np_, j, u],
                            moving=qs[o_g : o_g + dp, k, b, g],
                            accumulate=k > 0,
                            stationary=rows[b].keys[o_g : o_g + dp, tile_g + k, slots],
                        )
            piece0 = first_piece[index] + i0
            for b in row_ids:
                u0, un = row_units[b][0], len(row_units[b])
                out = scores[0:np_, piece0 : piece0 + ni, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)
                bias = rows[b].mask[0:np_, piece0 : piece0 + ni, :].expand_dim(2).broadcast(2, un * g_size)
                logits = acc[:, :, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)  # [np, ni, un·G, T]
                if spec.attn_logit_softcap:
                    cap = float(spec.attn_logit_softcap)
                    nisa.activation(dst=out, op=nl.tanh, data=logits, scale=1.0 / cap)
                    nisa.scalar_tensor_tensor(
                        dst=out, data=out, op0=nl.multiply, operand0=cap, op1=nl.add, operand1=bias
                    )
                else:
                    nisa.tensor_tensor(dst=out, data1=logits, data2=bias, op=nl.add)
            del acc
    return scores


def _softmax_weights(units, qs, rows, window, spec, constants):
    """(weights [128, pieces, columns] in the cache dtype, scale [Dp, columns] fp32): exp(score - column max) of
    _masked_scores' scores, and 1 / the column sums of the weights (as rounded for the matmul) on every output
    partition. The column max: per partition over pieces, then across partitions by a PE transpose and a free-axis
    max, spread back by onesᵀ·diag(-max); the column sums by onesᵀ·(per-partition sums)."""
    pmax = nl.tile_size.pmax
    dp, _ = head_tiles(spec.head_dim)
    dtype = rows[units[0][0]].keys.dtype
    scores = _masked_scores(units, qs, rows, window, spec)
    flat = scores.flatten_dims(2, 3)  # [128, pieces, columns]
    columns = flat.shape[2]
    column_max = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.sbuf, name="scores_partition_max")
    nisa.tensor_reduce(dst=column_max, op=nl.maximum, data=flat.permute((0, 2, 1)), axis=2)
    turned = nl.ndarray((columns, pmax), dtype=nl.float32, buffer=nl.psum, name="scores_max_psum")
    nisa.nc_transpose(dst=turned, data=column_max)
    neg_max = nl.ndarray((columns, 1), dtype=nl.float32, buffer=nl.sbuf, name="scores_neg_max")
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=turned, axis=1, negate=True)
    del turned
    # PSUM [128, columns]: -max of each column on every partition.
    shift = spread_across_partitions(neg_max, pmax, constants.ones, constants.identity)
    nisa.tensor_tensor(dst=flat, data1=flat, data2=shift.expand_dim(1).broadcast(1, len(window.pieces)), op=nl.add)
    del shift
    weights = nl.ndarray((pmax, len(window.pieces), columns), dtype=dtype, buffer=nl.sbuf, name="weightsT")
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


def _weighted_values(units, weights, scale, rows, window, out, spec):
    """out ← weights·V / column sums of each unit: attnᵀ [Dp, G·T] = V [np, Dp] stationary × weights moving,
    accumulated over the pieces, per tile of the head dim; row b's columns of kv head g's query heads."""
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
            for p_index, (index, i) in enumerate(window.pieces):
                np_ = window.blocks[index][1]
                f0 = g * d + k * pmax
                nisa.nc_matmul(
                    dst=acc,
                    stationary=rows[b].values[index][0:np_, i, f0 : f0 + dp],
                    moving=weights[0:np_, p_index, mine],
                    accumulate=p_index > 0,
                )
            if out.by_head is None:
                heads = out.attn.reshape_dim(1, (kv, g_size, nq_tiles // (kv * g_size)))
                dst = heads[:, g, :, k, b * t : (b + 1) * t]
            else:
                dst = out.by_head[:, g * g_size : (g + 1) * g_size, b * t : (b + 1) * t]
            nisa.tensor_tensor(dst=dst, data1=acc, data2=scale[:, mine], op=nl.multiply)
            del acc


def softmax_pass(units, qs, rows, window, out, spec, constants):
    """Scores, softmax and weights·V of several (row b, kv head g) `units` together (their G·T query columns side
    by side, at most 128) into `out` (AttentionOutput). qs: prepare_queries' queries; rows: {b: RowCache} of the
    units' rows; window: the layer's CacheWindow."""
    weights, scale = _softmax_weights(units, qs, rows, window, spec, constants)
    _weighted_values(units, weights, scale, rows, window, out, spec)


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


def attend(qT, k_cache, v_cache, layer, mask_bias, index, spec, constants, *, values_first=False):
    """attnT column tiles [128, ceil(heads·D/128), R] in the cache dtype: softmax(q·Kᵀ·scaling (softcapped) +
    mask)·V of each row's T queries over the slots of layer `layer`'s cache its mask can make visible: all S, or
    with spec.mask_windows the window of spec.window_slots(...) slots ending at the last query's slot (from the
    write slot tile `index`, load_write_index, at run time). qT: fp32 column tiles of the rotated (and normed)
    queries."""
    pmax = nl.tile_size.pmax
    _, batch, s, kv, d = k_cache.shape
    dtype = k_cache.dtype
    r = qT.shape[2]
    t = r // batch
    gt = spec.num_heads // kv * t
    mask = spec.layer_mask[layer]
    window = plan_window(spec.window_slots(mask, s, t), kv * d, dtype, cache_spread_bytes(spec))
    start = load_window_start(index, window.span, s, t)
    qs = prepare_queries(qT, spec, batch, dtype, constants)
    dp, _ = head_tiles(d)
    _, q_tiles = natural_tiles(spec.num_heads * d)
    out = AttentionOutput(
        nl.ndarray((pmax, q_tiles, r), dtype=dtype, buffer=nl.sbuf, name="attnT"),
        nl.ndarray((dp, spec.num_heads, r), dtype=nl.float32, buffer=nl.sbuf, name="attn_by_head")
        if d < pmax
        else None,
    )
    # Row by row (later rows' cache reads overlap this row's work); one softmax pass for as many of the row's kv
    # heads as fit 128 query columns.
    for b in range(batch):
        visible = load_mask_columns(mask_bias, mask, b, window.blocks, window.pieces, start)
        keys, values = read_cache(k_cache, v_cache, layer, b, window.blocks, window.chunks, values_first, start)
        rows = {b: RowCache(keys, values, visible)}
        del keys, values, visible
        for g0, gn in spans(kv, max(1, pmax // gt)):
            softmax_pass([(b, g) for g in range(g0, g0 + gn)], qs, rows, window, out, spec, constants)
        del rows
    if out.by_head is not None:
        place_heads(out, spec, constants)
    return out.attn


def check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer):
    """attention()'s arguments: its HBM operands as the contract gives them (contract.check_named, B and S from
    k_cache, T from cos, the model's dtype k_cache's), and what attention itself needs: a head dim it can tile
    (check_head_dim), a static layer, B·T rows and G·T queries per kv head within one partition tile, and qT, kT,
    vT natural column tiles of B·T rows."""
    pmax = nl.tile_size.pmax
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"attention: spec: got {type(spec).__name__}, expected a nki_kernels.decode.DecodeSpec")
    check_head_dim(spec.head_dim)
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
    qT, kT, vT, k_cache, v_cache, layer, write_index, cos, sin, mask_bias, qk_norm_weights, spec, *, constants=None
):
    """One layer's attention at decode, inside a kernel; returns attnT column tiles [128, ceil(heads·D/128), R]
    in the cache dtype (ready as the o projection's moving operand).

    qT [128, ceil(heads·D/128), R], kT and vT [128, ceil(kv·D/128), R]: SBUF column tiles (any float dtype) of
    this step's projections. layer: static int. Other operands in HBM as the module docstring says. Writes k
    (normed, rotated) and v into the caches at [write_index, write_index + T) IN PLACE, then attends over the
    slots its mask can make visible (attend). constants: AttentionConstants(spec), built once per kernel when
    attention runs for several layers.
    """
    check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer)
    constants = constants or AttentionConstants(spec)
    index = load_write_index(write_index)
    # The cache reads wait for the writes (same HBM bytes): v goes out first, k as soon as it is rotated.
    write_rows(vT, v_cache, layer, index)
    tables = load_rope_tables(cos, sin, qk_norm_weights, layer, spec, qT.shape[2])
    write_rows(norm_rope(kT, 1, tables, spec, constants), k_cache, layer, index)
    return attend(
        norm_rope(qT, 0, tables, spec, constants),
        k_cache,
        v_cache,
        layer,
        mask_bias,
        index,
        spec,
        constants,
        values_first=True,
    )


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
    write_rows(load_natural_columns(k, name="k_columns"), k_cache, layer, index)
    write_rows(load_natural_columns(v, name="v_columns"), v_cache, layer, index)
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
    attn = attend(qT, k_cache, v_cache, layer, mask_bias, load_write_index(write_index), spec, constants)
    out = nl.ndarray(q.shape, dtype=k_cache.dtype, buffer=nl.shared_hbm, name="attn")
    store_natural_columns(out, attn)
    return out
