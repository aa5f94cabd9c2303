"""Fused low-rank matmul Y = X·U·V as NKI kernels, following NeuronMM's two-stage design.

Shapes: tokens T, input features K, rank r, output features N; X [T, K], U [K, r], V [r, N].

Stage 1 makes (X·U)ᵀ [r, tokens] with a U tile stationary and an Xᵀ tile moving, so the rank lands on the
partition axis (implicit transposition). Stage 2 contracts that over the rank directly, in one of two ways:
  rows: stationary (XU)ᵀ [r, ≤128 tokens], moving V [r, ≤512 of N]  → Y tile [tokens, N]
  cols: stationary V [r, ≤128 of N],       moving (XU)ᵀ [r, ≤512 tokens] → Yᵀ tile [N, tokens]
Caching, per token block of `block_t` tokens: the Xᵀ strip is loaded once and serves every r block; the whole
(XU)ᵀ strip stays in SBUF and serves every N block; U and V arrive in blocks of `block_r` / `block_n` columns,
one DMA per 128-row tile with `block_*`-long contiguous rows. So for T ≤ block_t every byte of X, U and V
crosses HBM once and Y is written once. PSUM accumulates in float32; outputs have the inputs' dtype.

Kernels (all return a new tensor in `nl.shared_hbm`):
  svd_matmul_kernel(x [T,K], u, v)         → y [T, N]   (stage 2 rows)
  svd_matmul_t_out_kernel(x [T,K], u, v)   → yᵀ [N, T]  (stage 2 cols)
  svd_matmul_t_in_kernel(xT [K,T], u, v)   → y [T, N]   (Xᵀ given: no on-chip transpose of X)
  svd_matmul_decode_kernel(x [T,K], u, v)  → y [T, N]   (stage 2 cols: the few tokens are the moving operand,
                                                         Yᵀ tiles turned back on the PE; for small T)
Block sizes are keyword arguments fixed at trace time; `nki_kernels.dispatch` picks them from the tuned table.
"""

from __future__ import annotations

from nki_kernels.binding import nki, nl, nisa

# K tiles of X rows staged per DMA before the PE turns them (16 x 128 bf16 columns: 512 KiB per DMA).
X_ROW_SEGMENT_TILES = 16


def spans(total, step):
    """[(start, size)] covering range(total) in steps of `step`; the last one is ragged."""
    return [(start, min(step, total - start)) for start in range(0, total, step)]


def check_block(name, value, multiple_of):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple_of:
        raise ValueError(f"{name}: got {value!r}, expected a positive multiple of {multiple_of}")


def check_2d(kernel, name, tensor, layout):
    if len(tensor.shape) != 2:
        raise ValueError(f"{kernel}: {name} must be 2-D {layout}, got shape {tuple(tensor.shape)}")


def check_float_dtypes(kernel, **tensors):
    """All operands share one TensorE float dtype (bf16, fp16 or fp32)."""
    supported = (nl.bfloat16, nl.float16, nl.float32)
    names = list(tensors)
    first = tensors[names[0]].dtype
    for name in names:
        dtype = tensors[name].dtype
        if dtype not in supported:
            raise TypeError(f"{kernel}: {name} has dtype {dtype}, expected bfloat16, float16 or float32")
        if dtype != first:
            raise TypeError(f"{kernel}: {name} has dtype {dtype} but {names[0]} has {first}; "
                            f"all operands must share one dtype")


def check_factors(kernel, k_name, k, u, v, u_name="u", v_name="v"):
    """u [k, r] and v [r, N] chain onto an input with k features; returns (r, N)."""
    check_2d(kernel, u_name, u, "[K, r]")
    check_2d(kernel, v_name, v, "[r, N]")
    if u.shape[0] != k:
        raise ValueError(f"{kernel}: {u_name} has shape {tuple(u.shape)}, expected {k} rows to match "
                         f"{k_name} = {k}")
    if v.shape[0] != u.shape[1]:
        raise ValueError(f"{kernel}: {v_name} has shape {tuple(v.shape)}, expected {u.shape[1]} rows to match "
                         f"the rank (columns of {u_name})")
    return u.shape[1], v.shape[1]


def check_blocks(block_t, block_r, block_n):
    pmax = nl.tile_size.pmax
    check_block("block_t", block_t, pmax)
    check_block("block_r", block_r, pmax)
    check_block("block_n", block_n, pmax)


def load_x_strip(x, x_transposed, t0, tb):
    """Xᵀ of tokens [t0, t0+tb) in SBUF: strip[0:kt, ki, 0:tb] = X[t0:t0+tb, K tile ki]ᵀ.

    x is X [T, K] (`x_transposed` False) or Xᵀ [K, T] (True). From Xᵀ each K tile is one DMA of contiguous
    token rows. From X, 128-token row tiles are loaded whole and turned on the PE (nc_transpose to PSUM, one
    eviction per ≤512 tokens), X_ROW_SEGMENT_TILES K tiles at a time so the staging rows stay small for any K;
    a single token's row is already contiguous and goes straight onto partitions.
    """
    pmax = nl.tile_size.pmax
    k = x.shape[0] if x_transposed else x.shape[1]
    k_tiles = spans(k, pmax)
    strip = nl.ndarray((pmax, len(k_tiles), tb), dtype=x.dtype, buffer=nl.sbuf, name="x_strip")
    if x_transposed:
        for ki, (k0, kt) in enumerate(k_tiles):
            nisa.dma_copy(dst=strip[0:kt, ki, 0:tb], src=x[k0:k0 + kt, t0:t0 + tb])
        return strip
    if tb == 1:
        for ki, (k0, kt) in enumerate(k_tiles):
            nisa.dma_copy(dst=strip[0:kt, ki, 0:1], src=x[t0, k0:k0 + kt])
        return strip
    segment = X_ROW_SEGMENT_TILES * pmax
    for c0, tc in spans(tb, nl.tile_size.gemm_moving_fmax):
        for g0, gs in spans(k, segment):
            row_tiles = []
            for s0, ts in spans(tc, pmax):
                rows = nl.ndarray((ts, gs), dtype=x.dtype, buffer=nl.sbuf, name="x_rows")
                nisa.dma_copy(dst=rows, src=x[t0 + c0 + s0:t0 + c0 + s0 + ts, g0:g0 + gs])
                row_tiles.append((s0, ts, rows))
            for gi, (k0, kt) in enumerate(spans(gs, pmax)):
                ki = g0 // pmax + gi
                turned = nl.ndarray((kt, tc), dtype=x.dtype, buffer=nl.psum, name="xT_psum")
                for s0, ts, rows in row_tiles:
                    nisa.nc_transpose(dst=turned[0:kt, s0:s0 + ts], data=rows[0:ts, k0:k0 + kt])
                nisa.tensor_copy(dst=strip[0:kt, ki, c0:c0 + tc], src=turned)
    return strip


def load_row_block(w, c0, cs):
    """Columns [c0, c0+cs) of w [R, C] in SBUF as blk[0:rt, ri, 0:cs] = w[R tile ri, c0:c0+cs]."""
    pmax = nl.tile_size.pmax
    row_tiles = spans(w.shape[0], pmax)
    blk = nl.ndarray((pmax, len(row_tiles), cs), dtype=w.dtype, buffer=nl.sbuf, name="weight_block")
    for ri, (r0, rt) in enumerate(row_tiles):
        nisa.dma_copy(dst=blk[0:rt, ri, 0:cs], src=w[r0:r0 + rt, c0:c0 + cs])
    return blk


def stage1(strip, u, tb, block_r):
    """(X·U)ᵀ of one token block, kept in SBUF: xu[0:rt, rj, 0:tb], rank tile rj on the partitions.

    For each rank tile every token chunk (≤512, the moving width) has its own PSUM accumulator, so a U tile
    loaded as stationary streams all chunks before the next one is loaded.
    """
    pmax = nl.tile_size.pmax
    rank_tile = nl.tile_size.gemm_stationary_fmax
    k, r = u.shape
    k_tiles = spans(k, pmax)
    chunks = spans(tb, nl.tile_size.gemm_moving_fmax)
    xu = nl.ndarray((pmax, len(spans(r, rank_tile)), tb), dtype=u.dtype, buffer=nl.sbuf, name="xuT_strip")
    for b0, bs in spans(r, block_r):
        u_blk = load_row_block(u, b0, bs)
        for j0, rt in spans(bs, rank_tile):
            rj = (b0 + j0) // rank_tile
            accs = [nl.ndarray((rt, tc), dtype=nl.float32, buffer=nl.psum, name="xuT_psum") for _, tc in chunks]
            for ki, (k0, kt) in enumerate(k_tiles):
                for (c0, tc), acc in zip(chunks, accs):
                    nisa.nc_matmul(dst=acc, stationary=u_blk[0:kt, ki, j0:j0 + rt],
                                   moving=strip[0:kt, ki, c0:c0 + tc], accumulate=ki > 0)
            for (c0, tc), acc in zip(chunks, accs):
                nisa.tensor_copy(dst=xu[0:rt, rj, c0:c0 + tc], src=acc)
    return xu


def stage2_rows(xu, v, y, t0, tb, block_n):
    """y[t0:t0+tb, :] = X·U·V from the (XU)ᵀ strip: stationary (XU)ᵀ [r, ≤128 tokens], moving V [r, ≤512]."""
    r, n = v.shape
    r_tiles = spans(r, nl.tile_size.pmax)
    for nb0, nbs in spans(n, block_n):
        v_blk = load_row_block(v, nb0, nbs)
        n_chunks = spans(nbs, nl.tile_size.gemm_moving_fmax)
        for s0, ts in spans(tb, nl.tile_size.gemm_stationary_fmax):
            accs = [nl.ndarray((ts, nc), dtype=nl.float32, buffer=nl.psum, name="y_psum") for _, nc in n_chunks]
            for rj, (r0, rt) in enumerate(r_tiles):
                for (c0, nc), acc in zip(n_chunks, accs):
                    nisa.nc_matmul(dst=acc, stationary=xu[0:rt, rj, s0:s0 + ts],
                                   moving=v_blk[0:rt, rj, c0:c0 + nc], accumulate=rj > 0)
            y_rows = nl.ndarray((ts, nbs), dtype=y.dtype, buffer=nl.sbuf, name="y_rows")
            for (c0, nc), acc in zip(n_chunks, accs):
                nisa.tensor_copy(dst=y_rows[0:ts, c0:c0 + nc], src=acc)
            nisa.dma_copy(dst=y[t0 + s0:t0 + s0 + ts, nb0:nb0 + nbs], src=y_rows)


def stage2_cols_psum(xu, v_blk, r_tiles, j0, nt, tb):
    """PSUM accumulators of Yᵀ[j0:j0+nt of the V block, 0:tb] (one per ≤512-token chunk), with the chunks.

    Stationary V tile [r, nt ≤ 128] (loaded once per rank tile, reused for every chunk), moving (XU)ᵀ.
    """
    chunks = spans(tb, nl.tile_size.gemm_moving_fmax)
    accs = [nl.ndarray((nt, tc), dtype=nl.float32, buffer=nl.psum, name="yT_psum") for _, tc in chunks]
    for rj, (r0, rt) in enumerate(r_tiles):
        for i, (c0, tc) in enumerate(chunks):
            nisa.nc_matmul(dst=accs[i], stationary=v_blk[0:rt, rj, j0:j0 + nt],
                           moving=xu[0:rt, rj, c0:c0 + tc], accumulate=rj > 0)
    return chunks, accs


def stage2_cols(xu, v, yT, t0, tb, block_n):
    """yT[:, t0:t0+tb] = (X·U·V)ᵀ from the (XU)ᵀ strip, one [≤128 of N, tb] tile at a time."""
    r, n = v.shape
    r_tiles = spans(r, nl.tile_size.pmax)
    for nb0, nbs in spans(n, block_n):
        v_blk = load_row_block(v, nb0, nbs)
        for j0, nt in spans(nbs, nl.tile_size.gemm_stationary_fmax):
            chunks, accs = stage2_cols_psum(xu, v_blk, r_tiles, j0, nt, tb)
            yT_tile = nl.ndarray((nt, tb), dtype=yT.dtype, buffer=nl.sbuf, name="yT_tile")
            for i, (c0, tc) in enumerate(chunks):
                nisa.tensor_copy(dst=yT_tile[0:nt, c0:c0 + tc], src=accs[i])
            del accs  # free the PSUM banks before the next tile's accumulators start
            nisa.dma_copy(dst=yT[nb0 + j0:nb0 + j0 + nt, t0:t0 + tb], src=yT_tile)


def stage2_cols_to_rows(xu, v, y, t0, tb, block_n):
    """y[t0:t0+tb, :] through Yᵀ tiles (few tokens moving); tiles are turned back to rows on the PE.

    A single token's Yᵀ tile [nt, 1] is already the contiguous row segment y[t0, n0:n0+nt].
    """
    r, n = v.shape
    pmax = nl.tile_size.pmax
    r_tiles = spans(r, pmax)
    token_tiles = spans(tb, pmax)
    for nb0, nbs in spans(n, block_n):
        v_blk = load_row_block(v, nb0, nbs)
        y_rows = [nl.ndarray((ts, nbs), dtype=y.dtype, buffer=nl.sbuf, name="y_rows") for _, ts in token_tiles]
        for j0, nt in spans(nbs, nl.tile_size.gemm_stationary_fmax):
            chunks, accs = stage2_cols_psum(xu, v_blk, r_tiles, j0, nt, tb)
            yT_tile = nl.ndarray((nt, tb), dtype=y.dtype, buffer=nl.sbuf, name="yT_tile")
            for i, (c0, tc) in enumerate(chunks):
                nisa.tensor_copy(dst=yT_tile[0:nt, c0:c0 + tc], src=accs[i])
            del accs  # free the PSUM banks before the next tile's accumulators start
            if tb == 1:
                nisa.dma_copy(dst=y[t0, nb0 + j0:nb0 + j0 + nt], src=yT_tile)
                continue
            for (s0, ts), rows in zip(token_tiles, y_rows):
                turned = nl.ndarray((ts, nt), dtype=y.dtype, buffer=nl.psum, name="y_turn_psum")
                nisa.nc_transpose(dst=turned, data=yT_tile[0:nt, s0:s0 + ts])
                nisa.tensor_copy(dst=rows[0:ts, j0:j0 + nt], src=turned)
        if tb > 1:
            for (s0, ts), rows in zip(token_tiles, y_rows):
                nisa.dma_copy(dst=y[t0 + s0:t0 + s0 + ts, nb0:nb0 + nbs], src=rows)


def svd_matmul_body(kernel, x, u, v, x_transposed, y_transposed, decode, block_t, block_r, block_n):
    """Shared body of the svd_matmul kernels: validation, token blocking, the two stages."""
    check_2d(kernel, "xT" if x_transposed else "x", x, "[K, T]" if x_transposed else "[T, K]")
    k, t = (x.shape[0], x.shape[1]) if x_transposed else (x.shape[1], x.shape[0])
    _, n = check_factors(kernel, "xT.shape[0]" if x_transposed else "x.shape[1]", k, u, v)
    check_float_dtypes(kernel, **{"xT" if x_transposed else "x": x, "u": u, "v": v})
    check_blocks(block_t, block_r, block_n)
    out_shape = (n, t) if y_transposed else (t, n)
    out = nl.ndarray(out_shape, dtype=x.dtype, buffer=nl.shared_hbm, name="yT" if y_transposed else "y")
    for t0, tb in spans(t, block_t):
        strip = load_x_strip(x, x_transposed, t0, tb)
        xu = stage1(strip, u, tb, block_r)
        del strip  # the Xᵀ strip is dead once (XU)ᵀ exists; free its SBUF for the V blocks
        if y_transposed:
            stage2_cols(xu, v, out, t0, tb, block_n)
        elif decode:
            stage2_cols_to_rows(xu, v, out, t0, tb, block_n)
        else:
            stage2_rows(xu, v, out, t0, tb, block_n)
        del xu  # dead before the next token block's strip is loaded
    return out


@nki.jit
def svd_matmul_kernel(x, u, v, *, block_t=512, block_r=512, block_n=512):
    """y [T, N] = x [T, K] · u [K, r] · v [r, N], all in HBM, row-major; y has x's dtype.

    block_t: tokens per block (the Xᵀ and (XU)ᵀ strips held in SBUF); block_r / block_n: columns of U / V per
    DMA block. All multiples of 128. T ≤ block_t reads X, U, V once and writes Y once.
    """
    return svd_matmul_body("svd_matmul_kernel", x, u, v, False, False, False, block_t, block_r, block_n)


@nki.jit
def svd_matmul_t_out_kernel(x, u, v, *, block_t=512, block_r=512, block_n=512):
    """yᵀ [N, T] = (x [T, K] · u [K, r] · v [r, N])ᵀ: the layout a following t_in kernel consumes."""
    return svd_matmul_body("svd_matmul_t_out_kernel", x, u, v, False, True, False, block_t, block_r, block_n)


@nki.jit
def svd_matmul_t_in_kernel(xT, u, v, *, block_t=512, block_r=512, block_n=512):
    """y [T, N] = xT [K, T]ᵀ · u [K, r] · v [r, N]: Xᵀ given, so no on-chip transpose of X."""
    return svd_matmul_body("svd_matmul_t_in_kernel", xT, u, v, True, False, False, block_t, block_r, block_n)


@nki.jit
def svd_matmul_decode_kernel(x, u, v, *, block_t=512, block_r=512, block_n=512):
    """y [T, N] = x [T, K] · u [K, r] · v [r, N] with the tokens as the moving operand in both stages.

    Meant for small T (decode): a stage-2 matmul then costs ~64 PE cycles per 128 output features instead of
    ~128. Yᵀ tiles are turned back on the PE (T > 1) or written as the contiguous row they are (T = 1).
    On the emulator's cost model it does not win (small T is HBM-bound, so the PE cycles saved are hidden
    while its 4x more evictions and output DMAs are not); dispatch picks it only where the tuned table does.
    """
    return svd_matmul_body("svd_matmul_decode_kernel", x, u, v, False, False, True, block_t, block_r, block_n)
