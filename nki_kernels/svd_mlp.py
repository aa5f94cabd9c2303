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

from nki_kernels.activations import ACTIVATIONS, check_fused_activation
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.svd_matmul import (
    Stage2,
    check_2d,
    check_blocks,
    check_factors,
    check_operand_dtypes,
    k_slots,
    load_row_block,
    spans,
    stage1,
    stage2_cols_psum,
    svd_matmul_body,
    turn_into_rows,
)


def activation_op(activation):
    """The ScalarE activation function for a fused activation name (`activations.FUSED_ACTIVATIONS`)."""
    check_fused_activation(activation)
    return getattr(nl, ACTIVATIONS[activation].nl_op)


@nki.jit
def svd_mlp_gate_up_kernel(
    x, gate_u, gate_v, up_u, up_v, *, activation="silu", block_t=512, block_k=1024, block_n=2048
):
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
        raise ValueError(
            f"{kernel}: gate_v has {i_gate} columns but up_v has {i_up}; both must be the intermediate size I"
        )
    check_operand_dtypes(kernel, x=x, gate_u=gate_u, gate_v=gate_v, up_u=up_u, up_v=up_v)
    check_blocks(block_t, block_k, block_n)
    pmax = nl.tile_size.pmax
    hT = nl.ndarray((i_gate, t), dtype=x.dtype, buffer=nl.shared_hbm, name="hT")
    gate_rank_tiles = spans(gate_v.shape[0], pmax)
    up_rank_tiles = spans(up_v.shape[0], pmax)
    for t0, tb in spans(t, block_t):
        gate_xu, up_xu = stage1(x, False, t0, tb, [gate_u, up_u], block_k)  # one X load for both
        for feature_start, feature_count in spans(i_gate, block_n):
            gate_blk = load_row_block(gate_v, feature_start, feature_count)
            up_blk = load_row_block(up_v, feature_start, feature_count)
            # Output features in the k_slots layout: slot s, partition p ↔ feature row p·q + s of the block,
            # so with all tokens in the block each partition writes q whole rows of hᵀ as one run. A single
            # token's column (T = 1 in all, not a ragged last block of one) is instead turned into one row: the
            # contiguous run it is in hᵀ.
            slots = k_slots(feature_start, feature_count)
            h_block = nl.ndarray((pmax, len(slots), tb), dtype=x.dtype, buffer=nl.sbuf, name="hT_block")
            row = [nl.ndarray((1, feature_count), dtype=x.dtype, buffer=nl.sbuf, name="hT_row")] if t == 1 else None
            whole_tiles = feature_count % pmax == 0
            for slot, (slot_rows, features) in enumerate(slots):
                columns = slice(features.start - feature_start, features.stop - feature_start, features.step)
                chunks, gate_accs = stage2_cols_psum(gate_xu, gate_blk, gate_rank_tiles, columns, slot_rows, tb)
                _, up_accs = stage2_cols_psum(up_xu, up_blk, up_rank_tiles, columns, slot_rows, tb)
                for chunk, (chunk_start, chunk_size) in enumerate(chunks):
                    act = nl.ndarray((slot_rows, chunk_size), dtype=nl.float32, buffer=nl.sbuf, name="act_gate")
                    nisa.activation(dst=act, op=op, data=gate_accs[chunk])
                    nisa.tensor_tensor(
                        dst=h_block[0:slot_rows, slot, chunk_start : chunk_start + chunk_size],
                        data1=act,
                        data2=up_accs[chunk],
                        op=nl.multiply,
                    )
                del gate_accs, up_accs  # free the PSUM banks before the next tile's accumulators start
                if row is not None:
                    turn_into_rows(h_block[0:slot_rows, slot, 0:1], row, columns, slot_rows, tb)
                elif not whole_tiles or tb != t:
                    nisa.dma_copy(dst=hT[features, t0 : t0 + tb], src=h_block[0:slot_rows, slot, 0:tb])
            if row is not None:
                nisa.dma_copy(dst=hT[feature_start : feature_start + feature_count, t0], src=row[0])
            elif whole_tiles and tb == t:
                nisa.dma_copy(
                    dst=hT[feature_start : feature_start + feature_count, 0:t].reshape((pmax, len(slots), t)),
                    src=h_block,
                )
            del gate_blk, up_blk, h_block  # single-buffered: free before the next blocks are loaded
        del gate_xu, up_xu  # dead before the next token block's stage 1
    return hT


@nki.jit
def svd_mlp_down_kernel(hT, down_u, down_v, *, block_t=512, block_k=1024, block_n=2048):
    """y [T, H] = hT [I, T]ᵀ · down_u [I, rd] · down_v [rd, H]; y in hT's dtype, row-major.

    The transposed-input fused matmul: Xᵀ = hᵀ is given, so X needs no on-chip transpose (except for T = 1).
    """
    return svd_matmul_body(
        "svd_mlp_down_kernel",
        hT,
        down_u,
        down_v,
        x_transposed=True,
        stage2=Stage2.ROWS,
        block_t=block_t,
        block_k=block_k,
        block_n=block_n,
    )
