"""The dense matmul the fused kernels are measured against, written from the algorithm AWS documents.

`baseline_matmul_kernel(lhsT [K, M], rhs [K, N]) → [M, N]` is the NKI matmul tutorial's "fully optimized"
kernel: the left operand arrives transposed; N is blocked outermost, K in sequential blocks, M innermost;
each K block's rhs tiles are loaded once per N block and its lhsT tiles once per (N, K) block; every
(M tile, N chunk) accumulates one K block in PSUM and is added into an SBUF accumulator holding the whole
N block for all M, which goes to HBM in N-block-wide DMAs at the end. Meta-parameters tiles_m / tiles_n /
tiles_k count tiles (128 / 512 / 128) per block, as in the tutorial. With `hoist_lhsT=True` (the tutorial's
"hoist load" step, chosen by `fit_baseline_blocks` when the lhsT block fits SBUF) M blocks go outermost and
each M block's lhsT K-tiles are loaded once and reused by every N block; for M ≤ tiles_m·128 (few tokens)
every input byte then crosses HBM once. Differences: ragged edges by slicing, and the accumulator is float32
(the tutorial's is the output dtype) so the result matches one PSUM accumulation; with a single K block PSUM
is evicted straight to the output dtype.

benchmarks/harness/baselines.py composes it into the dense and unfused low-rank baselines.
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.hardware import MOVING_FMAX, PMAX
from nki_kernels.svd_matmul import check_2d, check_block, check_operand_dtypes, spans

TUTORIAL_BLOCKS = {"tiles_m": 16, "tiles_n": 2, "tiles_k": 8}


def baseline_sbuf_bytes(
    m, k, n, itemsize, tiles_m, tiles_n, tiles_k, hoist_lhsT=False, pmax=PMAX, moving_fmax=MOVING_FMAX
):
    """SBUF bytes per partition `baseline_matmul_kernel` keeps live (streamed blocks double-buffered; a hoisted
    lhsT block, loaded once per M block, single-buffered)."""
    block_n = min(n, tiles_n * moving_fmax)
    block_m = min(m, tiles_m * pmax)
    k_tiles = -(-k // pmax)
    multi_k = k > tiles_k * pmax
    acc_rows = block_m if hoist_lhsT else m
    acc = -(-acc_rows // pmax) * block_n * (4 if multi_k else itemsize)
    rhs = min(k_tiles, tiles_k) * block_n * itemsize
    if hoist_lhsT:
        lhs = k_tiles * block_m * itemsize
    else:
        lhs = 2 * min(k_tiles, tiles_k) * block_m * itemsize
    return acc + 2 * rhs + lhs + (block_n * itemsize if multi_k else 0)


def fit_baseline_blocks(m, k, n, itemsize, sbuf_bytes_per_partition):
    """The tutorial's meta-parameters, shrunk (tiles_n, then tiles_m, then tiles_k) until the kernel fits SBUF,
    plus hoist_lhsT=True when the whole lhsT block of an M block also fits (then each lhsT byte is loaded once
    per M block instead of once per N block)."""
    blocks = dict(TUTORIAL_BLOCKS)
    order = ("tiles_n", "tiles_m", "tiles_k")
    while baseline_sbuf_bytes(m, k, n, itemsize, **blocks) > sbuf_bytes_per_partition:
        for name in order:
            if blocks[name] > 1:
                blocks[name] //= 2
                break
        else:
            raise ValueError(
                f"baseline matmul [{m}, {k}] x [{k}, {n}]: does not fit SBUF even with one tile "
                f"per block (the whole-M accumulator needs too much); split M"
            )
    blocks["hoist_lhsT"] = baseline_sbuf_bytes(m, k, n, itemsize, **blocks, hoist_lhsT=True) <= sbuf_bytes_per_partition
    return blocks


def _load_k_tiles(src, row0, k_tiles, col0, cols, name):
    """SBUF block [128, len(k_tiles), cols]: block[0:kt, k_tile, 0:cols] = src[row0 + k0 : +kt, col0 : col0 + cols]."""
    block = nl.ndarray((nl.tile_size.pmax, len(k_tiles), cols), dtype=src.dtype, buffer=nl.sbuf, name=name)
    for k_tile, (k0, kt) in enumerate(k_tiles):
        nisa.dma_copy(dst=block[0:kt, k_tile, 0:cols], src=src[row0 + k0 : row0 + k0 + kt, col0 : col0 + cols])
    return block


def _accumulate_k_block(accs, lhs_blk, first_k_tile, m_off, rhs_blk, k_tiles, m0, mb, n_chunks, first_k_block):
    """accs[M tile] (+)= one K block's product for M rows m0:m0+mb of the pass, every N chunk: each (M tile,
    N chunk) accumulates the block's K tiles in PSUM, then is copied (first K block) or added into its
    accumulator. lhs_blk[0:kt, first_k_tile + k_tile, m_off + j] is the lhsT element of K tile k_tile, row j."""
    tile_m = nl.tile_size.gemm_stationary_fmax
    for c0, nc in n_chunks:
        for mt0, mt in spans(mb, tile_m):
            acc = accs[(m0 + mt0) // tile_m][0:mt, c0 : c0 + nc]
            part = nl.ndarray((mt, nc), dtype=nl.float32, buffer=nl.psum, name="result_psum")
            for k_tile, (_, kt) in enumerate(k_tiles):
                stationary = lhs_blk[0:kt, first_k_tile + k_tile, m_off + mt0 : m_off + mt0 + mt]
                nisa.nc_matmul(
                    dst=part, stationary=stationary, moving=rhs_blk[0:kt, k_tile, c0 : c0 + nc], accumulate=k_tile > 0
                )
            if first_k_block:
                nisa.tensor_copy(dst=acc, src=part)
            else:
                nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)


@nki.jit
def baseline_matmul_kernel(lhsT, rhs, *, tiles_m=16, tiles_n=2, tiles_k=8, hoist_lhsT=False):
    """result [M, N] = lhsT [K, M]ᵀ · rhs [K, N] (HBM, row-major); result in lhsT's dtype.

    hoist_lhsT: load each M block's lhsT [K, ≤tiles_m·128] once (all K tiles, kept in SBUF) and run every N
    block against it, instead of reloading lhsT per (N block, K block)."""
    kernel = "baseline_matmul_kernel"
    check_2d(kernel, "lhsT", lhsT, "[K, M]")
    check_2d(kernel, "rhs", rhs, "[K, N]")
    k, m = lhsT.shape
    if rhs.shape[0] != k:
        raise ValueError(
            f"{kernel}: rhs has shape {tuple(rhs.shape)}, expected {k} rows to match lhsT "
            f"shape {tuple(lhsT.shape)} (contraction on the rows of both)"
        )
    n = rhs.shape[1]
    check_operand_dtypes(kernel, lhsT=lhsT, rhs=rhs)
    for name, value in (("tiles_m", tiles_m), ("tiles_n", tiles_n), ("tiles_k", tiles_k)):
        check_block(name, value, 1)
    if not isinstance(hoist_lhsT, bool):
        raise TypeError(f"hoist_lhsT: got {hoist_lhsT!r}, expected True or False")
    tile_m = nl.tile_size.gemm_stationary_fmax
    tile_k = nl.tile_size.pmax
    tile_n = nl.tile_size.gemm_moving_fmax
    result = nl.ndarray((m, n), dtype=lhsT.dtype, buffer=nl.shared_hbm, name="result")
    k_blocks = spans(k, tile_k * tiles_k)
    multi_k = len(k_blocks) > 1
    acc_dtype = nl.float32 if multi_k else lhsT.dtype
    # Hoisted: one pass per M block with its lhsT resident; otherwise one pass over all of M.
    for pass_m0, pass_ms in spans(m, tile_m * tiles_m) if hoist_lhsT else [(0, m)]:
        if hoist_lhsT:
            lhs_resident = _load_k_tiles(lhsT, 0, spans(k, tile_k), pass_m0, pass_ms, "lhsT_resident")
        m_tiles = spans(pass_ms, tile_m)
        for n0, nb in spans(n, tile_n * tiles_n):
            n_chunks = spans(nb, tile_n)
            accs = [nl.ndarray((mt, nb), dtype=acc_dtype, buffer=nl.sbuf, name="result_acc") for _, mt in m_tiles]
            for k_block, (kb0, kbs) in enumerate(k_blocks):
                k_tiles = spans(kbs, tile_k)
                rhs_blk = _load_k_tiles(rhs, kb0, k_tiles, n0, nb, "rhs_block")
                for m0, mb in spans(pass_ms, tile_m * tiles_m):
                    if hoist_lhsT:
                        lhs_blk, first_k_tile, m_off = lhs_resident, k_block * tiles_k, m0
                    else:
                        lhs_blk = _load_k_tiles(lhsT, kb0, k_tiles, pass_m0 + m0, mb, "lhsT_block")
                        first_k_tile, m_off = 0, 0
                    _accumulate_k_block(
                        accs,
                        lhs_blk,
                        first_k_tile,
                        m_off,
                        rhs_blk,
                        k_tiles,
                        m0,
                        mb,
                        n_chunks,
                        first_k_block=k_block == 0,
                    )
            for (m0, mt), acc in zip(m_tiles, accs):
                if multi_k:
                    out_tile = nl.ndarray((mt, nb), dtype=result.dtype, buffer=nl.sbuf, name="result_tile")
                    nisa.tensor_copy(dst=out_tile, src=acc)
                else:
                    out_tile = acc
                nisa.dma_copy(dst=result[pass_m0 + m0 : pass_m0 + m0 + mt, n0 : n0 + nb], src=out_tile)
    return result
