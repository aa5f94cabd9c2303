"""Dense kernel → SVD factors for the module converters (`SVDLinear.from_linear`, `SVDDense.params_from_dense`, ...)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_neuronmm.compress import svd
from jax_neuronmm.reference import jnp_activation
from nki_kernels.activations import FUSED_ACTIVATIONS


def factorize_kernel(
    kernel, *, rank=None, keep=None, method="svd", calibration=None, block=128, damping=svd.DEFAULT_DAMPING
) -> tuple[np.ndarray, np.ndarray]:
    """u [K, r], v [r, N] approximating kernel [K, N], in kernel's dtype.

    Exactly one of rank / keep (keep → `block_aligned_rank`). method "svd" uses `truncated_svd`; "whitened" uses
    `whitened_svd` with calibration = the layer's input activations [n, K].
    """
    kernel = np.asarray(kernel)
    if (rank is None) == (keep is None):
        raise ValueError(f"give exactly one of rank= or keep=, got rank={rank!r}, keep={keep!r}")
    if rank is None:
        rank = svd.block_aligned_rank(kernel.shape[-2], kernel.shape[-1], keep, block)
    if method == "svd":
        if calibration is not None:
            raise ValueError("calibration is only used by method='whitened'; got calibration with method='svd'")
        return svd.truncated_svd(kernel, rank)
    if method == "whitened":
        if calibration is None:
            raise ValueError("method='whitened' needs calibration= activations [n, in_features]")
        return svd.whitened_svd(kernel, calibration, rank, damping=damping)
    raise ValueError(f"method must be 'svd' or 'whitened', got {method!r}")


def gated_hidden(x, gate_kernel, up_kernel, activation: str) -> np.ndarray:
    """act(x·Wg) * (x·Wu) [n, I] in float32: the inputs the down projection of a gated MLP sees."""
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(FUSED_ACTIVATIONS)}, got {activation!r}")
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[-1] != np.shape(gate_kernel)[0]:
        raise ValueError(
            f"calibration must be activations [n, {np.shape(gate_kernel)[0]}] (the MLP's in_features), "
            f"got shape {x.shape}"
        )
    gate = x @ np.asarray(gate_kernel, np.float32)
    up = x @ np.asarray(up_kernel, np.float32)
    return np.asarray(jnp_activation(activation)(jnp.asarray(gate))) * up


def three_ranks(rank) -> tuple[int, int, int]:
    """(gate, up, down) ranks of a gated MLP from one int or a triple."""
    if isinstance(rank, (tuple, list)):
        if len(rank) != 3:
            raise ValueError(f"rank must be an int or a (gate, up, down) triple, got {rank!r}")
        return tuple(rank)
    return (rank, rank, rank)
