"""fp8 e4m3 weights with fp32 scales, in Trainium's range.

Trainium's float8_e4m3 saturates at ±240 (IEEE-style e4m3: the top exponent is reserved), not at OCP e4m3fn's
±448. Within ±240 both formats have the same bits, so values are stored as `float8_e4m3fn` (the dtype JAX, XLA
and safetensors' F8_E4M3 know) and never exceed ±240; the kernels reinterpret the bits as Trainium's type.

A quantized weight w [..., K, N] used as x·w is (values [..., K, N], scale [..., N]) with
w ≈ values · diag(scale): one float32 scale per output channel, the max taken over the contraction axis.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from jax_neuronmm.compress.gram import check_damping, check_gram, damped_cholesky
from jax_neuronmm.shapes import FP8_DTYPE, FP8_MAX, SCALE_DTYPE, fp8_storage  # noqa: F401  (FP8_* public here)

# The stored weight dtypes besides the model's own (compress_model / quantize_model's weight_dtype).
WEIGHT_DTYPES = ("float8_e4m3",)
# What quantize_fp8 rounds from and dequantize_fp8 widens to.
WIDE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _axes(op, ndim, axis):
    if ndim < 2:
        raise ValueError(f"{op}: w must have at least 2 dims [..., K, N], got {ndim}")
    if axis not in (-1, -2, ndim - 1, ndim - 2):
        raise ValueError(f"{op}: axis={axis!r}; expected -1 (one scale per column) or -2 (one scale per row)")
    channel = axis % ndim
    reduced = ndim - 2 if channel == ndim - 1 else ndim - 1
    return channel, reduced


def quantize_fp8(w, axis=-1):
    """Round-to-nearest fp8 e4m3 values and fp32 scales of w [..., K, N], one scale per output channel.

    axis: the output-channel axis, -1 (columns: w used as x·w, the layout of u, v and dense kernels) or -2
      (rows: w used as x·wᵀ, e.g. a tied embedding [V, H] as the LM head). The scale is the channel's largest
      magnitude over the other of the last two axes (the contraction) divided by 240; all-zero (or empty) channels
      get scale 1. Leading axes are a stack of independent weights and keep their own scales. w is float16,
      bfloat16, float32 or float64 (TypeError otherwise: an 8-bit float is already rounded).

    Returns:
      (values, scale): values has w's shape in float8_e4m3fn, round-to-nearest-even of w / scale clipped to
      ±240; scale float32 has w's shape without the contraction axis ([..., N] for axis=-1, [..., K] for -2).
      w ≈ values.astype(f32) * expand(scale) along the channel axis (`dequantize_fp8`).
    """
    w = jnp.asarray(w)
    if np.dtype(w.dtype).name not in WIDE_DTYPES:
        raise TypeError(
            f"quantize_fp8: w has dtype {w.dtype}; expected {', '.join(WIDE_DTYPES)} (the weight before rounding; "
            "an 8-bit one is already rounded: widen it first if that is meant)"
        )
    _, reduced = _axes("quantize_fp8", w.ndim, axis)
    wf = w.astype(jnp.promote_types(w.dtype, jnp.float32))
    amax = jnp.max(jnp.abs(wf), axis=reduced, keepdims=True, initial=0.0)  # an empty contraction: scale 1
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(SCALE_DTYPE)
    values = jnp.clip(wf / scale.astype(wf.dtype), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, jnp.squeeze(scale, axis=reduced)


def dequantize_fp8(values, scale, axis=-1, dtype=jnp.float32):
    """values [..., K, N] · diag(scale) along the channel `axis` (as in `quantize_fp8`), in `dtype` (a float type:
    TypeError otherwise, as an integer type would truncate)."""
    if dtype is None or np.dtype(dtype).name not in WIDE_DTYPES:
        raise TypeError(f"dequantize_fp8: dtype={dtype!r}; expected one of {', '.join(WIDE_DTYPES)}")
    values, scale = fp8_storage(jnp.asarray(values)), jnp.asarray(scale)
    _, reduced = _axes("dequantize_fp8", values.ndim, axis)
    expected = values.shape[:reduced] + values.shape[reduced + 1 :]
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"dequantize_fp8: scale has shape {tuple(scale.shape)}; expected {expected} (values {values.shape} "
            f"without axis {reduced - values.ndim})"
        )
    wide = jnp.promote_types(dtype, jnp.float32)
    return (values.astype(wide) * jnp.expand_dims(scale.astype(wide), reduced)).astype(dtype)


def gptq_fp8(w, gram, *, damping=0.01, block=128, column_chunk=8192):
    """fp8 values and per-column scales of w [K, N] (used as x·w) rounded with error feedback (GPTQ).

    gram: XᵀX [K, K] of calibration inputs X [n, K] (what the whitening computes). Rows of w (input features) are
    rounded in order; each row's rounding error, weighted by the inverse Gram matrix's Cholesky factor, is pushed
    onto the rows not yet rounded, so that ‖X·(w − dequantized)‖ rather than ‖w − dequantized‖ stays small. The
    scales are `quantize_fp8`'s (each column's largest magnitude / 240), so values are clipped to ±240 where the
    feedback pushes past them. damping: added to the diagonal as a fraction of its mean (inputs that never vary
    make the Gram matrix singular). Runs on the host in float64, rows in blocks of `block`, columns in chunks of
    `column_chunk` (they are independent given the shared Gram matrix). A damping that is not a finite number >= 0,
    a block or column_chunk that is not a positive int, and a gram that is not finite, symmetric and (damped)
    positive definite are ValueErrors naming them (`compress.gram`).

    Returns:
      (values [K, N] float8_e4m3fn, scale [N] float32), as `quantize_fp8(w)` returns.
    """
    op = "gptq_fp8"
    w = np.asarray(w)  # widened to float64 a column chunk at a time (an LM head is large)
    if w.ndim != 2 or np.shape(gram) != (w.shape[0], w.shape[0]):
        raise ValueError(f"{op}: w has shape {w.shape} and gram {np.shape(gram)}; expected w [K, N] and gram [K, K]")
    damping = check_damping(op, damping)
    for name, value in (("block", block), ("column_chunk", column_chunk)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{op}: {name}={value!r}; expected a positive int")
    k, n = w.shape
    gram = check_gram(op, gram, k)
    scale = quantize_fp8(w)[1]
    dead = np.diag(gram) == 0  # inputs that are always zero: their rows cannot matter
    gram[dead, dead] = 1.0
    # Upper Cholesky factor of the inverse Gram matrix: row i holds the feedback weights of input i.
    inverse = np.linalg.inv(damped_cholesky(op, gram, damping)[1])
    upper = np.linalg.cholesky(inverse.T @ inverse).T
    values = np.empty((k, n), FP8_DTYPE)
    s = np.asarray(scale, np.float64)
    for c0 in range(0, n, column_chunk):
        cols = slice(c0, min(n, c0 + column_chunk))
        work = np.array(w[:, cols], np.float64)
        work[dead] = 0.0
        for b0 in range(0, k, block):
            b1 = min(k, b0 + block)
            errors = np.empty((b1 - b0, work.shape[1]))
            for i in range(b0, b1):
                q = np.clip(work[i] / s[cols], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
                values[i, cols] = q
                error = (work[i] - q.astype(np.float64) * s[cols]) / upper[i, i]
                work[i + 1 : b1] -= np.outer(upper[i, i + 1 : b1], error)
                errors[i - b0] = error
            work[b1:] -= upper[b0:b1, b1:].T @ errors
    return jnp.asarray(values), scale
