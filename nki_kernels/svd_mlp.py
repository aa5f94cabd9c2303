"""Fused low-rank gated MLP as two NKI kernels (NeuronMM's MLP design).

    y = (act(x·Ug·Vg) * (x·Uu·Vu)) · Ud · Vd        x [T, H], Ug [H, rg], Vg [rg, I], Uu [H, ru], Vu [ru, I],
                                                    Ud [I, rd], Vd [rd, H]
1. svd_mlp_gate_up_kernel → hᵀ [I, T]: one load of X per token block feeds both stage-1 products (XUg)ᵀ and
   (XUu)ᵀ, kept in SBUF; stage 2 runs with V tiles stationary so each PSUM tile holds [≤128 of I, tokens] of
   gate and of up. The activation is applied by ScalarE while it evicts the gate tile, and VectorE multiplies
   by the up tile straight out of PSUM, writing h transposed (features permuted within a block so each
   partition's share of hᵀ is one contiguous run).
2. svd_mlp_down_kernel(hᵀ, Ud, Vd) → y [T, H]: the transposed-input fused matmul, so hᵀ needs no transpose.
No rank-r intermediate touches HBM; the only intermediate in HBM is hᵀ (T·I elements).
"""

from __future__ import annotations

from nki_kernels.binding import nki, nl, nisa
from nki_kernels.svd_matmul import (check_2d, check_blocks, check_factors, check_float_dtypes, k_slots,
                                    load_row_block, spans, stage1, stage2_cols_psum, svd_matmul_body,
                                    turn_into_rows)

ACTIVATIONS = ("silu", "gelu_tanh")


def activation_op(activation):
    """The ScalarE activation function for a name in ACTIVATIONS."""
    if activation == "silu":
        return nl.silu
    if activation == "gelu_tanh":
        return nl.gelu_apprx_tanh
    raise ValueError(f"activation: got {activation!r}, expected one of {ACTIVATIONS}")


@nki.jit
def svd_mlp_gate_up_kernel(x, gate_u, gate_v, up_u, up_v, *, activation="silu", block_t=512, block_k=1024,
                           block_n=2048):
    """hᵀ [I, T] with h = act(x·gate_u·gate_v) * (x·up_u·up_v); x [T, H] row-major in HBM, hᵀ in x's dtype.

    activation: "silu" (Llama, Qwen) or "gelu_tanh" (Gemma). block_t: tokens per block; block_k: hidden
    features (rows of gate_u and up_u) per K block; block_n: columns of gate_v / up_v (features of I) per DMA
    block.
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
    check_blocks(block_t, block_k, block_n)
    pmax = nl.tile_size.pmax
    hT = nl.ndarray((i_gate, t), dtype=x.dtype, buffer=nl.shared_hbm, name="hT")
    gate_r_tiles = spans(gate_v.shape[0], pmax)
    up_r_tiles = spans(up_v.shape[0], pmax)
    for t0, tb in spans(t, block_t):
        gate_xu, up_xu = stage1(x, False, t0, tb, [gate_u, up_u], block_k)  # one X load for both
        for nb0, nbs in spans(i_gate, block_n):
            gate_blk = load_row_block(gate_v, nb0, nbs)
            up_blk = load_row_block(up_v, nb0, nbs)
            # Output features in the k_slots layout: slot s, partition p ↔ feature row p·q + s of the block,
            # so with all tokens in the block each partition writes q whole rows of hᵀ as one run. A single
            # token's column (T = 1 in all, not a ragged last block of one) is instead turned into one row: the
            # contiguous run it is in hᵀ.
            slots = k_slots(nb0, nbs)
            h_block = nl.ndarray((pmax, len(slots), tb), dtype=x.dtype, buffer=nl.sbuf, name="hT_block")
            row = [nl.ndarray((1, nbs), dtype=x.dtype, buffer=nl.sbuf, name="hT_row")] if t == 1 else None
            for s, (nt, features) in enumerate(slots):
                columns = slice(features.start - nb0, features.stop - nb0, features.step)
                chunks, gate_accs = stage2_cols_psum(gate_xu, gate_blk, gate_r_tiles, columns, nt, tb)
                _, up_accs = stage2_cols_psum(up_xu, up_blk, up_r_tiles, columns, nt, tb)
                for c, (c0, tc) in enumerate(chunks):
                    act = nl.ndarray((nt, tc), dtype=nl.float32, buffer=nl.sbuf, name="act_gate")
                    nisa.activation(dst=act, op=op, data=gate_accs[c])
                    nisa.tensor_tensor(dst=h_block[0:nt, s, c0:c0 + tc], data1=act, data2=up_accs[c],
                                       op=nl.multiply)
                del gate_accs, up_accs  # free the PSUM banks before the next tile's accumulators start
                if row is not None:
                    turn_into_rows(h_block[0:nt, s, 0:1], row, columns, nt, tb)
                elif nbs % pmax or tb != t:
                    nisa.dma_copy(dst=hT[features, t0:t0 + tb], src=h_block[0:nt, s, 0:tb])
            if row is not None:
                nisa.dma_copy(dst=hT[nb0:nb0 + nbs, t0], src=row[0])
            elif nbs % pmax == 0 and tb == t:
                nisa.dma_copy(dst=hT[nb0:nb0 + nbs, 0:t].reshape((pmax, len(slots), t)), src=h_block)
            del gate_blk, up_blk, h_block  # single-buffered: free before the next blocks are loaded
        del gate_xu, up_xu  # dead before the next token block's stage 1
    return hT


@nki.jit
def svd_mlp_down_kernel(hT, down_u, down_v, *, block_t=512, block_k=1024, block_n=2048):
    """y [T, H] = hT [I, T]ᵀ · down_u [I, rd] · down_v [rd, H]; y in hT's dtype, row-major."""
    return svd_matmul_body("svd_mlp_down_kernel", hT, down_u, down_v, True, False, False, block_t, block_k, block_n)
