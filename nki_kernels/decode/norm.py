"""RMSNorm over column tiles (nki_kernels.decode.tiles) for the decode kernels: the per-layer and final norms of the
hidden state, in float32, into a matmul operand in the model dtype or into float32.

The sum of squares crosses partitions by one matmul with a ones matrix, which leaves the total on every partition.
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.tiles import column_tiles, load_columns, tile_runs


def load_norm_weights(norms_hbm, layout, unit_offset):
    """norms_hbm [NN, F] (HBM) as float32 column tiles [128, tiles, NN] (+1 with unit_offset); zero padding."""
    count = norms_hbm.shape[0]
    w = column_tiles(layout, count, nl.float32, "norm_weights")
    load_columns(w, norms_hbm, layout)
    if unit_offset:
        for s0, n, size in tile_runs(layout):
            nisa.tensor_scalar(
                dst=w[0:size, s0 : s0 + n, 0:count], data=w[0:size, s0 : s0 + n, 0:count], op0=nl.add, operand0=1.0
            )
    return w


class NormConstants:
    """What every RMSNorm reuses: a ones [128, 128] float32 stationary (cross-partition sums) and eps as a
    [128, 1] bias vector (trn1's ScalarE takes no scalar bias)."""

    def __init__(self, eps):
        pmax = nl.tile_size.pmax
        self.ones = nl.ndarray((pmax, pmax), dtype=nl.float32, buffer=nl.sbuf, name="ones")
        nisa.memset(dst=self.ones, value=1.0)
        self.eps = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf, name="norm_eps")
        nisa.memset(dst=self.eps, value=float(eps))


def rms_norm(dst, x, weight, layout, rows, consts, features=None):
    """dst = x·rsqrt(mean(x²) + eps)·weight over the features of `layout`, per row.

    x: float32 column tiles with zero padding; weight: [128, tiles, 1] float32 (already 1 + w for unit-offset
    norms); dst: column tiles in any dtype (a matmul operand in the model dtype, or float32).
    Sum of squares: squares summed over the tiles, then over partitions by a ones matmul, which leaves the total on
    every partition (no broadcast needed). Each norm is a chain of dependent instructions on the decode step's
    critical path, so one row (R = 1, batch-1 decode) takes a shorter one: the squares and their sum over the tiles
    are one ScalarE activation (its free-axis reduction), and rstd, a per-partition scalar then, scales x and the
    weight in one VectorE instruction: four instructions instead of six.
    """
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    rstd = _rstd(x, layout, rows, consts, features)
    if rows == 1:
        nisa.scalar_tensor_tensor(
            dst=dst[:, :, 0:1],
            data=x[:, :, 0:1],
            op0=nl.multiply,
            operand0=rstd[:, 0, :],
            op1=nl.multiply,
            operand1=weight[:, :, 0:1],
        )
        return
    scaled = nl.ndarray((pmax, tiles, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_scaled")
    nisa.tensor_tensor(dst=scaled, data1=x[:, :, 0:rows], data2=rstd.broadcast(1, tiles), op=nl.multiply)
    nisa.tensor_tensor(dst=dst[:, :, 0:rows], data1=scaled, data2=weight[:, :, 0:1].broadcast(2, rows), op=nl.multiply)


def rms_norm_add(x, y, weight, layout, consts):
    """x += rms_norm(y)·weight for one row (R = 1; x, y float32 column tiles with zero padding; weight as rms_norm's):
    y·weight on GpSimd while ScalarE and TensorE sum y's squares, then one VectorE instruction x + (y·weight)·rstd,
    where a norm into a tile of its own and an add were two VectorE instructions on the step's serial chain (the
    sandwich norms' residual adds)."""
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    yw = nl.ndarray((pmax, tiles, 1), dtype=nl.float32, buffer=nl.sbuf, name="norm_yw")
    nisa.tensor_tensor(dst=yw, data1=y[:, :, 0:1], data2=weight[:, :, 0:1], op=nl.multiply, engine=nisa.gpsimd_engine)
    rstd = _rstd(y, layout, 1, consts)
    nisa.scalar_tensor_tensor(
        dst=x[:, :, 0:1], data=yw, op0=nl.multiply, operand0=rstd[:, 0, :], op1=nl.add, operand1=x[:, :, 0:1]
    )


def _rstd(x, layout, rows, consts, features=None):
    """rsqrt(mean(x²) + eps) of each row of float32 column tiles x over `layout`'s features, on every partition:
    [128, 1, R] float32 (see rms_norm)."""
    pmax = nl.tile_size.pmax
    tiles = len(layout)
    features = sum(size for size, _ in layout) if features is None else features
    partial = nl.ndarray((pmax, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_partial")
    if rows == 1:
        squares = nl.ndarray((pmax, tiles), dtype=nl.float32, buffer=nl.sbuf, name="norm_squares")
        nisa.activation(
            dst=squares,
            op=nl.square,
            data=x[:, :, 0],
            reduce_op=nl.add,
            reduce_res=partial,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
    else:
        squares = nl.ndarray((pmax, rows, tiles), dtype=nl.float32, buffer=nl.sbuf, name="norm_squares")
        x_by_row = x[:, :, 0:rows].permute((0, 2, 1))
        nisa.tensor_tensor(dst=squares, data1=x_by_row, data2=x_by_row, op=nl.multiply)
        nisa.tensor_reduce(dst=partial, op=nl.add, data=squares, axis=2)
    total = nl.ndarray((pmax, rows), dtype=nl.float32, buffer=nl.psum, name="norm_total")
    nisa.nc_matmul(dst=total, stationary=consts.ones, moving=partial, accumulate=False)
    rstd = nl.ndarray((pmax, 1, rows), dtype=nl.float32, buffer=nl.sbuf, name="norm_rstd")
    nisa.activation(dst=rstd[:, 0, :], op=nl.rsqrt, data=total, scale=1.0 / features, bias=consts.eps)
    return rstd
