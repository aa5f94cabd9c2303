"""The primitives' computations written as NKI kernel launches.

One code path for both kernel backends: on Trainium these functions are traced
with JAX arrays (the real `nki.jit` turns each launch into an
`AwsNeuronCustomNativeKernel` custom call); with the "emulator" backend they run
inside a host callback on numpy blocks, and the same kernels execute on the CPU
emulator. Dispatch (`nki_kernels.dispatch`) picks the kernel variant and block
sizes from the token count and shapes.

Operands carry `n_batch` leading batch dims (vmap over stacked weights); each
batch element is one kernel launch. Token dims are flattened to T.

Kernels write their output in the operands' dtype; `preferred_element_type` is
applied after, so bf16 operands give bf16-rounded values even when float32 is
requested (the XLA reference rounds only once, to the requested dtype).
"""

import math
import os

import jax.numpy as jnp
import numpy as np

from nki_kernels import dispatch
from nki_kernels.emulator.context import resolve_target

KERNEL_DTYPES = ("bfloat16", "float16", "float32")


def check_kernel_dtype(backend, dtype):
    """The kernels take bf16/fp16/fp32 (TensorE has no float64)."""
    if np.dtype(dtype).name not in KERNEL_DTYPES:
        raise TypeError(f"backend {backend!r} runs NKI kernels, which take {', '.join(KERNEL_DTYPES)} operands; "
                        f"got {np.dtype(dtype).name}. Use backend 'xla' for it.")


def _namespace(x):
    return np if isinstance(x, np.ndarray) else jnp


def _target(xp):
    """Which chip's tuned blocks to use.

    On the emulator (numpy blocks in a host callback): the emulator's target. On Trainium (traced with JAX
    arrays): NEURON_PLATFORM_TARGET_OVERRIDE, else trn1, whose smaller SBUF (192 KiB per partition) makes its
    blocks fit trn2's 224 KiB as well.
    """
    if xp is np:
        return resolve_target()
    return resolve_target(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1"))


def _split(x, n_batch, feature_dims):
    """x [*B, *T, F...] -> (B tuple, T tuple, flat batch count, flat token count)."""
    batch = x.shape[:n_batch]
    tokens = x.shape[n_batch:x.ndim - feature_dims]
    return batch, tokens, math.prod(batch), math.prod(tokens)


def svd_matmul_kernels(x, u, v, *, n_batch, precision, out_dtype):
    """(x·u)·v through the fused kernel: x [*B, *T, K], u [*B, K, r], v [*B, r, N] -> [*B, *T, N]."""
    del precision  # the kernels always accumulate in fp32 PSUM
    xp = _namespace(x)
    batch, tokens, n_flat, t = _split(x, n_batch, 1)
    k, r, n = x.shape[-1], u.shape[-1], v.shape[-1]
    out_shape = batch + tokens + (n,)
    if 0 in (t, k, r, n):
        return xp.zeros(out_shape, out_dtype)
    kernel, blocks = dispatch.svd_matmul_plan(t, k, r, n, x.dtype, _target(xp))
    xs, us, vs = x.reshape(n_flat, t, k), u.reshape(n_flat, k, r), v.reshape(n_flat, r, n)
    ys = [kernel(xs[b], us[b], vs[b], **blocks) for b in range(n_flat)]
    return xp.stack(ys).reshape(out_shape).astype(out_dtype)


def svd_mlp_kernels(x, gate_u, gate_v, up_u, up_v, down_u, down_v, *, activation, n_batch, precision, out_dtype):
    """The gated low-rank MLP as two kernel launches per batch element (gate+up → hᵀ [I, T]; down → [T, H])."""
    del precision
    xp = _namespace(x)
    batch, tokens, n_flat, t = _split(x, n_batch, 1)
    h, i, h_out = x.shape[-1], gate_v.shape[-1], down_v.shape[-1]
    ranks = gate_u.shape[-1], up_u.shape[-1], down_u.shape[-1]
    out_shape = batch + tokens + (h_out,)
    if 0 in (t, h, i, h_out, *ranks):
        # An empty contraction makes gate and up 0, and act(0) * 0 = 0 for both activations.
        return xp.zeros(out_shape, out_dtype)
    (gate_up, gate_up_kwargs), (down, down_kwargs) = dispatch.svd_mlp_plan(
        t, h, i, *ranks, x.dtype, _target(xp), activation=activation)
    flat = [a.reshape((n_flat,) + a.shape[n_batch:]) for a in (gate_u, gate_v, up_u, up_v, down_u, down_v)]
    xs = x.reshape(n_flat, t, h)
    ys = []
    for b in range(n_flat):
        gu, gv, uu, uv, du, dv = (w[b] for w in flat)
        hidden_t = gate_up(xs[b], gu, gv, uu, uv, **gate_up_kwargs)
        ys.append(down(hidden_t, du, dv, **down_kwargs))
    return xp.stack(ys).reshape(out_shape).astype(out_dtype)
