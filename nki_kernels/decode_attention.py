"""Decode-step attention in NKI: q/k head-dim RMSNorm, RoPE, the in-place KV-cache write, GQA over the cache.

Layouts (DECODE_STEP_SPEC.md). R = B·T rows (row r = b·T + t), features on partitions: a "column tile" tensor of
F features is SBUF [128, ceil(F/128), R] with element [p, i, r] = feature i·128 + p of row r. q has heads·D
features (feature h·D + d is head h's component d), k and v kv_heads·D; kv head g serves query heads g·G ..
g·G + G - 1 (G = heads / kv_heads). The head dim D must divide 128 (several heads per tile) or be a multiple of
256 (a head spans whole tiles and the rotate-half halves are whole tiles).

HBM operands: k_cache, v_cache [L, B, S, kv_heads, D] (model dtype); write_index [1, 1] int32 (the first slot of
this step, a runtime value); cos, sin [NR, B, T, D] float32 rotate-half tables (halves duplicated), table
spec.layer_rope[layer]; mask_bias [NM, B, T, S] float32 (0 or float32 min), mask spec.layer_mask[layer];
qk_norm_weights [L, 2, D] (q_norm, k_norm; raw weights, 1 + w when spec.norm_unit_offset) or None.

How the work is laid out (the cost model charges a decode step mostly for the cache bytes it reads):
- Norm and RoPE stay in column tiles (few free elements per instruction). The per-head mean square is a
  cross-partition sum: one matmul with a block-of-ones matrix (1/D inside each head's partitions). Rotate-half
  crosses partitions when D <= 128: one matmul with a signed permutation; for D >= 256 it swaps whole tiles.
- The new k and v are turned into rows on the PE and written with one DMA per cache at slots
  [write_index, write_index + T) of every row (each slot's kv_heads·D values are contiguous in HBM).
- The cache is then read (after the write: the same HBM bytes) in blocks whose every partition holds several
  consecutive slots (one long contiguous run per partition, one DMA per block), so slot p·q + i of a block sits
  at partition p, slot column i. Scores use the permuted slot order (i major): K columns are turned on the PE
  per slot column i, the mask is read through the same permutation, and V needs none (its slots stay on the
  partitions, matching the turned weights).
- Per row b and kv head g: scores [G·T, S] = qᵀ [D, G·T] stationary × Kᵀ [D, ≤512 slots] moving, accumulated
  over D tiles, + mask (tanh softcap first when set); softmax in fp32 along the free axis (exp with its row sum
  on ScalarE); weightsᵀ per ≤128 slots on the PE; attnᵀ [D, G·T] = V [slots, D] stationary × weightsᵀ moving,
  accumulated over slots, so the output lands features-on-partitions; the 1/sum is broadcast over the D
  partitions by a ones matmul against diag(1/sum). query_scaling is folded into q.
"""

from __future__ import annotations

from nki_kernels.binding import nki, nl, nisa
from nki_kernels.decode_spec import DecodeSpec
from nki_kernels.svd_matmul import spans

# Per-partition bytes of one cache block (K or V, one DMA each): long contiguous runs, a few blocks per row.
CACHE_BLOCK_BYTES = 16384
PSUM_BANK_BYTES = 2048


def check_head_dim(head_dim):
    if head_dim % 2 or not (128 % head_dim == 0 or head_dim % 256 == 0):
        raise ValueError(f"DecodeSpec.head_dim: got {head_dim}, expected an even divisor of 128 or a multiple of "
                         f"256 (heads must not straddle partition tiles; rotate-half halves must be whole tiles)")


def head_tiles(head_dim):
    """(partitions, tiles) of one head's features: (D, 1) when D <= 128, else (128, D / 128)."""
    pmax = nl.tile_size.pmax
    return min(head_dim, pmax), max(1, head_dim // pmax)


def column_tiles(features):
    """(partitions used, tiles) of a column-tile tensor of `features` features."""
    pmax = nl.tile_size.pmax
    return min(features, pmax), -(-features // pmax)


class AttentionConstants:
    """On-chip fp32 matrices attention() needs; build once per kernel and pass them to every layer.

    shift [128, 256]: shift[p, c] = 1 iff c = p + 128, so shift[:, 128:256] is the identity, shift[0:128,
    128+o : 128+o+D] moves partitions o..o+D-1 to 0..D-1 and shift[0:D, 128-o : 256-o] moves them back.
    ones [128, 128]; rotate [128, 128] (D <= 128): rotate-half as stationary.T @ x; head_mean [128, 128]: 1/D
    where two partitions hold features of the same head (D <= 128), 1/D everywhere for D >= 256.
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
        nisa.affine_select(dst=self.shift, pattern=[[1, 2 * pmax]], channel_multiplier=-1, on_true_tile=self.shift,
                           on_false_value=0.0, cmp_op=nl.equal, offset=-pmax)
        self.rotate = self.head_mean = None
        if d <= pmax:
            self.rotate = self._rotate_half(d)
        if spec.qk_norm:
            self.head_mean = self._head_mean(d)

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
        nisa.affine_select(dst=halves[:, :, 0, :], pattern=[[-d, heads], [-1, half]], channel_multiplier=1,
                           on_true_tile=minus, on_false_value=0.0, cmp_op=nl.equal, offset=-half)
        nisa.affine_select(dst=halves[:, :, 1, :], pattern=[[-d, heads], [-1, half]], channel_multiplier=1,
                           on_true_tile=self.ones[:, 0:pmax // 2], on_false_value=0.0, cmp_op=nl.equal, offset=0)
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
        nisa.affine_select(dst=member, pattern=[[1, pmax]], channel_multiplier=-d, on_true_tile=member,
                           on_false_value=0.0, cmp_op=nl.greater_equal, offset=0)
        nisa.affine_select(dst=member, pattern=[[1, pmax]], channel_multiplier=-d, on_true_tile=member,
                           on_false_value=0.0, cmp_op=nl.less, offset=-d)
        same = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.psum, name="attn_same_head_psum")
        nisa.nc_matmul(dst=same, stationary=member, moving=member)
        nisa.activation(dst=head_mean, op=nl.copy, data=same, scale=1.0 / d)
        return head_mean


# -- layout helpers ---------------------------------------------------------------------------------------

def rows_to_columns(rows, columns):
    """columns[0:pt, i, 0:R] = rows[0:R, i·128 : i·128 + pt]ᵀ (rows SBUF [R, F], columns SBUF [128, nt, R]) by
    PE transposes in rows' dtype, one eviction (with cast) per PSUM bank of whole tiles."""
    pmax = nl.tile_size.pmax
    r, f = rows.shape[0], rows.shape[1]
    tiles = spans(f, pmax)
    per_bank = max(1, PSUM_BANK_BYTES // (r * rows.dtype.itemsize))
    groups = [tiles[i:i + per_bank] for i in range(0, len(tiles), per_bank)]
    if len(groups[-1]) > 1 and groups[-1][-1][1] != pmax:  # a ragged last tile is evicted alone
        groups[-1:] = [groups[-1][:-1], groups[-1][-1:]]
    for group in groups:
        pt, first = group[0][1], group[0][0] // pmax
        turned = nl.ndarray((pt, len(group), r), dtype=rows.dtype, buffer=nl.psum, name="columns_psum")
        for j, (f0, _) in enumerate(group):
            nisa.nc_transpose(dst=turned[0:pt, j, 0:r], data=rows[0:r, f0:f0 + pt])
        nisa.tensor_copy(dst=columns[0:pt, first:first + len(group), 0:r], src=turned)


def columns_to_rows(columns, rows):
    """rows[0:R, i·128 : i·128 + pt] = columns[0:pt, i, 0:R]ᵀ (the inverse of rows_to_columns), one eviction
    (with cast to rows' dtype) per PSUM bank."""
    pmax = nl.tile_size.pmax
    r, f = rows.shape[0], rows.shape[1]
    per_bank = PSUM_BANK_BYTES // columns.dtype.itemsize
    for c0, cw in spans(f, max(pmax, per_bank - per_bank % pmax)):
        turned = nl.ndarray((r, cw), dtype=columns.dtype, buffer=nl.psum, name="rows_psum")
        for f0, pt in spans(cw, pmax):
            nisa.nc_transpose(dst=turned[0:r, f0:f0 + pt], data=columns[0:pt, (c0 + f0) // pmax, 0:r])
        nisa.tensor_copy(dst=rows[0:r, c0:c0 + cw], src=turned)


def load_columns(x, dtype=None, name="x_columns"):
    """Rows x [B, T, F] (or [R, F]) in HBM as column tiles SBUF [128, ceil(F/128), R] in `dtype` (default x's)."""
    pmax = nl.tile_size.pmax
    f = x.shape[-1]
    r = 1
    for n in x.shape[:-1]:
        r *= n
    rows = nl.ndarray((r, f), dtype=x.dtype, buffer=nl.sbuf, name=f"{name}_rows")
    nisa.dma_copy(dst=rows, src=x.reshape((r, f)))
    columns = nl.ndarray((pmax, -(-f // pmax), r), dtype=dtype or x.dtype, buffer=nl.sbuf, name=name)
    rows_to_columns(rows, columns)
    return columns


def store_columns(columns, out):
    """Column tiles [128, nt, R] into rows out [B, T, F] (or [R, F]) in HBM (cast to out's dtype)."""
    f = out.shape[-1]
    r = columns.shape[2]
    rows = nl.ndarray((r, f), dtype=out.dtype, buffer=nl.sbuf, name="out_rows")
    columns_to_rows(columns, rows)
    nisa.dma_copy(dst=out.reshape((r, f)), src=rows)


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
    rows_to_columns(rows, columns)
    return columns


def per_head(columns, table, features, head_dim):
    """(x view [P, heads_tiles, nd, R], table view broadcast to it): pair each tile of a column-tile tensor with
    the table tile its partitions' head components use."""
    parts, tiles = column_tiles(features)
    _, nd = head_tiles(head_dim)
    x = columns[0:parts, 0:tiles, :].reshape_dim(1, (tiles // nd, nd))
    t = table[0:parts, 0:nd, :].expand_dim(1).broadcast(1, tiles // nd)
    if t.shape[-1] != x.shape[-1]:
        t = t.broadcast(3, x.shape[-1])
    return x, t


# -- the pieces ----------------------------------------------------------------------------------------------

def rms_norm_heads(x, features, weights, spec, constants):
    """x (fp32 column tiles of `features` = n·D features) normalized over each head's D features in place:
    x·rsqrt(mean(x²) + eps)·w; weights fp32 [128, nd, 1] in the load_head_table layout (already 1 + w)."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    parts, tiles = column_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    squares = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_squares")
    nisa.activation(dst=squares, op=nl.square, data=x[0:parts, 0:tiles, :])
    groups = tiles // nd  # one mean per head (D >= 256) or per tile (a block per head, D <= 128)
    eps = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_eps")
    nisa.memset(dst=eps, value=float(spec.norm_eps))
    rstd = nl.ndarray((parts, groups, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_norm_rstd")
    per_bank = max(1, PSUM_BANK_BYTES // (4 * r))
    for g0, gn in spans(groups, per_bank):
        mean = nl.ndarray((parts, gn, r), dtype=nl.float32, buffer=nl.psum, name="qk_norm_mean_psum")
        for j in range(gn):
            for k in range(nd):
                nisa.nc_matmul(dst=mean[0:parts, j, 0:r], stationary=constants.head_mean[0:parts, 0:parts],
                               moving=squares[0:parts, (g0 + j) * nd + k, 0:r], accumulate=k > 0)
        nisa.activation(dst=rstd[0:parts, g0:g0 + gn, :], op=nl.rsqrt, data=mean, bias=eps)
    view = x[0:parts, 0:tiles, :].reshape_dim(1, (groups, nd))
    nisa.tensor_tensor(dst=view, data1=view, data2=rstd.expand_dim(2).broadcast(2, nd), op=nl.multiply)
    xw, w = per_head(x, weights, features, d)
    nisa.tensor_tensor(dst=xw, data1=xw, data2=w, op=nl.multiply)


def rope_heads(x, features, cos_t, sin_t, spec, constants, name):
    """x·cos + rotate_half(x)·sin of fp32 column tiles x (features = n·D), into a new fp32 tile."""
    d = spec.head_dim
    parts, tiles = column_tiles(features)
    _, nd = head_tiles(d)
    r = x.shape[2]
    x_cos = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_cos")
    x_sin = nl.ndarray((parts, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_sin")
    out = nl.ndarray((nl.tile_size.pmax, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name=name)
    for product, table, engine in ((x_cos, cos_t, nisa.vector_engine), (x_sin, sin_t, nisa.gpsimd_engine)):
        xv, tv = per_head(x, table, features, d)
        nisa.tensor_tensor(dst=product.reshape_dim(1, (tiles // nd, nd)), data1=xv, data2=tv, op=nl.multiply,
                           engine=engine)
    if constants.rotate is not None:
        # rotate_half(x)·sin = rotate_half(x·sin): sin's halves are equal, so one matmul per tile.
        per_bank = max(1, PSUM_BANK_BYTES // (4 * r))
        for t0, tn in spans(tiles, per_bank):
            turned = nl.ndarray((parts, tn, r), dtype=nl.float32, buffer=nl.psum, name="rope_psum")
            for j in range(tn):
                nisa.nc_matmul(dst=turned[0:parts, j, 0:r], stationary=constants.rotate[0:parts, 0:parts],
                               moving=x_sin[0:parts, t0 + j, 0:r])
            nisa.tensor_tensor(dst=out[0:parts, t0:t0 + tn, :], data1=x_cos[0:parts, t0:t0 + tn, :], data2=turned,
                               op=nl.add)
    else:
        half = nd // 2
        xc = x_cos.reshape_dim(1, (tiles // nd, 2, half))
        xs = x_sin.reshape_dim(1, (tiles // nd, 2, half))
        o = out.reshape_dim(1, (tiles // nd, 2, half))
        nisa.tensor_tensor(dst=o[:, :, 0], data1=xc[:, :, 0], data2=xs[:, :, 1], op=nl.subtract)
        nisa.tensor_tensor(dst=o[:, :, 1], data1=xc[:, :, 1], data2=xs[:, :, 0], op=nl.add)
    return out


def norm_rope_qk(qT, kT, layer, cos, sin, qk_norm_weights, spec, constants):
    """(q, k) fp32 column tiles after the optional head-dim RMSNorm and RoPE (tables of layer `layer`)."""
    d = spec.head_dim
    r = qT.shape[2]
    _, batch, t, _ = cos.shape
    table = spec.layer_rope[layer]
    cos_t = load_head_table(cos, table * batch * t * d, r, d, "rope_cos")
    sin_t = load_head_table(sin, table * batch * t * d, r, d, "rope_sin")
    out = []
    for which, (x, features) in enumerate(((qT, spec.num_heads * d), (kT, spec.num_kv_heads * d))):
        parts, tiles = column_tiles(features)
        x32 = nl.ndarray((nl.tile_size.pmax, tiles, r), dtype=nl.float32, buffer=nl.sbuf, name="qk_f32")
        nisa.tensor_copy(dst=x32[0:parts, :, :], src=x[0:parts, 0:tiles, 0:r])
        if spec.qk_norm:
            weights = load_head_table(qk_norm_weights, (layer * 2 + which) * d, 1, d, "qk_norm_weight")
            if spec.norm_unit_offset:
                nisa.tensor_scalar(dst=weights, data=weights, op0=nl.add, operand0=1.0)
            rms_norm_heads(x32, features, weights, spec, constants)
        out.append(rope_heads(x32, features, cos_t, sin_t, spec, constants, "qk_rope"))
    return out[0], out[1]


def write_cache(kT, vT, k_cache, v_cache, layer, write_index):
    """k_cache[layer, b, w:w+T] = k rows, v_cache likewise, IN PLACE, w = write_index[0, 0] read at run time.

    kT, vT: column tiles of kv_heads·D features (any float dtype; cast to the cache dtype). One DMA per cache:
    every row's T slots of kv_heads·D values are one contiguous run in HBM.
    """
    _, batch, s, kv, d = k_cache.shape
    r = kT.shape[2]
    t = r // batch
    index = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="write_index")
    nisa.dma_copy(dst=index, src=write_index)
    for columns, cache in ((vT, v_cache), (kT, k_cache)):
        rows = nl.ndarray((r, kv * d), dtype=cache.dtype, buffer=nl.sbuf, name="cache_rows")
        columns_to_rows(columns, rows)
        slots = cache.ap([[s * kv * d, batch], [kv * d, t], [1, kv * d]], offset=layer * batch * s * kv * d,
                         scalar_offset=index, indirect_dim=2)
        nisa.dma_copy(dst=slots, src=rows)


def slot_blocks(s, slot_bytes):
    """[(s0, np, q)]: cache blocks covering slots 0..S-1; block slot s0 + p·q + i lives at partition p < np,
    slot column i < q. Whole-partition blocks take up to CACHE_BLOCK_BYTES per partition; a last block of
    S mod 128 slots has one slot per partition."""
    pmax = nl.tile_size.pmax
    q_max = max(1, CACHE_BLOCK_BYTES // slot_bytes)
    blocks, s0 = [], 0
    while s - s0 >= pmax:
        q = min(q_max, (s - s0) // pmax)
        blocks.append((s0, pmax, q))
        s0 += pmax * q
    if s0 < s:
        blocks.append((s0, s - s0, 1))
    return blocks


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


def prepare_queries(q, spec, batch, dtype, constants):
    """qs [Dp, nd, B, kv, G, T] in `dtype`: each kv head's query heads of each row b with the head dim on
    partitions 0..Dp-1 (stationary [Dp, G·T] per (tile, b, g)), times query_scaling."""
    d = spec.head_dim
    dp, nd = head_tiles(d)
    heads, kv = spec.num_heads, spec.num_kv_heads
    g_size = heads // kv
    r = q.shape[2]
    t = r // batch
    qs = nl.ndarray((dp, nd, batch, kv, g_size, t), dtype=dtype, buffer=nl.sbuf, name="attn_queries")
    if d >= nl.tile_size.pmax:
        source = q.reshape_dim(1, (kv, g_size, nd))
        for k in range(nd):
            nisa.activation(dst=qs[:, k].permute((0, 2, 3, 1, 4)), op=nl.copy,
                            data=source[:, :, :, k, :].reshape_dim(3, (batch, t)), scale=float(spec.query_scaling))
        return qs
    parts, _ = column_tiles(heads * d)
    by_head = qs[:, 0].permute((0, 2, 3, 1, 4)).flatten_dims(1, 2)  # [D, heads, B, T]
    per_bank = max(1, PSUM_BANK_BYTES // (4 * r))
    for h0, hn in spans(heads, per_bank):
        moved = nl.ndarray((dp, hn, r), dtype=nl.float32, buffer=nl.psum, name="queries_psum")
        for j in range(hn):
            offset = ((h0 + j) * d) % nl.tile_size.pmax
            nisa.nc_matmul(dst=moved[0:dp, j, 0:r],
                           stationary=constants.shift[0:parts, 128 + offset:128 + offset + dp],
                           moving=q[0:parts, (h0 + j) * d // nl.tile_size.pmax, 0:r])
        nisa.activation(dst=by_head[:, h0:h0 + hn], op=nl.copy, data=moved.reshape_dim(2, (batch, t)),
                        scale=float(spec.query_scaling))
    return qs


def attend(qT, k_cache, v_cache, layer, mask_bias, spec, constants):
    """attnT column tiles [128, ceil(heads·D/128), R] in the cache dtype: softmax(q·Kᵀ·scaling (softcapped) +
    mask)·V of each row's T queries over all S slots of layer `layer`'s cache. qT: fp32 column tiles of the
    rotated (and normed) queries."""
    pmax = nl.tile_size.pmax
    _, batch, s, kv, d = k_cache.shape
    dtype = k_cache.dtype
    heads = spec.num_heads
    g_size = heads // kv
    dp, nd = head_tiles(d)
    r = qT.shape[2]
    t = r // batch
    gt = g_size * t
    q_parts, q_tiles = column_tiles(heads * d)
    mask = spec.layer_mask[layer]
    qs = prepare_queries(qT, spec, batch, dtype, constants)
    attn = nl.ndarray((pmax, q_tiles, r), dtype=dtype, buffer=nl.sbuf, name="attnT")
    by_head = None
    if d < pmax:
        by_head = nl.ndarray((dp, heads, r), dtype=nl.float32, buffer=nl.sbuf, name="attn_by_head")
    blocks = slot_blocks(s, kv * d * dtype.itemsize)
    chunks = score_chunks(blocks)
    wt_per_bank = max(1, PSUM_BANK_BYTES // (gt * dtype.itemsize))
    for b in range(batch):
        k_blocks, v_blocks = [], []
        for s0, np_, q in blocks:
            for cache, loaded in ((k_cache, k_blocks), (v_cache, v_blocks)):
                tile = nl.ndarray((np_, q, kv * d), dtype=dtype, buffer=nl.sbuf, name="cache_block")
                nisa.dma_copy(dst=tile, src=cache[layer, b, s0:s0 + np_ * q, :, :].reshape((np_, q, kv * d)))
                loaded.append(tile)
        bias = nl.ndarray((gt, s), dtype=nl.float32, buffer=nl.sbuf, name="attn_mask")
        nisa.dma_copy(dst=bias, src=mask_bias.ap([[0, g_size], [s, t], [1, s]], offset=((mask * batch + b) * t) * s))
        for g in range(kv):
            keys = nl.ndarray((dp, nd, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
            scores = nl.ndarray((gt, s), dtype=nl.float32, buffer=nl.sbuf, name="scores")
            for n, (index, i0, ni, c0) in enumerate(chunks):
                s0, np_, q = blocks[index]
                width = ni * np_
                for k in range(nd):
                    turned = nl.ndarray((dp, width), dtype=dtype, buffer=nl.psum, name="keysT_psum")
                    for j in range(ni):
                        f0 = g * d + k * pmax
                        nisa.nc_transpose(dst=turned[0:dp, j * np_:(j + 1) * np_],
                                          data=k_blocks[index][0:np_, i0 + j, f0:f0 + dp])
                    if (n + k) % 2:
                        nisa.activation(dst=keys[0:dp, k, c0:c0 + width], op=nl.copy, data=turned)
                    else:
                        nisa.tensor_copy(dst=keys[0:dp, k, c0:c0 + width], src=turned)
                acc = nl.ndarray((gt, width), dtype=nl.float32, buffer=nl.psum, name="scores_psum")
                for k in range(nd):
                    nisa.nc_matmul(dst=acc, stationary=qs[0:dp, k, b, g], moving=keys[0:dp, k, c0:c0 + width],
                                   accumulate=k > 0)
                visible = bias[:, s0:s0 + np_ * q].reshape_dim(1, (np_, q)).permute((0, 2, 1))[:, i0:i0 + ni, :]
                out = scores[:, c0:c0 + width]
                if spec.attn_logit_softcap:
                    cap = float(spec.attn_logit_softcap)
                    nisa.activation(dst=out, op=nl.tanh, data=acc, scale=1.0 / cap)
                    nisa.scalar_tensor_tensor(dst=out, data=out, op0=nl.multiply, operand0=cap, op1=nl.add,
                                              operand1=visible)
                else:
                    nisa.tensor_tensor(dst=out, data1=acc, data2=visible, op=nl.add)
                del acc
            del keys
            neg_max = nl.ndarray((gt, 1), dtype=nl.float32, buffer=nl.sbuf, name="scores_neg_max")
            nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=scores, axis=1, negate=True)
            weights = nl.ndarray((gt, s), dtype=dtype, buffer=nl.sbuf, name="attn_weights")
            total = nl.ndarray((gt, 1), dtype=nl.float32, buffer=nl.sbuf, name="weights_sum")
            nisa.activation(dst=weights, op=nl.exp, data=scores, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            del scores
            # weightsᵀ: one [np, G·T] piece per slot column, in score order.
            pieces = [(index, i) for index, (_, _, q) in enumerate(blocks) for i in range(q)]
            weights_t = nl.ndarray((pmax, len(pieces), gt), dtype=dtype, buffer=nl.sbuf, name="weightsT")
            first_piece = 0
            for index, (_, np_, q) in enumerate(blocks):
                column0 = chunks[[c[0] for c in chunks].index(index)][3]
                for i0, ni in spans(q, wt_per_bank):
                    turned = nl.ndarray((np_, ni, gt), dtype=dtype, buffer=nl.psum, name="weightsT_psum")
                    for j in range(ni):
                        c = column0 + (i0 + j) * np_
                        nisa.nc_transpose(dst=turned[0:np_, j, 0:gt], data=weights[0:gt, c:c + np_])
                    nisa.tensor_copy(dst=weights_t[0:np_, first_piece + i0:first_piece + i0 + ni, :], src=turned)
                first_piece += q
            del weights
            # 1/sum on every partition: onesᵀ·diag(1/sum).
            recip = nl.ndarray((gt, 1), dtype=nl.float32, buffer=nl.sbuf, name="weights_recip")
            nisa.reciprocal(dst=recip, data=total)
            diag = nl.ndarray((gt, gt), dtype=nl.float32, buffer=nl.sbuf, name="weights_recip_diag")
            nisa.tensor_scalar(dst=diag, data=constants.shift[0:gt, pmax:pmax + gt], op0=nl.multiply, operand0=recip)
            spread = nl.ndarray((dp, gt), dtype=nl.float32, buffer=nl.psum, name="recip_psum")
            nisa.nc_matmul(dst=spread, stationary=constants.ones[0:gt, 0:dp], moving=diag)
            scale = nl.ndarray((dp, gt), dtype=nl.float32, buffer=nl.sbuf, name="weights_recip_bcast")
            nisa.tensor_copy(dst=scale, src=spread)
            del spread
            for k in range(nd):
                acc = nl.ndarray((dp, gt), dtype=nl.float32, buffer=nl.psum, name="attnT_psum")
                for p_index, (index, i) in enumerate(pieces):
                    np_ = blocks[index][1]
                    f0 = g * d + k * pmax
                    nisa.nc_matmul(dst=acc, stationary=v_blocks[index][0:np_, i, f0:f0 + dp],
                                   moving=weights_t[0:np_, p_index, 0:gt], accumulate=p_index > 0)
                if by_head is None:
                    dst = attn.reshape_dim(1, (kv, g_size, nd))[:, g, :, k, b * t:(b + 1) * t]
                else:
                    dst = by_head[:, g * g_size:(g + 1) * g_size, b * t:(b + 1) * t]
                nisa.tensor_tensor(dst=dst, data1=acc, data2=scale, op=nl.multiply)
                del acc
        del k_blocks, v_blocks, bias
    if by_head is not None:
        # Head h's D outputs move from partitions 0..D-1 to (h·D) mod 128 of tile h·D / 128.
        heads_per_tile = pmax // d
        for i in range(q_tiles):
            placed = nl.ndarray((q_parts, r), dtype=nl.float32, buffer=nl.psum, name="attn_place_psum")
            members = range(i * heads_per_tile, min(heads, (i + 1) * heads_per_tile))
            for n, h in enumerate(members):
                offset = (h * d) % pmax
                nisa.nc_matmul(dst=placed, stationary=constants.shift[0:d, pmax - offset:pmax - offset + q_parts],
                               moving=by_head[0:d, h, 0:r], accumulate=n > 0)
            nisa.tensor_copy(dst=attn[0:q_parts, i, :], src=placed)
    return attn


def check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer):
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"spec: expected a DecodeSpec, got {type(spec).__name__}")
    check_head_dim(spec.head_dim)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise ValueError(f"layer: got {layer!r}, expected a static int in [0, {spec.num_layers})")
    cache_shape = tuple(k_cache.shape)
    if len(cache_shape) != 5 or cache_shape[0] != spec.num_layers or cache_shape[3:] != (spec.num_kv_heads,
                                                                                           spec.head_dim):
        raise ValueError(f"k_cache: got shape {cache_shape}, expected [L={spec.num_layers}, B, S, "
                         f"kv_heads={spec.num_kv_heads}, D={spec.head_dim}]")
    if tuple(v_cache.shape) != cache_shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: got {tuple(v_cache.shape)} {v_cache.dtype}, expected k_cache's {cache_shape} "
                         f"{k_cache.dtype}")
    _, batch, s, _, d = cache_shape
    if tuple(write_index.shape) != (1, 1) or write_index.dtype != nl.int32:
        raise ValueError(f"write_index: got {tuple(write_index.shape)} {write_index.dtype}, expected [1, 1] int32")
    if len(cos.shape) != 4 or cos.shape[1] != batch or cos.shape[3] != d or cos.shape[0] < spec.num_rope_tables:
        raise ValueError(f"cos: got shape {tuple(cos.shape)}, expected [NR >= {spec.num_rope_tables}, B={batch}, T, "
                         f"D={d}]")
    t = cos.shape[2]
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"sin: got shape {tuple(sin.shape)}, expected cos's {tuple(cos.shape)}")
    for name, table in (("cos", cos), ("sin", sin), ("mask_bias", mask_bias)):
        if table.dtype != nl.float32:
            raise TypeError(f"{name}: got dtype {table.dtype}, expected float32")
    if tuple(mask_bias.shape[1:]) != (batch, t, s) or mask_bias.shape[0] < spec.num_masks:
        raise ValueError(f"mask_bias: got shape {tuple(mask_bias.shape)}, expected [NM >= {spec.num_masks}, "
                         f"B={batch}, T={t}, S={s}]")
    r = batch * t
    g_size = spec.num_heads // spec.num_kv_heads
    if r > nl.tile_size.pmax or g_size * t > nl.tile_size.pmax:
        raise ValueError(f"cos: B·T = {r} rows and G·T = {g_size * t} queries per kv head must each be at most "
                         f"{nl.tile_size.pmax}")
    for name, x, features in (("qT", qT, spec.num_heads * d), ("kT", kT, spec.num_kv_heads * d),
                              ("vT", vT, spec.num_kv_heads * d)):
        if x is None:
            continue
        expected = (nl.tile_size.pmax, -(-features // nl.tile_size.pmax), r)
        if tuple(x.shape) != expected:
            raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected column tiles {list(expected)} "
                             f"({features} features, B·T = {r} rows)")
    if spec.qk_norm and (qk_norm_weights is None or tuple(qk_norm_weights.shape) != (spec.num_layers, 2, d)):
        raise ValueError(f"qk_norm_weights: got {None if qk_norm_weights is None else tuple(qk_norm_weights.shape)}"
                         f", expected [L={spec.num_layers}, 2, D={d}] (spec.qk_norm is set)")


def attention(qT, kT, vT, k_cache, v_cache, layer, write_index, cos, sin, mask_bias, qk_norm_weights, spec, *,
              constants=None):
    """One layer's attention at decode, inside a kernel; returns attnT column tiles [128, ceil(heads·D/128), R]
    in the cache dtype (ready as the o projection's moving operand).

    qT [128, ceil(heads·D/128), R], kT and vT [128, ceil(kv·D/128), R]: SBUF column tiles (any float dtype) of
    this step's projections. layer: static int. Other operands in HBM as the module docstring says. Writes k
    (normed, rotated) and v into the caches at [write_index, write_index + T) IN PLACE, then attends over all S
    slots. constants: AttentionConstants(spec), built once per kernel when attention runs for several layers.
    """
    check_operands(qT, kT, vT, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norm_weights, spec, layer)
    constants = constants or AttentionConstants(spec)
    q, k = norm_rope_qk(qT, kT, layer, cos, sin, qk_norm_weights, spec, constants)
    write_cache(k, vT, k_cache, v_cache, layer, write_index)
    return attend(q, k_cache, v_cache, layer, mask_bias, spec, constants)


# -- per-op kernels (composition (i)): HBM in, HBM out --------------------------------------------------------

def _rows_count(x, name, features):
    if len(x.shape) != 3 or x.shape[2] != features:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected rows [B, T, {features}]")
    return x.shape[0] * x.shape[1]


@nki.jit
def rope_kernel(q, k, cos, sin, qk_norms, *, layer, spec):
    """(q, k) rows [B, T, heads·D] / [B, T, kv·D] after the optional head-dim RMSNorm (qk_norms [L, 2, D] or
    None) and RoPE with table spec.layer_rope[layer]; new HBM tensors in q's / k's dtype."""
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    _rows_count(k, "k", spec.num_kv_heads * d)
    qT, kT = load_columns(q, name="q_columns"), load_columns(k, name="k_columns")
    constants = AttentionConstants(spec)
    q_out, k_out = norm_rope_qk(qT, kT, layer, cos, sin, qk_norms, spec, constants)
    q_rows = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm, name="q_rope")
    k_rows = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm, name="k_rope")
    store_columns(q_out, q_rows)
    store_columns(k_out, k_rows)
    return q_rows, k_rows


@nki.jit
def cache_write_kernel(k, v, k_cache, v_cache, write_index, *, layer):
    """k_cache[layer, b, w:w+T] = k[b], v_cache[layer, b, w:w+T] = v[b] IN PLACE (w = write_index [1, 1] int32,
    a runtime value); k, v rows [B, T, kv·D]; returns (k_cache, v_cache)."""
    features = k_cache.shape[3] * k_cache.shape[4]
    _rows_count(k, "k", features)
    _rows_count(v, "v", features)
    write_cache(load_columns(k, name="k_columns"), load_columns(v, name="v_columns"), k_cache, v_cache, layer,
                write_index)
    return k_cache, v_cache


@nki.jit
def attention_kernel(q, k_cache, v_cache, mask_bias, *, layer, spec):
    """attn rows [B, T, heads·D] (cache dtype) of rotated queries q [B, T, heads·D] over layer `layer` of the
    caches [L, B, S, kv, D] with mask_bias [NM, B, T, S] table spec.layer_mask[layer]; scaling, softcap,
    softmax and weights·V as attention()."""
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    qT = load_columns(q, dtype=nl.float32, name="q_columns")
    constants = AttentionConstants(spec)
    attn = attend(qT, k_cache, v_cache, layer, mask_bias, spec, constants)
    out = nl.ndarray(q.shape, dtype=k_cache.dtype, buffer=nl.shared_hbm, name="attn")
    store_columns(attn, out)
    return out
