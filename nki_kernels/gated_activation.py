"""act(gate) * up as its own kernel launch: what an unfused MLP runs between its matmuls."""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.svd_matmul import check_2d, check_block, check_operand_dtypes, spans
from nki_kernels.svd_mlp import activation_op


@nki.jit
def gated_activation_kernel(gate, up, *, activation="silu", block_f=2048):
    """h [T, I] = act(gate) * up elementwise, gate and up [T, I] in HBM: the separate elementwise launch the
    unfused and dense MLP baselines need between their matmuls. 128-row tiles, `block_f` columns at a time."""
    kernel = "gated_activation_kernel"
    op = activation_op(activation)
    check_2d(kernel, "gate", gate, "[T, I]")
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(f"{kernel}: up has shape {tuple(up.shape)}, expected gate's shape {tuple(gate.shape)}")
    check_operand_dtypes(kernel, gate=gate, up=up)
    check_block("block_f", block_f, 1)
    t, i = gate.shape
    h = nl.ndarray((t, i), dtype=gate.dtype, buffer=nl.shared_hbm, name="h")
    for t0, ts in spans(t, nl.tile_size.pmax):
        for f0, fs in spans(i, block_f):
            gate_tile = nl.ndarray((ts, fs), dtype=gate.dtype, buffer=nl.sbuf, name="gate_tile")
            up_tile = nl.ndarray((ts, fs), dtype=up.dtype, buffer=nl.sbuf, name="up_tile")
            nisa.dma_copy(dst=gate_tile, src=gate[t0 : t0 + ts, f0 : f0 + fs])
            nisa.dma_copy(dst=up_tile, src=up[t0 : t0 + ts, f0 : f0 + fs])
            act = nl.ndarray((ts, fs), dtype=nl.float32, buffer=nl.sbuf, name="act_gate")
            nisa.activation(dst=act, op=op, data=gate_tile)
            h_tile = nl.ndarray((ts, fs), dtype=gate.dtype, buffer=nl.sbuf, name="h_tile")
            nisa.tensor_tensor(dst=h_tile, data1=act, data2=up_tile, op=nl.multiply)
            nisa.dma_copy(dst=h[t0 : t0 + ts, f0 : f0 + fs], src=h_tile)
    return h
