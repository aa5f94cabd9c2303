"""The stored forms of a decode step's weights: Factored(u, v[, u_scale, v_scale]), Quantized(w, scale) (fp8 values
with float32 per-output-column scales) and Dense() (a placeholder for a packed dense weight in the model's dtype), and
how a layer's weight is taken out of its stack.

fp8 weights: a weight the spec names in `fp8_weights` is stored as Trainium's float8_e4m3 values (±240) with one
float32 scale per output column, x·W = (x·values)·diag(scale): a dense one as `Quantized(w, scale)`, a factored one as
`Factored(u, v, u_scale, v_scale)` (x·W = ((x·u)·diag(u_scale))·v·diag(v_scale)). The kernels multiply by the scales
as they evict the float32 matmul sums; the parts and their shapes are declared once, on these types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from nki_kernels.decode.spec import SCALE, SPLIT_ROWS, DecodeSpec

# What an operand's dtype must be: the model's (x's), a weight's (the model's, or the fp8 dtype for a weight the
# spec names in fp8_weights), the packed weights' (fp8 or the model's, DecodeSpec.packed_fp8), or a fixed one.
MODEL_DTYPE = "model"
WEIGHT_DTYPE = "weight"
PACKED_DTYPE = "packed"


def _part(shape, dtype=WEIGHT_DTYPE):
    """A field of a stored weight: shape(k, r, n) its per-layer shape for a [K, N] weight (at rank r when factored);
    a SCALE part exists for fp8 weights only."""
    return dataclasses.field(default=None, metadata=dict(shape=shape, dtype=dtype))


class StoredWeight:
    """A weight stored as several arrays (its parts, fields declaring their shapes and dtypes); iterating gives the
    parts present (not None), in field order."""

    def parts(self) -> dict:
        """{part name: value} of the parts present (not None), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def __iter__(self):
        return iter(self.parts().values())

    @property
    def dtype(self):
        """The dtype of the stored values (the first part's)."""
        return next(iter(self)).dtype


@dataclasses.dataclass(frozen=True)
class Factored(StoredWeight):
    """A weight stored as factors: x·W = (x·u)·v, or with fp8 factors ((x·u)·diag(u_scale))·v·diag(v_scale).
    Stacked over layers, u is [L, K, Rmax] and v [L, Rmax, N] (layer l uses the first spec.ranks[...][l] columns
    of u / rows of v, the rest zeros; a layer the spec leaves dense holds its W as `dense_in_stack` says),
    u_scale [L, Rmax] and v_scale [L, N]; the LM head's are u [H, r], v [r, V], u_scale [r], v_scale [V]. The
    scales are None unless the spec names the weight in fp8_weights."""

    u: Any = _part(lambda k, r, n: (k, r))
    v: Any = _part(lambda k, r, n: (r, n))
    u_scale: Any = _part(lambda k, r, n: (r,), SCALE)
    v_scale: Any = _part(lambda k, r, n: (n,), SCALE)


@dataclasses.dataclass(frozen=True)
class Quantized(StoredWeight):
    """A dense weight stored as fp8 values and one float32 scale per output column: x·W = (x·w)·diag(scale).
    Stacked over layers, w is [L, K, N] and scale [L, N]; the LM head's are w [H, V] and scale [V]."""

    w: Any = _part(lambda k, r, n: (k, n))
    scale: Any = _part(lambda k, r, n: (n,), SCALE)


@dataclasses.dataclass(frozen=True)
class Dense(StoredWeight):
    """A dense weight in the model's dtype as a stored weight: only as the placeholder of one that
    spec.packed_weights names (Dense(): its values are in the `packed` operand); otherwise a dense weight is one
    array [L, K, N]."""

    w: Any = _part(lambda k, r, n: (k, n))


def stored_type(spec: DecodeSpec, weight: str):
    """How the spec stores `weight`: Factored, Quantized (dense fp8), Dense (dense in the model's dtype and packed:
    an empty placeholder) or None (one dense array)."""
    if spec.factored(weight):
        return Factored
    if spec.fp8(weight):
        return Quantized
    return Dense if weight in spec.packed_weights else None


def kernel_arg(value):
    """An operand as an NKI kernel argument (tensors, or lists of them): a stored weight as the list of its parts
    in field order up to the last present one (a packed weight's values None); None for one with no parts (packed
    in the model's dtype)."""
    if not isinstance(value, StoredWeight):
        return value
    parts = [getattr(value, field.name) for field in dataclasses.fields(value)]
    while parts and parts[-1] is None:
        parts.pop()
    return parts or None


def as_weight(value, factored: bool):
    """A kernel's weight argument as the contract's weight: the list of its parts as a Factored when `factored`
    (the spec says so), else as a Quantized; a dense array itself."""
    if not isinstance(value, (list, tuple)):
        return value
    return (Factored if factored else Quantized)(*value)


def layer_weight(weight, layer: int):
    """Layer `layer` of a stacked weight: [K, N], or the stored weight of that layer's parts (e.g. a Factored of
    u [K, Rmax], v [Rmax, N] and, for fp8, u_scale [Rmax], v_scale [N])."""
    if isinstance(weight, StoredWeight):
        return type(weight)(**{name: part[layer] for name, part in weight.parts().items()})
    return weight[layer]


def dense_in_stack(spec: DecodeSpec, projection: str, weight, values=None):
    """Of a layer where spec.rank(projection, layer) is None though the projection is factored in other layers:
    its dense weight as the kernels read it, from `weight`, that layer's Factored (HBM views or arrays). Such a
    layer's W [K, N] is stored as exact factors (`dense_as_factors`), so a product of every layer's factors stays
    exact: W in the factor spec.dense_factor names, the identity in the other, the rest of the stack zeros. With fp8
    factors W's scales are v_scale (u_scale ones), so the layer reads as Quantized(W, v_scale). values: W already
    loaded (a packed layer's OnChipWeight) instead of the view into u or v."""
    if values is None:
        factor, width = spec.dense_factor(projection)
        values = weight.u[:, 0:width] if factor == "u" else weight.v[0:width, :]
    return values if weight.v_scale is None else Quantized(values, weight.v_scale)


def dense_as_factors(projection: str, w, xp=np):
    """(u, v): the exact factors a factored stack holds a dense layer's W [K, N] as (`DecodeSpec.dense_factor`):
    (I [K, K], W) for a projection whose columns tensor-parallel ranks split, (W, I [N, N]) for SPLIT_ROWS; in W's
    dtype (the identity is exact in fp8 too). xp: numpy, or a module with its eye (jax.numpy)."""
    k, n = w.shape
    if projection in SPLIT_ROWS:
        return w, xp.eye(n, dtype=w.dtype)
    return xp.eye(k, dtype=w.dtype), w
