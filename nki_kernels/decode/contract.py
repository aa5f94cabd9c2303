"""The decode step's operand contract, shared by the NKI kernels, the float64 reference, JAX and the benchmark.

A decode step runs every decoder layer on a few new tokens per row and ends with the final norm and the LM head; what
the kernels are specialized on is a DecodeSpec (nki_kernels.decode.spec), a weight's stored form Factored, Quantized or
Dense (nki_kernels.decode.weights); those names are importable from here too.

`DecodeOperands` names the operands; each field declares its shape (symbolic, and as a function of the spec and B, T,
S) and dtype once, and `expected_shapes`, `check`, the kernels' argument lists, the JAX pytree and the benchmark's
placeholders are all derived from those declarations: an added operand is one field here. A factored weight is a
`Factored(u, v)`; a dense one a single array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from nki_kernels.decode.layouts import packed_shape
from nki_kernels.decode.spec import (
    FP8,
    PROJECTIONS,
    SCALE,
    SPLIT_ROWS,
    WEIGHTS,
    DecodeShapes,
    DecodeSpec,
    ModelVariant,
    WeightStorage,
)
from nki_kernels.decode.weights import (
    MODEL_DTYPE,
    PACKED_DTYPE,
    WEIGHT_DTYPE,
    Dense,
    Factored,
    Quantized,
    StoredWeight,
    as_weight,
    dense_as_factors,
    dense_in_stack,
    kernel_arg,
    layer_weight,
    stored_type,
)

# The spec's and the weights' names, importable from here as before the split.
__all__ = [
    "FP8",
    "MODEL_DTYPE",
    "OPTIONAL_LAST",
    "PACKED_DTYPE",
    "POOL",
    "PROJECTIONS",
    "SCALE",
    "SPLIT_ROWS",
    "WEIGHTS",
    "WEIGHT_DTYPE",
    "DecodeOperands",
    "DecodeShapes",
    "DecodeSpec",
    "Dense",
    "Factored",
    "ModelVariant",
    "Quantized",
    "StoredWeight",
    "WeightStorage",
    "as_weight",
    "batch_axes",
    "check",
    "check_lengths",
    "check_named",
    "check_spec",
    "check_write_index",
    "dense_as_factors",
    "dense_in_stack",
    "expected_dtypes",
    "expected_shapes",
    "kernel_arg",
    "layer_weight",
    "layout_of",
    "operand_fields",
    "stored_type",
]


def _operand(layout: str, shape, dtype=MODEL_DTYPE, *, present=None, batch_axis=None, paged=None):
    """A DecodeOperands field: `layout` the symbolic shape (for messages and docs), shape(spec, b, t, s) the
    concrete one, present: the spec's flag that says whether the operand exists (None when it does not),
    batch_axis: its B axis for an operand with one per row (vmap folds rows into B there; not for a paged
    spec's pools), paged: (layout, shape(spec, num_blocks)) where a paged spec gives it another shape (the
    caches as pools of blocks)."""
    return dataclasses.field(
        default=None,
        metadata=dict(layout=layout, shape=shape, dtype=dtype, present=present, batch_axis=batch_axis, paged=paged),
    )


# A paged spec's caches: pools of blocks shared by the rows.
POOL = (
    "[L, num_blocks, block_size, kv_heads, D]",
    lambda spec, nb: (spec.num_layers, nb, spec.block_size, spec.num_kv_heads, spec.head_dim),
)


def _weight(projection: str):
    """A DecodeOperands field for a projection's stacked weight (dense [L, K, N], Quantized or Factored)."""

    def shape(spec, b, t, s):
        return spec.in_features(projection), spec.out_features(projection)

    return dataclasses.field(
        default=None,
        metadata=dict(
            layout="[L, K, N], Quantized(w [L, K, N], scale [L, N]) or Factored(u [L, K, Rmax], v [L, Rmax, N]"
            "[, u_scale [L, Rmax], v_scale [L, N]])",
            shape=shape,
            weight=projection,
        ),
    )


@dataclasses.dataclass(frozen=True)
class DecodeOperands:
    """The operands of one decode step, by name (L = spec.num_layers, B rows of T new tokens, S cache slots).

    Paged (spec.block_size = BS): T = 1; k_cache, v_cache are pools [L, num_blocks, BS, kv_heads, D] of blocks
    shared by all rows (what every slot holds must be finite), write_index is None, and block_table [B, MB] int32
    (row b's i-th block of positions is block_table[b, i]; every entry a block of the pool) and lengths [B] int32
    (the tokens of row b already cached) place each row: row b writes its new k and v at position p = lengths[b]
    (block block_table[b, p // BS], slot p % BS) and attends over its logical slots 0 .. S - 1 = MB·BS - 1 through
    the table, its mask_bias[:, b, 0] over those positions (which must show p and hide every position past it);
    lengths[b] = -1: an inactive row (nothing written, its logits meaningless). cos, sin hold each row's tables of
    its position p.

    x [B, T, H]: the embedded tokens. norms [L, NN, H] (NN = spec.num_norms). qk_norms [L, 2, D] (q_norm, k_norm)
    or None without spec.qk_norm. q, k, v, o, gate, up, down: a dense [L, K, N] or a Factored (zero padded to its
    largest per-layer rank), fp8 with scales where spec.fp8_weights names them (Quantized, or Factored with
    u_scale and v_scale). k_cache, v_cache [L, B, S, kv_heads, D]: this step's keys and values are written IN
    PLACE at slots [write_index, write_index + T); what those slots held before must be finite (a fresh cache's
    zeros, an earlier step's values): the fused kernels read it, weighted by 0. write_index [1, 1] int32. cos, sin
    [NR, B, T, D] float32: rotate-half tables with duplicated halves (layer l reads table spec.layer_rope[l]).
    mask_bias [NM, B, T, S] float32, 0 or a large negative number (layer l reads spec.layer_mask[l]; with
    spec.mask_windows the kernels read only the window of slots ending at each query's slot, so the mask must hide
    every slot outside it). final_norm [H]. head: dense [H, V] or Factored(u [H, r], v [r, V]), fp8 as the
    projections. packed [L, 128, E] (fp8, or the model's dtype: DecodeSpec.packed_fp8), or None without
    spec.packed_weights: those projections' values of each layer in the kernels' layout (nki_kernels.decode.layouts;
    their stored weights then hold only their scales: an fp8 one's u_scale, v_scale, a bf16 one nothing, Factored()).
    """

    x: Any = _operand("[B, T, H]", lambda spec, b, t, s: (b, t, spec.hidden), batch_axis=0)
    norms: Any = _operand("[L, NN, H]", lambda spec, b, t, s: (spec.num_layers, spec.num_norms, spec.hidden))
    qk_norms: Any = _operand("[L, 2, D]", lambda spec, b, t, s: (spec.num_layers, 2, spec.head_dim), present="qk_norm")
    q: Any = _weight("q")
    k: Any = _weight("k")
    v: Any = _weight("v")
    o: Any = _weight("o")
    gate: Any = _weight("gate")
    up: Any = _weight("up")
    down: Any = _weight("down")
    k_cache: Any = _operand(
        "[L, B, S, kv_heads, D]",
        lambda spec, b, t, s: (spec.num_layers, b, s, spec.num_kv_heads, spec.head_dim),
        batch_axis=1,
        paged=POOL,
    )
    v_cache: Any = _operand(
        "[L, B, S, kv_heads, D]",
        lambda spec, b, t, s: (spec.num_layers, b, s, spec.num_kv_heads, spec.head_dim),
        batch_axis=1,
        paged=POOL,
    )
    write_index: Any = _operand("[1, 1]", lambda spec, b, t, s: (1, 1), np.dtype(np.int32), present="contiguous")
    cos: Any = _operand(
        "[NR, B, T, D]",
        lambda spec, b, t, s: (spec.num_rope_tables, b, t, spec.head_dim),
        np.dtype(np.float32),
        batch_axis=1,
    )
    sin: Any = _operand(
        "[NR, B, T, D]",
        lambda spec, b, t, s: (spec.num_rope_tables, b, t, spec.head_dim),
        np.dtype(np.float32),
        batch_axis=1,
    )
    mask_bias: Any = _operand(
        "[NM, B, T, S]", lambda spec, b, t, s: (spec.num_masks, b, t, s), np.dtype(np.float32), batch_axis=1
    )
    final_norm: Any = _operand("[H]", lambda spec, b, t, s: (spec.hidden,))
    head: Any = dataclasses.field(
        default=None,
        metadata=dict(
            layout="[H, V], Quantized(w [H, V], scale [V]) or Factored(u [H, r], v [r, V][, u_scale [r], v_scale [V]])",
            shape=lambda spec, b, t, s: (spec.hidden, spec.vocab),
            weight="head",
        ),
    )
    packed: Any = _operand(
        "[L, 128, E]", lambda spec, b, t, s: packed_shape(spec), PACKED_DTYPE, present="packed_weights"
    )
    block_table: Any = _operand(
        "[B, MB]", lambda spec, b, t, s: (b, s // spec.block_size), np.dtype(np.int32), present="paged", batch_axis=0
    )
    lengths: Any = _operand("[B]", lambda spec, b, t, s: (b,), np.dtype(np.int32), present="paged", batch_axis=0)

    @classmethod
    def of(cls, operands, spec: DecodeSpec) -> DecodeOperands:
        """`operands` as DecodeOperands: itself, or a sequence in field order (the optional last ones, `packed`,
        `block_table`, `lengths`, may be left out when None) where a weight may be given as the list of its parts
        (how a kernel's list argument comes back): a Quantized where `spec` stores the weight dense in fp8, else a
        Factored ([u, v], or [u, v, u_scale, v_scale]; a packed one's u and v None). A packed weight with no parts
        (in the model's dtype) may be given as None or () (kernel_arg's None): Factored(), or Dense() for a dense
        one."""
        if isinstance(operands, cls):
            return operands
        names = operand_fields()
        operands = list(operands)
        if len(names) - len(OPTIONAL_LAST) <= len(operands) < len(names):
            operands += [None] * (len(names) - len(operands))
        if len(operands) != len(names):
            raise ValueError(f"got {len(operands)} operands, expected {len(names)} {names}")
        values = {}
        for field, value in zip(dataclasses.fields(cls), operands):
            weight = field.metadata.get("weight")
            if weight is not None and _partless(spec, weight) and (value is None or _empty_sequence(value)):
                value = stored_type(spec, weight)()
            elif weight is not None and isinstance(value, (list, tuple)):
                kind = stored_type(spec, weight) or Factored
                if 2 <= len(value) <= len(dataclasses.fields(kind)):
                    value = kind(*value)
            values[field.name] = value
        return cls(**values)

    def kernel_args(self) -> list:
        """The operands as one NKI kernel argument: a list in field order, each as kernel_arg gives it."""
        return [kernel_arg(value) for value in self.values()]

    def values(self) -> list:
        return [getattr(self, name) for name in operand_fields()]

    def named_leaves(self) -> list[tuple[str, Any]]:
        """(name, array) of every present operand in field order; a stored weight gives one per part present:
        "name.u", "name.v" (, "name.u_scale", "name.v_scale") of a Factored, "name.w", "name.scale" of a Quantized."""
        leaves = []
        for name, value in zip(operand_fields(), self.values()):
            if isinstance(value, StoredWeight):
                leaves += [(f"{name}.{part}", array) for part, array in value.parts().items()]
            elif value is not None:
                leaves.append((name, value))
        return leaves

    @property
    def weights(self) -> dict:
        """{projection: its stacked weight} for the projections of a layer (PROJECTIONS order)."""
        return {name: getattr(self, name) for name in PROJECTIONS}

    def replace(self, **changes) -> DecodeOperands:
        return dataclasses.replace(self, **changes)


# The operands a sequence may leave out at its end (each None unless the spec has it).
OPTIONAL_LAST = ("packed", "block_table", "lengths")


def _partless(spec: DecodeSpec, weight: str) -> bool:
    """Whether `weight`'s stored weight holds no parts: packed in the model's dtype (its values in `packed`)."""
    return weight in spec.packed_weights and not spec.fp8(weight)


def _empty_sequence(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 0


def operand_fields() -> tuple[str, ...]:
    """The operands' names in order (DecodeOperands' fields)."""
    return tuple(field.name for field in dataclasses.fields(DecodeOperands))


def batch_axes() -> dict[str, int]:
    """{operand name: its B axis} of the operands with one entry per row (a contiguous spec's; a paged spec's
    pools have none)."""
    return {
        field.name: field.metadata["batch_axis"]
        for field in dataclasses.fields(DecodeOperands)
        if field.metadata.get("batch_axis") is not None
    }


def layout_of(spec: DecodeSpec, name: str) -> str:
    """The symbolic shape of operand `name` for `spec` (a paged spec's pools differ)."""
    meta = next(field.metadata for field in dataclasses.fields(DecodeOperands) if field.name == name)
    return meta["paged"][0] if spec.paged and meta.get("paged") else meta["layout"]


def expected_shapes(
    spec: DecodeSpec, batch: int, tokens: int, slots: int, rank_padding: dict | None = None, num_blocks: int = 1
):
    """DecodeOperands of shapes for B = batch rows of T = tokens new tokens and S = slots cache slots (a paged
    spec: logical slots per row, a multiple of block_size, in pools of num_blocks blocks): a tuple per operand, a
    Factored (factors stacked to rank_padding.get(name) when given, else to spec.stacked_rank) or a Quantized of
    tuples per stored weight (`stored_type`; the scales only for fp8 weights, the values only for weights not
    packed), None where the spec has no such operand."""
    rank_padding = rank_padding or {}
    shapes = {}
    for field in dataclasses.fields(DecodeOperands):
        meta = field.metadata
        present = meta.get("present")
        if present is not None and not getattr(spec, present):
            shapes[field.name] = None
            continue
        if spec.paged and meta.get("paged"):
            shapes[field.name] = meta["paged"][1](spec, num_blocks)
            continue
        shape = meta["shape"](spec, batch, tokens, slots)
        weight = meta.get("weight")
        if weight is None:
            shapes[field.name] = shape
            continue
        stacked = () if weight == "head" else (spec.num_layers,)
        kind = stored_type(spec, weight)
        if kind is None:
            shapes[field.name] = stacked + shape
            continue
        r = rank_padding.get(field.name, spec.stacked_rank(weight)) if kind is Factored else None
        shapes[field.name] = kind(
            **{
                part.name: stacked + part.metadata["shape"](shape[0], r, shape[1])
                for part in dataclasses.fields(kind)
                if spec.has_part(weight, part)
            }
        )
    return DecodeOperands(**shapes)


def expected_dtypes(spec: DecodeSpec, model_dtype, fp8_dtype=FP8) -> DecodeOperands:
    """DecodeOperands of the dtype each operand (each part of a stored weight) must have, the model's being
    `model_dtype` and fp8 weight values' `fp8_dtype`; None where the spec has no such operand (the structure of
    expected_shapes)."""
    model_dtype, fp8_dtype = np.dtype(model_dtype), np.dtype(fp8_dtype)

    def resolve(rule, weight):
        if isinstance(rule, np.dtype):
            return rule
        if (rule == PACKED_DTYPE and spec.packed_fp8) or (rule == WEIGHT_DTYPE and spec.fp8(weight)):
            return fp8_dtype
        return model_dtype

    dtypes = {}
    one = spec.block_size or 1  # one logical block of slots
    for field, shape in zip(dataclasses.fields(DecodeOperands), expected_shapes(spec, 1, 1, one).values()):
        weight = field.metadata.get("weight")
        if isinstance(shape, StoredWeight):
            rules = {part.name: part.metadata["dtype"] for part in dataclasses.fields(shape)}
            dtypes[field.name] = type(shape)(**{part: resolve(rules[part], weight) for part in shape.parts()})
        else:
            dtypes[field.name] = None if shape is None else resolve(field.metadata.get("dtype", WEIGHT_DTYPE), weight)
    return DecodeOperands(**dtypes)


def _shape_of(value) -> tuple:
    return tuple(value.shape)


def check_spec(spec, where: str) -> None:
    """A TypeError starting with `where` unless `spec` is a DecodeSpec."""
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"{where}: spec: got {type(spec).__name__}, expected a nki_kernels.decode.DecodeSpec")


def _check_structure(where: str, spec: DecodeSpec, name: str, value, layout: str) -> None:
    """A ValueError naming weight `name` unless `value` is stored as the spec says (`stored_type`) with exactly the
    parts it needs (an fp8 weight's scales included)."""
    kind, fp8 = stored_type(spec, name), spec.fp8(name)
    contract = f"(the contract: {name} has shape {layout})"
    if kind is Factored and not isinstance(value, Factored):
        parts = "u, v, u_scale, v_scale" if fp8 else "u, v"
        raise ValueError(
            f"{where}: {name}: expected a factored pair ({parts}) since the spec gives its ranks; got "
            f"{type(value).__name__}"
        )
    if kind is not Factored and isinstance(value, Factored):
        raise ValueError(
            f"{where}: {name}: got a factored pair, expected "
            + ("Quantized(w, scale)" if fp8 else "one dense array")
            + f" since the spec gives it no ranks {contract}"
        )
    if kind is Quantized and not isinstance(value, Quantized):
        got = "one array" if hasattr(value, "shape") else type(value).__name__
        raise ValueError(
            f"{where}: {name}: got {got}, expected Quantized(w, scale) (fp8 values and float32 per-column scales) "
            f"since spec.fp8_weights names it {contract}"
        )
    if kind is Dense and not isinstance(value, Dense):
        raise ValueError(
            f"{where}: {name}: got {type(value).__name__}, expected Dense() (or None) since spec.packed_weights names "
            f"{name}, dense in the model's dtype: its values are in the packed operand"
        )
    if kind is None and isinstance(value, (Quantized, Dense)):
        raise ValueError(
            f"{where}: {name}: got {type(value).__name__}, expected one dense array in x's dtype since neither "
            f"spec.fp8_weights nor spec.packed_weights names it {contract}"
        )
    if kind is None:
        return
    for part in dataclasses.fields(kind):
        scale = part.metadata["dtype"] is SCALE
        given = getattr(value, part.name) is not None
        if given and scale and not fp8:
            raise ValueError(
                f"{where}: {name}.{part.name}: expected None since spec.fp8_weights does not name {name} (scales go "
                f"with fp8 weights) {contract}"
            )
        if given and not spec.has_part(name, part):
            raise ValueError(
                f"{where}: {name}.{part.name}: expected None since spec.packed_weights names {name} (its values are "
                "in the packed operand: nki_kernels.decode.packing.pack_weights)"
            )
        if not given and spec.has_part(name, part):
            why = f": spec.fp8_weights names {name}, so its fp8 values need float32 scales" if scale else ""
            raise ValueError(f"{where}: {name}.{part.name}: got None{why} {contract}")


def check(spec: DecodeSpec, operands, where: str, *, padded_ranks: bool = False, fp8_dtype=FP8) -> DecodeOperands:
    """`operands` (DecodeOperands or a sequence in field order) as DecodeOperands, once they follow the contract
    for `spec`; else a ValueError (shapes, structure, an fp8 weight's missing scales) or TypeError (dtypes, the
    spec) that starts with `where` and names the operand (B, T and S >= 1, S >= T included). padded_ranks: factors
    (and their rank scales) may be stacked past their largest rank (the kernels read only each layer's ranks); else
    exactly to it. fp8_dtype: the dtype of fp8 weight values (the kernels' FP8, or the float8_e4m3fn that JAX holds
    them in). Shapes and dtypes only: write_index's value is `check_write_index`'s."""
    check_spec(spec, where)
    try:
        ops = DecodeOperands.of(operands, spec)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    fields = {field.name: field for field in dataclasses.fields(DecodeOperands)}
    for name, value in zip(operand_fields(), ops.values()):
        meta = fields[name].metadata
        weight = meta.get("weight")
        present = meta.get("present")
        if present is not None and (value is None) == bool(getattr(spec, present)):
            raise ValueError(
                f"{where}: {name}: got None, expected {layout_of(spec, name)} since spec.{present} is set"
                if value is None
                else f"{where}: {name}: expected None since spec.{present} is {getattr(spec, present)!r}"
            )
        if value is None and present is None:
            raise ValueError(f"{where}: {name}: got None, expected {meta['layout']}")
        if weight is not None:
            _check_structure(where, spec, name, value, meta["layout"])
        arrays = value.parts().values() if isinstance(value, StoredWeight) else [] if value is None else [value]
        if any(not (hasattr(a, "shape") and hasattr(a, "dtype")) for a in arrays):
            raise ValueError(f"{where}: {name}: got {type(value).__name__}, expected arrays of {meta['layout']}")
    x, cache = ops.x, ops.k_cache
    for name, value, rank in (("x", x, 3), ("k_cache", cache, 5)) + (
        (("block_table", ops.block_table, 2),) if spec.paged else ()
    ):
        if len(value.shape) != rank:
            raise ValueError(
                f"{where}: {name}: got shape {_shape_of(value)}, expected {layout_of(spec, name)} "
                f"(the contract: {name} has shape {layout_of(spec, name)})"
            )
    slots, num_blocks = cache.shape[2], 1
    if spec.paged:
        slots, num_blocks = ops.block_table.shape[1] * spec.block_size, cache.shape[1]
    for name, size, what in (
        ("x", x.shape[0], "B (rows)"),
        ("x", x.shape[1], "T (tokens)"),
        ("block_table" if spec.paged else "k_cache", slots, "S (slots)"),
    ) + ((("k_cache", num_blocks, "num_blocks"),) if spec.paged else ()):
        if size < 1:
            value = getattr(ops, name)
            raise ValueError(f"{where}: {name}: got shape {_shape_of(value)} with {what} = {size}, expected >= 1")
    if spec.paged and x.shape[1] != 1:
        raise ValueError(
            f"{where}: x: got shape {_shape_of(x)}, expected T = 1 token per row since spec.block_size is set (a "
            "paged step writes each row's one new token at its own position lengths[b])"
        )
    if slots < x.shape[1]:
        raise ValueError(
            f"{where}: k_cache: got {slots} slots, expected at least T = {x.shape[1]} (this step's tokens)"
        )
    padding = {}
    if padded_ranks:
        for name, value in zip(operand_fields(), ops.values()):
            weight = fields[name].metadata.get("weight")
            stacked_part = (
                next((p for p in (value.u, value.u_scale) if p is not None), None)
                if isinstance(value, Factored)
                else None
            )  # packed: its scales'; packed in the model's dtype: none (stacked to the largest rank)
            if stacked_part is None:
                continue
            stacked = stacked_part.shape[-1]
            if stacked >= spec.stacked_rank(weight):
                padding[name] = stacked
    want = expected_shapes(spec, x.shape[0], x.shape[1], slots, padding, num_blocks)
    model = np.dtype(x.dtype)
    if model not in (np.float16, np.float32, np.float64) and model.name != "bfloat16":
        raise TypeError(f"{where}: x: got dtype {model.name}, expected a float dtype (the model's)")
    wanted = dict(want.named_leaves())
    dtypes = dict(expected_dtypes(spec, model, fp8_dtype).named_leaves())
    for name, value in ops.named_leaves():
        field = fields[name.partition(".")[0]]
        if _shape_of(value) != wanted[name]:
            raise ValueError(
                f"{where}: {name}: got shape {_shape_of(value)}, expected {wanted[name]} (from the spec and "
                f"x [B, T, H] = {_shape_of(x)}, cache slots S = {slots}; the contract: "
                f"{field.name} has shape {layout_of(spec, field.name)})"
            )
        got = np.dtype(value.dtype)
        if got != dtypes[name]:
            weight = field.metadata.get("weight")
            why = " (x's dtype)" if dtypes[name] == model else ""
            if weight is not None and spec.fp8(weight) and dtypes[name] != SCALE:
                why = f" (spec.fp8_weights names {weight})"
            elif weight is not None and got.itemsize == 1:
                why += f"; an fp8 weight needs float32 scales and spec.fp8_weights naming {weight}"
            raise TypeError(f"{where}: {name}: got dtype {got.name}, expected {dtypes[name].name}{why}")
    return ops


def check_named(spec: DecodeSpec, operands: dict, where: str, *, batch: int, tokens: int, slots: int, model_dtype):
    """`check` for a kernel that takes some of a step's operands: each of `operands` ({name: array or None}, names
    of DecodeOperands fields other than weights) has the shape and dtype the contract gives it for `spec`, B = batch
    rows, T = tokens, S = slots and the model's dtype `model_dtype`, and is None exactly where the spec has no such
    operand; else a ValueError (shape, presence) or TypeError (dtype) that starts with `where` and names it."""
    shapes = expected_shapes(spec, batch, tokens, slots)
    dtypes = expected_dtypes(spec, model_dtype)
    fields = {field.name: field for field in dataclasses.fields(DecodeOperands)}
    for name, value in operands.items():
        meta = fields[name].metadata
        want = getattr(shapes, name)
        if want is None or value is None:
            if value is not None:
                raise ValueError(f"{where}: {name}: expected None since spec.{meta['present']} is False")
            if want is not None:
                since = f" since spec.{meta['present']} is set" if meta.get("present") else ""
                raise ValueError(f"{where}: {name}: got None, expected {meta['layout']}{since}")
            continue
        if _shape_of(value) != want:
            raise ValueError(
                f"{where}: {name}: got shape {_shape_of(value)}, expected {want} (B = {batch}, T = {tokens}, "
                f"S = {slots}; the contract: {name} has shape {meta['layout']})"
            )
        if np.dtype(value.dtype) != getattr(dtypes, name):
            raise TypeError(
                f"{where}: {name}: got dtype {np.dtype(value.dtype).name}, expected {getattr(dtypes, name).name}"
                + (" (the model's)" if meta.get("dtype", MODEL_DTYPE) == MODEL_DTYPE else "")
            )


def check_write_index(where: str, write_index, *, slots: int, tokens: int) -> None:
    """A ValueError starting with `where` and naming write_index unless a step's T = `tokens` tokens fit the
    S = `slots` cache slots at write_index (0 <= write_index <= S - T). write_index: its concrete value (the [1, 1]
    operand, or a scalar). `check` sees shapes only, so callers holding the value call this before a launch: an
    index out of range would otherwise write other slots (XLA clamps) or fault in the kernel's DMA."""
    index = int(np.asarray(write_index).reshape(-1)[0])
    if not 0 <= index <= slots - tokens:
        raise ValueError(
            f"{where}: write_index: got {index}, expected 0 <= write_index <= S - T = {slots - tokens} (the step "
            f"writes its T = {tokens} tokens at cache slots [write_index, write_index + T) of S = {slots})"
        )


def check_lengths(where: str, lengths, block_table, *, block_size: int, num_blocks: int) -> None:
    """A ValueError starting with `where` and naming lengths or block_table unless a paged step can run on these
    values (concrete arrays): every lengths[b] in [-1, S - 1] (S = MB·block_size logical slots; -1 an inactive
    row) and every block_table entry a block of the pool, in [0, num_blocks) (the kernels read a row's whole
    table, or its window of it, entries past its length included). `check` sees shapes only: out of range, the
    kernels' DMAs would read or write other memory."""
    lengths, table = np.asarray(lengths).reshape(-1), np.asarray(block_table)
    slots = table.shape[1] * block_size
    bad = np.flatnonzero((lengths < -1) | (lengths > slots - 1))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"{where}: lengths: got lengths[{b}] = {int(lengths[b])}, expected -1 (an inactive row) or a position in "
            f"[0, S - 1 = {slots - 1}] (S = {table.shape[1]} blocks of {block_size} slots in the block table)"
        )
    bad = np.argwhere((table < 0) | (table >= num_blocks))
    if bad.size:
        b, i = (int(v) for v in bad[0])
        raise ValueError(
            f"{where}: block_table: got block_table[{b}, {i}] = {int(table[b, i])}, expected a block of the pool in "
            f"[0, {num_blocks}) (every entry, those past a row's length too, must name a valid block)"
        )
