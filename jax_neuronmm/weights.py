"""The weight types the ops take, registered as JAX pytrees.

`Factored(u, v[, u_scale, v_scale])` is one low-rank weight x·W = (x·u)·v (with fp8 factors
((x·u)·diag(u_scale))·v·diag(v_scale)) and `Quantized(w, scale)` one fp8 dense weight. They are the decode step's
operand types (`nki_kernels.decode.contract`), used unchanged by `svd_mlp` and the models, so a factored weight is
the same value from a single projection to the whole decode step.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jax_neuronmm.shapes import fp8_storage
from nki_kernels.decode.contract import Factored, Quantized

for _cls in (Factored, Quantized):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])

__all__ = ["Factored", "Quantized", "factored_parts"]


def factored_parts(op: str, name: str, weight):
    """(u, v, u_scale, v_scale) of the Factored `weight` as JAX arrays (fp8 factors in the storage dtype, scales
    None when absent); TypeError naming `op` and `name` for anything else or for missing factors."""
    if not isinstance(weight, Factored):
        raise TypeError(
            f"{op}: {name}: got {type(weight).__name__}, expected a Factored(u, v) (with u_scale, v_scale for fp8 "
            "factors; jax_neuronmm.Factored)"
        )
    missing = [f"{name}.{part}" for part in ("u", "v") if getattr(weight, part) is None]
    if missing:
        raise TypeError(f"{op}: {' and '.join(missing)} missing; expected both factors u and v")
    u, v = (fp8_storage(jnp.asarray(a)) for a in (weight.u, weight.v))
    scales = (None if s is None else jnp.asarray(s) for s in (weight.u_scale, weight.v_scale))
    return (u, v, *scales)
