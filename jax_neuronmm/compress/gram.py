"""Checks of the calibration Gram matrices (XᵀX of a layer's inputs) and of the damping added to their diagonal,
shared by GPTQ rounding (`quantize.gptq_fp8`) and neuron pruning (`prune.prune_neurons`).

A Gram matrix is symmetric positive semi-definite; damped by damping·mean(diag) it must have a Cholesky factor,
which both algorithms rely on (GPTQ factors the inverse, pruning inverts it). Anything else would surface as a
numpy error that names nothing, or as NaN weights, so it is refused here with the argument's name.
"""

from __future__ import annotations

import numbers

import numpy as np

# Relative asymmetry tolerated in a Gram matrix (float32 products summed in a different order on each side).
SYMMETRY_RTOL = 1e-5


def check_damping(op: str, damping) -> float:
    """damping as a float when it is a finite real number >= 0; ValueError naming it otherwise."""
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not np.isfinite(damping) or damping < 0:
        raise ValueError(
            f"{op}: damping={damping!r}; expected a finite number >= 0 (a fraction of the Gram matrix's mean diagonal)"
        )
    return float(damping)


def check_gram(op: str, gram, size: int) -> np.ndarray:
    """gram as a float64 copy [size, size] when it is finite and symmetric; ValueError naming it otherwise."""
    gram = np.array(gram, np.float64)
    if gram.shape != (size, size):
        raise ValueError(f"{op}: gram has shape {gram.shape}; expected [{size}, {size}]")
    bad = np.count_nonzero(~np.isfinite(gram))
    if bad:
        raise ValueError(f"{op}: gram holds {bad} NaN or ±inf value(s); expected XᵀX of finite calibration inputs")
    if np.abs(gram - gram.T).max(initial=0) > SYMMETRY_RTOL * np.abs(gram).max(initial=0):
        raise ValueError(f"{op}: gram is not symmetric; expected XᵀX of calibration inputs")
    return gram


def damped_cholesky(op: str, gram: np.ndarray, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """(gram + damping·mean(diag)·I, its lower Cholesky factor); ValueError naming gram when the damped matrix is
    not positive definite (gram was not positive semi-definite, or it is singular and damping is 0)."""
    damped = gram + damping * float(np.mean(np.diag(gram))) * np.eye(len(gram))
    try:
        return damped, np.linalg.cholesky(damped)
    except np.linalg.LinAlgError:
        raise ValueError(
            f"{op}: gram with damping={damping:g} is not positive definite; expected XᵀX of calibration inputs "
            "(positive semi-definite), and damping > 0 when some input never varies"
        ) from None
