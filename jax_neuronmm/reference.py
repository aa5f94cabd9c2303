"""Reference implementations in jnp: the XLA lowering of every primitive.

They mirror the kernels' numerics: products accumulate in float32 (PSUM), the
rank-r intermediate is rounded to the compute dtype (it sits in SBUF as bf16 when
the inputs are bf16), and the result is cast to the requested dtype.

Operands carry `n_batch` leading dims shared by activations and weights (vmap
over stacked weights adds them): x [*B, *T, K], u [*B, K, r], v [*B, r, N].
"""

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm.shapes import accumulation_dtype

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
}


def batched_dot(a, b, n_batch, precision, out_dtype, out_sharding=None):
    """a [*B, *T, K] · b [*B, K, N] -> [*B, *T, N], accumulated in float32/64.

    out_sharding: the result's sharding under Explicit mesh axes (as in lax.dot_general).
    """
    batch = tuple(range(n_batch))
    dims = (((a.ndim - 1,), (n_batch,)), (batch, batch))
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc,
                           out_sharding=out_sharding).astype(out_dtype)


def svd_matmul_ref(x, u, v, *, n_batch=0, precision=None, out_dtype=None):
    """(x·u)·v with the intermediate rounded to x's dtype; result in out_dtype."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xu = batched_dot(x, u, n_batch, precision, x.dtype)
    return batched_dot(xu, v, n_batch, precision, out_dtype)


def svd_mlp_ref(x, gate_u, gate_v, up_u, up_v, down_u, down_v, *, activation="silu", n_batch=0,
                precision=None, out_dtype=None):
    """(act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd; gate and up stay in float32 until the product."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    acc = accumulation_dtype(x.dtype)
    gate = svd_matmul_ref(x, gate_u, gate_v, n_batch=n_batch, precision=precision, out_dtype=acc)
    up = svd_matmul_ref(x, up_u, up_v, n_batch=n_batch, precision=precision, out_dtype=acc)
    hidden = (ACTIVATIONS[activation](gate) * up).astype(x.dtype)
    return svd_matmul_ref(hidden, down_u, down_v, n_batch=n_batch, precision=precision, out_dtype=out_dtype)


def token_contract(a, b, n_batch, precision, out_dtype, out_sharding=None):
    """Sum over token dims: a [*B, *T, P] , b [*B, *T, Q] -> [*B, P, Q] (weight cotangents).

    out_sharding: the result's sharding under Explicit mesh axes (as in lax.dot_general).
    """
    batch = tuple(range(n_batch))
    tokens = tuple(range(n_batch, a.ndim - 1))
    dims = ((tokens, tokens), (batch, batch))
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc,
                           out_sharding=out_sharding).astype(out_dtype)


def swap_last(w):
    return jnp.swapaxes(w, -1, -2)
