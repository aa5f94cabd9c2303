"""Fused low-rank gated MLP as two NKI kernels (NeuronMM's MLP design).

    y = (act(x·Ug·Vg) * (x·Uu·Vu)) · Ud · Vd        x [T, H], Ug [H, rg], Vg [rg, I], Uu [H, ru], Vu [ru, I],
                                                    Ud [I, rd], Vd [rd, H]
1. svd_mlp_gate_up_kernel → hᵀ [I, T]: one Xᵀ strip per token block feeds both stage-1 products (XUg)ᵀ and
   (XUu)ᵀ, kept in SBUF; stage 2 runs with V tiles stationary so each PSUM tile holds [≤128 of I, tokens] of
   gate and of up. The activation is applied by ScalarE while it evicts the gate tile, and VectorE multiplies
   by the up tile straight out of PSUM, writing h transposed.
2. svd_mlp_down_kernel(hᵀ, Ud, Vd) → y [T, H]: the transposed-input fused matmul, so hᵀ needs no transpose.
No rank-r intermediate touches HBM; the only intermediate in HBM is hᵀ (T·I elements).
"""

from __future__ import annotations

from nki_kernels.binding import nki, nl, nisa
from nki_kernels.svd_matmul import (check_2d, check_blocks, check_factors, check_float_dtypes, load_row_block,
                                    load_x_strip, spans, stage1, stage2_cols_psum, svd_matmul_body)

ACTIVATIONS = ("silu", "gelu_tanh")


def activation_op(activation):
    """The ScalarE activation function for a name in ACTIVATIONS."""
    if activation == "silu":
        return nl.silu
    if activation == "gelu_tanh":
        return nl.gelu_apprx_tanh
    raise ValueError(f"activation: got {activation!r}, expected one of {ACTIVATIONS}")


@nki.jit
def svd_mlp_gate_up_kernel(x, gate_u, gate_v, up_u, up_v, *, activation="silu", block_t=512, block_r=512,
                           block_n=512):
    """hᵀ [I, T] with h = act(x·gate_u·gate_v) * (x·up_u·up_v); x [T, H] row-major in HBM, hᵀ in x's dtype.

    activation: "silu" (Llama, Qwen) or "gelu_tanh" (Gemma). block_t: tokens per block; block_r: columns of
    gate_u / up_u per DMA block; block_n: columns of gate_v / up_v (features of I) per DMA block.
    """
    kernel = "svd_mlp_gate_up_kernel"
    op = activation_op(activation)
    check_2d(kernel, "x", x, "[T, H]")
    t, h = x.shape
    _, i_gate = check_factors(kernel, "x.shape[1]", h, gate_u, gate_v, "gate_u", "gate_v")
    _, i_up = check_factors(kernel, "x.shape[1]", h, up_u, up_v, "up_u", "up_v")
    if i_gate != i_up:
        raise ValueError(f"{kernel}: gate_v has {i_gate} columns but up_v has {i_up}; both must be the "
                         f"intermediate size I")
    check_float_dtypes(kernel, x=x, gate_u=gate_u, gate_v=gate_v, up_u=up_u, up_v=up_v)
    check_blocks(block_t, block_r, block_n)
    pmax = nl.tile_size.pmax
    hT = nl.ndarray((i_gate, t), dtype=x.dtype, buffer=nl.shared_hbm, name="hT")
    for t0, tb in spans(t, block_t):
        strip = load_x_strip(x, False, t0, tb)
        gate_xu = stage1(strip, gate_u, tb, block_r)
        up_xu = stage1(strip, up_u, tb, block_r)
        del strip  # dead once both (XU)ᵀ strips exist; frees SBUF for the V blocks
        gate_r_tiles = spans(gate_v.shape[0], pmax)
        up_r_tiles = spans(up_v.shape[0], pmax)
        for nb0, nbs in spans(i_gate, block_n):
            gate_blk = load_row_block(gate_v, nb0, nbs)
            up_blk = load_row_block(up_v, nb0, nbs)
            for j0, nt in spans(nbs, nl.tile_size.gemm_stationary_fmax):
                chunks, gate_accs = stage2_cols_psum(gate_xu, gate_blk, gate_r_tiles, j0, nt, tb)
                _, up_accs = stage2_cols_psum(up_xu, up_blk, up_r_tiles, j0, nt, tb)
                h_tile = nl.ndarray((nt, tb), dtype=x.dtype, buffer=nl.sbuf, name="hT_tile")
                for c, (c0, tc) in enumerate(chunks):
                    act = nl.ndarray((nt, tc), dtype=nl.float32, buffer=nl.sbuf, name="act_gate")
                    nisa.activation(dst=act, op=op, data=gate_accs[c])
                    nisa.tensor_tensor(dst=h_tile[0:nt, c0:c0 + tc], data1=act, data2=up_accs[c], op=nl.multiply)
                del gate_accs, up_accs  # free the PSUM banks before the next tile's accumulators start
                nisa.dma_copy(dst=hT[nb0 + j0:nb0 + j0 + nt, t0:t0 + tb], src=h_tile)
        del gate_xu, up_xu, gate_blk, up_blk  # dead before the next token block's strip is loaded
    return hT


@nki.jit
def svd_mlp_down_kernel(hT, down_u, down_v, *, block_t=512, block_r=512, block_n=512):
    """y [T, H] = hT [I, T]ᵀ · down_u [I, rd] · down_v [rd, H]; y in hT's dtype, row-major."""
    return svd_matmul_body("svd_mlp_down_kernel", hT, down_u, down_v, True, False, False, block_t, block_r, block_n)
