"""The fp8 e4m3 math of the layers in `WeightFormat.FP8_E4M3`: the dense product and the checks of stored values.

Values are float8_e4m3fn holding Trainium's e4m3 values (±240), made by `compress.quantize_fp8` (float8_e4m3 arrays
are taken as the same bits); values beyond ±240 or NaN, and NaN / ±inf scales, are a ValueError.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_neuronmm.decoder_math import scaled_linear
from jax_neuronmm.shapes import FP8_DTYPE, check_fp8_contents, fp8_storage, is_fp8


def fp8_dense(x, kernel, kernel_scale, *, precision=None):
    """(x·kernel)·diag(kernel_scale): x [..., K] (float), kernel [K, N] fp8, kernel_scale [N] float32 → [..., N]
    in x's dtype; the fp8 values are widened to x's dtype (exactly) and the products summed in float32
    (`decoder_math.scaled_linear`, which the decode step's XLA lowering uses too). There is no dense fp8 NKI
    kernel: this runs as XLA ops on every backend."""
    kernel = fp8_storage(kernel)
    if not is_fp8(kernel.dtype):
        raise TypeError(f"fp8_dense: kernel has dtype {kernel.dtype}; expected {FP8_DTYPE.name} or float8_e4m3")
    check_fp8_contents("fp8_dense", {"kernel": kernel, "kernel_scale": kernel_scale})
    return scaled_linear(x, kernel, kernel_scale, precision=precision)


def checked_fp8_values(op, name, values, scale, columns):
    """(values, scale) as JAX arrays, values in the fp8 storage dtype; TypeError for a wrong dtype or shape (a
    missing scale included), ValueError for values known here beyond ±240 or NaN, or non-finite scales."""
    values = fp8_storage(jnp.asarray(values))
    if not is_fp8(values.dtype) or values.ndim != 2:
        raise TypeError(
            f"{op}: {name}: got {values.dtype}{list(values.shape)}, expected a 2-D {FP8_DTYPE.name} (or "
            "float8_e4m3) array"
        )
    if scale is None:
        raise TypeError(f"{op}: {name}_scale: got None, expected float32 [{values.shape[1]}] (one per {columns})")
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32 or tuple(scale.shape) != (values.shape[1],):
        raise TypeError(
            f"{op}: {name}_scale: got {scale.dtype}{list(scale.shape)}, expected float32 [{values.shape[1]}] (one "
            f"per {columns})"
        )
    check_fp8_contents(op, {name: values, f"{name}_scale": scale})
    return values, scale
