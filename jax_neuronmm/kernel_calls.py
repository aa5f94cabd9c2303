"""Running an op as NKI kernel launches: what every op file's `KernelLaunches` is made of.

One code path for both kernel backends: traced with JAX arrays on Trainium (each launch becomes a custom call), run
on numpy blocks in a host callback on the emulator. `nki_kernels.dispatch` picks the kernel and block sizes; each
element of the `n_batch` leading dims is one launch, token dims flatten to T. Kernels write the operands' dtype and
`preferred_element_type` is applied after, so bf16 operands give bf16-rounded values even when float32 is asked.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_neuronmm import shapes
from nki_kernels.dispatch import FP8_ACTIVATION_DTYPES, FP8_WEIGHT_DTYPE, KERNEL_DTYPES


def check_kernel_dtype(backend, dtype):
    """The kernels take bf16/fp16/fp32 (TensorE has no float64)."""
    if np.dtype(dtype).name not in KERNEL_DTYPES:
        raise TypeError(
            f"backend {backend!r} runs NKI kernels, which take {', '.join(KERNEL_DTYPES)} operands; "
            f"got {np.dtype(dtype).name}. Use backend 'xla' for it."
        )


def fp8_weight_dtype(op, x_dtype):
    """The kernels' weight dtype for fp8 factors, after checking that x's dtype can meet fp8 on TensorE."""
    name = np.dtype(x_dtype).name
    if name not in FP8_ACTIVATION_DTYPES:
        raise TypeError(
            f"{op}: x has dtype {name}; fp8 factors run on the NKI kernels beside {' or '.join(FP8_ACTIVATION_DTYPES)} "
            f"activations only (TensorE does not mix fp8 with float32): cast x, or use backend 'xla'"
        )
    return FP8_WEIGHT_DTYPE


def kernel_fp8(w):
    """fp8 factors as the kernels take them: float8_e4m3fn storage reinterpreted as Trainium's float8_e4m3 (the
    same bits for values within ±240, all that `compress.quantize_fp8` makes). Host blocks for the emulator are
    read as the device reads them first (`shapes.fp8_read`: NaN beyond ±240), so the emulator and the XLA
    lowering agree on a traced weight that no call-time check could refuse; on Trainium the bits go as they are."""
    if isinstance(w, np.ndarray):
        return shapes.fp8_read(w).view(ml_dtypes.float8_e4m3)
    return jax.lax.bitcast_convert_type(w, jnp.float8_e4m3)


def array_namespace(x):
    """numpy for host blocks (emulator), jax.numpy for traced arrays (Trainium)."""
    return np if isinstance(x, np.ndarray) else jnp


def split_leading(x, n_batch, feature_dims):
    """x [*B, *T, F...] -> (B tuple, T tuple, flat batch count, flat token count)."""
    batch = x.shape[:n_batch]
    tokens = x.shape[n_batch : x.ndim - feature_dims]
    return batch, tokens, math.prod(batch), math.prod(tokens)


@dataclasses.dataclass(frozen=True)
class KernelLaunches:
    """An op's computation as NKI kernel launches, in two steps so that shapes are checked before anything runs.

    plan(*operands, target, **params): from shapes and dtypes only (operands may be abstract values), the
      kernels and block sizes `run` needs, or None when the result is empty; raises ValueError (from
      `nki_kernels.dispatch`) when no kernel fits.
    run(plan, *operands, **params): launches them on numpy blocks (emulator) or traced JAX arrays (Trainium).
    """

    op: str
    plan: Callable
    run: Callable

    def checked_plan(self, *operands, target, **params):
        """`plan`, its ValueError restated with the op, the operand shapes and the target."""
        try:
            return self.plan(*operands, target=target, **params)
        except ValueError as error:
            shapes = ", ".join(str(tuple(a.shape)) for a in operands)
            raise ValueError(
                f"{self.op}: operands of shapes {shapes} cannot run as NKI kernels on {target}: {error}"
            ) from None

    def __call__(self, *operands, target, **params):
        return self.run(self.checked_plan(*operands, target=target, **params), *operands, **params)
