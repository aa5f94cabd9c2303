"""aᵀ of a matrix in HBM as its own kernel launch: the step the unfused baselines take between matmuls."""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.svd_matmul import check_2d, check_block, spans


@nki.jit
def transpose_kernel(a, *, block_m=512):
    """aᵀ [N, M] of a [M, N] in HBM: 128-row tiles of a loaded whole, turned on the PE in [≤128, ≤128]
    pieces into one PSUM tile per 128 columns × block_m rows, written as block_m-long rows of aᵀ."""
    kernel = "transpose_kernel"
    check_2d(kernel, "a", a, "[M, N]")
    pmax = nl.tile_size.pmax
    check_block("block_m", block_m, pmax)
    if block_m > nl.tile_size.gemm_moving_fmax:
        raise ValueError(f"block_m: got {block_m}, expected at most {nl.tile_size.gemm_moving_fmax} (one PSUM bank)")
    m, n = a.shape
    aT = nl.ndarray((n, m), dtype=a.dtype, buffer=nl.shared_hbm, name="aT")
    for m0, mb in spans(m, block_m):
        row_tiles = []
        for s0, ts in spans(mb, pmax):
            rows = nl.ndarray((ts, n), dtype=a.dtype, buffer=nl.sbuf, name="a_rows")
            nisa.dma_copy(dst=rows, src=a[m0 + s0 : m0 + s0 + ts, 0:n])
            row_tiles.append((s0, ts, rows))
        for n0, nt in spans(n, pmax):
            turned = nl.ndarray((nt, mb), dtype=a.dtype, buffer=nl.psum, name="aT_psum")
            for s0, ts, rows in row_tiles:
                nisa.nc_transpose(dst=turned[0:nt, s0 : s0 + ts], data=rows[0:ts, n0 : n0 + nt])
            out_tile = nl.ndarray((nt, mb), dtype=a.dtype, buffer=nl.sbuf, name="aT_tile")
            nisa.tensor_copy(dst=out_tile, src=turned)
            nisa.dma_copy(dst=aT[n0 : n0 + nt, m0 : m0 + mb], src=out_tile)
    return aT
