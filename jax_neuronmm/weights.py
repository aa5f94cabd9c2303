"""The weight types the ops take, registered as JAX pytrees.

`Factored(u, v[, u_scale, v_scale])` is one low-rank weight x·W = (x·u)·v (with fp8 factors
((x·u)·diag(u_scale))·v·diag(v_scale)) and `Quantized(w, scale)` one fp8 dense weight. They are the decode step's
operand types (`nki_kernels.decode.contract`), used unchanged by `svd_mlp` and the models, so a factored weight is
the same value from a single projection to the whole decode step. `WeightFormat` names how a layer stores them.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from jax_neuronmm.shapes import fp8_storage, is_fp8
from nki_kernels.decode.contract import Factored, Quantized

for _cls in (Factored, Quantized):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])

__all__ = ["Factored", "Quantized", "WeightFormat", "factored_parts"]


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


class WeightFormat(enum.Enum):
    """How a layer stores its weight matrices, as a value rather than in class names (one layer class serves every
    format; a new format such as int8 is a new member here plus its quantizer in `compress`).

    FLOAT: in the layer's param dtype (bf16, fp16, fp32), trainable `nnx.Param`s, no scales.
    FP8_E4M3: Trainium's float8_e4m3 values (±240, held as float8_e4m3fn; `compress.quantize_fp8`) with one float32
    scale per output column of each matrix; inference only.
    A quantized format's value is the name `quantize_model(weight_dtype=...)` takes for it.
    """

    FLOAT = "float"
    FP8_E4M3 = "float8_e4m3"

    @property
    def scaled(self) -> bool:
        """Whether the weights carry per-column scales (quantized values) next to them."""
        return self is not WeightFormat.FLOAT

    @classmethod
    def of(cls, dtype) -> WeightFormat:
        """The format whose values have `dtype`: FP8_E4M3 for float8_e4m3fn / float8_e4m3, FLOAT otherwise."""
        return cls.FP8_E4M3 if is_fp8(fp8_storage(np.zeros((), dtype)).dtype) else cls.FLOAT
