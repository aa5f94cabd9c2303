"""Baselines the fused kernels are measured against, written from the algorithm AWS documents.

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

Used as (a) the dense baseline x·W = baseline(xᵀ, W) and (b) the unfused low-rank chain
X·U → HBM → transpose → ·V (`unfused_svd_matmul`: three kernel launches, the rank-r intermediate crossing
HBM four times), and in whole-MLP baselines (`unfused_svd_mlp`, `dense_mlp`) with a separate gated-activation
kernel between the matmuls.
"""

from __future__ import annotations

from nki_kernels.binding import nki, nl, nisa
from nki_kernels.svd_matmul import check_2d, check_block, check_float_dtypes, spans
from nki_kernels.svd_mlp import activation_op

TUTORIAL_BLOCKS = {"tiles_m": 16, "tiles_n": 2, "tiles_k": 8}


def baseline_sbuf_bytes(m, k, n, itemsize, tiles_m, tiles_n, tiles_k, hoist_lhsT=False, pmax=128,
                        moving_fmax=512):
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
            raise ValueError(f"baseline matmul [{m}, {k}] x [{k}, {n}]: does not fit SBUF even with one tile "
                             f"per block (the whole-M accumulator needs too much); split M")
    blocks["hoist_lhsT"] = baseline_sbuf_bytes(m, k, n, itemsize, **blocks, hoist_lhsT=True) \
        <= sbuf_bytes_per_partition
    return blocks


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
        raise ValueError(f"{kernel}: rhs has shape {tuple(rhs.shape)}, expected {k} rows to match lhsT "
                         f"shape {tuple(lhsT.shape)} (contraction on the rows of both)")
    n = rhs.shape[1]
    check_float_dtypes(kernel, lhsT=lhsT, rhs=rhs)
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
    for om0, oms in spans(m, tile_m * tiles_m) if hoist_lhsT else [(0, m)]:
        if hoist_lhsT:
            k_tiles_all = spans(k, tile_k)
            lhs_resident = nl.ndarray((tile_k, len(k_tiles_all), oms), dtype=lhsT.dtype, buffer=nl.sbuf,
                                      name="lhsT_resident")
            for ki, (k0, kt) in enumerate(k_tiles_all):
                nisa.dma_copy(dst=lhs_resident[0:kt, ki, 0:oms], src=lhsT[k0:k0 + kt, om0:om0 + oms])
        m_tiles = spans(oms, tile_m)
        for n0, nb in spans(n, tile_n * tiles_n):
            n_chunks = spans(nb, tile_n)
            accs = [nl.ndarray((mt, nb), dtype=acc_dtype, buffer=nl.sbuf, name="result_acc") for _, mt in m_tiles]
            for kb, (kb0, kbs) in enumerate(k_blocks):
                k_tiles = spans(kbs, tile_k)
                rhs_blk = nl.ndarray((tile_k, len(k_tiles), nb), dtype=rhs.dtype, buffer=nl.sbuf,
                                     name="rhs_block")
                for ki, (k0, kt) in enumerate(k_tiles):
                    nisa.dma_copy(dst=rhs_blk[0:kt, ki, 0:nb], src=rhs[kb0 + k0:kb0 + k0 + kt, n0:n0 + nb])
                for m0, mb in spans(oms, tile_m * tiles_m):
                    # lhs_blk[0:kt, first_k_tile + ki, m_off + j] is lhsT row kb0 + k0 + p, column om0 + m0 + j.
                    if hoist_lhsT:
                        lhs_blk, first_k_tile, m_off = lhs_resident, kb * tiles_k, m0
                    else:
                        lhs_blk, first_k_tile, m_off = nl.ndarray((tile_k, len(k_tiles), mb), dtype=lhsT.dtype,
                                                                  buffer=nl.sbuf, name="lhsT_block"), 0, 0
                        for ki, (k0, kt) in enumerate(k_tiles):
                            nisa.dma_copy(dst=lhs_blk[0:kt, ki, 0:mb],
                                          src=lhsT[kb0 + k0:kb0 + k0 + kt, om0 + m0:om0 + m0 + mb])
                    for c0, nc in n_chunks:
                        for j0, mt in spans(mb, tile_m):
                            acc = accs[(m0 + j0) // tile_m][0:mt, c0:c0 + nc]
                            part = nl.ndarray((mt, nc), dtype=nl.float32, buffer=nl.psum, name="result_psum")
                            for ki, (k0, kt) in enumerate(k_tiles):
                                stationary = lhs_blk[0:kt, first_k_tile + ki, m_off + j0:m_off + j0 + mt]
                                nisa.nc_matmul(dst=part, stationary=stationary,
                                               moving=rhs_blk[0:kt, ki, c0:c0 + nc], accumulate=ki > 0)
                            if kb == 0:
                                nisa.tensor_copy(dst=acc, src=part)
                            else:
                                nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
            for (m0, mt), acc in zip(m_tiles, accs):
                if multi_k:
                    out_tile = nl.ndarray((mt, nb), dtype=result.dtype, buffer=nl.sbuf, name="result_tile")
                    nisa.tensor_copy(dst=out_tile, src=acc)
                else:
                    out_tile = acc
                nisa.dma_copy(dst=result[om0 + m0:om0 + m0 + mt, n0:n0 + nb], src=out_tile)
    return result


@nki.jit
def transpose_kernel(a, *, block_m=512):
    """aᵀ [N, M] of a [M, N] in HBM: 128-row tiles of a loaded whole, turned on the PE in [≤128, ≤128]
    pieces into one PSUM tile per 128 columns × block_m rows, written as block_m-long rows of aᵀ."""
    kernel = "transpose_kernel"
    check_2d(kernel, "a", a, "[M, N]")
    pmax = nl.tile_size.pmax
    check_block("block_m", block_m, pmax)
    if block_m > nl.tile_size.gemm_moving_fmax:
        raise ValueError(f"block_m: got {block_m}, expected at most {nl.tile_size.gemm_moving_fmax} "
                         f"(one PSUM bank)")
    m, n = a.shape
    aT = nl.ndarray((n, m), dtype=a.dtype, buffer=nl.shared_hbm, name="aT")
    for m0, mb in spans(m, block_m):
        row_tiles = []
        for s0, ts in spans(mb, pmax):
            rows = nl.ndarray((ts, n), dtype=a.dtype, buffer=nl.sbuf, name="a_rows")
            nisa.dma_copy(dst=rows, src=a[m0 + s0:m0 + s0 + ts, 0:n])
            row_tiles.append((s0, ts, rows))
        for n0, nt in spans(n, pmax):
            turned = nl.ndarray((nt, mb), dtype=a.dtype, buffer=nl.psum, name="aT_psum")
            for s0, ts, rows in row_tiles:
                nisa.nc_transpose(dst=turned[0:nt, s0:s0 + ts], data=rows[0:ts, n0:n0 + nt])
            out_tile = nl.ndarray((nt, mb), dtype=a.dtype, buffer=nl.sbuf, name="aT_tile")
            nisa.tensor_copy(dst=out_tile, src=turned)
            nisa.dma_copy(dst=aT[n0:n0 + nt, m0:m0 + mb], src=out_tile)
    return aT


@nki.jit
def gated_activation_kernel(gate, up, *, activation="silu", block_f=2048):
    """h [T, I] = act(gate) * up elementwise, gate and up [T, I] in HBM: the separate elementwise launch the
    unfused and dense MLP baselines need between their matmuls. 128-row tiles, `block_f` columns at a time."""
    kernel = "gated_activation_kernel"
    op = activation_op(activation)
    check_2d(kernel, "gate", gate, "[T, I]")
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(f"{kernel}: up has shape {tuple(up.shape)}, expected gate's shape {tuple(gate.shape)}")
    check_float_dtypes(kernel, gate=gate, up=up)
    check_block("block_f", block_f, 1)
    t, i = gate.shape
    h = nl.ndarray((t, i), dtype=gate.dtype, buffer=nl.shared_hbm, name="h")
    for t0, ts in spans(t, nl.tile_size.pmax):
        for f0, fs in spans(i, block_f):
            gate_tile = nl.ndarray((ts, fs), dtype=gate.dtype, buffer=nl.sbuf, name="gate_tile")
            up_tile = nl.ndarray((ts, fs), dtype=up.dtype, buffer=nl.sbuf, name="up_tile")
            nisa.dma_copy(dst=gate_tile, src=gate[t0:t0 + ts, f0:f0 + fs])
            nisa.dma_copy(dst=up_tile, src=up[t0:t0 + ts, f0:f0 + fs])
            act = nl.ndarray((ts, fs), dtype=nl.float32, buffer=nl.sbuf, name="act_gate")
            nisa.activation(dst=act, op=op, data=gate_tile)
            h_tile = nl.ndarray((ts, fs), dtype=gate.dtype, buffer=nl.sbuf, name="h_tile")
            nisa.tensor_tensor(dst=h_tile, data1=act, data2=up_tile, op=nl.multiply)
            nisa.dma_copy(dst=h[t0:t0 + ts, f0:f0 + fs], src=h_tile)
    return h


def unfused_svd_mlp(xT, gate_u, gate_v, up_u, up_v, down_u, down_v, *, activation="silu", blocks=None):
    """y [T, H] of the gated low-rank MLP without fusion: gate and up as unfused chains, the gated activation,
    a transpose, and down as an unfused chain (11 launches). `blocks(m, k, n)` → baseline meta-parameters."""
    def chain(lhsT, u, v):
        t, (k, r), n = lhsT.shape[1], u.shape, v.shape[1]
        return unfused_svd_matmul(lhsT, u, v, xu_blocks=blocks(t, k, r) if blocks else None,
                                  y_blocks=blocks(t, r, n) if blocks else None)

    h = gated_activation_kernel(chain(xT, gate_u, gate_v), chain(xT, up_u, up_v), activation=activation)
    return chain(transpose_kernel(h), down_u, down_v)


def dense_mlp(xT, gate_w, up_w, down_w, *, activation="silu", blocks=None):
    """y [T, H] of the dense gated MLP with the baseline matmul (5 launches). `blocks(m, k, n)` as above."""
    def matmul(lhsT, w):
        k, m = lhsT.shape
        return baseline_matmul_kernel(lhsT, w, **(blocks(m, k, w.shape[1]) if blocks else TUTORIAL_BLOCKS))

    h = gated_activation_kernel(matmul(xT, gate_w), matmul(xT, up_w), activation=activation)
    return matmul(transpose_kernel(h), down_w)


def unfused_svd_matmul(xT, u, v, *, xu_blocks=None, y_blocks=None):
    """y [T, N] = xT [K, T]ᵀ · u · v as the unfused chain: three kernel launches,
    xu = baseline(xT, u) → HBM [T, r]; xuT = transpose(xu) → HBM [r, T]; y = baseline(xuT, v).

    xu_blocks / y_blocks: meta-parameters of the two matmuls (default: the tutorial's).
    """
    xu = baseline_matmul_kernel(xT, u, **(xu_blocks or TUTORIAL_BLOCKS))
    xuT = transpose_kernel(xu)
    return baseline_matmul_kernel(xuT, v, **(y_blocks or TUTORIAL_BLOCKS))
