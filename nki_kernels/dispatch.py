"""Which kernel, with which block sizes, for a call's shapes: what the JAX side asks before launching a kernel.

    kernel, kwargs = svd_matmul_plan(T, K, r, N, dtype, target="trn1")
    y = kernel(x, u, v, **kwargs)

Plans come from the tuned table (`nki_kernels.tuning.lookup`) and are cached per shape.
"""

from __future__ import annotations

import functools

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so np.dtype("bfloat16") resolves)
import numpy as np

from nki_kernels import tuning

LAYOUTS = ("normal", "t_out", "t_in")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def _dtype_name(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"dtype: got {dtype!r}, expected one of {_FLOAT_DTYPES}") from None
    if name not in _FLOAT_DTYPES:
        raise TypeError(f"dtype: got {name}, expected one of {_FLOAT_DTYPES}")
    return name


def _check_dims(**dims):
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive integer")


def _blocks(entry):
    return {name: entry[name] for name in tuning.BLOCK_NAMES}


@functools.lru_cache(maxsize=4096)
def _svd_matmul_plan(t, k, r, n, dtype_name, target, layout):
    from nki_kernels import svd_matmul

    dtype = np.dtype(dtype_name)
    if layout == "normal":
        entry = tuning.lookup("svd_matmul", t, k, r, n, dtype, target)
        kernel = svd_matmul.svd_matmul_decode_kernel if entry["variant"] == "decode" else svd_matmul.svd_matmul_kernel
        return kernel, _blocks(entry)
    if layout == "t_in":
        # Same body as the MLP down kernel, so its tuned entries apply.
        return svd_matmul.svd_matmul_t_in_kernel, _blocks(tuning.lookup("svd_mlp_down", t, k, r, n, dtype, target))
    shape = (t, k, r, n)
    return svd_matmul.svd_matmul_t_out_kernel, tuning.default_blocks("svd_matmul", "cols", shape,
                                                                      dtype.itemsize, target)


def svd_matmul_plan(T, K, r, N, dtype, target="trn1", *, layout="normal"):
    """(kernel, kwargs) computing x·u·v for x with T tokens and K features, rank r, N outputs.

    layout "normal": kernel(x [T, K], u, v, **kwargs) → y [T, N] (svd_matmul_kernel, or the decode variant
    where the table says it is faster); "t_out": → yᵀ [N, T]; "t_in": kernel(xᵀ [K, T], u, v) → y [T, N].
    target: "trn1" or "trn2" (whose SBUF size and cost model the blocks were tuned for).
    """
    _check_dims(T=T, K=K, r=r, N=N)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}, expected one of {LAYOUTS}")
    if target not in tuning.TARGETS:
        raise ValueError(f"target: got {target!r}, expected one of {tuning.TARGETS}")
    kernel, blocks = _svd_matmul_plan(int(T), int(K), int(r), int(N), _dtype_name(dtype), target, layout)
    return kernel, dict(blocks)


@functools.lru_cache(maxsize=4096)
def _svd_mlp_plan(t, h, i, r_gate_up, r_down, dtype_name, target):
    from nki_kernels import svd_mlp

    dtype = np.dtype(dtype_name)
    gate_up = _blocks(tuning.lookup("svd_mlp_gate_up", t, h, r_gate_up, i, dtype, target))
    down = _blocks(tuning.lookup("svd_mlp_down", t, i, r_down, h, dtype, target))
    return (svd_mlp.svd_mlp_gate_up_kernel, gate_up), (svd_mlp.svd_mlp_down_kernel, down)


def svd_mlp_plan(T, H, I, r_gate, r_up, r_down, dtype, target="trn1", *, activation="silu"):
    """((gate_up_kernel, kwargs), (down_kernel, kwargs)) for the two-kernel low-rank MLP:

        hT = gate_up_kernel(x [T, H], gate_u, gate_v, up_u, up_v, **kwargs)   # kwargs include activation
        y = down_kernel(hT, down_u, down_v, **kwargs)                          # y [T, H]
    """
    from nki_kernels.svd_mlp import ACTIVATIONS

    _check_dims(T=T, H=H, I=I, r_gate=r_gate, r_up=r_up, r_down=r_down)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: got {activation!r}, expected one of {ACTIVATIONS}")
    if target not in tuning.TARGETS:
        raise ValueError(f"target: got {target!r}, expected one of {tuning.TARGETS}")
    (gate_up, gate_up_blocks), (down, down_blocks) = _svd_mlp_plan(
        int(T), int(H), int(I), int(max(r_gate, r_up)), int(r_down), _dtype_name(dtype), target)
    return (gate_up, dict(gate_up_blocks, activation=activation)), (down, dict(down_blocks))
