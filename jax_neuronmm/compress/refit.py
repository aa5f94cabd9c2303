"""Closed-form update of the right factor v given u: ridge least squares on calibration activations.

With u fixed, x·u·v is linear in v, so the v minimizing ‖X̃·u·v − Y‖_F² + λ‖v‖_F² is one small solve. X̃ are the
inputs the compressed model feeds the layer, Y the outputs the dense model produces (X·W on its own inputs X);
when X̃ = X and u comes from `whitened_svd`, the refit returns the same v (that v is already optimal), so the
update pays off when the inputs drift (sequential calibration) or when u was not fitted to X (plain SVD).
"""

from __future__ import annotations

import numbers

import numpy as np

DEFAULT_RIDGE = 1e-4


def refit_v(u, inputs, targets, *, ridge: float = DEFAULT_RIDGE) -> np.ndarray:
    """v [r, N] minimizing ‖inputs·u·v − targets‖_F² + ridge·mean(diag(AᵀA))·‖v‖_F², A = inputs·u.

    u [K, r]; inputs X̃ [n, K]; targets Y [n, N]. Computed in float64, returned in u's dtype. The ridge term is
    relative to the scale of A so one default fits every layer; it keeps the solve stable when A's columns are
    nearly dependent (few tokens, or u columns the inputs barely excite).
    """
    u = np.asarray(u)
    x = np.asarray(inputs, np.float64)
    y = np.asarray(targets, np.float64)
    if u.ndim != 2:
        raise ValueError(f"u must have shape [K, r], got {u.shape}")
    if x.ndim != 2 or x.shape[1] != u.shape[0]:
        raise ValueError(f"inputs must have shape [n, {u.shape[0]}] (u's K), got {x.shape}")
    if y.ndim != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape [{x.shape[0]}, N] (one row per input row), got {y.shape}")
    if not isinstance(ridge, numbers.Real) or not np.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge!r}")
    a = x @ u.astype(np.float64)
    gram = a.T @ a
    scale = float(np.mean(np.diag(gram)))
    if not scale > 0:
        raise ValueError("inputs·u is all zero: the calibration inputs do not excite u at all")
    gram[np.diag_indices_from(gram)] += ridge * scale
    v = np.linalg.solve(gram, a.T @ y)
    return v.astype(u.dtype)
