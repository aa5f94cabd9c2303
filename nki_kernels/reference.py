"""Float64 numpy references for every kernel in nki_kernels.

Each `*_ref` takes the kernel's inputs (any float dtype; bf16 arrives through ml_dtypes) and returns the exact
float64 result of the operation the kernel implements, in the kernel's output layout. Tests compare kernel
outputs against these; nothing here rounds intermediates, so the bf16 tolerance covers the kernels' roundings.
"""

from __future__ import annotations

import numpy as np

_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def silu_ref(z) -> np.ndarray:
    z = _f64(z)
    return z / (1.0 + np.exp(-z))


def gelu_tanh_ref(z) -> np.ndarray:
    """GELU with the tanh approximation (what Gemma's `gelu_pytorch_tanh` computes)."""
    z = _f64(z)
    return 0.5 * z * (1.0 + np.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3)))


ACTIVATIONS_REF = {"silu": silu_ref, "gelu_tanh": gelu_tanh_ref}


def svd_matmul_ref(x, u, v) -> np.ndarray:
    """x [T, K], u [K, r], v [r, N] → y [T, N] = x·u·v."""
    return (_f64(x) @ _f64(u)) @ _f64(v)


def svd_matmul_t_out_ref(x, u, v) -> np.ndarray:
    """x [T, K], u [K, r], v [r, N] → yᵀ [N, T]."""
    return svd_matmul_ref(x, u, v).T


def svd_matmul_t_in_ref(xT, u, v) -> np.ndarray:
    """xᵀ [K, T], u [K, r], v [r, N] → y [T, N]."""
    return svd_matmul_ref(_f64(xT).T, u, v)


def svd_mlp_gate_up_ref(x, gate_u, gate_v, up_u, up_v, activation: str = "silu") -> np.ndarray:
    """x [T, H] → hᵀ [I, T] with h = act(x·Ug·Vg) * (x·Uu·Vu)."""
    act = ACTIVATIONS_REF[activation]
    return (act(svd_matmul_ref(x, gate_u, gate_v)) * svd_matmul_ref(x, up_u, up_v)).T


def svd_mlp_down_ref(hT, down_u, down_v) -> np.ndarray:
    """hᵀ [I, T], down_u [I, rd], down_v [rd, H] → y [T, H]."""
    return svd_matmul_t_in_ref(hT, down_u, down_v)


def svd_mlp_ref(x, gate_u, gate_v, up_u, up_v, down_u, down_v, activation: str = "silu") -> np.ndarray:
    """The whole gated low-rank MLP: x [T, H] → y [T, H]."""
    return svd_mlp_down_ref(svd_mlp_gate_up_ref(x, gate_u, gate_v, up_u, up_v, activation), down_u, down_v)


def matmul_lhsT_ref(lhsT, rhs) -> np.ndarray:
    """lhsᵀ [K, M], rhs [K, N] → lhs·rhs [M, N] (the tutorial matmul's contract)."""
    return _f64(lhsT).T @ _f64(rhs)


def transpose_ref(a) -> np.ndarray:
    """a [M, N] → aᵀ [N, M]."""
    return _f64(a).T
