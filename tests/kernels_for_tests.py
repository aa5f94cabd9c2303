"""NKI kernels shared by the emulator tests (not test files themselves)."""

from nki_kernels.binding import nki, nisa, nl


@nki.jit
def blocked_matmul(lhs_t, rhs):
    """out[M, N] = lhs_t[K, M].T @ rhs[K, N] in lhs_t's dtype, fp32 PSUM accumulation.

    The plainest tiling (nl.tile_size tiles, ragged edges by min(...) slicing): every (m, n) output tile loads
    its lhs_t and rhs strips once per k tile, accumulates them in one PSUM tile, and is evicted and stored
    once, so tests can count its instructions and DMA bytes by hand.
    """
    k_total, m_total = lhs_t.shape
    _, n_total = rhs.shape
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m in range(0, m_total, tm):
        mt = min(tm, m_total - m)
        for n in range(0, n_total, tn):
            nt = min(tn, n_total - n)
            acc = nl.ndarray((mt, nt), nl.float32, buffer=nl.psum)
            for k in range(0, k_total, tk):
                kt = min(tk, k_total - k)
                a = nl.ndarray((kt, mt), lhs_t.dtype, buffer=nl.sbuf)
                b = nl.ndarray((kt, nt), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(a, lhs_t[k:k + kt, m:m + mt])
                nisa.dma_copy(b, rhs[k:k + kt, n:n + nt])
                nisa.nc_matmul(acc, a, b)
            result = nl.ndarray((mt, nt), out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(result, acc)
            nisa.dma_copy(out[m:m + mt, n:n + nt], result)
    return out
