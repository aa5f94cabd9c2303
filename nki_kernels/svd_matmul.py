"""Fused low-rank matmul Y = X·U·V as NKI kernels, following NeuronMM's two-stage design.

Shapes: tokens T, input features K, rank r, output features N; X [T, K], U [K, r], V [r, N].

Stage 1 makes (X·U)ᵀ [r, tokens] with a U tile stationary and an Xᵀ tile moving, so the rank lands on the
partition axis (implicit transposition). Stage 2 contracts that over the rank directly, in one of two ways:
  rows: stationary (XU)ᵀ [r, ≤128 tokens], moving V [r, ≤512 of N]  → Y tile [tokens, N]
  cols: stationary V [r, ≤128 of N],       moving (XU)ᵀ [r, ≤512 tokens] → Yᵀ tile [N, tokens]
Caching, per token block of `block_t` tokens: X is loaded once (in K blocks of `block_k` rows, each feeding
every rank tile); the whole (XU)ᵀ strip stays in SBUF and serves every N block; U arrives as full-width rows
one K block at a time (K permuted so that each partition reads q whole rows as one contiguous run: see
k_slots), V in blocks of `block_n` columns. So for T ≤ block_t every byte of X, U and V crosses HBM once and
Y is written once.
Pipelining: the next K block's X, U rows and X transposes are issued before the current block's matmuls, so
DMAs and PSUM evictions overlap the PE. PSUM accumulates in float32 (partial sums of several K blocks add up
in a float32 SBUF accumulator); outputs have the inputs' dtype. X rows are loaded whole-row (long contiguous
DMAs) and turned on the PE; a single token's Yᵀ column is turned back into a row before it is written.

fp8 factors (float8_e4m3, Trainium's ±240 format, with float32 scales u_scale [r] and v_scale [N]) take the same
path: they cross HBM as fp8 (half of bf16's bytes) and meet bf16 / fp16 X on TensorE; u_scale multiplies (XU)ᵀ as
stage 1's PSUM is evicted (rank on the partitions: one scale per partition), v_scale each output tile as stage 2's
PSUM is evicted (per partition in the cols layouts; repeated over the token partitions in the rows layout).
Kernels (all return a new tensor in `nl.shared_hbm`):
  svd_matmul_kernel(x [T,K], u, v)         → y [T, N]   (stage 2 rows)
  svd_matmul_t_out_kernel(x [T,K], u, v)   → yᵀ [N, T]  (stage 2 cols)
  svd_matmul_decode_kernel(x [T,K], u, v)  → y [T, N]   (stage 2 cols: the few tokens are the moving operand,
                                                         Yᵀ tiles turned back on the PE; for small T)
each also as kernel(x, u, v, u_scale, v_scale) with fp8 factors.
The transposed-input variant (xᵀ [K, T] given, so no on-chip transpose of X) is `svd_mlp.svd_mlp_down_kernel`.
Block sizes are keyword arguments fixed at trace time; `nki_kernels.dispatch` picks them from the tuned table.
"""

from __future__ import annotations

import dataclasses
import enum

from nki_kernels.binding import nisa, nki, nl


def spans(total, step):
    """[(start, size)] covering range(total) in steps of `step`; the last one is ragged."""
    return [(start, min(step, total - start)) for start in range(0, total, step)]


def check_block(name, value, multiple_of):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple_of:
        raise ValueError(f"{name}: got {value!r}, expected a positive multiple of {multiple_of}")


def check_2d(kernel, name, tensor, layout):
    if len(tensor.shape) != 2:
        raise ValueError(f"{kernel}: {name} must be 2-D {layout}, got shape {tuple(tensor.shape)}")


def check_operand_dtypes(kernel, **tensors):
    """All operands share one TensorE float dtype (bf16, fp16 or fp32)."""
    supported = (nl.bfloat16, nl.float16, nl.float32)
    names = list(tensors)
    first = tensors[names[0]].dtype
    for name in names:
        dtype = tensors[name].dtype
        if dtype not in supported:
            raise TypeError(f"{kernel}: {name} has dtype {dtype}, expected bfloat16, float16 or float32")
        if dtype != first:
            raise TypeError(
                f"{kernel}: {name} has dtype {dtype} but {names[0]} has {first}; all operands must share one dtype"
            )


def check_scaled_factors(kernel, x_name, x, u, v, u_scale, v_scale, u_name="u", v_name="v"):
    """Dtypes of a factor pair: x's dtype with no scales, or fp8 with float32 scales u_scale [r], v_scale [N].

    fp8 factors (float8_e4m3, Trainium's ±240 format) are the matmul operand beside bf16 / fp16 activations:
    TensorE takes fp8 next to any 2-byte float, but fp32 only next to fp32. Returns whether the pair is fp8.
    """
    if u_scale is None and v_scale is None:
        check_operand_dtypes(kernel, **{x_name: x, u_name: u, v_name: v})
        return False
    for name, tensor in ((u_name, u), (v_name, v)):
        if tensor.dtype != nl.float8_e4m3:
            raise TypeError(
                f"{kernel}: {name} has dtype {tensor.dtype} with scales given; expected float8_e4m3 (fp8 weights)"
            )
    if x.dtype not in (nl.bfloat16, nl.float16):
        raise TypeError(f"{kernel}: {x_name} has dtype {x.dtype}; fp8 factors need bfloat16 or float16 activations")
    for name, scale, length in ((f"{u_name}_scale", u_scale, u.shape[1]), (f"{v_name}_scale", v_scale, v.shape[1])):
        if scale is None:
            raise TypeError(f"{kernel}: {name} is missing; fp8 factors need both scales")
        if scale.dtype != nl.float32 or tuple(scale.shape) != (length,):
            raise TypeError(
                f"{kernel}: {name} is {scale.dtype} {tuple(scale.shape)}; expected float32 of shape ({length},)"
            )
    return True


def load_scale_columns(scale, size):
    """scale [C] (HBM, float32) as [cs, 1] SBUF views, one per 128 entries (entry c0 + p on partition p): the
    operands of scaled PSUM evictions when C lies on the partitions."""
    row = load_scale_row(scale, 0, size)
    return scale_columns(row, [(cs, slice(c0, c0 + cs)) for c0, cs in spans(size, nl.tile_size.pmax)])


def load_scale_row(scale, c0, cs):
    """scale[c0:c0+cs] (HBM, float32) as one contiguous [1, cs] SBUF row: one DMA of cs·4 bytes (a DMA that puts
    one 4-byte element on each partition moves data at a small fraction of the rate)."""
    row = nl.ndarray((1, cs), dtype=nl.float32, buffer=nl.sbuf, name="scale_row")
    nisa.dma_copy(dst=row, src=scale[c0 : c0 + cs].reshape((1, cs)))
    return row


def scale_columns(row, pieces):
    """Pieces of a scale row turned onto the partitions: for each (rows, columns) of `pieces` (columns a slice of
    `row`'s free dim, rows ≤ 128 entries, the full pieces first) a [rows, 1] SBUF view whose partition p holds
    the piece's entry p. Turned on the PE into one PSUM tile, evicted by one or two copies."""
    pmax = nl.tile_size.pmax
    turned = nl.ndarray((pmax, len(pieces)), dtype=nl.float32, buffer=nl.psum, name="scale_psum")
    for j, (rows, columns) in enumerate(pieces):
        nisa.nc_transpose(dst=turned[0:rows, j : j + 1], data=row[0:1, columns])
    tile = nl.ndarray((pmax, len(pieces)), dtype=nl.float32, buffer=nl.sbuf, name="scale_columns")
    full = sum(rows == pmax for rows, _ in pieces)
    if full:
        nisa.tensor_copy(dst=tile[0:pmax, 0:full], src=turned[0:pmax, 0:full])
    for j in range(full, len(pieces)):
        rows = pieces[j][0]
        nisa.tensor_copy(dst=tile[0:rows, j : j + 1], src=turned[0:rows, j : j + 1])
    return [tile[0:rows, j : j + 1] for j, (rows, _) in enumerate(pieces)]


def check_factors(kernel, k_name, k, u, v, u_name="u", v_name="v"):
    """u [k, r] and v [r, N] chain onto an input with k features; returns (r, N)."""
    check_2d(kernel, u_name, u, "[K, r]")
    check_2d(kernel, v_name, v, "[r, N]")
    if u.shape[0] != k:
        raise ValueError(f"{kernel}: {u_name} has shape {tuple(u.shape)}, expected {k} rows to match {k_name} = {k}")
    if v.shape[0] != u.shape[1]:
        raise ValueError(
            f"{kernel}: {v_name} has shape {tuple(v.shape)}, expected {u.shape[1]} rows to match "
            f"the rank (columns of {u_name})"
        )
    return u.shape[1], v.shape[1]


def check_blocks(block_t, block_k, block_n):
    pmax = nl.tile_size.pmax
    check_block("block_t", block_t, pmax)
    check_block("block_k", block_k, pmax)
    check_block("block_n", block_n, pmax)


def evict(dst, src, i, scale=None):
    """PSUM → SBUF copy with cast: even i on VectorE, odd i on ScalarE (an activation copy), so evictions of
    consecutive tiles run side by side instead of queueing on one engine. scale: None, or a float32 [P, 1]
    tile multiplying each partition (fp8 weights' per-channel scales), applied in float32 before the cast."""
    if scale is not None and i % 2:
        nisa.activation(dst=dst, op=nl.copy, data=src, scale=scale)
    elif scale is not None:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=scale)
    elif i % 2:
        nisa.activation(dst=dst, op=nl.copy, data=src)
    else:
        nisa.tensor_copy(dst=dst, src=src)


def load_row_block(w, c0, cs):
    """Columns [c0, c0+cs) of w [R, C] in SBUF as blk[0:rt, ri, 0:cs] = w[R tile ri, c0:c0+cs]."""
    pmax = nl.tile_size.pmax
    row_tiles = spans(w.shape[0], pmax)
    blk = nl.ndarray((pmax, len(row_tiles), cs), dtype=w.dtype, buffer=nl.sbuf, name="weight_block")
    for ri, (r0, rt) in enumerate(row_tiles):
        nisa.dma_copy(dst=blk[0:rt, ri, 0:cs], src=w[r0 : r0 + rt, c0 : c0 + cs])
    return blk


def k_slots(k0, ks):
    """How rows [k0, k0+ks) of a contraction (or output) dimension map onto (partition, slot) in SBUF:
    [(kt, rows)] per slot, `rows` the rows (a slice) whose partition p is row number p of the slice.

    A block of whole 128-row tiles is laid out permuted: partition p holds q = ks/128 consecutive rows
    (slot i ↔ rows k0 + p·q + i), so each partition's share of U is one contiguous q·r run in HBM. A ragged
    block falls back to plain 128-row tiles. The contraction does not care about the order of K, as long as
    X and U use the same one.
    """
    pmax = nl.tile_size.pmax
    if ks % pmax == 0:
        q = ks // pmax
        return [(pmax, slice(k0 + i, k0 + ks, q)) for i in range(q)]
    return [(kt, slice(k0 + i0, k0 + i0 + kt)) for i0, kt in spans(ks, pmax)]


def stage_x_rows(x, x_transposed, t0, tb, k0, ks):
    """X[t0:t0+tb, k0:k0+ks] as 128-token row tiles in SBUF (ks contiguous elements per token, one DMA per
    tile), grouped per ≤512-token chunk: [(c0, tc, [(s0, ts, rows)])]. With Xᵀ given this is only used for
    a single token, whose column of Xᵀ is contiguous as well."""
    pmax = nl.tile_size.pmax
    staged = []
    for c0, tc in spans(tb, nl.tile_size.gemm_moving_fmax):
        row_tiles = []
        for s0, ts in spans(tc, pmax):
            rows = nl.ndarray((ts, ks), dtype=x.dtype, buffer=nl.sbuf, name="x_rows")
            first = t0 + c0 + s0
            src = x[k0 : k0 + ks, first] if x_transposed else x[first : first + ts, k0 : k0 + ks]
            nisa.dma_copy(dst=rows, src=src)
            row_tiles.append((s0, ts, rows))
        staged.append((c0, tc, row_tiles))
    return staged


def load_k_block(x, x_transposed, t0, tb, factors, k0, ks):
    """Xᵀ strip and U rows of K rows [k0, k0+ks) for one token block, in the k_slots layout.

    strip[0:kt, slot, 0:tb] = X[tokens, K rows of the slot]ᵀ; for each u in factors, rows[0:kt, slot, 0:r] =
    u[K rows of the slot, :] (permuted blocks: one DMA whose per-partition run is q full rows of U). Xᵀ tiles
    come straight from Xᵀ when it is given (T > 1); otherwise X rows are staged and turned on the PE, one
    eviction per ≤512-token chunk.
    """
    pmax = nl.tile_size.pmax
    slots = k_slots(k0, ks)
    strip = nl.ndarray((pmax, len(slots), tb), dtype=x.dtype, buffer=nl.sbuf, name="x_strip")
    direct = x_transposed and tb > 1
    staged = None if direct else stage_x_rows(x, x_transposed, t0, tb, k0, ks)
    if direct and ks % pmax == 0 and tb == x.shape[1]:
        # All tokens: the block of Xᵀ is contiguous, so each partition reads its q rows as one run.
        nisa.dma_copy(dst=strip, src=x[k0 : k0 + ks, 0:tb].reshape((pmax, len(slots), tb)))
    elif direct:
        for slot, (kt, k_rows) in enumerate(slots):
            nisa.dma_copy(dst=strip[0:kt, slot, 0:tb], src=x[k_rows, t0 : t0 + tb])
    u_rows = []
    for u in factors:
        r = u.shape[1]
        rows = nl.ndarray((pmax, len(slots), r), dtype=u.dtype, buffer=nl.sbuf, name="u_rows")
        if ks % pmax == 0:
            nisa.dma_copy(dst=rows, src=u[k0 : k0 + ks, 0:r].reshape((pmax, len(slots), r)))
        else:
            for slot, (kt, k_rows) in enumerate(slots):
                nisa.dma_copy(dst=rows[0:kt, slot, 0:r], src=u[k_rows, 0:r])
        u_rows.append(rows)
    for slot, (kt, k_rows) in enumerate(slots):
        columns = slice(k_rows.start - k0, k_rows.stop - k0, k_rows.step)
        for c0, tc, row_tiles in staged or ():
            turned = nl.ndarray((kt, tc), dtype=x.dtype, buffer=nl.psum, name="xT_psum")
            for s0, ts, rows in row_tiles:
                nisa.nc_transpose(dst=turned[0:kt, s0 : s0 + ts], data=rows[0:ts, columns])
            evict(strip[0:kt, slot, c0 : c0 + tc], turned, slot)
    return strip, u_rows


def stage1(x, x_transposed, t0, tb, factors, block_k, scales=None):
    """(X·U)ᵀ of one token block for each U in `factors`, kept in SBUF in x's dtype: xu[0:rt, rank_tile, 0:tb],
    rank tile on the partitions (one X load serves every factor).

    K is walked in blocks of block_k rows. Within a block, groups of rank tiles (as many accumulators as PSUM
    holds beside one transpose tile) accumulate over the block's K tiles, K loop outermost; with several K
    blocks the partial sums add up in a float32 SBUF accumulator and the last add writes xu.
    scales: None, or per factor the `load_scale_columns` tiles of its per-rank scale (fp8 factors): the float32
    sum is multiplied by them as it is written to xu (rank on the partitions: one scale per partition).
    """
    pmax = nl.tile_size.pmax
    rank_tile_size = nl.tile_size.gemm_stationary_fmax
    k = factors[0].shape[0]
    token_chunks = spans(tb, nl.tile_size.gemm_moving_fmax)
    tiles_per_group = max(1, (nl.tile_size.psum_num_banks - 1) // len(token_chunks))
    k_blocks = spans(k, block_k)
    xus, totals = [], []
    for u in factors:
        rank_tile_count = len(spans(u.shape[1], rank_tile_size))
        xus.append(nl.ndarray((pmax, rank_tile_count, tb), dtype=x.dtype, buffer=nl.sbuf, name="xuT_strip"))
        totals.append(
            nl.ndarray((pmax, rank_tile_count, tb), dtype=nl.float32, buffer=nl.sbuf, name="xuT_total")
            if len(k_blocks) > 1
            else None
        )
    upcoming = load_k_block(x, x_transposed, t0, tb, factors, *k_blocks[0])
    for k_block, (k0, ks) in enumerate(k_blocks):
        strip, u_rows = upcoming
        upcoming = None
        if k_block + 1 < len(k_blocks):
            upcoming = load_k_block(x, x_transposed, t0, tb, factors, *k_blocks[k_block + 1])
        first, last = k_block == 0, k_block == len(k_blocks) - 1
        slots = k_slots(k0, ks)
        for factor, (u, rows, xu, total) in enumerate(zip(factors, u_rows, xus, totals)):
            rank_tiles = spans(u.shape[1], rank_tile_size)
            for group_start in range(0, len(rank_tiles), tiles_per_group):
                group = rank_tiles[group_start : group_start + tiles_per_group]
                accs = [
                    [
                        nl.ndarray((rank_size, chunk_size), dtype=nl.float32, buffer=nl.psum, name="xuT_psum")
                        for _, chunk_size in token_chunks
                    ]
                    for _, rank_size in group
                ]
                for slot, (kt, _) in enumerate(slots):
                    for member, (rank_start, rank_size) in enumerate(group):
                        for chunk, (chunk_start, chunk_size) in enumerate(token_chunks):
                            nisa.nc_matmul(
                                dst=accs[member][chunk],
                                stationary=rows[0:kt, slot, rank_start : rank_start + rank_size],
                                moving=strip[0:kt, slot, chunk_start : chunk_start + chunk_size],
                                accumulate=slot > 0,
                            )
                for member, (_, rank_size) in enumerate(group):
                    rank_tile = group_start + member
                    scale = None if scales is None else scales[factor][rank_tile]
                    for chunk, (chunk_start, chunk_size) in enumerate(token_chunks):
                        tokens = slice(chunk_start, chunk_start + chunk_size)
                        engine_turn = member * len(token_chunks) + chunk
                        # With a scale the last add goes to the accumulator, scaled on its way to xu.
                        out = (xu if last and (first or scale is None) else total)[0:rank_size, rank_tile, tokens]
                        if first:
                            evict(out, accs[member][chunk], engine_turn, scale if last else None)
                        else:
                            nisa.tensor_tensor(
                                dst=out,
                                data1=total[0:rank_size, rank_tile, tokens],
                                data2=accs[member][chunk],
                                op=nl.add,
                            )
                            if last and scale is not None:
                                evict(xu[0:rank_size, rank_tile, tokens], out, engine_turn, scale)
                del accs  # free the PSUM banks before the next group's
        del strip, u_rows, rows  # free this K block before the one after next is loaded
    return xus


def load_scale_rows(scale, nb0, nbs, rows):
    """scale[nb0:nb0+nbs] (HBM, float32) repeated on `rows` partitions: a [rows, nbs] float32 SBUF tile, the
    operand of a scaled eviction when the scaled dim is free (one DMA of the row, broadcast on TensorE)."""
    row = nl.ndarray((1, nbs), dtype=nl.float32, buffer=nl.sbuf, name="scale_row")
    nisa.dma_copy(dst=row, src=scale[nb0 : nb0 + nbs].reshape((1, nbs)))
    repeated = nl.ndarray((rows, nbs), dtype=nl.float32, buffer=nl.sbuf, name="scale_rows")
    for c0, cs in spans(nbs, nl.tile_size.psum_fmax):
        nisa.tensor_copy(dst=repeated[0:rows, c0 : c0 + cs], src=nl.broadcast_to(row[0:1, c0 : c0 + cs], (rows, cs)))
    return repeated


def stage2_rows(xu, v, y, t0, tb, block_n, v_scale=None):
    """y[t0:t0+tb, :] = X·U·V from the (XU)ᵀ strip: stationary (XU)ᵀ [r, ≤128 tokens], moving V [r, ≤512].

    v_scale: None, or V's per-column scales [N] in HBM (fp8 V), multiplied into each PSUM tile on VectorE as
    it is evicted (N is the free dim here, so the scales are repeated on every token partition)."""
    r, n = v.shape
    r_tiles = spans(r, nl.tile_size.pmax)
    for nb0, nbs in spans(n, block_n):
        # The few scale bytes first, so they do not queue behind the V block.
        scale_rows = None if v_scale is None else load_scale_rows(v_scale, nb0, nbs, min(tb, nl.tile_size.pmax))
        v_blk = load_row_block(v, nb0, nbs)
        n_chunks = spans(nbs, nl.tile_size.gemm_moving_fmax)
        for s0, ts in spans(tb, nl.tile_size.gemm_stationary_fmax):
            accs = [nl.ndarray((ts, nc), dtype=nl.float32, buffer=nl.psum, name="y_psum") for _, nc in n_chunks]
            for rank_tile, (r0, rt) in enumerate(r_tiles):
                for chunk, (c0, nc) in enumerate(n_chunks):
                    nisa.nc_matmul(
                        dst=accs[chunk],
                        stationary=xu[0:rt, rank_tile, s0 : s0 + ts],
                        moving=v_blk[0:rt, rank_tile, c0 : c0 + nc],
                        accumulate=rank_tile > 0,
                    )
            y_rows = nl.ndarray((ts, nbs), dtype=y.dtype, buffer=nl.sbuf, name="y_rows")
            for chunk, (c0, nc) in enumerate(n_chunks):
                if scale_rows is None:
                    evict(y_rows[0:ts, c0 : c0 + nc], accs[chunk], chunk)
                else:
                    nisa.tensor_tensor(
                        dst=y_rows[0:ts, c0 : c0 + nc],
                        data1=accs[chunk],
                        data2=scale_rows[0:ts, c0 : c0 + nc],
                        op=nl.multiply,
                    )
            del accs
            nisa.dma_copy(dst=y[t0 + s0 : t0 + s0 + ts, nb0 : nb0 + nbs], src=y_rows)
        del v_blk, scale_rows  # single-buffered: free before the next block is loaded


def stage2_cols_psum(xu, v_blk, r_tiles, columns, nt, tb):
    """PSUM accumulators of Yᵀ for the nt ≤ 128 V-block columns `columns` (a slice) and tokens 0:tb, one per
    ≤512-token chunk, with the chunks.

    Stationary V tile [r, nt] (loaded once per rank tile, reused for every chunk), moving (XU)ᵀ.
    """
    chunks = spans(tb, nl.tile_size.gemm_moving_fmax)
    accs = [nl.ndarray((nt, tc), dtype=nl.float32, buffer=nl.psum, name="yT_psum") for _, tc in chunks]
    for rank_tile, (r0, rt) in enumerate(r_tiles):
        for chunk, (c0, tc) in enumerate(chunks):
            nisa.nc_matmul(
                dst=accs[chunk],
                stationary=v_blk[0:rt, rank_tile, columns],
                moving=xu[0:rt, rank_tile, c0 : c0 + tc],
                accumulate=rank_tile > 0,
            )
    return chunks, accs


def stage2_cols_tile(xu, v_blk, r_tiles, j0, nt, tb, dtype, scale=None):
    """SBUF tile [nt, tb] in `dtype` of Yᵀ for V-block columns j0:j0+nt (nt ≤ 128) and tokens 0:tb: the
    stage2_cols_psum accumulators evicted (times `scale`, a [nt, 1] float32 tile of V's column scales, when
    given), their PSUM banks free again once this returns."""
    chunks, accs = stage2_cols_psum(xu, v_blk, r_tiles, slice(j0, j0 + nt), nt, tb)
    yT_tile = nl.ndarray((nt, tb), dtype=dtype, buffer=nl.sbuf, name="yT_tile")
    for chunk, (c0, tc) in enumerate(chunks):
        evict(yT_tile[0:nt, c0 : c0 + tc], accs[chunk], j0 // nl.tile_size.pmax + chunk, scale)
    return yT_tile


def turn_into_rows(tile, rows, columns, nt, tb):
    """rows[s][0:ts, columns] = tile[0:nt, s0:s0+ts]ᵀ for each ≤128-token piece s, through the PE."""
    for s, (s0, ts) in enumerate(spans(tb, nl.tile_size.pmax)):
        turned = nl.ndarray((ts, nt), dtype=tile.dtype, buffer=nl.psum, name="turn_psum")
        nisa.nc_transpose(dst=turned, data=tile[0:nt, s0 : s0 + ts])
        evict(rows[s][0:ts, columns], turned, s)


def block_scale_columns(v_scale, nb0, nbs):
    """None, or V's column scales of the N block [nb0, nb0+nbs) as [nt, 1] tiles per ≤128 columns."""
    if v_scale is None:
        return None
    return load_scale_columns(v_scale[nb0 : nb0 + nbs], nbs)


def stage2_cols(xu, v, yT, t0, tb, block_n, v_scale=None):
    """yT[:, t0:t0+tb] = (X·U·V)ᵀ from the (XU)ᵀ strip, one [≤128 of N, tb] tile at a time.

    With T = 1 in all (yT [N, 1]) the token's column is turned into one row per N block and written as the
    contiguous run it is in yT; a ragged last block of one token out of several is a strided column and goes
    out as Yᵀ tiles like any other block.
    """
    r, n = v.shape
    single_token = yT.shape[1] == 1
    r_tiles = spans(r, nl.tile_size.pmax)
    for nb0, nbs in spans(n, block_n):
        scales = block_scale_columns(v_scale, nb0, nbs)  # before the V block: see stage2_rows
        v_blk = load_row_block(v, nb0, nbs)
        row = [nl.ndarray((1, nbs), dtype=yT.dtype, buffer=nl.sbuf, name="yT_row")] if single_token else None
        for tile_index, (j0, nt) in enumerate(spans(nbs, nl.tile_size.gemm_stationary_fmax)):
            scale = None if scales is None else scales[tile_index]
            yT_tile = stage2_cols_tile(xu, v_blk, r_tiles, j0, nt, tb, yT.dtype, scale)
            if row is None:
                nisa.dma_copy(dst=yT[nb0 + j0 : nb0 + j0 + nt, t0 : t0 + tb], src=yT_tile)
            else:
                turn_into_rows(yT_tile, row, slice(j0, j0 + nt), nt, tb)
        if row is not None:
            nisa.dma_copy(dst=yT[nb0 : nb0 + nbs, t0], src=row[0])
        del v_blk, scales  # single-buffered: free before the next block is loaded


def stage2_cols_to_rows(xu, v, y, t0, tb, block_n, v_scale=None):
    """y[t0:t0+tb, :] through Yᵀ tiles (few tokens moving), turned back to rows on the PE."""
    r, n = v.shape
    pmax = nl.tile_size.pmax
    r_tiles = spans(r, pmax)
    token_tiles = spans(tb, pmax)
    for nb0, nbs in spans(n, block_n):
        scales = block_scale_columns(v_scale, nb0, nbs)  # before the V block: see stage2_rows
        v_blk = load_row_block(v, nb0, nbs)
        y_rows = [nl.ndarray((ts, nbs), dtype=y.dtype, buffer=nl.sbuf, name="y_rows") for _, ts in token_tiles]
        for tile_index, (j0, nt) in enumerate(spans(nbs, nl.tile_size.gemm_stationary_fmax)):
            scale = None if scales is None else scales[tile_index]
            yT_tile = stage2_cols_tile(xu, v_blk, r_tiles, j0, nt, tb, y.dtype, scale)
            turn_into_rows(yT_tile, y_rows, slice(j0, j0 + nt), nt, tb)
        for (s0, ts), rows in zip(token_tiles, y_rows):
            nisa.dma_copy(dst=y[t0 + s0 : t0 + s0 + ts, nb0 : nb0 + nbs], src=rows)
        del v_blk, y_rows, scales  # single-buffered: free before the next block is loaded


class Stage2(enum.Enum):
    """How stage 2 contracts the (XU)ᵀ strip with V, and so the layout it writes."""

    ROWS = "rows"  # stationary (XU)ᵀ, moving V → y [T, N]
    COLS = "cols"  # stationary V, moving (XU)ᵀ → yᵀ [N, T]
    COLS_TO_ROWS = "cols_to_rows"  # as COLS, each Yᵀ tile turned back on the PE → y [T, N] (decode)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A kernel's block sizes (its block_t, block_k, block_n keywords), multiples of 128 (`check`): t tokens per
    block (the (XU)ᵀ strip held in SBUF), k rows of X and U per K block, n columns of V per DMA block."""

    t: int
    k: int
    n: int

    def check(self):
        check_blocks(self.t, self.k, self.n)


def svd_matmul_body(kernel, x, u, v, u_scale, v_scale, *, x_transposed, stage2, blocks):
    """Shared body of the svd_matmul kernels: validation, token blocking, the two stages.

    x_transposed: x is xᵀ [K, T] in HBM (else x [T, K]); stage2: a Stage2, which also fixes the output layout.
    u_scale, v_scale: None, or float32 [r] / [N] scales of fp8 u / v (see check_scaled_factors). blocks: Blocks.
    """
    x_name = "xT" if x_transposed else "x"
    check_2d(kernel, x_name, x, "[K, T]" if x_transposed else "[T, K]")
    k, t = (x.shape[0], x.shape[1]) if x_transposed else (x.shape[1], x.shape[0])
    r, n = check_factors(kernel, "xT.shape[0]" if x_transposed else "x.shape[1]", k, u, v)
    fp8 = check_scaled_factors(kernel, x_name, x, u, v, u_scale, v_scale)
    blocks.check()
    y_transposed = stage2 is Stage2.COLS
    out_shape = (n, t) if y_transposed else (t, n)
    out = nl.ndarray(out_shape, dtype=x.dtype, buffer=nl.shared_hbm, name="yT" if y_transposed else "y")
    write_stage2 = {Stage2.ROWS: stage2_rows, Stage2.COLS: stage2_cols, Stage2.COLS_TO_ROWS: stage2_cols_to_rows}
    # The per-rank scales stay in SBUF for every token block (r float32 values).
    scales = [load_scale_columns(u_scale, r)] if fp8 else None
    for t0, tb in spans(t, blocks.t):
        (xu,) = stage1(x, x_transposed, t0, tb, [u], blocks.k, scales)
        write_stage2[stage2](xu, v, out, t0, tb, blocks.n, v_scale if fp8 else None)
        del xu  # dead before the next token block's stage 1
    return out


@nki.jit
def svd_matmul_kernel(x, u, v, u_scale=None, v_scale=None, *, block_t=512, block_k=1024, block_n=2048):
    """y [T, N] = x [T, K] · u [K, r] · v [r, N], all in HBM, row-major; y has x's dtype.

    fp8 factors: u, v float8_e4m3 with float32 scales u_scale [r], v_scale [N] and bf16 / fp16 x give
    y = ((x·u)·diag(u_scale))·v·diag(v_scale): fp8 goes from HBM to SBUF as is (half of bf16's bytes) and into
    TensorE beside bf16 x; u_scale multiplies the float32 (X·U)ᵀ as stage 1's PSUM is evicted (one scale per
    partition), v_scale the float32 output tiles as stage 2's PSUM is evicted. The other kernels take the same.

    block_t: tokens per block (the (XU)ᵀ strip held in SBUF); block_k: rows of X and U per K block; block_n:
    columns of V per DMA block. All multiples of 128. T ≤ block_t reads X, U, V once and writes Y once.
    """
    return svd_matmul_body(
        "svd_matmul_kernel",
        x,
        u,
        v,
        u_scale,
        v_scale,
        x_transposed=False,
        stage2=Stage2.ROWS,
        blocks=Blocks(block_t, block_k, block_n),
    )


@nki.jit
def svd_matmul_t_out_kernel(x, u, v, u_scale=None, v_scale=None, *, block_t=512, block_k=1024, block_n=2048):
    """yᵀ [N, T] = (x [T, K] · u [K, r] · v [r, N])ᵀ: the layout a following transposed-input kernel
    (svd_mlp_down_kernel) consumes."""
    return svd_matmul_body(
        "svd_matmul_t_out_kernel",
        x,
        u,
        v,
        u_scale,
        v_scale,
        x_transposed=False,
        stage2=Stage2.COLS,
        blocks=Blocks(block_t, block_k, block_n),
    )


@nki.jit
def svd_matmul_decode_kernel(x, u, v, u_scale=None, v_scale=None, *, block_t=512, block_k=1024, block_n=2048):
    """y [T, N] = x [T, K] · u [K, r] · v [r, N] with the tokens as the moving operand in both stages.

    Meant for small T (decode): a stage-2 matmul then costs ~64 PE cycles per 128 output features instead of
    ~128; Yᵀ tiles are turned back into rows on the PE. Small T is HBM-bound on the emulator's cost model, so
    the PE cycles saved are hidden while the extra evictions are not; dispatch picks it only where the tuned
    table does.
    """
    return svd_matmul_body(
        "svd_matmul_decode_kernel",
        x,
        u,
        v,
        u_scale,
        v_scale,
        x_transposed=False,
        stage2=Stage2.COLS_TO_ROWS,
        blocks=Blocks(block_t, block_k, block_n),
    )
