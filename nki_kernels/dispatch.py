"""Which kernel, with which block sizes, for a call's shapes: what the JAX side asks before launching a kernel.

    kernel, kwargs = svd_matmul_plan(T, K, r, N, dtype, target="trn1")
    y = kernel(x, u, v, **kwargs)

Plans come from the tuned table (`nki_kernels.block_table.lookup`) and are cached per shape. A shape no block
sizes fit raises ValueError naming the kernel kind, the shape and the target.
"""

from __future__ import annotations

import functools
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so np.dtype("bfloat16") resolves)
import numpy as np

from nki_kernels import block_table
from nki_kernels.activations import check_fused_activation
from nki_kernels.hardware import canonical_target, check_target

KERNEL_DTYPES = ("bfloat16", "float16", "float32")
FP8_WEIGHT_DTYPE = "float8_e4m3"  # Trainium's e4m3 (±240): fp8 factors, beside bf16 / fp16 activations only
FP8_ACTIVATION_DTYPES = ("bfloat16", "float16")


def _dtype_name(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"dtype: got {dtype!r}, expected one of {KERNEL_DTYPES}") from None
    if name not in KERNEL_DTYPES:
        raise TypeError(f"dtype: got {name}, expected one of {KERNEL_DTYPES}")
    return name


def _weight_dtype_name(dtype, weight_dtype):
    """None for factors in the activations' dtype; "float8_e4m3" for fp8 factors (bf16 / fp16 activations)."""
    if weight_dtype is None:
        return None
    name = np.dtype(weight_dtype).name
    if name != FP8_WEIGHT_DTYPE:
        raise TypeError(f"weight_dtype: got {name}, expected None or {FP8_WEIGHT_DTYPE}")
    if _dtype_name(dtype) not in FP8_ACTIVATION_DTYPES:
        raise TypeError(
            f"dtype: got {_dtype_name(dtype)} with fp8 weights; TensorE takes fp8 beside "
            f"{' or '.join(FP8_ACTIVATION_DTYPES)} only"
        )
    return name


def _check_dims(**dims):
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive integer")


def _blocks(entry):
    return {name: entry[name] for name in block_table.BLOCK_NAMES}


def launch_target(emulated):
    """The chip whose tuned blocks a launch uses.

    Emulated: the emulator's target (the innermost `emulator.use_target`, else NEURON_PLATFORM_TARGET_OVERRIDE,
    else trn2). On Trainium: NEURON_PLATFORM_TARGET_OVERRIDE, else trn1, whose smaller SBUF (192 KiB per
    partition) makes its blocks fit trn2's 224 KiB as well.
    """
    if emulated:
        from nki_kernels.emulator.context import resolve_target  # only emulated launches need the emulator

        return resolve_target()
    return canonical_target(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1"))


@functools.lru_cache(maxsize=4096)
def _svd_matmul_plan(t, k, r, n, dtype_name, target, weight_dtype_name):
    from nki_kernels import svd_matmul

    entry = block_table.lookup("svd_matmul", t, k, r, n, np.dtype(dtype_name), target, weight_dtype=weight_dtype_name)
    kernel = svd_matmul.svd_matmul_decode_kernel if entry["variant"] == "decode" else svd_matmul.svd_matmul_kernel
    return kernel, _blocks(entry)


def svd_matmul_plan(T, K, r, N, dtype, target="trn1", *, weight_dtype=None):
    """(kernel, kwargs) computing x·u·v for x with T tokens and K features, rank r, N outputs:
    kernel(x [T, K], u, v, **kwargs) → y [T, N] (svd_matmul_kernel, or the decode variant where the table says
    it is faster). target: "trn1" or "trn2" (whose SBUF size and cost model the blocks were tuned for).
    weight_dtype: None, or float8_e4m3 for fp8 factors: kernel(x, u, v, u_scale, v_scale, **kwargs).
    """
    _check_dims(T=T, K=K, r=r, N=N)
    check_target(target)
    weight = _weight_dtype_name(dtype, weight_dtype)
    kernel, blocks = _svd_matmul_plan(int(T), int(K), int(r), int(N), _dtype_name(dtype), target, weight)
    return kernel, dict(blocks)


@functools.lru_cache(maxsize=4096)
def _svd_mlp_plan(t, h, i, r_gate_up, r_down, dtype_name, target, weight_dtype_name):
    from nki_kernels import svd_mlp

    dtype = np.dtype(dtype_name)
    lookup = functools.partial(block_table.lookup, dtype=dtype, target=target, weight_dtype=weight_dtype_name)
    gate_up = _blocks(lookup("svd_mlp_gate_up", t, h, r_gate_up, i))
    down = _blocks(lookup("svd_mlp_down", t, i, r_down, h))
    return (svd_mlp.svd_mlp_gate_up_kernel, gate_up), (svd_mlp.svd_mlp_down_kernel, down)


def svd_mlp_plan(T, H, I, r_gate, r_up, r_down, dtype, target="trn1", *, activation="silu", weight_dtype=None):
    """((gate_up_kernel, kwargs), (down_kernel, kwargs)) for the two-kernel low-rank MLP:

    hT = gate_up_kernel(x [T, H], gate_u, gate_v, up_u, up_v, **kwargs)   # kwargs include activation
    y = down_kernel(hT, down_u, down_v, **kwargs)                          # y [T, H]
    weight_dtype: None, or float8_e4m3 for fp8 factors, whose scales follow each kernel's factors.
    """
    _check_dims(T=T, H=H, I=I, r_gate=r_gate, r_up=r_up, r_down=r_down)
    check_fused_activation(activation)
    check_target(target)
    weight = _weight_dtype_name(dtype, weight_dtype)
    (gate_up, gate_up_blocks), (down, down_blocks) = _svd_mlp_plan(
        int(T), int(H), int(I), int(max(r_gate, r_up)), int(r_down), _dtype_name(dtype), target, weight
    )
    return (gate_up, dict(gate_up_blocks, activation=activation)), (down, dict(down_blocks))
