"""The baselines the fused kernels are measured against, composed of separate kernel launches.

`unfused_svd_matmul`: the low-rank chain X·U → HBM → transpose → ·V (three launches, the rank-r intermediate
crossing HBM four times); `unfused_svd_mlp` and `dense_mlp`: whole gated MLPs with a separate gated-activation
launch between the matmuls. Inputs arrive transposed (xT [K, T]), as the baseline matmul takes them.
"""

from __future__ import annotations

from nki_kernels.baseline_matmul import TUTORIAL_BLOCKS, baseline_matmul_kernel
from nki_kernels.gated_activation import gated_activation_kernel
from nki_kernels.transpose import transpose_kernel


def unfused_svd_mlp(xT, gate_u, gate_v, up_u, up_v, down_u, down_v, *, activation="silu", blocks=None):
    """y [T, H] of the gated low-rank MLP without fusion: gate and up as unfused chains, the gated activation,
    a transpose, and down as an unfused chain (11 launches). `blocks(m, k, n)` → baseline meta-parameters."""

    def chain(lhsT, u, v):
        t, (k, r), n = lhsT.shape[1], u.shape, v.shape[1]
        return unfused_svd_matmul(
            lhsT, u, v, xu_blocks=blocks(t, k, r) if blocks else None, y_blocks=blocks(t, r, n) if blocks else None
        )

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
