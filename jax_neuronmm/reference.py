"""jnp building blocks of the primitives' XLA lowerings (each op file writes its own `*_ref` with them).

They mirror the kernels' numerics: products accumulate in float32 (PSUM), and the caller rounds the rank-r
intermediate to the compute dtype (it sits in SBUF as bf16 when the inputs are bf16).

Operands carry `n_batch` leading dims shared by activations and weights (vmap over stacked weights adds them):
a [*B, *T, K], b [*B, K, N].
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm.shapes import accumulation_dtype
from nki_kernels.activations import ACTIVATIONS


def jnp_activation(name):
    """The jnp function of activation `name` (a key of `nki_kernels.activations.ACTIVATIONS`)."""
    function, kwargs = ACTIVATIONS[name].jax_nn
    return functools.partial(getattr(jax.nn, function), **kwargs)


def batched_dot(a, b, n_batch, precision, out_dtype, out_sharding=None):
    """a [*B, *T, K] · b [*B, K, N] -> [*B, *T, N], accumulated in float32/64.

    out_sharding: the result's sharding under Explicit mesh axes (as in lax.dot_general).
    """
    batch = tuple(range(n_batch))
    dims = (((a.ndim - 1,), (n_batch,)), (batch, batch))
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=acc, out_sharding=out_sharding
    ).astype(out_dtype)


def token_contract(a, b, n_batch, precision, out_dtype, out_sharding=None):
    """Sum over token dims: a [*B, *T, P] , b [*B, *T, Q] -> [*B, P, Q] (weight cotangents).

    out_sharding: the result's sharding under Explicit mesh axes (as in lax.dot_general).
    """
    batch = tuple(range(n_batch))
    tokens = tuple(range(n_batch, a.ndim - 1))
    dims = ((tokens, tokens), (batch, batch))
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=acc, out_sharding=out_sharding
    ).astype(out_dtype)


def swap_last(w):
    return jnp.swapaxes(w, -1, -2)
