"""Float64 numpy references for the kernels at the root of nki_kernels (the decode step's: decode/reference.py).

Each `*_f64` takes the kernel's inputs (any float dtype; bf16 arrives through ml_dtypes) and returns the exact
float64 result of the operation the kernel implements, in the kernel's output layout. Tests compare kernel
outputs against these; nothing here rounds intermediates, so the bf16 tolerance covers the kernels' roundings.
(`jax_neuronmm`'s `svd_matmul_ref` / `svd_mlp_ref` are something else: the XLA lowering, rounding as the
kernels do.) Activations: `activations.ACTIVATIONS[name].reference`.
"""

from __future__ import annotations

import numpy as np

from nki_kernels.activations import ACTIVATIONS


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def svd_matmul_f64(x, u, v) -> np.ndarray:
    """x [T, K], u [K, r], v [r, N] → y [T, N] = x·u·v."""
    return (_f64(x) @ _f64(u)) @ _f64(v)


def svd_matmul_t_out_f64(x, u, v) -> np.ndarray:
    """x [T, K], u [K, r], v [r, N] → yᵀ [N, T]."""
    return svd_matmul_f64(x, u, v).T


def svd_mlp_gate_up_f64(x, gate_u, gate_v, up_u, up_v, activation: str = "silu") -> np.ndarray:
    """x [T, H] → hᵀ [I, T] with h = act(x·Ug·Vg) * (x·Uu·Vu)."""
    act = ACTIVATIONS[activation].reference
    return (act(svd_matmul_f64(x, gate_u, gate_v)) * svd_matmul_f64(x, up_u, up_v)).T


def svd_mlp_down_f64(hT, down_u, down_v) -> np.ndarray:
    """hᵀ [I, T], down_u [I, rd], down_v [rd, H] → y [T, H]."""
    return svd_matmul_f64(_f64(hT).T, down_u, down_v)


def svd_mlp_f64(x, gate_u, gate_v, up_u, up_v, down_u, down_v, activation: str = "silu") -> np.ndarray:
    """The whole gated low-rank MLP: x [T, H] → y [T, H]."""
    return svd_mlp_down_f64(svd_mlp_gate_up_f64(x, gate_u, gate_v, up_u, up_v, activation), down_u, down_v)


def matmul_lhsT_f64(lhsT, rhs) -> np.ndarray:
    """lhsᵀ [K, M], rhs [K, N] → lhs·rhs [M, N] (the tutorial matmul's contract)."""
    return _f64(lhsT).T @ _f64(rhs)


def transpose_f64(a) -> np.ndarray:
    """a [M, N] → aᵀ [N, M]."""
    return _f64(a).T
