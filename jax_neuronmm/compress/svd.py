"""Low-rank factorizations of a dense weight W [K, N] into u [K, r] and v [r, N], so that x·W ≈ x·u·v.

Everything here runs on the host in numpy, so that compressing a checkpoint needs no accelerator and gives the
same factors on every run: `truncated_svd` works in float32 (float64 for float64 weights), `whitened_svd` in
float64 throughout (its Cholesky factor can be ill-conditioned); results come back in the weight's dtype.
Leading dimensions of w are treated as a stack of independent layers (as in scanned models: w [L, K, N] →
u [L, K, r], v [L, r, N]).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import numbers
import warnings

import numpy as np
import scipy.linalg
from threadpoolctl import threadpool_limits

# The one rank rule, shared with the kernels' tuner (nki_kernels cannot import this package).
from nki_kernels.ranks import block_aligned_rank, check_keep  # noqa: F401  (public here as compress.block_aligned_rank)

logger = logging.getLogger(__name__)

DEFAULT_DAMPING = 1e-6
# Relative damping of an output Gram matrix (output_whitening): the smallest of the values the accuracy report tried
# (up to 1), which measured best.
OUTPUT_DAMPING = 1e-3


class WhiteningDampedWarning(UserWarning):
    """The calibration Gram matrix XᵀX was not positive definite, so damping was added to its diagonal."""


# Within `damping_summary`: a list collecting (K, tokens, damping) per damped Gram matrix instead of one warning each.
_DAMPED: contextvars.ContextVar[list | None] = contextvars.ContextVar("damped_gram_matrices", default=None)


def _report_damping(width: int, tokens: int, damping: float, stacklevel: int) -> None:
    collected = _DAMPED.get()
    if collected is not None:
        collected.append((width, tokens, damping))
        return
    message = (
        f"calibration Gram matrix XᵀX (K={width}, {tokens} tokens) is not positive definite; "
        f"added {damping:.3g}·mean(diag) to its diagonal" + _tokens_hint(width, tokens)
    )
    warnings.warn(message, WhiteningDampedWarning, stacklevel=stacklevel + 1)
    logger.warning(message)


def _tokens_hint(width: int, tokens: int) -> str:
    if tokens >= width:
        return " (its features are linearly dependent)"
    return f" ({tokens} tokens cannot fill a {width}-wide Gram matrix: it needs at least {width} calibration tokens)"


@contextlib.contextmanager
def damping_summary():
    """Within it, Gram matrices that needed damping are collected, and on leaving ONE `WhiteningDampedWarning`
    (and log line) sums them up: how many, the widest K, the fewest tokens and how many tokens the widths need.
    A compression run wraps its whole pass in it, so a model gives one warning, not one per projection."""
    collected = []
    token = _DAMPED.set(collected)
    try:
        yield collected
    finally:
        _DAMPED.reset(token)
    if collected:
        width = max(k for k, _, _ in collected)
        tokens = min(n for _, n, _ in collected)
        message = (
            f"{len(collected)} calibration Gram matrices XᵀX (K up to {width}, from {tokens} tokens) were not "
            f"positive definite; added up to {max(d for _, _, d in collected):.3g}·mean(diag) to their diagonals"
            + _tokens_hint(width, tokens)
        )
        warnings.warn(message, WhiteningDampedWarning, stacklevel=3)
        logger.warning(message)


@dataclasses.dataclass(frozen=True)
class WhitenedFactors:
    """Result of `whitened_svd_with_info`: the factors and the damping that had to be added (0.0 if none)."""

    u: np.ndarray
    v: np.ndarray
    damping_added: float


def single_threaded_blas():
    """Context manager pinning numpy's BLAS/LAPACK to one thread.

    Compression interleaves LAPACK calls with JAX, whose own thread pool keeps the cores busy; a multi-threaded
    OpenBLAS then spin-waits against it, and on 2 cores one 640x2048 SVD took 6 to 30 times longer than with one
    thread (benchmarks/compress_speed.md). The factorizations here are too small to gain from BLAS threads.
    """
    return threadpool_limits(1, user_api="blas")


def truncated_svd(w, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Best rank-`rank` factors of w [..., K, N] in Frobenius norm (Eckart–Young).

    Returns u = U_r·√Σ_r [..., K, r] and v = √Σ_r·V_rᵀ [..., r, N] in w's dtype. ‖w − u·v‖_F² equals the sum of
    the discarded σ². Singular vectors get a canonical sign (largest-magnitude entry of each u column positive),
    so the result does not depend on LAPACK's sign choice.
    """
    w_host, compute_dtype = _as_weight(w, "w")
    check_rank(rank, w_host.shape)
    with single_threaded_blas():
        left, sigma, right_t = np.linalg.svd(w_host.astype(compute_dtype), full_matrices=False)
    u, v = _split_sigma(left[..., :, :rank], sigma[..., :rank], right_t[..., :rank, :])
    return u.astype(w_host.dtype), v.astype(w_host.dtype)


def whitened_svd(w, activations, rank: int, *, damping: float = DEFAULT_DAMPING) -> tuple[np.ndarray, np.ndarray]:
    """Truncation-aware whitened SVD (SVD-LLM): factors minimizing ‖X·w − X·u·v‖_F on calibration inputs X.

    w [..., K, N]; activations X [n, K] (shared by every stacked layer) or [..., n, K] (one set per layer), the
    inputs the layer sees. With XᵀX = S·Sᵀ (Cholesky), the SVD of Sᵀ·w = U Σ Vᵀ truncated to rank r gives
    u = S⁻ᵀ·U_r·√Σ_r and v = √Σ_r·V_rᵀ; since ‖X·A‖_F = ‖Sᵀ·A‖_F for every A, this is the optimum of the output
    error on X. When XᵀX is not positive definite (fewer tokens than K, or dependent features), `damping`·mean(diag)
    is added to its diagonal, growing ×10 until the Cholesky succeeds; that is reported with a
    `WhiteningDampedWarning` and a log line. Returns (u, v) in w's dtype.
    """
    factors = whitened_svd_with_info(w, activations, rank, damping=damping)
    return factors.u, factors.v


def whitened_svd_with_info(w, activations, rank: int, *, damping: float = DEFAULT_DAMPING) -> WhitenedFactors:
    """`whitened_svd`, also returning the largest relative damping added to XᵀX (0.0 when none was needed)."""
    with single_threaded_blas():
        return _whitened_svd_with_info(w, activations, rank, damping)


def _whitened_svd_with_info(w, activations, rank: int, damping: float) -> WhitenedFactors:
    w_host, _ = _as_weight(w, "w")
    check_rank(rank, w_host.shape)
    if not isinstance(damping, numbers.Real) or not np.isfinite(damping) or damping <= 0:
        raise ValueError(f"damping must be a positive finite number, got {damping!r}")
    x = _as_activations(activations, w_host.shape)
    stack_shape = w_host.shape[:-2]
    w_stack = w_host.reshape((-1,) + w_host.shape[-2:]).astype(np.float64)
    x_stack = x.reshape((-1,) + x.shape[-2:])
    # One Cholesky factor per activation set: shared activations [n, K] serve every stacked layer.
    whiteners = [_damped_cholesky(x_layer.T @ x_layer, damping) for x_layer in x_stack]
    damping_added = max(layer_damping for _, layer_damping in whiteners)
    u_list, v_list = [], []
    for index, w_layer in enumerate(w_stack):
        chol, _ = whiteners[index if len(whiteners) > 1 else 0]
        u, v = whitened_factors(w_layer, chol, rank)
        u_list.append(u)
        v_list.append(v)
    if damping_added > 0:
        _report_damping(w_host.shape[-2], x.shape[-2], damping_added, stacklevel=4)
    u = np.stack(u_list).reshape(stack_shape + u_list[0].shape).astype(w_host.dtype)
    v = np.stack(v_list).reshape(stack_shape + v_list[0].shape).astype(w_host.dtype)
    return WhitenedFactors(u=u, v=v, damping_added=damping_added)


def whitening(activations, *, damping: float = DEFAULT_DAMPING) -> tuple[np.ndarray, float]:
    """Lower Cholesky factor S [K, K] (float64) of XᵀX for activations X [n, K], and the relative damping added.

    Compute it once per set of inputs and pass it to `whitened_factors` / `whitened_spectrum` for every projection
    that reads those inputs (gate and up of an MLP, q/k/v of an attention block). Damping as in `whitened_svd`,
    reported with a `WhiteningDampedWarning`.
    """
    x = np.asarray(activations)
    if x.ndim != 2:
        raise ValueError(f"activations must have shape [n, K], got shape {x.shape}")
    x = _as_activations(x, (x.shape[1], 1))
    with single_threaded_blas():
        chol, damping_added = _damped_cholesky(x.T @ x, damping)
    if damping_added > 0:
        _report_damping(x.shape[1], x.shape[0], damping_added, stacklevel=2)
    return chol, damping_added


def whitened_decomposition(w, chol, out_chol=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SVD of Sᵀ·w for w [K, N] and a `whitening` factor S [K, K]: (U [K, m], σ [m], Vᵀ [m, N]), m = min(K, N),
    float64. σ² are the output energies ‖X·w‖ splits into; truncating after r of them loses Σ_{i>r} σ_i².

    out_chol: a lower Cholesky factor L [N, N] of an output-side weighting G = L·Lᵀ (`output_whitening`): then the
    SVD is of Sᵀ·w·L, and truncating it loses the weighted error tr(ΔWᵀ·XᵀX·ΔW·G) instead."""
    w64 = np.asarray(w, np.float64)
    if w64.ndim != 2 or chol.shape != (w64.shape[0], w64.shape[0]):
        raise ValueError(f"w must be [K, N] with a whitening factor [K, K]; got w {w64.shape}, factor {chol.shape}")
    if out_chol is not None and out_chol.shape != (w64.shape[1], w64.shape[1]):
        raise ValueError(f"out_chol: got shape {out_chol.shape}, expected [N, N] for w [K, N] = {w64.shape}")
    with single_threaded_blas():
        # Sᵀ·w as (wᵀ·S)ᵀ with a triangular product (half a general one's work); the transposes are F-ordered views
        # of the C-ordered arrays, so BLAS copies nothing.
        whitened = scipy.linalg.blas.dtrmm(
            1.0, np.asarray(chol, np.float64).T, w64.T, side=1, lower=False, trans_a=True
        ).T
        if out_chol is not None:
            whitened = scipy.linalg.blas.dtrmm(1.0, np.asarray(out_chol, np.float64), whitened, side=1, lower=True)
        return np.linalg.svd(whitened, full_matrices=False)


def whitened_factors(w, chol, rank: int, decomposition=None, out_chol=None) -> tuple[np.ndarray, np.ndarray]:
    """`whitened_svd` of w [K, N] with a precomputed `whitening` factor S: (u [K, r], v [r, N]) in w's dtype.

    decomposition: `whitened_decomposition(w, chol, out_chol)` when already computed (rank allocation needs it
    first). out_chol: as in `whitened_decomposition`; the factors then minimize the output-weighted error, v mapped
    back through L⁻¹."""
    w_host = np.asarray(w)
    check_rank(rank, w_host.shape)
    if decomposition is None:
        decomposition = whitened_decomposition(w_host, chol, out_chol)
    left, sigma, right_t = decomposition
    u_white, v = _split_sigma(left[:, :rank], sigma[:rank], right_t[:rank, :])
    # Map the left factor back through S⁻ᵀ with a triangular solve (no explicit inverse); v through L⁻¹ likewise.
    u = scipy.linalg.solve_triangular(chol.T, u_white, lower=False)
    if out_chol is not None:
        v = scipy.linalg.solve_triangular(out_chol, v.T, lower=True, trans="T").T
    return u.astype(w_host.dtype), v.astype(w_host.dtype)


def output_whitening(gram, *, damping: float = OUTPUT_DAMPING) -> np.ndarray:
    """Lower Cholesky factor L [N, N] (float64) of G + damping·mean(diag G)·I for an output-side Gram matrix
    G [N, N] (positive semi-definite, e.g. `pipeline.fisher.output_grams`). The damping is always added: a
    Fisher estimate from a few thousand sampled gradients is noisy in its small directions, and the weighting should
    not let them decide the truncation (OUTPUT_DAMPING measured best).
    An all-zero G (no gradient reached the output) gives the identity: no weighting."""
    g = np.asarray(gram, np.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"gram must be a square [N, N] matrix, got shape {g.shape}")
    if not (isinstance(damping, numbers.Real) and np.isfinite(damping) and damping > 0):
        raise ValueError(f"damping must be a positive finite number, got {damping!r}")
    scale = float(np.mean(np.diag(g)))
    if not scale > 0:
        return np.eye(g.shape[0])
    return _damped_cholesky(g + damping * scale * np.eye(g.shape[0]), DEFAULT_DAMPING)[0]


def _damped_cholesky(gram: np.ndarray, damping: float) -> tuple[np.ndarray, float]:
    """Lower Cholesky factor S of gram (= S·Sᵀ), and the relative damping that had to be added (0.0 if none)."""
    try:
        return np.linalg.cholesky(gram), 0.0
    except np.linalg.LinAlgError:
        pass
    scale = float(np.mean(np.diag(gram)))
    if not scale > 0:
        raise ValueError("activations are all zero: the calibration Gram matrix XᵀX has no positive diagonal entry")
    identity = np.eye(gram.shape[0])
    relative = damping
    while relative <= 1.0:
        try:
            return np.linalg.cholesky(gram + relative * scale * identity), relative
        except np.linalg.LinAlgError:
            relative *= 10.0
    raise ValueError(f"calibration Gram matrix XᵀX stays indefinite even with damping {relative / 10:.3g}·mean(diag)")


def _split_sigma(left: np.ndarray, sigma: np.ndarray, right_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u = U·√Σ, v = √Σ·Vᵀ with a canonical sign per singular pair (largest-|entry| of each u column > 0)."""
    pivot = np.take_along_axis(left, np.argmax(np.abs(left), axis=-2)[..., None, :], axis=-2)
    sign = np.where(pivot < 0, -1.0, 1.0).astype(left.dtype)
    root = np.sqrt(sigma)[..., None, :]
    return left * sign * root, np.swapaxes(sign * root, -1, -2) * right_t


def _as_weight(w, name: str) -> tuple[np.ndarray, type]:
    """w as a host array of a floating dtype, and the dtype to compute its SVD in."""
    w_host = np.asarray(w)
    if w_host.ndim < 2:
        raise ValueError(f"{name} must have shape [..., K, N] (at least 2-D), got shape {w_host.shape}")
    if not np.issubdtype(w_host.dtype, np.floating) and w_host.dtype.name != "bfloat16":
        raise ValueError(f"{name} must be a floating-point array, got dtype {w_host.dtype}")
    if not np.all(np.isfinite(w_host.astype(np.float32) if w_host.dtype != np.float64 else w_host)):
        raise ValueError(f"{name} contains NaN or Inf values (shape {w_host.shape})")
    return w_host, (np.float64 if w_host.dtype == np.float64 else np.float32)


def _as_activations(activations, w_shape: tuple[int, ...]) -> np.ndarray:
    """Activations as float64 [n, K] or [stack..., n, K], checked against w [stack..., K, N]."""
    x = np.asarray(activations)
    in_features, stack_shape = w_shape[-2], w_shape[:-2]
    if x.ndim < 2 or x.shape[-1] != in_features:
        raise ValueError(
            f"activations must have shape [n, {in_features}] (the weight's in_features K={in_features}), "
            f"got shape {x.shape}"
        )
    if x.ndim > 2 and x.shape[:-2] != stack_shape:
        raise ValueError(
            f"activations with leading dims must match the weight's stacked dims {stack_shape}: expected shape "
            f"{stack_shape + (-1, in_features)}, got {x.shape}"
        )
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"activations contain NaN or Inf values (shape {x.shape})")
    return x


def check_rank(rank, w_shape: tuple[int, ...]) -> None:
    limit = min(w_shape[-2:])
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or not 1 <= rank <= limit:
        raise ValueError(
            f"rank must be an integer in [1, min(K, N)] = [1, {limit}] for a weight of shape {w_shape}, got {rank!r}"
        )
