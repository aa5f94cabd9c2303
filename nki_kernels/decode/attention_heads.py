"""Decode attention's head layouts and its q/k stages: the head-dim RMSNorm and RoPE on column tiles.

Layouts: R = B·T rows (row r = b·T + t), features on partitions in natural column tiles (nki_kernels.decode.tiles): a
tensor of F features is SBUF [128, ceil(F/128), R] with element [p, i, r] = feature i·128 + p of row r. q has heads·D
features (feature h·D + d is head h's component d), k and v kv_heads·D; kv head g serves query heads g·G .. g·G + G - 1
(G = heads / kv_heads). D must divide 128 (several heads per tile) or be a multiple of 256 (a head spans whole tiles,
the rotate-half halves are whole tiles); F need not be a multiple of 128 (a ragged last tile is read only on the
partitions its features use).

Norm and RoPE stay in column tiles (few free elements per instruction). The per-head mean square is a cross-partition
sum: one matmul with a block-of-ones matrix (1/D inside each head's partitions). Rotate-half crosses partitions when
D <= 128: one matmul with a signed permutation; for D >= 256 it swaps whole tiles.
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.tiles import (
    feature_layout,
    fp32_per_psum_bank,
    natural_tiles,
    rows_to_natural_columns,
    tile_runs,
)
from nki_kernels.svd_matmul import spans


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


def kv_head_place(g, d):
    """(partition offset, first column tile) of kv head g's features in column tiles of kv_heads·D features."""
    pmax = nl.tile_size.pmax
    return (g * d) % pmax, (g * d) // pmax
