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

import dataclasses

from nki_kernels.activations import ACTIVATIONS, check_fused_activation
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.svd_matmul import (
    Blocks,
    Stage2,
    check_2d,
    check_factors,
    check_scaled_factors,
    k_slots,
    load_row_block,
    load_scale_columns,
    load_scale_row,
    scale_columns,
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


def load_slot_scales(scale, f0, fc):
    """scale[f0:f0+fc] (HBM, float32) in the k_slots layout: per slot a [rows, 1] SBUF view whose partition p holds
    the scale of the feature on partition p of that slot (the slot's per-partition scale operand)."""
    row = load_scale_row(scale, f0, fc)
    slots = k_slots(f0, fc)
    pieces = [(rows, slice(f.start - f0, f.stop - f0, f.step)) for rows, f in slots]
    return scale_columns(row, pieces)


@dataclasses.dataclass(frozen=True)
class MlpFactors:
    """The gate or the up projection's factors as gate_up_body takes them: u [H, r], v [r, I] and, for fp8 factors,
    their float32 scales u_scale [r], v_scale [I] (else None)."""

    u: object
    v: object
    u_scale: object = None
    v_scale: object = None

    def parts(self):
        """(u, v, u_scale, v_scale)."""
        return self.u, self.v, self.u_scale, self.v_scale


@nki.jit
def svd_mlp_gate_up_kernel(
    x,
    gate_u,
    gate_v,
    up_u,
    up_v,
    gate_u_scale=None,
    gate_v_scale=None,
    up_u_scale=None,
    up_v_scale=None,
    *,
    activation="silu",
    block_t=512,
    block_k=1024,
    block_n=2048,
):
    """hᵀ [I, T] with h = act(x·gate_u·gate_v) * (x·up_u·up_v); x [T, H] row-major in HBM, hᵀ in x's dtype.

    activation: "silu" (Llama, Qwen) or "gelu_tanh" (Gemma). block_t: tokens per block; block_k: hidden
    features (rows of gate_u and up_u) per K block; block_n: columns of gate_v / up_v (features of I) per DMA
    block. fp8 factors (float8_e4m3, bf16 / fp16 x) come with float32 scales per column of each factor
    (gate_u_scale [rg], gate_v_scale [I], up_u_scale [ru], up_v_scale [I]): the rank scales are applied as
    stage 1 is evicted, the gate's feature scales inside the activation (its `scale`, one per partition), the
    up's in the multiply by the activated gate.

    The argument list is the kernel's device call contract (each HBM tensor one kernel argument, as the JAX side
    and NKI's JAX integration pass them; the block sizes the static keywords dispatch's tuned table fills), so it
    stays flat; the body (gate_up_body) takes the factors and block sizes bundled.
    """
    gate = MlpFactors(gate_u, gate_v, gate_u_scale, gate_v_scale)
    up = MlpFactors(up_u, up_v, up_u_scale, up_v_scale)
    return gate_up_body(x, gate, up, activation_op(activation), Blocks(block_t, block_k, block_n))


def gate_up_body(x, gate, up, op, blocks):
    """svd_mlp_gate_up_kernel's work: hᵀ [I, T] for x [T, H], gate and up MlpFactors, op the activation's ScalarE
    function (activation_op) and `blocks` (svd_matmul.Blocks)."""
    kernel = "svd_mlp_gate_up_kernel"
    check_2d(kernel, "x", x, "[T, H]")
    t, h = x.shape
    _, i_gate = check_factors(kernel, "x.shape[1]", h, gate.u, gate.v, "gate_u", "gate_v")
    _, i_up = check_factors(kernel, "x.shape[1]", h, up.u, up.v, "up_u", "up_v")
    if i_gate != i_up:
        raise ValueError(
            f"{kernel}: gate_v has {i_gate} columns but up_v has {i_up}; both must be the intermediate size I"
        )
    fp8 = check_scaled_factors(kernel, "x", x, *gate.parts(), "gate_u", "gate_v")
    if check_scaled_factors(kernel, "x", x, *up.parts(), "up_u", "up_v") != fp8:
        raise TypeError(f"{kernel}: gate and up factors must both be fp8 with scales, or neither")
    blocks.check()
    rank_scales = None
    if fp8:  # in SBUF for the whole call (r float32 values per factor)
        rank_scales = [load_scale_columns(gate.u_scale, gate.u.shape[1]), load_scale_columns(up.u_scale, up.u.shape[1])]
    pmax = nl.tile_size.pmax
    hT = nl.ndarray((i_gate, t), dtype=x.dtype, buffer=nl.shared_hbm, name="hT")
    gate_rank_tiles = spans(gate.v.shape[0], pmax)
    up_rank_tiles = spans(up.v.shape[0], pmax)
    for t0, tb in spans(t, blocks.t):
        gate_xu, up_xu = stage1(x, False, t0, tb, [gate.u, up.u], blocks.k, rank_scales)  # one X load for both
        for feature_start, feature_count in spans(i_gate, blocks.n):
            gate_blk = load_row_block(gate.v, feature_start, feature_count)
            up_blk = load_row_block(up.v, feature_start, feature_count)
            gate_scales = load_slot_scales(gate.v_scale, feature_start, feature_count) if fp8 else None
            up_scales = load_slot_scales(up.v_scale, feature_start, feature_count) if fp8 else None
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
                    h_tile = h_block[0:slot_rows, slot, chunk_start : chunk_start + chunk_size]
                    if fp8:
                        nisa.activation(dst=act, op=op, data=gate_accs[chunk], scale=gate_scales[slot])
                        nisa.scalar_tensor_tensor(
                            dst=h_tile,
                            data=up_accs[chunk],
                            op0=nl.multiply,
                            operand0=up_scales[slot],
                            op1=nl.multiply,
                            operand1=act,
                        )
                    else:
                        nisa.activation(dst=act, op=op, data=gate_accs[chunk])
                        nisa.tensor_tensor(dst=h_tile, data1=act, data2=up_accs[chunk], op=nl.multiply)
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
            del gate_blk, up_blk, h_block, gate_scales, up_scales  # single-buffered: free before the next blocks
        del gate_xu, up_xu  # dead before the next token block's stage 1
    return hT


@nki.jit
def svd_mlp_down_kernel(
    hT, down_u, down_v, down_u_scale=None, down_v_scale=None, *, block_t=512, block_k=1024, block_n=2048
):
    """y [T, H] = hT [I, T]ᵀ · down_u [I, rd] · down_v [rd, H]; y in hT's dtype, row-major.

    The transposed-input fused matmul: Xᵀ = hᵀ is given, so X needs no on-chip transpose (except for T = 1).
    fp8 factors with float32 scales [rd] / [H] as in `svd_matmul.svd_matmul_kernel`.
    """
    return svd_matmul_body(
        "svd_mlp_down_kernel",
        hT,
        down_u,
        down_v,
        down_u_scale,
        down_v_scale,
        x_transposed=True,
        stage2=Stage2.ROWS,
        blocks=Blocks(block_t, block_k, block_n),
    )
